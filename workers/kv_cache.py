"""Preallocated key/value cache for one rank: fixed shapes, written by position index.

Every layer owns one k and one v tensor of shape (batch, kv_heads_per_rank, max_seq_len, head_dim),
allocated once. A forward pass writes its new keys and values into the slots named by
`cache_positions` and attends over the whole cache under a mask, so no tensor changes shape or
grows between decode steps: a fixed-shape decode step is what a compiler (Neuron, torch.compile)
turns into a single graph.

Two ways to index it, one write function:
- a static batch (workers/engine.py) owns the whole cache, one row per sequence; slots are shared
  by the batch (in a left-padded batch, slot i holds column i of every row), so a step names its
  slots once: cache_positions (seq,).
- the serving engine (workers/serving/) keeps max_num_seqs rows plus one scratch row, and each
  step names, for every token, the row and the slot it goes to: rows and cache_positions (batch,
  seq). Sequences start at slot 0 of their own row, each at its own length; padding tokens (a
  chunk padded to its bucket, filler rows of a batch bucket) are sent to the scratch row, which no
  real sequence reads.
"""

from __future__ import annotations

import math
import mmap

import torch

from workers.kv_quant import from_cache, to_cache, writable


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, cache_positions: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """write_kv's writes alone, for a reader of the caches themselves (the decode attention kernel):
    the gathered copy of each row's keys and values write_kv returns was made and thrown away at
    every eager decode step's layer."""
    # An fp8 cache (workers/kv_quant.py) stores quantized bytes and is dequantized where it is read.
    if rows is None:
        writable(k_cache).index_copy_(2, cache_positions, to_cache(k, k_cache))
        writable(v_cache).index_copy_(2, cache_positions, to_cache(v, v_cache))
        return
    # Advanced indices around a slice: the indexed view is (batch, seq, kv_heads, head_dim).
    writable(k_cache)[rows, :, cache_positions] = to_cache(k.transpose(1, 2), k_cache)
    writable(v_cache)[rows, :, cache_positions] = to_cache(v.transpose(1, 2), v_cache)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, cache_positions: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, rows: torch.Tensor | None = None,
             read_slots: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Write k, v (batch, kv_heads, seq, head_dim) into one layer's caches (cache rows, kv_heads,
    max_seq_len, head_dim) and return the keys and values the batch attends over.

    rows None: the batch is the cache's rows and cache_positions (seq,) the slots, shared by all
    rows; the whole caches are returned.
    rows (batch, seq): token (i, j) goes to row rows[i, j], slot cache_positions[i, j]; returned are
    the rows rows[:, 0] (each batch row's own sequence), their first read_slots slots.

    Both write in place: the cache tensors keep their storage for the whole request (and a compiled
    graph turns the write into a scatter into its input, not a copy of the cache)."""
    store_kv(k_cache, v_cache, cache_positions, k, v, rows)
    if rows is None:
        return from_cache(k_cache, k.dtype), from_cache(v_cache, v.dtype)
    own = rows[:, 0]
    read_slots = k_cache.shape[2] if read_slots is None else read_slots
    return from_cache(k_cache[own, :, :read_slots], k.dtype), from_cache(v_cache[own, :, :read_slots], v.dtype)


def zeros_on_first_touch(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor held in an anonymous memory map. The OS maps each page, zero-filled, when
    it is first touched, so allocating costs nothing and a page costs memory only once a sequence
    reaches it (a write, or a read: Linux counts a read page in the resident set too). torch.zeros
    writes every byte at once instead: SmolLM2's serving cache (17 rows of 4096 slots, 3 GiB) took
    about a second alone and several during a `corelaunch serve` start on machine I, where most of
    it is never written. The tensor keeps the map alive and unmaps it when freed."""
    return torch.frombuffer(mmap.mmap(-1, math.prod(shape) * dtype.itemsize), dtype=dtype).view(shape)


class KVCache:
    def __init__(self, num_layers: int, batch: int, kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 long_lived: bool = False) -> None:
        """long_lived: the serving engine's cache, allocated once for the group's life and mostly never
        written; on the CPU its pages come zero-filled from the OS on first touch
        (zeros_on_first_touch). A static batch's cache (False) is written whole by its prefill and
        freed after the request: torch.zeros there reuses memory the allocator already holds, where
        fresh maps would fault every page in again (the static batch of 16 measured slower that way
        on machine I; README, Measured)."""
        for name, value in (("num_layers", num_layers), ("batch", batch), ("kv_heads", kv_heads),
                            ("max_seq_len", max_seq_len), ("head_dim", head_dim)):
            if value < 1:
                raise ValueError(f"KVCache {name} ({value}) must be at least 1")
        self.batch = batch
        self.kv_heads = kv_heads
        self.max_seq_len = max_seq_len
        self.head_dim = head_dim
        self.dtype = dtype
        shape = (batch, kv_heads, max_seq_len, head_dim)
        first_touch = long_lived and (device is None or torch.device(device).type == "cpu")

        def zeroed() -> torch.Tensor:
            if first_touch:
                return zeros_on_first_touch(shape, dtype)
            return torch.zeros(shape, dtype=dtype, device=device)

        self.k = [zeroed() for _ in range(num_layers)]
        self.v = [zeroed() for _ in range(num_layers)]

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def clear_row(self, row: int, slots: int) -> None:
        """Zero row `row`'s first `slots` slots in every layer: a request that failed on NaN or inf (or
        was cancelled before its logits were read) may have written them, and a later request's
        masked read of them would give NaN (0 x NaN)."""
        with torch.inference_mode():
            for tensor in self.k + self.v:
                tensor[row, :, :slots].zero_()

    def copy_prefix(self, source: int, row: int, slots: int) -> None:
        """Row `row`'s first `slots` slots in every layer become row `source`'s (prefix caching: a
        prompt that starts as another row's tokens; workers/serving/prefix_reuse.py)."""
        with torch.inference_mode():
            for tensor in self.k + self.v:
                stored = writable(tensor)  # fp8 as its bytes: copied, never converted
                stored[row, :, :slots] = stored[source, :, :slots]

    def reset(self) -> None:
        """Zero every slot (stale values are masked anyway; zeroing keeps them finite)."""
        with torch.inference_mode():
            for tensor in self.k + self.v:
                tensor.zero_()
