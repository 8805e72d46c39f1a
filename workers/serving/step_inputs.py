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


def prefill_batches(chunks: tuple[PrefillChunk, ...], shapes: ServingShapes | None) -> list[list[int]]:
    """The plan's chunks (by index) grouped into prefill calls: chunks of one chunk bucket together,
    in plan order (every rank groups alike), each call exactly a prefill batch bucket, the largest
    that the chunks left fill (15 chunks: 8, 4, 2, 1). A prefill is arithmetic, not memory traffic:
    a padding row costs as much as a real one, while one more call costs little.
    Without shapes (eager), calls of similar lengths, longest first, each at most as many padded
    tokens as the plan's real ones (or its longest chunk): one call for all padded every chunk to the
    longest, up to max_num_seqs x the budget (16 x 2033 tokens for 2048 real ones, 2.2 GiB of
    attention scores a layer for SmolLM2)."""
    if shapes is None:
        order = sorted(range(len(chunks)), key=lambda i: -len(chunks[i].token_ids))
        bound = max(sum(len(c.token_ids) for c in chunks), 1)
        calls: list[list[int]] = []
        for i in order:  # each call's width is its first (longest) chunk's
            if calls and (len(calls[-1]) + 1) * len(chunks[calls[-1][0]].token_ids) <= bound:
                calls[-1].append(i)
            else:
                calls.append([i])
        return calls
    groups: dict[tuple[int, bool], list[int]] = {}
    for i, chunk in enumerate(chunks):  # first chunks apart: their calls read only their own slots
        groups.setdefault((shapes.chunk_bucket(len(chunk.token_ids)), chunk.start == 0), []).append(i)
    calls = []
    for (bucket, _), members in groups.items():
        sizes = shapes.prefill_batch_buckets(bucket)
        k = 0
        while k < len(members):
            take = max(size for size in sizes if size <= len(members) - k)
            calls.append(members[k:k + take])
            k += take
    return calls


def prefill_inputs(chunks: list[PrefillChunk], shapes: ServingShapes | None, scratch_row: int,
                   cache_slots: int) -> StepInputs:
    """One batch row per chunk (a batch bucket x the chunk bucket; exact without shapes); its logits
    are taken at its last real token. When every chunk starts its sequence, each row attends over
    the call's width of slots (all that chunk can see); otherwise, with shapes, over its sequence's
    whole cache row (the continuing chunks' graphs read it all), and without, over the slots up to
    the call's furthest chunk end (a short chunk after a long cached prefix reads only those).
    Filler rows and padding tokens write only the scratch row, at slot 0."""
    longest = max(len(c.token_ids) for c in chunks)
    batch, width = shapes.prefill_shape(len(chunks), longest) if shapes is not None else (len(chunks), longest)
    ids = torch.zeros(batch, width, dtype=torch.int64)
    starts = torch.zeros(batch, 1, dtype=torch.int64)
    lengths = torch.zeros(batch, 1, dtype=torch.int64)
    rows = torch.full((batch, 1), scratch_row, dtype=torch.int64)
    for i, chunk in enumerate(chunks):
        ids[i, :len(chunk.token_ids)] = torch.tensor(chunk.token_ids, dtype=torch.int64)
        starts[i, 0], lengths[i, 0], rows[i, 0] = chunk.start, len(chunk.token_ids), chunk.row
    column = torch.arange(width, dtype=torch.int64)[None]
    # Padding columns repeat their row's last real position (filler rows: 0), so a row's largest
    # position is its real one (longrope chooses its factors by it: workers/rope.py) and stays
    # within the cache. Their tokens write only the scratch row and their logits are not used.
    positions = torch.minimum(column + starts, (starts + lengths - 1).clamp(min=0))
    real = column < lengths
    token_rows = torch.where(real, rows, scratch_row)  # column 0 is real: it names the row a batch row reads
    cache_positions = torch.where(real, positions, 0)
    if all(c.start == 0 for c in chunks):
        read = width
    else:
        read = cache_slots if shapes is not None else max(c.start + len(c.token_ids) for c in chunks)
    return StepInputs(ids, positions, cache_positions, token_rows, read, (lengths[:, 0] - 1).clamp(min=0))


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
