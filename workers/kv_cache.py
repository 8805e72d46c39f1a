"""Preallocated key/value cache for one rank: fixed shapes, written by position index.

Every layer owns one k and one v tensor of shape (batch, kv_heads_per_rank, max_seq_len, head_dim),
allocated once. A forward pass writes its new keys and values into the slots named by
`cache_positions` and attends over the whole cache under a mask, so no tensor changes shape or
grows between decode steps: a fixed-shape decode step is what a compiler (Neuron, torch.compile)
turns into a single graph.

Slots are shared by the batch: in a left-padded batch, slot i holds column i of every row.
"""

from __future__ import annotations

import torch


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, cache_positions: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write k, v (batch, kv_heads, seq, head_dim) into one layer's caches (batch, kv_heads,
    max_seq_len, head_dim) at slots cache_positions (seq,); returns the caches.

    index_copy_ writes in place: the cache tensors keep their storage for the whole request (and a
    compiled graph turns it into a scatter into its input, not a copy of the cache)."""
    k_cache.index_copy_(2, cache_positions, k)
    v_cache.index_copy_(2, cache_positions, v)
    return k_cache, v_cache


class KVCache:
    def __init__(self, num_layers: int, batch: int, kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
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
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def reset(self) -> None:
        """Zero every slot (stale values are masked anyway; zeroing keeps them finite)."""
        with torch.inference_mode():
            for tensor in self.k + self.v:
                tensor.zero_()
