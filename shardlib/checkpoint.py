"""Read one rank's slices of a Hugging Face checkpoint without ever holding the whole model.

Formats, in the order they are looked for (the order Hugging Face prefers them):
model.safetensors, model.safetensors.index.json, pytorch_model.bin, pytorch_model.bin.index.json.
Every tensor name and shape is checked against the config before any weight byte is read.

Memory: what a rank adds to its peak RSS (VmHWM) should be its shard and little more. Measured on
SmolLM2-135M float32 (538 MB, one model.safetensors), rank 0, added VmHWM in MiB (shard 513 at TP 1,
171 at TP 3):
  safe_open kept open, get_slice per tensor     TP1 1032  TP3 531   (every touched page stays mapped)
  safe_open opened and closed around each tensor TP1  519  TP3 177   (1.5 s at TP 3)
  os.preadv straight into the output tensor      TP1  515  TP3 172   (0.3 s at TP 3)
safetensors 0.8's get_slice returns a strided view over the whole mapped tensor, so a row-parallel
slice (dim 1: o_proj, down_proj) copied out of it faults in every page of that tensor, and those
file pages count in RSS until the file is unmapped; its "pread" backend reads the whole tensor into a
temporary buffer first. So safetensors files are read here with os.preadv from the offsets in the
header (after safetensors itself has parsed and validated that header): each byte range of the
rank's slice lands directly in the output tensor, with no temporary copy and no mapping, and the
bytes read equal the shard's bytes. A dim-1 slice costs one read per row, about 2 us each here
(SmolLM2 at TP 3: 35 thousand reads, 0.07 s); the largest models need about a million per rank,
a few seconds, a fair price for not holding a second copy of each tensor.
Pickles are memory-mapped by torch.load(mmap=True); after each tensor is sliced its file pages are
dropped from this process with madvise(MADV_DONTNEED) (measured: TP1 525, TP3 182 instead of 1031,
530). A slice is copied PICKLE_BLOCK_BYTES of rows at a time, each block's pages dropped before the
next: copied whole, it faulted in every row it touches first, and a slice along a later dim
(row-parallel: o_proj, down_proj) touches every row, so the rank's peak held its whole largest such
matrix beside its shard (README, Measured: pickled checkpoints' slices).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import math
import mmap
import os
import pickle
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

# Locating the files and checking names and shapes needs no torch (the driver does it before any
# worker starts); the names are re-exported here, where the loaders have always found them.
from shardlib.checkpoint_files import (CHECKPOINT_FILES, COPY_SAMPLE_BYTES, COPY_SAMPLES,  # noqa: F401
                                       READABLE_DTYPES, CheckpointFiles, StoredTensor, check_dtypes,
                                       check_stored_copies, checked_names, find_checkpoint, sample_starts,
                                       safetensors_header, unreadable_dtype, validated_names)
from shardlib.model_config import ModelConfig, normalize_dtype
from shardlib.param_shapes import expected_shapes
from shardlib.quantization import keeps_dtype
from shardlib.sharding import ShardLayout, TensorSlice, apply_slice, slice_for

Progress = Callable[[str, int, int], None]
"""progress(tensor_name, tensors_done, tensors_total), called after each tensor is read."""


# ---- safetensors: header from safetensors, bytes by preadv ------------------------------------
# in READABLE_DTYPES' order: the driver's check refuses exactly what a rank cannot read
_SAFETENSORS_DTYPES = dict(zip(READABLE_DTYPES, (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool), strict=True))


@dataclass(frozen=True)
class _Entry:
    shape: tuple[int, ...]
    dtype: torch.dtype
    begin: int = 0
    """Absolute file offset of the first byte (safetensors only)."""


class SafetensorsFile:
    """A safetensors file's table of contents; reads slices with preadv into fresh tensors.

    Use as a context manager around read() calls (it holds one file descriptor open).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, _Entry] = {}
        for name, entry in safetensors_header(path).items():  # validated by safetensors itself
            dtype = _SAFETENSORS_DTYPES.get(entry.dtype)
            if dtype is None:
                raise ValueError(unreadable_dtype(name, path, entry.dtype))
            self.entries[name] = _Entry(entry.shape, dtype, entry.begin)
        self._fd: int | None = None

    def __enter__(self) -> "SafetensorsFile":
        if sys.byteorder != "little":
            raise RuntimeError("safetensors data is little-endian; this reader needs a little-endian host")
        self._fd = os.open(self.path, os.O_RDONLY)
        return self

    def __exit__(self, *exc) -> None:
        os.close(self._fd)
        self._fd = None

    def read(self, name: str, tslice: TensorSlice) -> torch.Tensor:
        """Exactly apply_slice(full tensor, tslice), reading only the slice's bytes."""
        entry = self.entries[name]
        out = (torch.zeros if tslice.pad_to is not None else torch.empty)(tslice.shape(entry.shape), dtype=entry.dtype)
        if out.numel() == 0:
            return out
        dst = memoryview(out.view(-1).view(torch.uint8).numpy())
        if tslice.is_whole:
            self._pread_into(dst, entry.begin)
            return out
        # Bytes of one index along the sliced dim, and of one block over all indices of that dim:
        # a slice is, for each outer index, one contiguous byte run per range.
        d, shape = tslice.dim, entry.shape
        inner = math.prod(shape[d + 1:]) * out.element_size()
        src_block, dst_block = shape[d] * inner, out.shape[d] * inner
        for outer in range(math.prod(shape[:d])):
            pos = outer * dst_block
            for start, stop in tslice.ranges:
                size = (stop - start) * inner
                self._pread_into(dst[pos:pos + size], entry.begin + outer * src_block + start * inner)
                pos += size
        return out

    def _pread_into(self, view: memoryview, offset: int) -> None:
        while len(view):  # one read returns at most ~2 GiB on Linux
            got = os.preadv(self._fd, [view], offset)
            if got == 0:
                raise ValueError(f"{self.path} ended at byte {offset} while reading: the file was truncated "
                                 f"after it was opened; download or save it again")
            view, offset = view[got:], offset + got


