"""The serving loop every rank of a group runs while it serves: one iteration per step plan.

Rank 0 leads: it takes requests and cancellations from its inbox, plans the iteration
(workers/serving/scheduler.py), sends the plan to the other ranks (workers/serving/step_plan.py),
runs the plan's forwards, chooses the tokens and posts them to its outbox, which a sender thread
streams to the driver (workers/serving/event_stream.py).
The other ranks follow: receive a plan, run the same forwards, repeat. Nothing but the plan tensor
and the model's own collectives passes between ranks.

The KV cache is allocated once, when the loop starts: max_num_seqs rows of cache_slots slots plus
the scratch row padding writes to (workers/kv_cache.py).

Static batches (workers/engine.py, what `generate(..., batching="static")` runs) still reach every
rank as one Ray call each; while the loop runs, each rank parks its batch here, and the leader
tells all ranks when to run it (Command.STATIC), between two iterations.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Callable

import torch

from shardlib.serving_shapes import PREFILL_PHASES, PREFILL_START, ServingShapes
from workers.kernels import prefill_attention
from workers.serving.burst import BURST_WAIT_CAP
from workers.serving.held_tokens import HeldTokens
from workers.serving.outbox import Outbox
from workers.serving.prompt_scoring import prompt_targets, score_chunk
from workers.serving.requests import StreamRequest, TokenEvent
from workers.serving.scheduler import Scheduler, Sequence
from workers.serving.step_inputs import decode_inputs, prefill_batches, prefill_inputs
from workers.serving.step_plan import Command, DecodeRow, PlanCodec, PrefillChunk, StepPlan
from workers.serving.token_choice import choose, request_generator
from workers.structured.grammars import NOT_THE_GRAMMARS
from workers.structured.build_threads import BuildFuture, abandon_build, build_in_the_background
from workers.structured.matchers import TOKENIZER_WAIT_S, MatcherFailed, start_matcher

HEARTBEAT_S = 0.2
"""An idle leader sends an IDLE plan this often: followers wait in a collective for the next plan,
and a collective gives up after its timeout (tens of seconds)."""
EAGER_PREFILL_WASTE = 1.2
"""A compiled loop runs a prefill call eagerly, at its exact shape, when its bucket would pad it to at
least EAGER_PREFILL_WASTE times its real tokens; and on the cpu backend a call whose chunks continue
their sequences always, since its graph attends over whole cache rows where the eager step reads
only the slots its chunks reach. A prefill's graph runs each padded token about as fast as the eager
forward runs a real one: on one 2-core host (benchmarks/prefill_paths.py, README Measured) the eager
step took 1.06-1.13x the graph's time for calls without padding, 0.80-0.85x for 1.28x padding,
0.10-0.34x for 4x or more, and 0.04-0.69x for every continuing call measured."""
EAGER_PREFILL_WIDTH = 1024
"""On the cpu backend without the prefill attention kernel (eager_from_width), a prefill call padded to
chunks this wide or wider runs eagerly too: the eager step's attention then goes by query blocks over
the slots each may read (workers/attention_blocks.py), 5/8 of the scores the graph's one call under
the causal mask computes at 1024 tokens, 9/16 at 2048. On one 2-core host the eager step took
0.95-0.98x the graph's time for unpadded calls of 1024-token chunks, 0.84-0.87x for one 2048-token
chunk and 0.73x for 1800 tokens in the 2048 bucket, against 1.02-1.09x for 512-token chunks
(benchmarks/prefill_paths.py, README Measured)."""
QUICK_BUILD_S = 0.02
"""How long the leader waits for the matchers of the structured requests it has just taken (most
build in a few milliseconds) before stepping on without them: those built by then start in this
iteration, the rest once built (ServingLoop._admit_built)."""
STATIC_WAIT_S = 60.0
"""How long a follower waits for its copy of a static batch the leader already announced."""


@dataclass(frozen=True)
class ServingConfig:
    max_num_seqs: int
    max_prefill_tokens: int
    cache_slots: int
    """Slots per cache row: the longest prompt plus generated tokens a request may have."""
    shapes: ServingShapes | None = None
    """Pad every step to these shapes (compiled graphs); None: exact shapes (eager)."""
    burst_wait_s: float = 0.0
    """An idle leader that receives a request keeps taking more for as long as they arrive within this
    long of each other (at most BURST_WAIT_CAP times it, and no more than the free rows hold), so a
    burst's prompts are prefilled in one iteration. Otherwise the first would be prefilled alone while
    the rest of the burst, arriving a few ms later, waited the whole of that prefill. 0: no wait."""
    prefix_caching: bool = False
    """Rows keep what their requests wrote, and a prompt starting the same way is seated in such a row
    (or has the shared slots copied into its own) and prefilled from where they part
    (workers/serving/prefix_reuse.py); off whatever this says for a model whose cached keys depend on
    their forward's length (_keys_depend_on_length)."""


