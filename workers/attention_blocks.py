"""Eager attention of a long query block by block, each block reading only the key slots it may see.

A prefill of n tokens from slot 0 attends under a causal mask: query i reads slots 0..i. The CPU
flash-attention kernel given a boolean mask still computes every (query, slot) score and masks it
afterwards, so half of a long prefill's attention work is thrown away (41% of an eager 1056-token
SmolLM2 prefill was attention on Zen 4). Cut into query blocks, block [i0, i1) needs only the slots
its mask rows reach; for a prefill from slot 0 that is slots 0..i1-1: (k + 1) / 2k of the scores for
k blocks (5/8 at 1024 tokens, 9/16 at 2048), towards half for longer ones. A chunk continuing a long
cached history saves less (every block reads the whole history), so blocks are used only where they
skip a real share of the scores.

The slots are taken from the mask itself (from the first to the last slot any of the block's
queries reads in any batch row), so any mask works: sliding windows drop the slots before the window
too, and padding queries (which read only slot 0) widen nothing. Skipped slots are masked out for
every query of the block, so each block's softmax is the whole mask's: the results equal the
one-call product up to float rounding.

Eager CPU only: the slot ranges are data (read from the mask), which a traced graph cannot depend on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

QUERY_BLOCK = 256
"""Queries per block: 128 and 256 measured alike on a 1056-token prefill, 512 kept a third of the saving
(benchmarks/prefill_paths.py); fewer calls favour the larger."""

MAX_READ_SHARE = 0.85
"""Blocks are used only when they read at most this share of the one-call product's scores: a chunk
after a long cached history reads nearly all of them in every block and gains nothing from the calls."""


def key_ranges(mask: torch.Tensor, block: int = QUERY_BLOCK) -> list[tuple[int, int, int, int]]:
    """(i0, i1, lo, hi) per query block [i0, i1) of a boolean mask (batch, 1, seq, slots): the slots
    [lo, hi) any of the block's queries may read in any batch row. A block that reads no slot at all
    (no mask the model builds has one: every query reads its own slot) keeps every slot, as the one
    call would."""
    rows = mask.flatten(0, 1)  # (batch, seq, slots): the mask has one head
    reach = rows[0] if rows.shape[0] == 1 else rows.any(0)  # (seq, slots): any batch row reads it
    ranges = []
    for i0 in range(0, reach.shape[0], block):
        read = reach[i0:i0 + block].any(0).nonzero()  # the slots some query of the block reads, in order
        lo, hi = (int(read[0]), int(read[-1]) + 1) if read.numel() else (0, reach.shape[1])
        ranges.append((i0, min(i0 + block, reach.shape[0]), lo, hi))
    return ranges


def worth_blocking(q: torch.Tensor) -> bool:
    """Whether `attention` should go by blocks: an eager CPU call with at least two query blocks."""
    return q.device.type == "cpu" and q.shape[2] >= 2 * QUERY_BLOCK and not torch.compiler.is_compiling()


def blocked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      scale: float, enable_gqa: bool) -> torch.Tensor | None:
    """F.scaled_dot_product_attention by query blocks over the slots each reaches, or None when the
    blocks would read more than MAX_READ_SHARE of the scores (the caller makes the one call)."""
    ranges = key_ranges(mask)
    read = sum((i1 - i0) * (hi - lo) for i0, i1, lo, hi in ranges)
    if read > MAX_READ_SHARE * q.shape[2] * keys.shape[2]:
        return None
    parts = [F.scaled_dot_product_attention(q[:, :, i0:i1], keys[:, :, lo:hi], values[:, :, lo:hi],
                                            attn_mask=mask[:, :, i0:i1, lo:hi], enable_gqa=enable_gqa, scale=scale)
             for i0, i1, lo, hi in ranges]
    return torch.cat(parts, dim=2)