# ---- pickles: torch.load(weights_only, mmap), pages dropped after each tensor -----------------
_MADV_DONTNEED = 4


class _PickleFile:
    """A pytorch_model*.bin loaded as memory-mapped tensors (weights only, nothing executed)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            obj = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
        except pickle.UnpicklingError as err:
            found = re.search(r"GLOBAL ([\w.]+)", str(err))
            what = f" ({found.group(1)})" if found else ""
            raise ValueError(
                f"{path} holds a pickled object that is not a tensor{what}; corelaunch loads pickles with "
                f"torch.load(weights_only=True) and never runs pickled code. Convert the checkpoint to "
                f"safetensors where you trust its source, or save only the state_dict's tensors"
            ) from None
        except RuntimeError as err:
            if "mmap" in str(err) and _legacy_pickle(path):
                raise ValueError(
                    f"{path} uses torch's legacy (pre-1.6) serialization, which cannot be memory-mapped; "
                    f"re-save it with a current torch.save, or convert it to safetensors"
                ) from None
            raise ValueError(f"{path} is not a readable torch checkpoint ({str(err).splitlines()[0]}); "
                             f"it is probably truncated or corrupt: download or save it again") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path} holds a {type(obj).__name__}, not a state_dict of name -> tensor")
        odd = [str(k) for k, v in obj.items() if not (isinstance(k, str) and isinstance(v, torch.Tensor))]
        if odd:
            raise ValueError(f"{path} holds entries that are not tensors: {', '.join(odd[:8])}; a checkpoint "
                             f"must be a state_dict of name -> tensor (save model.state_dict() only)")
        self.tensors: dict[str, torch.Tensor] = obj
        self.entries = {n: _Entry(tuple(t.shape), t.dtype) for n, t in obj.items()}
        self._mappings = _mappings_of(path)

    def __enter__(self) -> "_PickleFile":
        return self

    def __exit__(self, *exc) -> None:
        self.tensors = {}  # the last reference to the mapping: the file is unmapped

    def read(self, name: str, tslice: TensorSlice) -> torch.Tensor:
        tensor = self.tensors[name]
        if tslice.is_whole or tensor.dim() == 0 or not tensor.is_contiguous():
            out = apply_slice(tensor, tslice)
            storage = tensor.untyped_storage()
            self._drop_pages(storage.data_ptr(), storage.nbytes())
            return out
        # In blocks of rows, each block's pages dropped before the next: copied whole, a slice faulted
        # in all the rows it touches (every row, for a later dim) before any page was dropped.
        out = (torch.zeros if tslice.pad_to is not None else torch.empty)(tslice.shape(tensor.shape), dtype=tensor.dtype)
        row_bytes = max(1, tensor.stride(0) * tensor.element_size())
        rows = max(1, PICKLE_BLOCK_BYTES // row_bytes)
        if tslice.dim == 0:
            spans = [(first, min(first + rows, stop)) for start, stop in tslice.ranges
                     for first in range(start, stop, rows)]
        else:
            spans = [(first, min(first + rows, tensor.shape[0])) for first in range(0, tensor.shape[0], rows)]
        at = 0  # where the next block goes along dim 0 of `out`
        for first, stop in spans:
            block = tensor[first:stop]
            if tslice.dim == 0:
                out[at:at + stop - first] = block
                at += stop - first
            else:
                out[first:stop] = apply_slice(block, tslice)
            self._drop_pages(block.data_ptr(), block.numel() * block.element_size())
        return out

    def _drop_pages(self, address: int, nbytes: int) -> None:
        """Unmap these bytes' pages from the process (they are re-read from the file if touched again).

        Only for pages inside this file's own mapping: MADV_DONTNEED on anonymous memory would zero it.
        """
        start = address // mmap.PAGESIZE * mmap.PAGESIZE
        stop = -(-(address + nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE
        if any(lo <= start and stop <= hi for lo, hi in self._mappings):
            _libc_madvise(start, stop - start, _MADV_DONTNEED)


PICKLE_BLOCK_BYTES = 4 << 20
"""How much of a pickled tensor's rows a later-dim slice copies at a time (_PickleFile.read)."""