def eager_from_width(cpu: bool, head_dim: int, dtype: torch.dtype) -> int | None:
    """EAGER_PREFILL_WIDTH where that rule applies: on the cpu backend when the model's prefill
    attention cannot take the prefill attention kernel (turned off, no compiler, a compute dtype
    other than float32, or a head_dim it does not tile), so that a graph would compute every score
    under the mask; None otherwise. With the kernel a graph computes only the tiles of slots its
    queries may read, like the eager step, and fuses what the eager step runs op by op: on machine R
    it took 0.83-0.89x the eager step's time for unpadded 1024- and 2048-token chunks and 0.95x for
    1800 tokens in the 2048 bucket (benchmarks/prefill_paths.py, README Measured), so only the waste
    rule sends a call eagerly."""
    return EAGER_PREFILL_WIDTH if cpu and not prefill_attention.covers(head_dim, dtype) else None


def group_eager_from_width(collectives, device: torch.device, local: int | None) -> int | None:
    """The eager_from_width every rank of the group holds, given this rank's own (`local`): every
    rank must call this, at the same point, since it holds a collective.

    Why: a rank's own answer depends on its host (a compiler, the kernel's build, its panel width,
    CORELAUNCH_PREFILL_ATTENTION in its environment), while a prefill call runs its collectives at
    the shape the rule picks: one rank running a 1x1800 eager step while another ran the 1x2048
    graph would all-reduce tensors of different sizes, and a warm-up would run forwards on one rank
    that the others never join. If any rank lacks the kernel, every rank takes EAGER_PREFILL_WIDTH:
    the group goes at its slowest rank's pace, and that rank's graph would compute every score under
    the mask (the eager step of a rank that has the kernel still takes it)."""
    if collectives.world_size == 1:
        return local
    # One flag per rank summed (the all-reduce every Collectives has): how many ranks need the rule.
    needing = torch.tensor([0 if local is None else 1], dtype=torch.int64, device=device)
    collectives.all_reduce_sum_(needing)
    return EAGER_PREFILL_WIDTH if int(needing.item()) > 0 else None


def warm_up_shapes(shapes, cpu: bool, head_dim: int, dtype: torch.dtype,
                   max_length: int | None = None) -> list[tuple[str, int, int]]:
    """The serving shapes (ServingShapes.shapes) whose graphs a warm-up builds: on the cpu backend,
    none for the prefill calls its loop runs eagerly whatever their padding (ServingLoop
    continues_eagerly, eager_from_width): calls continuing their sequences, and chunks of
    eager_from_width or wider where that rule applies. For `corelaunch compile`, which has no loop
    and asks on the driver's host (the count in its message); a rank's warm-up takes its loop's
    rules (warm_up_shapes_for), which the group agreed on (group_eager_from_width): the same where
    every rank's host answers as the driver's does."""
    return warm_up_shapes_for(shapes, cpu, eager_from_width(cpu, head_dim, dtype), max_length)


def warm_up_shapes_for(shapes, continues_eagerly: bool, eager_from: int | None,
                       max_length: int | None = None) -> list[tuple[str, int, int]]:
    """warm_up_shapes given the eager rules as a ServingLoop holds them (continues_eagerly,
    eager_from_width): the graphs its warm-up builds are then those its calls can take."""
    return shapes.shapes(max_length, continuing=not continues_eagerly, chunks_below=eager_from)


def _keys_depend_on_length(model, positions: int) -> bool:
    """Whether the model rotates a cached key by how long its forward's sequence was, for rows of
    `positions` slots (longrope past its original context: workers/rope.py): a prefix cached by one
    forward is then not what the same tokens at the start of another prompt would get, and prefix
    caching stays off."""
    from workers.family_layers import layer_kinds
    from workers.rope import rotation_follows_length

    config = getattr(model, "config", None)
    if config is None:
        return False
    kinds, _ = layer_kinds(config)
    return any(rotation_follows_length(kind.rope_scaling, config.max_position_embeddings, positions)
               for kind in kinds)


def _own_copy(row: torch.Tensor) -> torch.Tensor:
    """One row of a step's logits in storage of its own: a view would pickle (to the driver) the
    whole step's rows x vocab storage with every token."""
    return row.to("cpu", copy=True)


def _request_error(err: BaseException) -> str:
    """A structured request's failure as its error event says it: a ValueError's own message, any
    other (a Rust panic out of llguidance) named as its matcher's failure (MatcherFailed's words)."""
    return str(err if isinstance(err, ValueError) else MatcherFailed(err))


