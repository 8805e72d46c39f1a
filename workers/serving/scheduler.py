"""The leader's bookkeeping: which requests wait, which cache row each running one holds, and what
the next iteration runs (pure Python; workers/serving/loop.py runs the plans).

Each iteration (`schedule`):
1. requests waiting in arrival order take free cache rows (at most max_num_seqs run at once; with
   prefix caching one may wait longer for another's prefill of their shared prefix);
2. sequences still prefilling get chunks of their prompt, oldest first, while the iteration's
   budget of max_prefill_tokens lasts (a chunk is also at most the largest chunk bucket), so a
   long prompt delays running streams by one chunk per iteration, never by its whole prefill;
3. every sequence holding a token to feed back runs one decode step.
A sequence that finishes or is cancelled gives its row back at once; the next iteration can seat
a waiting request there. With prefix caching, the row keeps what the sequence wrote, and a request
whose prompt starts the same way is seated there, or gets the shared slots copied into its own row,
and is prefilled from where they part (workers/serving/prefix_reuse.py). A row that may hold NaN or
inf (its request failed by itself, or was cancelled while prefilling, before its last chunk's
logits could show them) comes back with the next plan, which zeroes what it wrote on every rank
first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from workers.serving import prefix_reuse
from workers.serving.prefix_reuse import RowHistories, common_prefix_length
from workers.serving.requests import StreamRequest
from workers.serving.step_plan import ClearRow, Command, CopyPrefix, DecodeRow, PrefillChunk, StepPlan


@dataclass(eq=False)  # one request's state, equal only to itself
class Sequence:
    request: StreamRequest
    row: int | None = None
    prefilled: int = 0
    """Prompt tokens already in the cache."""
    cached: int = 0
    """Of those, the ones its row held when it was seated, there or copied in before the step's
    forwards (prefix caching): never prefilled."""
    pending: int | None = None
    """The last token chosen, fed back by the next decode step."""
    generated: int = 0
    output_ids: list[int] = field(default_factory=list)
    """The tokens chosen in this submission, in order (penalties count them: workers/penalties.py)."""
    generator: object = None
    """The leader's torch.Generator for this request (None: greedy)."""
    seed: int | None = None
    """A sampled request's base seed (workers/serving/token_choice.py reseeds per draw from it)."""
    prompt_ids: object = None
    """The prompt's ids as a tensor, made at its first penalised step (workers/serving/token_choice.py)."""
    grammar: object = None
    """With structured output: the leader's RequestGrammar (workers/structured/matchers.py), which
    every chosen token advances."""
    prompt_logprobs: list = field(default_factory=list)
    """The leader's prompt log-probabilities so far (TokenLogprob per prompt token after the first),
    when the request asked for them."""

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.prompt_token_ids

    @property
    def length(self) -> int:
        """Tokens in the cache: the prompt so far, then one per decode step."""
        return self.prefilled + max(self.generated - 1, 0)