LEGACY_TORCH_MAGIC = pickle.dumps(torch.serialization.MAGIC_NUMBER, protocol=2)[2:-1]
"""torch's legacy (pre-1.6) serialization pickles its magic number first: these are its bytes, after
the pickle's protocol opcode (and, from protocol 4, a frame header) and before its STOP."""


def _legacy_pickle(path: Path) -> bool:
    """Whether `path` is in torch's legacy format (which cannot be memory-mapped), not an empty,
    cut-short-at-the-start or garbage file, for which torch.load(mmap=True) says the same: a pickle
    (its PROTO opcode first) whose first object is torch's magic number, at any pickle protocol."""
    try:
        with open(path, "rb") as f:
            head = f.read(32)
    except OSError:
        return False
    return head.startswith(b"\x80") and LEGACY_TORCH_MAGIC in head


def _mappings_of(path: Path) -> list[tuple[int, int]]:
    """Address ranges where `path` is mapped in this process (empty where /proc is unavailable)."""
    target = os.path.realpath(path)
    ranges = []
    with contextlib.suppress(OSError):
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.rstrip("\n").split(maxsplit=5)
                if len(parts) == 6 and parts[5] == target:
                    lo, hi = parts[0].split("-")
                    ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


def _libc_madvise(address: int, length: int, advice: int) -> None:
    global _madvise
    if _madvise is None:
        _madvise = ctypes.CDLL(None, use_errno=True).madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _madvise(address, length, advice)  # a failure only means the pages stay resident


_madvise = None


# ---- one rank's shard -------------------------------------------------------------------------
def load_rank_shard(model_dir: str | Path, config: ModelConfig, layout: ShardLayout, rank: int,
                    dtype: str | None = None, progress: Progress | None = None) -> dict[str, torch.Tensor]:
    """HF parameter name -> this rank's slice, equal to apply_slice(full tensor, slice_for(...)).

    `dtype` casts every tensor (default: each tensor keeps the checkpoint's dtype). With tied
    embeddings the result has no lm_head.weight: the LM head is the embed_tokens shard.
    """
    check_layout(config, layout, rank)
    target = None if dtype is None else getattr(torch, normalize_dtype(dtype))
    ckpt = find_checkpoint(model_dir)
    with _open_files(ckpt) as files:
        names = _checked(ckpt, files, config)
        table = {name: (files[ckpt.weight_map[name]], files[ckpt.weight_map[name]].entries[name]) for name in names}
        order = {path: i for i, path in enumerate(ckpt.files)}  # file by file, in offset order
        names.sort(key=lambda n: (order[ckpt.weight_map[n]], table[n][1].begin))
        shard: dict[str, torch.Tensor] = {}
        for done, name in enumerate(names, 1):
            reader, entry = table[name]
            tensor = reader.read(name, slice_for(config.model_type, name, entry.shape, rank, layout))
            shard[name] = tensor if target is None or tensor.dtype == target or keeps_dtype(name, tensor) \
                else _cast(name, tensor, target)
            if progress is not None:
                progress(name, done, len(names))
    return shard


