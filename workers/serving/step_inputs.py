"""The tensors of one prefill chunk or one decode step, padded to the serving shapes.

Every rank builds them from the same StepPlan with this code, so all ranks run identical forwards.
Padding never touches a real sequence: padding tokens go to the scratch row (the cache's last),
at slot 0, and filler batch rows read the scratch row (workers/kv_cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardlib.serving_shapes import ServingShapes
from workers.serving.step_plan import DecodeRow, PrefillChunk


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cache_positions: torch.Tensor
    rows: torch.Tensor
    read_slots: int
    logit_index: torch.Tensor | None = None

    def to(self, device: torch.device) -> "StepInputs":
        move = (lambda t: t if t is None else t.to(device))
        return StepInputs(move(self.input_ids), move(self.position_ids), move(self.cache_positions),
                          move(self.rows), self.read_slots, move(self.logit_index))


def prefill_inputs(chunk: PrefillChunk, shapes: ServingShapes | None, scratch_row: int,
                   cache_slots: int) -> StepInputs:
    """Batch 1 x the chunk's bucket; it attends over its sequence's whole cache row."""
    n = len(chunk.token_ids)
    width = shapes.chunk_bucket(n) if shapes is not None else n
    ids = torch.zeros(1, width, dtype=torch.int64)
    ids[0, :n] = torch.tensor(chunk.token_ids, dtype=torch.int64)
    positions = (torch.arange(width, dtype=torch.int64) + chunk.start).clamp(max=cache_slots - 1)[None]
    real = torch.arange(width)[None] < n
    rows = torch.where(real, chunk.row, scratch_row)
    cache_positions = torch.where(real, positions, 0)
    return StepInputs(ids, positions, cache_positions, rows, cache_slots, torch.tensor([n - 1]))


def decode_inputs(decode: tuple[DecodeRow, ...], shapes: ServingShapes | None, scratch_row: int) -> StepInputs:
    """One token per running row, batch padded to a bucket; each row reads the slots of the token
    bucket holding the longest history (exactly that many without shapes)."""
    n = len(decode)
    longest = max(r.position for r in decode) + 1
    batch, read = shapes.decode_shape(n, longest) if shapes is not None else (n, longest)
    filler = batch - n  # rows reading and writing only the scratch row, at slot 0
    # One tensor per column from Python lists: this runs every decode step (no per-element writes).
    ids = torch.tensor([r.token_id for r in decode] + [0] * filler, dtype=torch.int64)[:, None]
    positions = torch.tensor([r.position for r in decode] + [0] * filler, dtype=torch.int64)[:, None]
    rows = torch.tensor([r.row for r in decode] + [scratch_row] * filler, dtype=torch.int64)[:, None]
    return StepInputs(ids, positions, positions, rows, read)