class Scheduler:
    def __init__(self, max_num_seqs: int, max_prefill_tokens: int, max_chunk: int,
                 prefix_caching: bool = False) -> None:
        self.max_num_seqs, self.max_prefill_tokens, self.max_chunk = max_num_seqs, max_prefill_tokens, max_chunk
        self.free_rows = list(range(max_num_seqs))
        self.histories = RowHistories() if prefix_caching else None
        """With prefix caching: the tokens each free row still holds."""
        self.rows_to_clear: list[ClearRow] = []
        """Rows a failed (or mid-prefill cancelled) request held: free again once a plan has carried
        their clearing."""
        self._waiting: OrderedDict[str, Sequence] = OrderedDict()
        """Queued requests by id, in the order they are seated: add() and cancel() find an id, and
        take it out, without scanning the queue (with 16,000 requests queued at once, a scan per add
        and per cancel held the leader's loop for 21 s). One held back (prefix caching) goes back
        to the front."""
        self.running: OrderedDict[str, Sequence] = OrderedDict()
        """By admission order: the order chunks and decode rows are planned in."""

    # ---- requests in and out -------------------------------------------------------------------
    def add(self, sequence: Sequence) -> None:
        rid = sequence.request.request_id
        if rid in self.running or rid in self._waiting:
            raise ValueError(f"request id {rid!r} is already queued or running")
        self._waiting[rid] = sequence

    def cancel(self, request_id: str) -> Sequence | None:
        """Remove a waiting or running request (freeing its row); None when it is not here."""
        if request_id in self.running:
            seq = self.running[request_id]
            # mid-prefill, what its chunks wrote was never checked: no logits of theirs were read
            return self.finish(seq, clear=seq.prefilled < len(seq.prompt))
        return self._waiting.pop(request_id, None)

    def finish(self, sequence: Sequence, clear: bool = False) -> Sequence:
        """Free the sequence's row; `clear`: only once a plan has zeroed what it wrote (a request that
        failed by itself may have written NaN or inf there)."""
        self.running.pop(sequence.request.request_id, None)
        if sequence.row is not None:
            if clear:  # its prompt so far and its tokens, one more slot for a decode in flight
                written = sequence.prefilled + sequence.generated + 1
                self.rows_to_clear.append(ClearRow(sequence.row, written))
            else:
                if self.histories is not None:
                    self.histories.keep(sequence.row, _written(sequence), sequence.request.cache_salt)
                self.free_rows.append(sequence.row)
                self.free_rows.sort()
            sequence.row = None
        sequence.pending = None
        return sequence

    @property
    def waiting(self):
        """The queued sequences, in the order they are seated (a view: nothing is copied)."""
        return self._waiting.values()

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def load(self) -> dict[str, int]:
        return {"running": len(self.running), "waiting": len(self.waiting)}

    # ---- planning ------------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """The next iteration's plan (see the module docstring), or None when there is nothing to run."""
        # Rows to clear are free from this plan on: it clears them before any of its forwards.
        clears, self.rows_to_clear = tuple(self.rows_to_clear), []
        if clears:
            self.free_rows = sorted(self.free_rows + [c.row for c in clears])
        copies: list[CopyPrefix] = []
        # what the rows of running requests hold (and their requests' cache_salt), before this plan's
        # copies and forwards: the rows seated below hold nothing yet, so they are never copied from
        in_use = ({s.row: (s.request.cache_salt, _WrittenTokens(s)) for s in self.running.values()}
                  if self.histories is not None and self.waiting and self.free_rows else {})
        held_back: list[Sequence] = []
        # a row stays free for each request held back: one arriving after it would take the row
        # the held one waits to be seated in, and hold it for its whole answer, not a prefill
        while self._waiting and len(self.free_rows) > len(held_back):
            _, seq = self._waiting.popitem(last=False)
            if not self._seat(seq, copies, in_use):
                held_back.append(seq)
                continue
            self.running[seq.request.request_id] = seq
        for seq in reversed(held_back):  # first in line again, in their order
            self._waiting[seq.request.request_id] = seq
            self._waiting.move_to_end(seq.request.request_id, last=False)
        budget, prefills, decode = self.max_prefill_tokens, [], []
        for seq in self.running.values():
            if seq.prefilled < len(seq.prompt):
                size = min(len(seq.prompt) - seq.prefilled, budget, self.max_chunk)
                if size > 0:
                    prefills.append(PrefillChunk(seq.row, seq.prefilled,
                                                 tuple(seq.prompt[seq.prefilled: seq.prefilled + size]),
                                                 seq.request.prompt_logprobs is not None))
                    budget -= size
            elif seq.pending is not None:
                decode.append(DecodeRow(seq.row, seq.length, seq.pending))
        if not prefills and not decode and not clears:
            return None
        return StepPlan(Command.WORK, tuple(prefills), tuple(decode), clears=clears, copies=tuple(copies))

    def _seat(self, seq: Sequence, copies: list[CopyPrefix],
              in_use: dict[int, tuple[str | None, _WrittenTokens]]) -> bool:
        """Give the sequence a free row: with prefix caching, where the longest prefix of its prompt
        is cached (workers/serving/prefix_reuse.py), copied there from another row first when it
        comes from one (appended to `copies`); else the lowest. A request that wants every prompt
        token's logits (prompt_logprobs) prefills its whole prompt. False (nothing seated): its
        prompt shares at least MIN_SHARED_TOKENS more with a running request's prompt than the cache
        holds yet, so it waits for that prefill (a burst of requests behind one system prompt
        prefills it once, not once each). in_use: the cache_salt and token ids of each row of a
        running request, which can be copied from. Only requests of the same cache_salt share rows
        or wait for each other's prefills."""
        if self.histories is None:
            seq.row = self.free_rows.pop(0)
            return True
        reuse, salt = seq.request.prompt_logprobs is None, seq.request.cache_salt
        seat = self.histories.choose(self.free_rows, seq.prompt, reuse=reuse, in_use=in_use, salt=salt)
        if reuse and self._prefilled_soon(seq.prompt, salt) >= seat.cached + prefix_reuse.MIN_SHARED_TOKENS:
            return False
        seq.row, seq.cached = seat.row, seat.cached
        self.free_rows.remove(seq.row)
        self.histories.forget(seq.row)
        seq.prefilled = seq.cached
        if seat.copy_from is not None:
            copies.append(CopyPrefix(seat.copy_from, seat.row, seat.cached))
        return True

    def _prefilled_soon(self, prompt: tuple[int, ...], salt: str | None) -> int:
        """The most leading tokens `prompt` shares with the prompt of a running request of the same
        cache_salt still being prefilled (at most all but its last token). Another salt's prefill
        will never be shared: waiting for it would only delay the request (and show its timing)."""
        return max((min(common_prefix_length(s.prompt, prompt), len(prompt) - 1)
                    for s in self.running.values() if s.prefilled < len(s.prompt) and s.request.cache_salt == salt),
                   default=0)

    def by_row(self) -> dict[int, Sequence]:
        return {seq.row: seq for seq in self.running.values()}


def _written(seq: Sequence) -> tuple[int, ...]:
    """The token ids whose keys and values the sequence's row holds: its prompt so far, then every
    token it chose but the last, which no step has fed back yet."""
    return seq.prompt[:seq.prefilled] + tuple(seq.output_ids[:max(seq.generated - 1, 0)])


class _WrittenTokens:
    """_written(seq), read a slice at a time: planning compares every running row with a waiting
    prompt, and building each row's ids whole (16 rows of 12k tokens) took milliseconds per
    iteration, where comparing slices reads only as far as they agree. Valid until the sequence
    next changes (within one schedule())."""

    __slots__ = ("_prompt", "_prefilled", "_outputs", "_fed_back")

    def __init__(self, seq: Sequence) -> None:
        self._prompt, self._prefilled = seq.prompt, seq.prefilled
        self._outputs, self._fed_back = seq.output_ids, max(seq.generated - 1, 0)

    def __len__(self) -> int:
        return self._prefilled + self._fed_back

    def __getitem__(self, part: slice) -> tuple[int, ...]:
        start, stop, step = part.indices(len(self))
        if step != 1:
            raise ValueError(f"a row's tokens are read in contiguous slices, not with step {step}")
        from_prompt = tuple(self._prompt[start:min(stop, self._prefilled)])
        return from_prompt + tuple(self._outputs[max(start - self._prefilled, 0):max(stop - self._prefilled, 0)])