def _cast(name: str, tensor: torch.Tensor, target: torch.dtype) -> torch.Tensor:
    """`tensor` in `target`; ValueError where a cast to float16 made finite values infinite (past
    65504, which bfloat16 and float32 hold): such weights ran and gave garbage, inf and NaN from the
    first layer. Only float16 has a range narrower than the checkpoints' dtypes, so only its casts
    are looked at (one pass over what was cast)."""
    cast = tensor.to(target)
    if target is torch.float16 and tensor.is_floating_point() and not bool(torch.isfinite(cast).all()):
        finite = torch.isfinite(tensor)
        if bool((finite & ~torch.isfinite(cast)).any()):
            largest = tensor[finite].abs().max().item()
            raise ValueError(f"{name} holds values up to {largest:g} in magnitude, past float16's largest "
                             f"(65504): cast to float16 they become infinite; load this checkpoint with "
                             f"--dtype bfloat16 (or float32), whose range holds them")
    return cast


def shard_shapes(config: ModelConfig, layout: ShardLayout, rank: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of each tensor load_rank_shard returns for `rank`."""
    check_layout(config, layout, rank)
    return {name: slice_for(config.model_type, name, shape, rank, layout).shape(shape)
            for name, shape in expected_shapes(config).items()}


def check_layout(config: ModelConfig, layout: ShardLayout, rank: int) -> None:
    """ValueError unless `layout` was built for `config` and `rank` is one of its ranks."""
    if not 0 <= rank < layout.tp_degree:
        raise ValueError(f"rank {rank} is outside tp_degree {layout.tp_degree}: ranks are 0..{layout.tp_degree - 1}")
    own = ShardLayout.for_model(config, layout.tp_degree, layout.kv_strategy, layout.pad_q_heads, layout.moe_sharding)
    if own != layout:
        diff = ", ".join(f"{f.name}={getattr(layout, f.name)} (config: {getattr(own, f.name)})"
                         for f in dataclasses.fields(layout) if getattr(layout, f.name) != getattr(own, f.name))
        raise ValueError(f"the shard layout was built for another model than this config: {diff}; "
                         f"build it with ShardLayout.for_model(config, tp_degree, kv_strategy)")


_DTYPE_NAMES = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}


def _checked(ckpt: CheckpointFiles, files: dict[Path, SafetensorsFile | _PickleFile], config: ModelConfig) -> list[str]:
    """The names to read from the opened files, their names, shapes and dtypes checked."""
    names = checked_names(ckpt, {path: {n: e.shape for n, e in f.entries.items()} for path, f in files.items()},
                          config)
    entries = {name: files[ckpt.weight_map[name]].entries[name] for name in names}
    check_dtypes(ckpt, {name: _DTYPE_NAMES.get(e.dtype, str(e.dtype)) for name, e in entries.items()}, config)
    return names


def check_opened_checkpoint(ckpt: CheckpointFiles, config: ModelConfig) -> None:
    """The checks of a pickled checkpoint the driver makes before Ray starts, on its memory map (no
    weight byte read but the sampled pages), and check_stored_copies' (a tied head or a second copy
    of a tensor that differs: checked only for safetensors before, and a pickle's different head ran
    tied)."""
    with _open_files(ckpt) as files:
        names = _checked(ckpt, files, config)
        stored = {path: {name: _stored_pickled(tensor) for name, tensor in file.tensors.items()}
                  for path, file in files.items()}
        check_stored_copies(ckpt, stored, names, config)


def _stored_pickled(tensor: torch.Tensor) -> StoredTensor:
    return StoredTensor(tuple(tensor.shape), _DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype)),
                        lambda: _sampled_tensor_bytes(tensor, COPY_SAMPLES, COPY_SAMPLE_BYTES))


def _sampled_tensor_bytes(tensor: torch.Tensor, count: int, size: int) -> bytes:
    """sampled_bytes of a (memory-mapped) tensor's bytes in row-major order: only the sampled pages
    are read from the file."""
    # a view where the tensor is stored contiguous (as saved weights are); a strided one is copied whole
    flat = tensor.contiguous().reshape(-1).view(torch.uint8)
    starts = sample_starts(flat.numel(), count, size)
    if starts is None:
        return flat.numpy().tobytes()
    return b"".join(flat[start:start + size].numpy().tobytes() for start in starts)


@contextlib.contextmanager
def _open_files(ckpt: CheckpointFiles) -> Iterator[dict[Path, SafetensorsFile | _PickleFile]]:
    kind = SafetensorsFile if ckpt.format.startswith("safetensors") else _PickleFile
    with contextlib.ExitStack() as stack:
        yield {path: stack.enter_context(kind(path)) for path in ckpt.files}
