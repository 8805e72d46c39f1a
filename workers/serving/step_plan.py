"""What every rank of a group does in one serving iteration, and how rank 0 tells the others.

Rank 0 (the leader) decides each iteration; the plan travels to the other ranks as one fixed-size
int64 tensor through the group's own all-reduce (the followers add zeros), so no Ray call reaches a
follower per step and every Collectives implementation (shared memory, gloo, NCCL) carries it. The
followers then run exactly the forwards the leader runs, which pairs every collective call.
Sampling happens on the leader only: the tokens it picks come back to the followers as the next
decode step's inputs, inside the next plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import torch


_HEADER = 6
"""command, prefills, decodes, static id, clears, copies."""


class Command(IntEnum):
    IDLE = 1
    """Nothing to run: a heartbeat, so followers never wait in a collective past its timeout."""
    WORK = 2
    STATIC = 3
    """Run the static batch numbered `static_id` (workers/engine.py), which every rank received."""
    STOP = 4


@dataclass(frozen=True)
class PrefillChunk:
    row: int
    """The sequence's cache row."""
    start: int
    """Slot (and position) of the chunk's first token."""
    token_ids: tuple[int, ...]
    scored: bool = False
    """Its request wants prompt log-probabilities: the chunk runs alone, and every column's logits
    are taken (workers/serving/prompt_scoring.py)."""


@dataclass(frozen=True)
class DecodeRow:
    row: int
    position: int
    """Slot (and position) the token is written to: the sequence's length before this step."""
    token_id: int


@dataclass(frozen=True)
class ClearRow:
    row: int
    slots: int
    """Zero the row's first `slots` cache slots (what its last request may have written)."""


@dataclass(frozen=True)
class CopyPrefix:
    source: int
    row: int
    slots: int
    """Copy the source row's first `slots` cache slots into `row` (prefix caching:
    workers/serving/prefix_reuse.py)."""


@dataclass(frozen=True)
class StepPlan:
    command: Command
    prefills: tuple[PrefillChunk, ...] = ()
    """Run one after another, before the decode step."""
    decode: tuple[DecodeRow, ...] = ()
    static_id: int = 0
    clears: tuple[ClearRow, ...] = ()
    """Rows whose last request failed on its own (non-finite logits, say) or was cancelled before its
    last prefill chunk: every rank zeroes what it wrote before this step's forwards, since a masked
    read of NaN or inf still gives NaN."""
    copies: tuple[CopyPrefix, ...] = ()
    """Cached prefixes copied into the rows of requests seated this step, after the clears and
    before any forward."""

    @property
    def prefill_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.prefills)


@dataclass
class PlanCodec:
    """Fixed layout: [command, prefills, decodes, static id, clears, copies, (row, start, length,
    scored) x max_num_seqs, (row, position, token) x max_num_seqs, (row, slots) x max_num_seqs,
    (source, row, slots) x max_num_seqs, prefill tokens x max_prefill_tokens]."""

    max_num_seqs: int
    max_prefill_tokens: int
    _size: int = field(init=False)

    def __post_init__(self) -> None:
        self._size = _HEADER + 12 * self.max_num_seqs + self.max_prefill_tokens

    def empty(self) -> torch.Tensor:
        return torch.zeros(self._size, dtype=torch.int64)

    def encode(self, plan: StepPlan) -> torch.Tensor:
        m = self.max_num_seqs
        if (len(plan.prefills) > m or len(plan.decode) > m or len(plan.clears) > m or len(plan.copies) > m
                or plan.prefill_tokens > self.max_prefill_tokens):
            raise ValueError(f"a step plan of {len(plan.prefills)} chunks ({plan.prefill_tokens} tokens), "
                             f"{len(plan.decode)} decode rows, {len(plan.clears)} rows to clear and "
                             f"{len(plan.copies)} to copy exceeds max_num_seqs {m} / max_prefill_tokens "
                             f"{self.max_prefill_tokens}")
        out = [0] * self._size
        out[0:_HEADER] = [int(plan.command), len(plan.prefills), len(plan.decode), plan.static_id, len(plan.clears),
                          len(plan.copies)]
        tokens: list[int] = []
        for i, chunk in enumerate(plan.prefills):
            out[_HEADER + 4 * i: _HEADER + 4 * i + 4] = [chunk.row, chunk.start, len(chunk.token_ids),
                                                          int(chunk.scored)]
            tokens.extend(chunk.token_ids)
        base = _HEADER + 4 * m
        for i, row in enumerate(plan.decode):
            out[base + 3 * i: base + 3 * i + 3] = [row.row, row.position, row.token_id]
        base += 3 * m
        for i, clear in enumerate(plan.clears):
            out[base + 2 * i: base + 2 * i + 2] = [clear.row, clear.slots]
        base += 2 * m
        for i, copy in enumerate(plan.copies):
            out[base + 3 * i: base + 3 * i + 3] = [copy.source, copy.row, copy.slots]
        base += 3 * m
        out[base: base + len(tokens)] = tokens
        return torch.tensor(out, dtype=torch.int64)

    def decode(self, tensor: torch.Tensor) -> StepPlan:
        values = tensor.tolist()
        m = self.max_num_seqs
        command, n_prefill, n_decode, static_id, n_clear, n_copy = values[0:_HEADER]
        token_base, prefills = _HEADER + 12 * m, []
        for i in range(n_prefill):
            row, start, length, scored = values[_HEADER + 4 * i: _HEADER + 4 * i + 4]
            prefills.append(PrefillChunk(row, start, tuple(values[token_base: token_base + length]), bool(scored)))
            token_base += length
        base = _HEADER + 4 * m
        decode = tuple(DecodeRow(*values[base + 3 * i: base + 3 * i + 3]) for i in range(n_decode))
        base += 3 * m
        clears = tuple(ClearRow(*values[base + 2 * i: base + 2 * i + 2]) for i in range(n_clear))
        base += 2 * m
        copies = tuple(CopyPrefix(*values[base + 3 * i: base + 3 * i + 3]) for i in range(n_copy))
        return StepPlan(Command(command), tuple(prefills), decode, static_id, clears, copies)