class ServingLoop:
    def __init__(self, model, config: ServingConfig, run_static=None, grammar_tokenizer=None) -> None:
        """model: a ShardedCausalLM or CompiledCausalLM (anything with serve_step, new_cache,
        collectives, device). run_static(request) -> outputs runs one static batch.
        grammar_tokenizer: the leader's GrammarTokenizer (workers/structured/matchers.py), which
        structured requests need; None: they fail, each alone."""
        self.model, self.config = model, config
        self.grammar_tokenizer = grammar_tokenizer
        self._awaiting_grammar: dict[str, Sequence] = {}
        """Structured requests that arrived before the grammar tokenizer was built (it is built on a
        thread at the first one), by id in arrival order: admitted once it is, so the running requests
        never wait for it; a cancel finds its id without a scan (a mass cancel stays linear)."""
        self.grammar_wait_s = TOKENIZER_WAIT_S
        """How long they wait for it before each fails (its build hung), and how long one's matcher
        build may run before the request fails alone (that build hung). Counted from when the build
        began to run, not while it waits for a build thread: healthy builds queued behind a burst do
        not fail (the driver's request timeout and cancels bound that wait)."""
        self._building: dict[str, tuple[Sequence, BuildFuture]] = {}
        """Structured requests whose matchers are being built (or wait for one of the shared build
        threads: build_threads), by id in arrival order: a schema llguidance takes seconds to compile
        holds up no other request."""
        self._fresh_builds: list[Future] = []
        """The builds started since the leader last admitted built ones (_admit_built waits briefly
        for these alone, not again each step for one that takes seconds)."""
        self._awaiting_since = 0.0
        self.collectives = model.collectives
        self.is_leader = self.collectives.rank == 0
        self.device = getattr(model, "device", torch.device("cpu"))
        self.scratch_row = config.max_num_seqs
        self._can_prefill_eagerly = config.shapes is not None and hasattr(model, "eager_serve_step")
        """A compiled loop whose model has an eager step: a prefill call may run eagerly (_prefill_eagerly)."""
        self.continues_eagerly = self._can_prefill_eagerly and self.device.type == "cpu"
        """Every prefill call that continues its sequences runs eagerly (the cpu backend:
        EAGER_PREFILL_WASTE), so a warm-up need not build their graphs."""
        # continues_eagerly follows from the config, the model's class and the backend, alike on
        # every rank, so every rank (or none) joins the collective of group_eager_from_width.
        self.eager_from_width = (
            group_eager_from_width(self.collectives, self.device,
                                   eager_from_width(True, model.config.head_dim, model.dtype))
            if self.continues_eagerly else None)
        """Prefill calls padded to chunks at least this wide run eagerly (the cpu backend where any
        rank of the group lacks the prefill attention kernel: eager_from_width,
        group_eager_from_width), so a warm-up need not build their graphs; None: no such rule. The
        same on every rank: _prefill_eagerly and the warm-up's shapes follow it."""
        self.cache = model.new_cache(config.max_num_seqs + 1, config.cache_slots, long_lived=True)
        max_chunk = config.shapes.max_chunk if config.shapes is not None else config.max_prefill_tokens
        # The plan's token area is all-reduced every step, prefill or not (and every idle heartbeat):
        # sized by the prefill tokens one step can hold, never by a budget no step can fill
        # (max_prefill_tokens 16384 with chunks of 512 and 8 rows moved 128 KB a step, not 32).
        self.codec = PlanCodec(config.max_num_seqs, min(config.max_prefill_tokens, config.max_num_seqs * max_chunk))
        self.scheduler = Scheduler(config.max_num_seqs, config.max_prefill_tokens, max_chunk,
                                   config.prefix_caching and not _keys_depend_on_length(model, config.cache_slots))
        self.outbox = Outbox()
        self.held = HeldTokens()
        """Tokens of requests with a stream_interval, until their next event is due (leader only)."""
        self._inbox: queue.Queue = queue.Queue()
        self._run_static = run_static
        self._statics: dict[int, tuple[object, Future]] = {}
        self._statics_changed = threading.Condition()
        self._ended = False
        """Set once run() returns: a static batch parked after that would wait for ever."""
        self.steps = 0
        self.static_batches = 0
        """Static batches run (between steps: the driver's hung-group check counts them as progress)."""
        self.step_seconds = 0.0
        """Forward time (prefill and decode) summed over steps, for the overhead benchmark."""
        self.plan_seconds = 0.0
        """Leader: scheduling, plan broadcast, sampling and event posting summed over steps."""

    # ---- called from other threads --------------------------------------------------------------
    def submit(self, requests: list[StreamRequest]) -> None:
        self._inbox.put(("submit", requests))

    def cancel(self, request_ids: list[str]) -> None:
        self._inbox.put(("cancel", request_ids))

    def stop(self) -> None:
        self._inbox.put(("stop", None))

    def poll(self, wait_s: float) -> tuple[list[TokenEvent], dict[str, int]]:
        return self.outbox.take(wait_s)

    def static(self, static_id: int, request) -> Future:
        """Park a static batch until the leader runs it (every rank parks the same one)."""
        future: Future = Future()
        with self._statics_changed:
            if self._ended:
                future.set_exception(self._never_ran(static_id))
                return future
            self._statics[static_id] = (request, future)
            self._statics_changed.notify_all()
        if self.is_leader:
            self._inbox.put(("static", static_id))
        return future

    def warm_up(self, shapes: list[tuple[str, int, int]],
                progress: Callable[[int, int, tuple[str, int, int], float], None] | None = None) -> None:
        """Run each (phase, batch, length) of shardlib.serving_shapes once, writing only the scratch
        row, so its graph is built now rather than during a request. Every rank calls this with the
        same shapes (the forwards hold collectives). progress(done, total, shape, seconds) after each."""
        scratch = self.scratch_row
        with torch.inference_mode():
            for done, (phase, batch, length) in enumerate(shapes, 1):
                start_s = time.perf_counter()
                if phase in PREFILL_PHASES:  # a chunk starting at slot 0, or at 1 (a continuing one)
                    start = 0 if phase == PREFILL_START else 1
                    self._step(prefill_inputs([PrefillChunk(scratch, start, (0,) * length)] * batch,
                                              self.config.shapes, scratch, self.config.cache_slots))
                else:
                    rows = tuple(DecodeRow(scratch, length - 1, 0) for _ in range(batch))
                    self._step(decode_inputs(rows, self.config.shapes, scratch))
                if progress is not None:
                    progress(done, len(shapes), (phase, batch, length), time.perf_counter() - start_s)

    # ---- the loop ----------------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until stopped; raises when a forward or a collective fails (the group is then broken).
        Either way the outbox closes, so whoever drains it learns the loop has ended."""
        try:
            with torch.inference_mode():
                if self.is_leader:
                    self._lead()
                else:
                    self._follow()
        finally:
            self._fail_statics()
            self.outbox.close()

    def _fail_statics(self) -> None:
        """The loop has ended: every static batch still parked fails now (its caller, blocked on
        the future, would otherwise wait for ever), and later ones fail as they are parked."""
        with self._statics_changed:
            self._ended = True
            parked, self._statics = self._statics, {}
        for static_id, (_, future) in parked.items():
            if not future.done():
                future.set_exception(self._never_ran(static_id))

    def _never_ran(self, static_id: int) -> RuntimeError:
        return RuntimeError(f"static batch {static_id} never ran: the serving loop on rank "
                            f"{self.collectives.rank} had stopped (the group is stopping or broke)")

    def _broadcast(self, plan: StepPlan | None) -> StepPlan:
        if self.collectives.world_size == 1:
            return plan
        buffer = self.codec.encode(plan) if plan is not None else self.codec.empty()
        # An all-reduce is the broadcast every Collectives has: the followers contribute zeros.
        device_buffer = buffer.to(self.device)
        self.collectives.all_reduce_sum_(device_buffer)
        return plan if plan is not None else self.codec.decode(device_buffer.cpu())

    def _follow(self) -> None:
        while True:
            plan = self._broadcast(None)
            if plan.command is Command.STOP:
                return
            if plan.command is Command.STATIC:
                self._static_now(plan.static_id)
            elif plan.command is Command.WORK:
                self._forwards(plan)

    def _lead(self) -> None:
        while True:
            started = time.perf_counter()
            idle = self.scheduler.idle
            if self._drain_inbox(block=idle, gather_s=self.config.burst_wait_s if idle else 0.0):
                self._fail_all("the group is stopping")
                self._broadcast(StepPlan(Command.STOP))
                return
            if idle:  # waiting for work and gathering a burst are not the loop's own time
                started = time.perf_counter()
            self._admit_awaiting()
            self._admit_built()
            static_id = self._next_static()
            if static_id is not None:
                self._broadcast(StepPlan(Command.STATIC, static_id=static_id))
                self._static_now(static_id)
                continue
            plan = self.scheduler.schedule()
            if plan is None:
                self._broadcast(StepPlan(Command.IDLE))
                continue
            self._broadcast(plan)
            planned = time.perf_counter()
            prefill_logits, decode_logits = self._forwards(plan)
            ran = time.perf_counter()
            self.outbox.put(self._choose(plan, prefill_logits, decode_logits), self.scheduler.load())
            self.steps += 1
            self.step_seconds += ran - planned
            self.plan_seconds += (planned - started) + (time.perf_counter() - ran)

    def _drain_inbox(self, block: bool, gather_s: float = 0.0) -> bool:
        """Apply queued submissions and cancellations; True when asked to stop. gather_s > 0: once
        something arrived, keep waiting for more while it comes within gather_s of the last
        (ServingConfig.burst_wait_s)."""
        stop, events = False, []
        try:
            item = self._inbox.get(timeout=HEARTBEAT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return False
        # Read the clock only when gathering: a running group drains arrivals between decode steps.
        gather_until = time.monotonic() + BURST_WAIT_CAP * gather_s if gather_s else 0.0
        while True:
            stop = self._apply(item, events) or stop
            if item[0] not in ("submit", "built"):  # a stop, a static batch or a cancel is not waited past
                gather_s = 0.0
            try:
                item = self._inbox.get_nowait()
                continue
            except queue.Empty:
                if not gather_s or len(self.scheduler.waiting) >= len(self.scheduler.free_rows):
                    break
            wait = min(gather_s, gather_until - time.monotonic())
            if wait <= 0:
                break
            try:
                item = self._inbox.get(timeout=wait)
            except queue.Empty:
                break
        self.outbox.put(events, self.scheduler.load())
        return stop

    def _apply(self, item: tuple, events: list[TokenEvent]) -> bool:
        """One inbox item: submissions join the queue, cancellations leave it; True for stop."""
        kind, payload = item
        if kind == "submit":
            for request in payload:
                if request.request_id in self._awaiting_grammar or request.request_id in self._building:
                    # as _queue answers an id already queued: kept by id, the first would be lost
                    events.append(TokenEvent(request.request_id, [], "abort"))
                    continue
                if request.prompt_logprobs is not None and not hasattr(self.model, "score_step"):
                    events.append(TokenEvent(request.request_id, [], "error", error=(
                        f"prompt log-probabilities are not available on this backend "
                        f"({type(self.model).__name__} has no scoring step); ask without them")))
                    continue
                unfit = self._unfit(request)
                if unfit is not None:  # it would break the group's loop, or never end
                    events.append(TokenEvent(request.request_id, [], "error", error=unfit))
                    continue
                seq = Sequence(request)
                seq.generator = request_generator(seq, self.device)
                if request.sampling.structured_output is not None and self._grammar_pending():
                    if not self._awaiting_grammar:
                        self._awaiting_since = time.monotonic()
                        # an idle leader blocks on its inbox: the tokenizer's readiness wakes it
                        self.grammar_tokenizer.when_ready(self._wake_for_built)
                    self._awaiting_grammar[request.request_id] = seq
                else:
                    self._admit(seq, events)
        elif kind == "cancel":
            for rid in payload:
                self.held.drop(rid)
                if self.scheduler.cancel(rid) is not None or self._drop_awaiting(rid):
                    events.append(TokenEvent(rid, [], "abort"))
        # "built": a matcher's or the grammar tokenizer's build ended, which only wakes an idle leader
        # to admit what waited for it
        return kind == "stop"

    def _unfit(self, request: StreamRequest) -> str | None:
        """Why the request cannot run, or None when it can. The driver refuses such requests before
        submitting them (Launcher._check_lengths and shardlib.request_checks); this keeps one that
        got past it from failing the whole group's loop or holding a row for good. An empty prompt
        never gets a chunk nor a token to decode: it held its row and kept the leader spinning. An
        id past the vocabulary reads as no token in the embedding's shard, and the answer is noise.
        A request needs prompt + max_tokens - 1 slots of its row (its last token is never fed back;
        the prompt alone when max_tokens is 0): past the row, its decode wrote out of bounds."""
        prompt = len(request.prompt_token_ids)
        if not prompt:
            return "the prompt is empty (0 tokens): a request needs at least one prompt token"
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        outside = [t for t in request.prompt_token_ids if not 0 <= t < vocab] if isinstance(vocab, int) else []
        if outside:
            return (f"prompt token id {outside[0]} is outside the vocabulary (0 .. {vocab - 1}): "
                    f"send ids the model's tokenizer gives")
        needed = prompt + max(request.max_tokens, 1) - 1
        if needed <= self.config.cache_slots:
            return None
        return (f"the prompt has {prompt} tokens; with max_tokens {request.max_tokens} that needs {needed} "
                f"cache slots but each row of the serving cache holds {self.config.cache_slots} "
                f"(cache_slots): shorten the prompt or lower max_tokens")

    def _admit(self, seq: Sequence, events: list[TokenEvent]) -> None:
        """Queue a submitted request for a row; a structured one once its matcher is built."""
        if seq.request.sampling.structured_output is not None:
            future = build_in_the_background(lambda: self._grammar(seq.request))
            future.add_done_callback(lambda _: self._wake_for_built())
            self._building[seq.request.request_id] = (seq, future)
            self._fresh_builds.append(future)
            return
        self._queue(seq, events)

    def _wake_for_built(self) -> None:
        """Wake an idle leader (from another thread) to admit what waited for a build that has ended:
        a request's matcher, or the grammar tokenizer."""
        self._inbox.put(("built", None))

    def _queue(self, seq: Sequence, events: list[TokenEvent]) -> None:
        try:
            self.scheduler.add(seq)
        except ValueError:
            events.append(TokenEvent(seq.request.request_id, [], "abort"))

    def _admit_built(self) -> None:
        """Queue the structured requests whose matchers are built (failing those whose build
        failed), in arrival order, after waiting up to QUICK_BUILD_S for those not built yet; fail
        those whose build has run grammar_wait_s without ending, abandoning it (BuildThreads.abandon),
        so a hung build neither holds its request for good nor (mostly) one of the build threads. A
        build still queued for a thread is not timed: the time it waits is not its own."""
        fresh, self._fresh_builds = self._fresh_builds, []
        if not self._building:
            return
        if fresh:
            wait(fresh, timeout=QUICK_BUILD_S)
        events, building, self._building = [], self._building, {}
        now = time.monotonic()
        for rid, (seq, future) in building.items():
            if not future.done():
                started = future.started  # None while it waits for a build thread
                if started is None or now - started < self.grammar_wait_s:
                    self._building[rid] = (seq, future)
                    continue
                abandon_build(future)
                events.append(TokenEvent(rid, [], "error", error=(
                    f"the structured output's grammar was not built after its build ran {now - started:.1f} s "
                    f"on the group's leader (the limit is {self.grammar_wait_s:g} s)")))
                continue
            try:
                seq.grammar = future.result()
            except NOT_THE_GRAMMARS:
                raise
            except BaseException as err:  # noqa: BLE001 - this request's alone (a build's panic too: start_matcher
                # makes llguidance's a ValueError, and a BaseException missed here stopped the whole loop)
                error = _request_error(err)
                events.append(TokenEvent(seq.request.request_id, [], "error", error=error))
                continue
            self._queue(seq, events)
        if events:
            self.outbox.put(events, self.scheduler.load())

    def _grammar_pending(self) -> bool:
        """Whether the grammar tokenizer is still being built (the first call starts it)."""
        return self.grammar_tokenizer is not None and not self.grammar_tokenizer.ready()

    def _admit_awaiting(self) -> None:
        """Admit the structured requests that waited for the grammar tokenizer, once it is built;
        fail them once they have waited grammar_wait_s for it."""
        if not self._awaiting_grammar:
            return
        if self._grammar_pending():
            waited_s = time.monotonic() - self._awaiting_since
            if waited_s < self.grammar_wait_s:
                return
            events = [TokenEvent(seq.request.request_id, [], "error", error=(
                f"the model's tokenizer for structured output was not ready after {waited_s:.0f} s on the "
                f"group's leader")) for seq in self._awaiting_grammar.values()]
            self._awaiting_grammar = {}
            self.outbox.put(events, self.scheduler.load())
            return
        events, waited, self._awaiting_grammar = [], self._awaiting_grammar, {}
        for seq in waited.values():
            self._admit(seq, events)
        self.outbox.put(events, self.scheduler.load())

    def _drop_awaiting(self, request_id: str) -> bool:
        """Drop the request if it waits for the grammar tokenizer or its matcher (a build already
        running ends unread, on a thread of its own holding none of the shared ones while fewer than
        BUILD_THREADS such builds run, else on its shared one; one still queued for a build thread
        never runs); whether it did."""
        awaited = self._awaiting_grammar.pop(request_id, None)
        built = self._building.pop(request_id, None)
        if built is not None:
            abandon_build(built[1])
        return awaited is not None or built is not None

    def _grammar(self, request: StreamRequest):
        """The request's RequestGrammar, past the tokens it delivered before a group fault."""
        delivered = request.prompt_token_ids[len(request.prompt_token_ids) - request.draws_before:]
        return start_matcher(self.grammar_tokenizer, request.sampling.structured_output, delivered)

    def _fail_all(self, why: str) -> None:
        events = []
        for seq in list(self.scheduler.running.values()) + list(self.scheduler.waiting):
            self.scheduler.cancel(seq.request.request_id)
            events.append(TokenEvent(seq.request.request_id, [], "abort"))
        waiting = list(self._awaiting_grammar) + list(self._building)
        events.extend(TokenEvent(rid, [], "abort") for rid in waiting)
        for _, future in self._building.values():
            abandon_build(future)
        self._awaiting_grammar, self._building = {}, {}
        self.held.clear()
        self.outbox.put(events, self.scheduler.load())

    # ---- forwards, the same on every rank ----------------------------------------------------------
    def _forwards(self, plan: StepPlan) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        for clear in plan.clears:  # before anything a new request in that row writes or reads
            self.cache.clear_row(clear.row, clear.slots)
        for copy in plan.copies:  # a prefix the row's new request then never prefills
            self.cache.copy_prefix(copy.source, copy.row, copy.slots)
        prefill_logits: list[torch.Tensor | None] = [None] * len(plan.prefills)
        plain = [i for i, chunk in enumerate(plan.prefills) if not chunk.scored]
        for call in prefill_batches(tuple(plan.prefills[i] for i in plain), self.config.shapes):
            chunks = [plan.prefills[plain[i]] for i in call]
            eager = self._prefill_eagerly(chunks)
            inputs = prefill_inputs(chunks, None if eager else self.config.shapes, self.scratch_row,
                                    self.config.cache_slots)
            logits = self._eager_step(inputs) if eager else self._step(inputs)
            for j, i in enumerate(call):
                prefill_logits[plain[i]] = logits[j]
        scored = len(plain) < len(plan.prefills)
        by_row = self.scheduler.by_row() if scored and self.is_leader else {}
        for i, chunk in enumerate(plan.prefills if scored else ()):
            if chunk.scored:  # alone, every column's logits read (workers/serving/prompt_scoring.py)
                seq = by_row.get(chunk.row)
                targets = None if seq is None else prompt_targets(seq.prompt, chunk)
                entries, prefill_logits[i] = score_chunk(
                    self.model, self.cache, chunk, self.scratch_row, self.config.cache_slots, self.device, targets,
                    seq.request.prompt_logprobs if seq is not None else 0)
                if seq is not None:
                    seq.prompt_logprobs.extend(entries)
        decode_logits = None
        if plan.decode:
            inputs = decode_inputs(plan.decode, self.config.shapes, self.scratch_row)
            decode_logits = self._step(inputs)[: len(plan.decode)]
        return prefill_logits, decode_logits

    def _prefill_eagerly(self, chunks: list[PrefillChunk]) -> bool:
        """Whether a compiled loop runs this prefill call eagerly (EAGER_PREFILL_WASTE,
        EAGER_PREFILL_WIDTH): decided from the plan and rules the group agreed on when the loop was
        built (eager_from_width went through group_eager_from_width), so every rank decides alike."""
        if not self._can_prefill_eagerly:
            return False
        if self.continues_eagerly and any(c.start for c in chunks):
            return True
        real = sum(len(c.token_ids) for c in chunks)
        batch, width = self.config.shapes.prefill_shape(len(chunks), max(len(c.token_ids) for c in chunks))
        if self.eager_from_width is not None and width >= self.eager_from_width:
            return True
        return batch * width >= EAGER_PREFILL_WASTE * real

    def _eager_step(self, inputs) -> torch.Tensor:
        i = inputs.to(self.device)
        return self.model.eager_serve_step(i.input_ids, i.position_ids, self.cache, i.cache_positions, i.rows,
                                           i.read_slots, i.logit_index)

    def _step(self, inputs) -> torch.Tensor:
        i = inputs.to(self.device)
        return self.model.serve_step(i.input_ids, i.position_ids, self.cache, i.cache_positions, i.rows,
                                     i.read_slots, i.logit_index)

    # ---- the leader's token choice --------------------------------------------------------------
    def _choose(self, plan: StepPlan, prefill_logits: list[torch.Tensor],
                decode_logits: torch.Tensor | None) -> list[TokenEvent]:
        by_row = self.scheduler.by_row()
        chosen: list[tuple[Sequence, torch.Tensor]] = []
        for chunk, logits in zip(plan.prefills, prefill_logits):
            seq = by_row[chunk.row]
            seq.prefilled += len(chunk.token_ids)
            if seq.prefilled == len(seq.prompt):  # the prompt's last chunk: its logits give the first token
                chosen.append((seq, logits))
        if decode_logits is not None:
            chosen.extend((by_row[r.row], decode_logits[i]) for i, r in enumerate(plan.decode))
        if not chosen:
            return []
        sequences = [seq for seq, _ in chosen]
        # A decode-only step's rows already are one tensor in order: no copy of 16 x vocab floats.
        logits = decode_logits if len(chosen) == len(plan.decode) else torch.stack([row for _, row in chosen])
        events = []
        try:
            tokens, logprobs = choose(logits, sequences)
        except NOT_THE_GRAMMARS:
            raise
        except BaseException:  # noqa: BLE001 - one request's choice failed (a matcher's panic too): fail it alone
            # Rows that drew before the failing one draw the same again: each draw is seeded anew
            # from its request's seed and the draw's number (token_choice.seed_draws).
            sequences, logits, tokens, logprobs, failed = self._choose_alone(sequences, logits)
            events = [out for event in failed for out in self.held.failed(event)]
        chosen_at = time.perf_counter()
        for i, (seq, token) in enumerate(zip(sequences, tokens)):
            request = seq.request
            try:  # a whole match of the request's structured output that cannot go on ends it
                matched = (seq.grammar is not None and token not in request.stop_token_ids
                           and seq.grammar.advance(token))
            except NOT_THE_GRAMMARS:  # not the matcher's
                raise
            except BaseException as err:  # noqa: BLE001 - this request's alone (any error of its matcher's, a
                # Rust panic included: raised out of the step, it failed the group, which replayed the request
                # until given up)
                error = _request_error(err)
                events.extend(self.held.failed(TokenEvent(request.request_id, [], "error", error=error)))
                self.scheduler.finish(seq)
                continue
            seq.generated += 1
            seq.output_ids.append(token)
            reason = ("stop" if token in request.stop_token_ids or matched
                      else "length" if seq.generated >= request.max_tokens else None)
            event = TokenEvent(request.request_id, [token], reason, None if logprobs[i] is None else [logprobs[i]],
                               [_own_copy(logits[i])] if request.return_logits else None, chosen_at,
                               prompt_logprobs=(seq.prompt_logprobs if request.prompt_logprobs is not None
                                                and seq.generated == 1 else None),
                               cached_tokens=seq.cached if seq.generated == 1 else None)
            events.extend(self.held.pass_on(event, request.stream_interval, first=seq.generated == 1))
            if reason is None:
                seq.pending = token
            else:
                self.scheduler.finish(seq)
        return events

    def _choose_alone(self, sequences: list[Sequence], logits: torch.Tensor):
        """Each row's token chosen by itself, after choosing them together raised: a row that raises
        again fails its request alone ("error" event, its row freed), even when every row does (say,
        prompts that share one bad SamplingParams). The forwards ran on every rank and only the
        leader chooses tokens, so the group stays in step and serves on; failing the group instead
        would replay the same requests on the restarted group until it was given up. (A broken
        device fails the next forward, which fails the group as before.)
        Returns the rows that succeeded (sequences, logits, tokens, logprobs) and the error events."""
        kept, rows, tokens, logprobs, failed = [], [], [], [], []
        for i, seq in enumerate(sequences):
            try:
                [token], [logprob] = choose(logits[i:i + 1], [seq])
            except NOT_THE_GRAMMARS:
                raise
            except BaseException as err:  # noqa: BLE001 - reported to this request's caller
                failed.append((seq, err))
                continue
            kept.append(seq)
            rows.append(i)
            tokens.append(token)
            logprobs.append(logprob)
        events = []
        for seq, err in failed:
            error = (str(err) if isinstance(err, MatcherFailed)  # it names itself (the matcher's own failure)
                     else f"choosing its next token failed: {type(err).__name__}: {err}")
            events.append(TokenEvent(seq.request.request_id, [], "error", error=error))
            self.scheduler.finish(seq, clear=True)  # its forward may have cached NaN or inf
        return kept, logits[rows], tokens, logprobs, events

    # ---- static batches ------------------------------------------------------------------------------
    def _next_static(self) -> int | None:
        with self._statics_changed:
            pending = [i for i, (_, f) in self._statics.items() if not f.done()]
        return min(pending) if pending else None

    def _static_now(self, static_id: int) -> None:
        with self._statics_changed:
            if not self._statics_changed.wait_for(lambda: static_id in self._statics, timeout=STATIC_WAIT_S):
                raise RuntimeError(f"rank {self.collectives.rank} never received static batch {static_id} "
                                   f"that rank 0 announced (waited {STATIC_WAIT_S:g} s)")
            request, future = self._statics.pop(static_id)
        try:
            self.static_batches += 1
            future.set_result(self._run_static(request))
        except BaseException as err:  # noqa: BLE001 - the caller's error goes back to the caller
            future.set_exception(err)
            if not isinstance(err, (ValueError, FileNotFoundError)):
                raise
