"""The static shapes the serving engine runs at (compiled graphs exist per shape).

- prefill chunks: a prefill batch bucket x a chunk bucket (the context-encoding buckets up to
  max_prefill_tokens). Chunks of one bucket are prefilled together (powers of two up to as many as
  max_prefill_tokens holds, and max_num_seqs): one batched product per weight, not one per prompt.
  Each batch row is one sequence's chunk. A call whose chunks all start their sequences
  ("serve-prefill-start") attends over the chunk's own slots only; a call continuing longer prompts
  ("serve-prefill") attends over each sequence's whole cache row. A whole-row read would cost the
  first chunk of a short prompt attention over every slot the server allows (all but its own empty);
- decode steps: a batch bucket of running rows (powers of two up to max_num_seqs, and
  max_num_seqs) x a read bucket of slots read (the smallest holding every row's history). Read
  buckets are the token buckets with the midpoint of each two neighbours added (128, 256 -> 128,
  192, 256): every cache row holds the largest token bucket's slots, and a decode step's attention
  streams every slot it reads from memory, so histories of 129-192 tokens read 192 slots rather than
  256 (shorter steps: the README's Measured table), for one more decode graph per batch bucket and
  gap. The static engine sizes its cache per request at a token bucket and reads it whole;
  finer --token-buckets give it the same.

A step's real size is rounded up to these; padding is harmless by construction
(workers/kv_cache.py: padding tokens write only the scratch row).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from shardlib.buckets import Buckets, select_bucket
from shardlib.positive_int import positive_int

DEFAULT_MAX_NUM_SEQS = 8
"""Rows of a TP group's serving KV cache unless asked otherwise (LaunchConfig, generate, compile)."""

DEFAULT_MAX_PREFILL_TOKENS = 2048
"""Prompt tokens a TP group prefills per serving iteration unless asked otherwise."""


def serving_cache_rows(max_num_seqs: int) -> int:
    """KV cache rows a serving loop allocates: one per sequence slot, plus the scratch row that the
    padding rows of a decode bucket write into (workers/serving/loop.py)."""
    return max_num_seqs + 1


PREFILL_START, PREFILL_CONTINUE = "serve-prefill-start", "serve-prefill"
"""Prefill calls whose chunks all start their sequences (reading their own slots), and the others
(reading whole cache rows)."""
PREFILL_PHASES = (PREFILL_START, PREFILL_CONTINUE)


def with_midpoints(token_buckets: tuple[int, ...]) -> tuple[int, ...]:
    """The token buckets and the midpoint (rounded up) between each two neighbours:
    with_midpoints((128, 256, 300)) == (128, 192, 256, 278, 300)."""
    ordered = sorted(token_buckets)
    midpoints = {(a + b + 1) // 2 for a, b in zip(ordered, ordered[1:]) if b - a > 1}
    return tuple(sorted(set(ordered) | midpoints))


def powers_of_two_up_to(limit: int) -> tuple[int, ...]:
    out, value = [], 1
    while value < limit:
        out.append(value)
        value *= 2
    return tuple(out) + (limit,)


@dataclass(frozen=True)
class ServingShapes:
    max_num_seqs: int
    max_prefill_tokens: int
    cache_slots: int
    """Slots per cache row: the longest sequence (prompt plus generated tokens) served."""
    token_buckets: tuple[int, ...]
    chunk_buckets: tuple[int, ...]

    @functools.cached_property
    def read_buckets(self) -> tuple[int, ...]:
        """Slots a decode step may read (see the module docstring); looked up once per step."""
        return with_midpoints(self.token_buckets)

    @classmethod
    def build(cls, buckets: Buckets, max_num_seqs: int, max_prefill_tokens: int) -> "ServingShapes":
        positive_int("max_num_seqs", max_num_seqs)
        positive_int("max_prefill_tokens", max_prefill_tokens)
        slots = buckets.max_seq_len
        cap = min(max_prefill_tokens, buckets.max_context_length, slots)
        chunks = tuple(sorted({c for c in buckets.context if c < cap} | {cap}))
        return cls(max_num_seqs, max_prefill_tokens, slots, tuple(buckets.token), chunks)

    @property
    def batch_buckets(self) -> tuple[int, ...]:
        return powers_of_two_up_to(self.max_num_seqs)

    @property
    def max_chunk(self) -> int:
        return self.chunk_buckets[-1]

    def chunk_bucket(self, length: int) -> int:
        return select_bucket(length, self.chunk_buckets, "prefill chunk", "chunk")

    def prefill_batch_buckets(self, chunk: int) -> tuple[int, ...]:
        """Batch buckets for chunks of bucket `chunk`: as many as one iteration's prefill budget holds."""
        return powers_of_two_up_to(min(self.max_num_seqs, max(1, self.max_prefill_tokens // chunk)))

    def prefill_shape(self, chunks: int, longest: int) -> tuple[int, int]:
        """(batch bucket, chunk bucket) for `chunks` chunks of at most `longest` tokens; at most
        prefill_batch_buckets(chunk)[-1] chunks."""
        chunk = self.chunk_bucket(longest)
        return select_bucket(chunks, self.prefill_batch_buckets(chunk), "prefill chunks", "prefill batch"), chunk

    def decode_shape(self, rows: int, longest: int) -> tuple[int, int]:
        """(batch bucket, slots read) for `rows` running sequences whose longest history, the new
        token included, is `longest` tokens."""
        batch = select_bucket(rows, self.batch_buckets, "running sequences", "batch")
        return batch, select_bucket(longest, self.read_buckets, "sequence length", "token-generation")

    def shapes(self, max_length: int | None = None, continuing: bool = True,
               chunks_below: int | None = None) -> list[tuple[str, int, int]]:
        """Every (phase, batch, length) a load can need; max_length: only read buckets up to the
        one holding sequences of that many tokens (a warm-up for a known workload); continuing
        False: no prefill chunk that continues its sequence; chunks_below: no prefill chunk bucket
        this wide or wider (the cpu backend runs both kinds of call eagerly: workers/serving/loop.py)."""
        reads = self.read_buckets
        if max_length is not None:
            reads = reads[: reads.index(select_bucket(max_length, reads, "sequence length")) + 1]
        phases = PREFILL_PHASES if continuing else (PREFILL_START,)
        # A chunk as wide as the cache row reads the whole row either way: one graph, the first kind.
        chunks = [c for c in self.chunk_buckets if chunks_below is None or c < chunks_below]
        return ([(phase, b, c) for phase in phases for c in chunks
                 if phase == PREFILL_START or c < self.cache_slots for b in self.prefill_batch_buckets(c)]
                + [("serve-decode", b, t) for b in self.batch_buckets for t in reads])
