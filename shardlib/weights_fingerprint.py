"""A cheap fingerprint of a checkpoint's weights, so pre-sharded and compiled copies are used only
with the weights they were cut from.

A pre-sharded directory's manifest already names the model config it fits (its hash), but a
fine-tune shares its base model's config.json exactly: without looking at the weights, a compiled
directory built from the base model would serve the base model's weights to anyone who starts it
with `--model FINETUNE`, and a checkpoint replaced in place (a new revision downloaded into the same
folder) would keep serving the old one. Hashing every byte would cost minutes for a large model, on
every start. The fingerprint instead hashes each tensor's name, dtype, shape and three samples of
its bytes (the first, middle and last SAMPLE_BYTES): a few reads per tensor. Any retraining or
merged adapter changes the samples of every tensor it touches; an edit confined to bytes outside the
samples goes unnoticed (what the sha256 of each pre-sharded file does not cover either: that hash
guards the copy, not its source).

For safetensors checkpoints the fingerprint follows the tensors, not the files: the same weights
saved in other shards give the same fingerprint. Of a tensor stored in two shards (which the driver's
check refuses unless the copies' samples agree) only the copy the index maps it to, the one a load
reads, is hashed (a copy recorded before that rule, of such a checkpoint, no longer matches and is
refused as cut from other weights: write it again). A pickled (.bin) checkpoint has no table of
contents to read without unpickling it, so its fingerprint samples each file whole (name, size and
sixteen evenly spaced samples): re-saving it in other files changes it.

No torch here: the driver checks this before Ray or any rank starts.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from shardlib.checkpoint_files import CheckpointFiles, find_checkpoint, safetensors_header, sampled_bytes

SAMPLE_BYTES = 4096
FILE_SAMPLES = 16
FIELD = "weights_fingerprint"
"""The manifest field (of a pre-sharded directory) that records it."""


def weights_fingerprint(model_dir: str | Path) -> str | None:
    """sha256 hex digest of the sampled weights in `model_dir`, or None when it holds no checkpoint
    to read (a compiled-model directory's model/ folder keeps only the config and tokenizer; a
    download left as LFS pointers or truncated files: a launch from a pre-sharded copy never reads
    them)."""
    try:
        ckpt = find_checkpoint(model_dir)
        digest = hashlib.sha256(f"{ckpt.format.split('_')[0]}\n".encode())
        if ckpt.format.startswith("safetensors"):
            _hash_tensors(digest, ckpt)
        else:
            for path in ckpt.files:
                _hash_file(digest, path)
    except (OSError, ValueError):
        return None
    return digest.hexdigest()


def check_same_weights(recorded: str | None, model_dir: str | Path, *, copy: str, source: str | None,
                       fix: str) -> None:
    """ValueError when `model_dir`'s weights are not the ones a copy was cut from (its manifest
    `recorded` them). Nothing is compared when the copy recorded nothing (written before
    fingerprints existed) or `model_dir` holds no weights to compare.

    copy: the copy, for the message ("pre-sharded checkpoint /x"); source: the checkpoint it was
    written from, as its manifest says; fix: how to make a matching copy.
    """
    if recorded is None:
        return
    found = weights_fingerprint(model_dir)
    if found is None or found == recorded:
        return
    raise ValueError(
        f"{copy} was cut from other weights than {model_dir} holds"
        f"{f' (it was written from {source})' if source else ''}: the model config matches but sampled "
        f"tensor bytes differ (a fine-tune of the same model, or a checkpoint replaced since). {fix}, or "
        f"pass the model it was written from"
    )


def _hash_tensors(digest, ckpt: CheckpointFiles) -> None:
    spans = []
    for path in ckpt.files:
        header = safetensors_header(path)
        starts = sorted({entry.begin for entry in header.values()}) + [path.stat().st_size]
        next_begin = dict(zip(starts, starts[1:]))  # offsets are contiguous (checked by safetensors)
        # a tensor with no elements shares its offset with the next one and owns no bytes
        spans += [(name, entry, path, entry.begin if 0 in entry.shape else next_begin[entry.begin])
                  for name, entry in header.items() if _loaded_from(ckpt, name, path)]
    for name, entry, path, end in sorted(spans, key=lambda span: span[0]):
        digest.update(f"{name}\n{entry.dtype}\n{list(entry.shape)}\n".encode())
        digest.update(sampled_bytes(path, entry.begin, end, 3, SAMPLE_BYTES))


def _loaded_from(ckpt: CheckpointFiles, name: str, path: Path) -> bool:
    """Whether the load reads tensor `name` from `path`: a tensor stored in two shards is read from
    the one the index maps it to, and hashing both copies left the fingerprint unchanged when the
    index was re-pointed to the other (a copy cut before then loaded stale weights). A tensor the
    index does not list is hashed where it is, as it always was, so recorded fingerprints stay valid."""
    return ckpt.weight_map.get(name, path) == path


def _hash_file(digest, path: Path) -> None:
    size = path.stat().st_size
    digest.update(f"{path.name}\n{size}\n".encode())
    digest.update(sampled_bytes(path, 0, size, FILE_SAMPLES, SAMPLE_BYTES))
