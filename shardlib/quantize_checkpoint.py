"""Quantize a Hugging Face checkpoint directory into a new one (`corelaunch quantize`), streaming.

The output is a Hugging Face-style directory: config.json with a `quantization_config` block
(shardlib/quantization.py), one model.safetensors in which every quantized weight is stored in
8 bits with its `<module>.scale` beside it and every other tensor unchanged, and every other file
of the source (tokenizer, generation config) copied.

Memory: the safetensors header is written first, since every output shape and dtype is known from
the source's header, so the file is filled sequentially and never held whole. A weight to quantize
is never held whole either: it is read a block of rows at a time (shardlib.checkpoint's readers: a
safetensors slice is read with preadv, a pickle's is memory-mapped and its pages dropped after use),
and each block's 8-bit rows are written as soon as they are computed; its scales follow. A
per-tensor scale needs the whole tensor's maximum first, so those weights are read twice. Peak host
memory: the largest tensor kept as it is (norms, an unquantized embedding or LM head), or a few
blocks (QUANT_BLOCK_BYTES of float32 each) plus one weight's scales.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
from pathlib import Path
from typing import Callable

import torch

from shardlib.atomic_dir import (fsync_dir, fsync_tree, make_parents, owned_sibling, rename_no_replace,
                                 sibling_name_too_long, sweep_stale, unwritable_reason)
from shardlib.checkpoint import CHECKPOINT_FILES, _open_files, checked_names, find_checkpoint
from shardlib.checkpoint_files import check_checkpoint
from shardlib.demo_model import _MARKER as DEMO_MARKER
from shardlib.model_config import ModelConfig, load_model_config, read_config_json
from shardlib.quantization import (UNQUANTIZABLE_MODEL_TYPES, Quantization, absmax_scale, normalize_quant_dtype,
                                   quantize_with_scale, scale_name, storage_dtype)
from shardlib.sharding import TensorSlice

QUANT_BLOCK_BYTES = 4 << 20
"""float32 bytes of one block of rows quantized at a time (bounds the temporaries)."""

_ST_DTYPE = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int8: "I8",
             torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
_WHOLE = TensorSlice(dim=None)


def check_quantize_options(dtype: str, out_dir: str | Path, model_dir: str | Path | None = None) -> str:
    """The normalized format; ValueError for an unknown dtype, an output path inside `model_dir` (when
    given), or one that exists (what can be refused before the model is even found: the built-in
    one is converted on first use)."""
    fmt = normalize_quant_dtype(dtype)
    if model_dir is not None:  # the model's folder itself exists too: said as inside it, first
        refuse_out_inside_model(model_dir, out_dir)
    from shardlib.model_path_hints import refuse_unexpanded_home

    refuse_unexpanded_home("--out", out_dir)
    if Path(out_dir).exists() or Path(out_dir).is_symlink():
        raise ValueError(f"--out {out_dir} already exists; choose a new directory (quantize never overwrites)")
    # what compile's --out is refused for, before the conversion rather than after it (a file on the
    # way, a folder this user may not write, a name too long for the folder written beside it)
    reason = unwritable_reason(out_dir)  # said as a failed write of it is (quantize_command.py)
    if reason is not None:
        raise ValueError(f"could not write --out {out_dir} ({reason}); pass a new path in a directory you can "
                         f"write to")
    too_long = sibling_name_too_long(out_dir, "partial")
    if too_long is not None:
        raise ValueError(f"could not write --out {out_dir}: {too_long}")
    return fmt


def check_quantize_request(model_dir: str | Path, dtype: str, out_dir: str | Path,
                           lm_head: bool = False) -> tuple[dict, str]:
    """(the source's parsed config.json, the normalized format); ValueError (one line) for an unknown
    dtype, an already quantized source, an output path that exists, or an LM head asked for where
    the model has none of its own, or an output path inside the model's folder. Reads no weights."""
    normalize_quant_dtype(dtype)  # an unknown dtype first, as check_quantize_options names it
    config_file = Path(model_dir) / "config.json"
    if not Path(model_dir).exists():  # said "has no config.json" of a path that is not there at all
        from shardlib.model_path_hints import missing_model_hint

        raise FileNotFoundError(f"--model {model_dir} does not exist; pass a Hugging Face model directory, or omit "
                                f"--model for the built-in SmolLM2-135M-Instruct{missing_model_hint(model_dir)}")
    if Path(model_dir).is_file():
        raise ValueError(f"--model {model_dir} is a file; pass the model directory that holds it "
                         f"({Path(model_dir).parent})")
    # after those: a mistyped --model is named as missing
    fmt = check_quantize_options(dtype, out_dir, model_dir)
    if not config_file.exists():
        if (Path(model_dir) / "manifest.json").is_file():  # what corelaunch compile or save_presharded wrote
            raise ValueError(f"--model {model_dir} is a corelaunch compiled or pre-sharded directory, not a Hugging "
                             f"Face model: quantize the model it was made from, then compile that")
        raise ValueError(f"--model {model_dir} has no config.json; pass a Hugging Face model directory")
    raw = read_config_json(config_file)
    if isinstance(raw, dict) and raw.get("quantization_config") is not None:
        method = raw["quantization_config"].get("quant_method") if isinstance(raw["quantization_config"], dict) else "?"
        raise ValueError(f"--model {model_dir} is already quantized (quantization_config with quant_method="
                         f"{method!r}); quantize the original unquantized checkpoint instead")
    config = ModelConfig.from_dict(raw)  # every field checked before any weight is read
    if config.model_type in UNQUANTIZABLE_MODEL_TYPES:
        raise ValueError(f"--model {model_dir} is a {config.model_type} model, whose fused attention and expert "
                         f"matrices corelaunch quantize does not quantize; serve it in bfloat16 or float32")
    if lm_head and config.tie_word_embeddings:
        raise ValueError(f"--lm-head: {model_dir} ties its LM head to the embedding table "
                         f"(tie_word_embeddings), so it has no LM head of its own; pass --embedding to quantize "
                         f"the shared table, or drop --lm-head")
    return raw, fmt


def refuse_out_inside_model(model_dir: str | Path, out_dir: str | Path) -> None:
    """ValueError for an --out that is the model's folder or lies inside it: the copy became part
    of the model's folder, and the built-in model's cache folder (shardlib/demo_model.py) is replaced
    whole when it is converted again, losing the copy without a word. Compared once resolved, so
    a relative path, `..` or a symlinked parent cannot hide it (realpath: a symlink loop is left to
    the checks that name it, where Path.resolve raised)."""
    model, out = Path(os.path.realpath(model_dir)), Path(os.path.realpath(out_dir))
    if out == model or model in out.parents:
        where = "the" if out == model else "inside the"
        raise ValueError(f"--out {out_dir} is {where} --model directory {model_dir}: the quantized copy would be "
                         f"written into the model's own folder; pass a path outside the model directory")


def quantize_checkpoint(model_dir: str | Path, out_dir: str | Path, dtype: str, per_channel: bool = True,
                        lm_head: bool = False, embed: bool = False, progress: Callable[[str, int, int], None] | None = None) -> Path:
    """Write the quantized directory at `out_dir` (see the module docstring); returns it."""
    raw, fmt = check_quantize_request(model_dir, dtype, out_dir, lm_head)
    check_checkpoint(model_dir, ModelConfig.from_dict(raw))  # a tied config's stored head too, which is dropped
    quant = Quantization(fmt, "per_channel_symmetric" if per_channel else "per_tensor_symmetric",
                         "linear" + ("+embed" if embed else "") + ("+lm_head" if lm_head else ""))
    config = ModelConfig.from_dict(raw)
    out_dir = Path(out_dir)
    sweep_stale(out_dir)  # what a quantize killed part way (SIGKILL: no clean-up runs) left, the model's size
    partial = owned_sibling(out_dir, "partial")
    make_parents(out_dir)  # a parent the filesystem refuses is a failed write of out_dir (ParentNotCreated)
    partial.mkdir()
    try:
        _write_weights(Path(model_dir), config, quant, partial / "model.safetensors", progress)
        _copy_other_files(Path(model_dir), partial)
        (partial / "config.json").write_text(json.dumps(_quantized_config(Path(model_dir), raw, quant), indent=2))
        # every file and the folder on disk before the rename names them out_dir: a crash after it
        # left a complete-looking --out with empty or missing files (only the weights were fsynced)
        fsync_tree(partial)
        _rename_into_place(partial, out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    fsync_dir(out_dir.parent)  # the rename itself
    return out_dir


def _quantized_config(model_dir: Path, raw: dict, quant: Quantization) -> dict:
    """The output's config.json: the source's, with its quantization_config, and the source's dtype
    written out where the source's config names none. Read from the weights then (transformers'
    rule), the output's first floating tensor by name is a float32 `<m>.scale` once the embedding or
    LM head is quantized: a bf16 model was planned as float32, its KV cache twice the size."""
    written = {**raw, "quantization_config": quant.to_json()}
    if raw.get("dtype") is None and raw.get("torch_dtype") is None:
        # torch_dtype: the key transformers 4 and 5 and load_model_config all read
        written["torch_dtype"] = load_model_config(model_dir).torch_dtype
    return written


def _rename_into_place(partial: Path, out_dir: Path) -> None:
    """The finished folder renamed to `out_dir`, which must still not exist. Two quantizes into one
    new --out both passed the check before any weight was read; rename(2) then replaced an empty
    folder made meanwhile without a word, and the loser of the race was told its --out could not be
    written ("Directory not empty"), as if the fault were a permission."""
    taken = ValueError(f"--out {out_dir} already exists: another process wrote it while this quantize ran; "
                       f"choose a new directory (quantize never overwrites)")
    try:
        if not rename_no_replace(partial, out_dir):  # a file system without it: a check, then rename(2)
            if out_dir.exists() or out_dir.is_symlink():
                raise taken
            partial.rename(out_dir)
    except OSError as err:
        if err.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise taken from None
        raise


def _write_weights(model_dir: Path, config: ModelConfig, quant: Quantization, path: Path,
                   progress: Callable[[str, int, int], None] | None) -> None:
    ckpt = find_checkpoint(model_dir)
    with _open_files(ckpt) as files:
        # the index may name a tensor its file lacks: checked (and named) before anything is read
        names = checked_names(ckpt, {p: {n: e.shape for n, e in f.entries.items()} for p, f in files.items()}, config)
        entries = {name: files[p].entries[name] for name, p in ckpt.weight_map.items()}
        # The output's table of contents, in write order: each weight, then its scale.
        layout: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        for name in names:
            entry = entries[name]
            if quant.is_quantized(name, config.tie_word_embeddings):
                layout.append((name, storage_dtype(quant.dtype), entry.shape))
                layout.append((scale_name(name), torch.float32, quant.scale_shape(entry.shape)))
            else:
                layout.append((name, _written_dtype(entry.dtype), entry.shape))
        with open(path, "wb") as out:
            _write_header(out, layout)
            for done, name in enumerate(names, 1):
                reader = files[ckpt.weight_map[name]]
                if quant.is_quantized(name, config.tie_word_embeddings):
                    write_quantized(out, lambda a, b: reader.read(name, TensorSlice(dim=0, ranges=((a, b),))),
                                    entries[name].shape, quant, name)
                else:
                    tensor = reader.read(name, _WHOLE)
                    _write_tensor(out, tensor.to(_written_dtype(tensor.dtype)))
                    del tensor  # before the next read: one source tensor at a time
                if progress is not None:
                    progress(name, done, len(names))
        # fsynced with the folder's other files by quantize_checkpoint


def _written_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 tensors (norms or biases some checkpoints store so) are written as float32, which a
    launch casts them to anyway; safetensors' F64 was refused, naming no fix."""
    return torch.float32 if dtype == torch.float64 else dtype


def _finite(weight: torch.Tensor, name: str, start: int) -> torch.Tensor:
    """weight (the rows of `name` from `start` on), or ValueError when it holds NaN or infinite values: their
    scale and codes would be NaN, which no launch can use (the rank refuses them, or every request
    fails on NaN logits)."""
    bad = ~torch.isfinite(weight)
    if bool(bad.any()):
        # the rows that hold them, not the block read (its rows were every row of a small tensor)
        rows = (torch.nonzero(bad.reshape(bad.shape[0], -1).any(dim=1)).flatten() + start).tolist()
        shown = ", ".join(map(str, rows[:_ROWS_NAMED])) + (f" and {len(rows) - _ROWS_NAMED} more" if len(rows) >
                                                            _ROWS_NAMED else "")
        raise ValueError(f"tensor {name!r} holds {int(bad.sum())} NaN or infinite value(s) in row(s) {shown}: their "
                         f"8-bit codes and scale would be NaN; quantize a checkpoint with finite weights (the source "
                         f"model gives NaN or infinite outputs too)")
    return weight


_ROWS_NAMED = 5
"""A refusal names this many of a tensor's rows with NaN or infinite values, and counts the rest."""


def write_quantized(out, read_rows: Callable[[int, int], torch.Tensor], shape: tuple[int, ...],
                    quant: Quantization, name: str = "weight") -> None:
    """Write quantize(weight)'s 8-bit values, then its scale, reading the weight of `shape` through
    read_rows(start, stop) one block of rows (QUANT_BLOCK_BYTES of float32) at a time. The bytes are
    identical to quantizing it whole: per-channel scales are per row, and a per-tensor scale is the
    maximum of the blocks' maxima (taken in a first pass). ValueError naming `name` when a value is
    NaN or infinite. Each block is read as float32 (the bytes are those of any wider read): a weight
    stored in 8 bits (F8_E4M3 or F8_E5M2 in a checkpoint of no quantization) had no isfinite or
    amax in torch and ended the command in a traceback."""
    source_rows = read_rows

    def read_rows(start: int, stop: int) -> torch.Tensor:
        return source_rows(start, stop).to(torch.float32)

    rows = max(1, QUANT_BLOCK_BYTES // (4 * max(1, math.prod(shape[1:]))))
    blocks = [(start, min(start + rows, shape[0])) for start in range(0, shape[0], rows)]
    if quant.per_channel:
        scales = []
        for start, stop in blocks:
            weight = _finite(read_rows(start, stop), name, start)
            scales.append(absmax_scale(weight, quant.dtype, True))
            _write_tensor(out, quantize_with_scale(weight, scales[-1], quant.dtype))
        _write_tensor(out, torch.cat(scales) if scales else torch.empty(0))
        return
    scale = torch.stack([absmax_scale(_finite(read_rows(start, stop), name, start), quant.dtype, False)
                         for start, stop in blocks]).amax(0)
    for start, stop in blocks:
        _write_tensor(out, quantize_with_scale(read_rows(start, stop), scale, quant.dtype))
    _write_tensor(out, scale)


def _write_header(out, layout: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
    """A safetensors header for tensors written back to back in `layout` order."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in layout:
        if dtype not in _ST_DTYPE:
            raise ValueError(f"tensor {name!r} has dtype {dtype}, which `corelaunch quantize` cannot write")
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _ST_DTYPE[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned, as safetensors writes it
    out.write(len(blob).to_bytes(8, "little"))
    out.write(blob)


def _write_tensor(out, tensor: torch.Tensor) -> None:
    if tensor.numel():
        out.write(memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy()))


OTHER_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ot", ".onnx", ".gguf", ".ckpt",
                         ".tflite")
"""Weight files a model folder may hold beside the checkpoint (shards, other frameworks' copies: Flax's
msgpack, TensorFlow's h5, ...): not copied into the quantized folder, where they were full-size
unquantized copies."""


def _copy_other_files(source: Path, dest: Path) -> None:
    """Every file of the source but its weights and config.json (tokenizer, generation config...)."""
    weight_files = {name for _, name in CHECKPOINT_FILES}
    for path in sorted(source.iterdir()):
        if not path.is_file() or path.name == "config.json" or path.name in weight_files:
            continue
        if path.suffix in OTHER_WEIGHT_SUFFIXES or path.name.endswith(".index.json"):
            continue  # weight shards of a sharded checkpoint, or another framework's copy of the weights
        if path.name == DEMO_MARKER:  # the built-in model's record of its conversion: not the copy's
            continue
        shutil.copy2(path, dest / path.name)
