"""Pre-sharded checkpoints: each rank's slices written once, so a later load is one plain file read.

Layout of a pre-sharded directory:
  rank-00000-of-00003.safetensors ...  one file per rank, Hugging Face tensor names unchanged, each
                                       tensor already sliced (and padded) for that rank
  manifest.json                        what the files were cut for: the model's config hash, TP
                                       degree, KV strategy, dtype; each file's size and sha256

A pre-sharded directory only fits the exact settings it was written for, so loading compares the
manifest with what is asked and refuses any difference instead of returning wrong slices.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from shardlib.atomic_dir import atomic_dir
from shardlib.checkpoint import Progress, SafetensorsFile, check_layout, load_rank_shard, shard_shapes
from shardlib.manifest import MANIFEST, read_manifest_json, write_manifest_json
from shardlib.model_config import ModelConfig, normalize_dtype
from shardlib.param_shapes import expected_shapes
from shardlib.sharding import ShardLayout, TensorSlice

FORMAT_VERSION = 1
KIND = "a pre-sharded checkpoint"
"""What these directories are called in messages."""
_WHOLE = TensorSlice(dim=None)


def rank_file_name(rank: int, tp_degree: int) -> str:
    return f"rank-{rank:05d}-of-{tp_degree:05d}.safetensors"


def save_presharded(out_dir: str | Path, model_dir: str | Path, config: ModelConfig, layout: ShardLayout,
                    dtype: str | None = None, progress: Progress | None = None) -> Path:
    """Write every rank's shard of the checkpoint in `model_dir` to `out_dir`; returns out_dir.

    One rank's shard is in memory at a time. The files are written into a temporary sibling folder
    that is renamed into place, so `out_dir` is never seen half written. An existing pre-sharded
    directory at `out_dir` is replaced; any other non-empty directory there is refused.
    """
    out_dir = Path(out_dir)
    dtype_name = None if dtype is None else normalize_dtype(dtype)
    tp = layout.tp_degree
    per_rank = len(expected_shapes(config))
    with atomic_dir(out_dir, KIND) as tmp:
        files, stored = [], set()
        for rank in range(tp):
            def report(name: str, done: int, total: int, rank: int = rank) -> None:
                progress(f"rank {rank}: {name}", rank * per_rank + done, tp * per_rank)

            shard = load_rank_shard(model_dir, config, layout, rank, dtype, report if progress else None)
            stored |= {str(t.dtype).removeprefix("torch.") for t in shard.values()}
            path = tmp / rank_file_name(rank, tp)
            save_file(shard, path, metadata={"format": "pt", "rank": str(rank), "tp_degree": str(tp)})
            del shard
            files.append({"rank": rank, "file": path.name, "bytes": path.stat().st_size, "sha256": _sha256(path)})
        manifest = {
            "format_version": FORMAT_VERSION,
            "config_hash": config.config_hash(),
            "model_type": config.model_type,
            "tp_degree": tp,
            "kv_strategy": layout.kv_strategy.value,
            "dtype": dtype_name or (stored.pop() if len(stored) == 1 else "mixed"),
            "files": files,
            "corelaunch_version": _corelaunch_version(),
            "source": str(Path(model_dir).resolve()),
        }
        write_manifest_json(tmp, manifest)
    return out_dir


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The parsed manifest.json of a pre-sharded directory."""
    return read_manifest_json(
        directory, what=KIND,
        required=("format_version", "config_hash", "model_type", "tp_degree", "kv_strategy", "dtype", "files"),
        write_hint="write it with shardlib.presharded.save_presharded (or `corelaunch compile`), or load "
                   "the original Hugging Face checkpoint instead")


def load_presharded(directory: str | Path, config: ModelConfig, layout: ShardLayout, rank: int,
                    dtype: str | None = None, *, verify_sha256: bool = False) -> dict[str, torch.Tensor]:
    """This rank's shard from a pre-sharded directory: the same dict load_rank_shard returns.

    ValueError when the manifest was written for other settings than (config, layout, dtype).
    File sizes are always checked; `verify_sha256` also hashes the rank's file.
    """
    directory = Path(directory)
    check_layout(config, layout, rank)
    manifest = read_manifest(directory)
    asked = {"format_version": FORMAT_VERSION, "config_hash": config.config_hash(),
             "model_type": config.model_type, "tp_degree": layout.tp_degree,
             "kv_strategy": layout.kv_strategy.value}
    if dtype is not None:
        asked["dtype"] = normalize_dtype(dtype)
    differ = [f"{key}: expected {value!r}, found {manifest[key]!r}"
              for key, value in asked.items() if manifest[key] != value]
    if differ:
        settings = f"tp_degree={layout.tp_degree}, kv_strategy={layout.kv_strategy.value!r}" + (
            f", dtype={asked['dtype']!r}" if "dtype" in asked else "")
        raise ValueError(
            f"pre-sharded checkpoint {directory} was written for other settings: {'; '.join(differ)}. "
            f"Re-run save_presharded for this model with {settings}, or load the original checkpoint"
            f"{' (' + manifest['source'] + ')' if manifest.get('source') else ''} instead"
        )
    entry = next((f for f in manifest["files"] if f.get("rank") == rank), None)
    if entry is None:
        raise ValueError(f"{directory / MANIFEST} lists no file for rank {rank}; write the checkpoint again")
    path = directory / entry["file"]
    _check_file(path, entry, verify_sha256)
    want = shard_shapes(config, layout, rank)
    with SafetensorsFile(path) as reader:
        found = {name: e.shape for name, e in reader.entries.items()}
        missing = [n for n in want if n not in found]
        extra = [n for n in found if n not in want]
        wrong = [n for n in want if n in found and found[n] != want[n]]
        if missing or extra or wrong:
            detail = (f"tensor {missing[0]!r} is missing" if missing else f"tensor {extra[0]!r} is unexpected"
                      if extra else f"tensor {wrong[0]!r} has shape {found[wrong[0]]}, expected {want[wrong[0]]}")
            raise ValueError(f"{path} does not hold rank {rank}'s shard for this config: {detail}; "
                             f"write the pre-sharded checkpoint again")
        return {name: reader.read(name, _WHOLE) for name in sorted(want, key=lambda n: reader.entries[n].begin)}


def _check_file(path: Path, entry: dict, verify_sha256: bool) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"pre-sharded file {path} named in its {MANIFEST} is missing; copy the whole "
                                f"directory again or write it again")
    size = path.stat().st_size
    if size != entry.get("bytes"):
        raise ValueError(f"{path} has {size} bytes but {MANIFEST} records {entry.get('bytes')}: it was truncated "
                         f"or modified; copy it again or write the pre-sharded checkpoint again")
    if verify_sha256 and _sha256(path) != entry.get("sha256"):
        raise ValueError(f"{path} does not match the sha256 in {MANIFEST}: it is corrupt; copy it again")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _corelaunch_version() -> str:
    try:
        return importlib.metadata.version("corelaunch")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"
