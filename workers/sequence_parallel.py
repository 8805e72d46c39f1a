"""Sequence parallelism for multi-token steps (prefills): the residual stream split along the sequence.

Plain tensor parallelism keeps the whole (batch, seq, hidden) residual stream on every rank: each
rank runs every norm and residual add over every token, and each block ends in an all-reduce that
leaves every rank with the full sum. With sequence parallelism (NxD's `sequence_parallel_enabled`),
rank r keeps only its block of ceil(seq / tp) tokens between blocks:

    norm(x_r) -> all-gather along seq -> q/k/v or gate/up (column-parallel, whole sequence)
    -> attention or activation -> o_proj or down_proj (row-parallel partial sums)
    -> reduce-scatter along seq -> x_r + block output

The all-reduce becomes a reduce-scatter plus an all-gather moving the same bytes in total, and
the norms, residual adds and the activations kept between blocks shrink by the TP degree. The
embedding ends in a reduce-scatter too, and the step gathers the sequence once more before the LM
head. Decode steps (one token per row) have nothing to split and never use it.

Exactness. Every element of a reduce-scatter is summed in global rank order like the all-reduce
(workers/collectives.py), norms are per token, and the projections see the same gathered input as
without the split, so a step's logits and keys/values are bit-identical with and without it.

A sequence that does not divide by the TP degree is padded with zero tokens at the end before the
scatter and trimmed after each gather. A zero token stays zero through every norm (RMSNorm and
LayerNorm of a zero vector are zero; a projection's bias may make it nonzero after its block), so
padding never produces NaN, and since the tokens are trimmed before anything reads across the
sequence it never reaches a real one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.collectives import Collectives

SEQ_DIM = 1
"""Activations are (batch, seq, hidden)."""


class SequenceSplit:
    """How one step's `seq` tokens are split over the ranks of `collectives`."""

    def __init__(self, collectives: Collectives, seq: int) -> None:
        self.collectives, self.seq = collectives, seq
        ranks = collectives.world_size
        self.block = -(-seq // ranks)  # tokens per rank, the last rank's block padded
        self.padded = self.block * ranks

    def scatter_sum(self, partial: torch.Tensor) -> torch.Tensor:
        """(batch, seq, hidden) partial sums -> this rank's (batch, block, hidden) of their total."""
        if self.padded != self.seq:
            partial = F.pad(partial, (0, 0, 0, self.padded - self.seq))
        return self.collectives.reduce_scatter_along(partial, SEQ_DIM)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's (batch, block, hidden) -> the whole (batch, seq, hidden), in token order."""
        whole = self.collectives.gather_along(local, SEQ_DIM)
        # Trimmed, contiguous: with two rows or more the slice is not, and F.linear with a bias then
        # multiplies and adds the bias in two roundings where plain TP's contiguous input takes one
        # fused addmm (bf16 logits 0.2 apart, Qwen2 at TP 3).
        return whole if self.padded == self.seq else whole[:, : self.seq].contiguous()


def split_for(collectives: Collectives, enabled: bool, seq: int) -> SequenceSplit | None:
    """The split for a step of `seq` tokens per row, or None when the step runs without one
    (disabled, TP 1, or a single-token decode step)."""
    if not enabled or collectives.world_size == 1 or seq < 2:
        return None
    return SequenceSplit(collectives, seq)
