"""One tensor-parallel rank: its backend, process group, shard, model and requests.

The class knows nothing of Ray: the launcher wraps it as an actor (launcher/cluster/ray_worker.py), and the
in-process benchmark drives the same class directly. The constructor is cheap; each heavy step is an
explicit call made after the launcher has placed the process (so device visibility is already set):

    describe() -> prepare_backend() -> init_backend() -> load() -> generate()* -> shutdown()

To serve (continuous batching, workers/serving/), every rank then calls prepare_serving() and
serve(), which runs until stop_serving() reaches rank 0; meanwhile the driver talks to rank 0 only
(submit_requests, cancel_requests, and stream_events, which sends the tokens back over a socket of
their own), and generate() batches run between two iterations.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from shardlib.buckets import Buckets
from shardlib.model_config import ModelConfig
from shardlib.moe_params import model_names
from shardlib.sampling_params import SamplingParams
from shardlib.sharding import ShardLayout
from workers.backends import backend_entry, get_backend
from workers.backends.base import RendezvousInfo, rendezvous_backlog
from workers.net import listener_below_the_ephemeral_range
from workers.serving.numbered_calls import NumberedCalls


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs to know before it starts; identical for all ranks but `rank`."""

    rank: int
    world_size: int
    backend: str
    """Backend name (see workers.backends.BACKENDS)."""
    threads: int
    """torch intra-op threads for this rank (CPU backend)."""
    lnc: int = 1
    """Logical NeuronCore config the plan was made for (the backends whose registry entry lists it
    in constructor_options: neuron)."""


@dataclass(frozen=True)
class LoadSpec:
    """Which weights to load and how to lay them out."""

    config: ModelConfig
    layout: ShardLayout
    dtype: str
    model_dir: str
    """Hugging Face checkpoint directory (read through per-rank lazy slices)."""
    kv_cache_dtype: str | None = None
    """"f8e4m3": an fp8 KV cache (workers/kv_quant.py); None: the compute dtype."""
    presharded_dir: str | None = None
    """A pre-sharded directory for this exact layout; preferred over model_dir when set."""
    compile: bool = False
    """Run through the backend's per-bucket compiled graphs (needs buckets); False: eager."""
    buckets: Buckets | None = None
    """Bucketed shapes: the graphs' shapes when compiling; eager runs at these shapes too when set."""
    compile_granularity: str | None = None
    """What one compiled graph covers (see workers/compiled.py); None: the backend's default."""
    compile_cache_dir: str | None = None
    """Where the backend persists and finds compiled graphs (a compiled-model directory's cache)."""
    warm_up: bool = False
    """Build every bucket's graph during load instead of on first use."""
    expected_versions: dict[str, str] | None = None
    """Library versions the compiled artifacts were built with; load refuses other ones."""
    progress_file: str | None = None
    """Rank 0 appends one line per graph built during warm-up here (the compile command shows them)."""
    fused_projections: bool = False
    """Fuse each rank's q/k/v and gate/up matrices after loading (workers/fused_projections.py)."""
    sequence_parallel: bool = False
    """Split multi-token steps' residual stream along the sequence (workers/sequence_parallel.py)."""


@dataclass(frozen=True)
class GenerateRequest:
    """One batch of tokenized prompts; the whole prefill+decode loop runs inside the ranks."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    max_seq_len: int | None = None
    return_logits: bool = False
    """Return the logits each token was chosen from (accuracy checks)."""


@dataclass(frozen=True)
class ServeSpec:
    """The serving loop's limits (workers/serving/loop.py)."""

    max_num_seqs: int
    """Cache rows: requests running at once; more wait for a free row."""
    max_prefill_tokens: int
    """Prompt tokens prefilled per iteration, over all sequences."""
    cache_slots: int | None = None
    """Slots per row without buckets; with buckets, the largest token bucket."""
    warm_up_max_length: int | None = None
    """Build the serving graphs for sequences of up to this many tokens before serving; None: none
    (each is built on first use), 0: every serving shape."""
    burst_wait_s: float = 0.0
    """ServingConfig.burst_wait_s: how long an idle leader waits for a burst's next request."""
    prefix_caching: bool = False
    """ServingConfig.prefix_caching: prompts skip the prefix they share with what a cache row holds."""


@dataclass
class LoadStats:
    load_time_s: float
    shard_bytes: int
    peak_rss_bytes: int
    source: str
    """"checkpoint" or "presharded"."""
    compile: dict | None = None
    """Compiled runs: the graphs built so far with their times, and the compile cache's hit/miss counts."""
    decode_read_bytes: int = 0
    """The shard's bytes a decode step reads: all of them but an input embedding that is not also the
    LM head (its lookup reads one row a token). What a memory-bandwidth bound divides."""


SHUTDOWN_LOOP_WAIT_S = 5.0
"""How long shutdown waits for the serving loop to end before closing the collectives under it."""


def _silent(line: str) -> None:
    """Other ranks build the same graphs as rank 0 at the same time: one announcement is enough."""


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM), 0 where /proc is absent."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass
class RankWorker:
    spec: WorkerSpec
    _backend: object = field(default=None, init=False, repr=False)
    _collectives: object = field(default=None, init=False, repr=False)
    _model: object = field(default=None, init=False, repr=False)
    _buckets: Buckets | None = field(default=None, init=False, repr=False)
    _graph_progress: object = field(default=None, init=False, repr=False)
    """Rank 0 under `corelaunch compile`: writes each graph a warm-up builds to the compile log."""
    _loop: object = field(default=None, init=False, repr=False)
    _prepared_loop: object = field(default=None, init=False, repr=False)
    """The loop prepare_serving made, until stream_events takes it (even when the loop has ended by then)."""
    _numbered: NumberedCalls = field(default_factory=NumberedCalls, init=False, repr=False)
    """Rank 0: the driver's numbered submissions and cancellations, handed to the loop in order."""
    _serve_ended: threading.Event | None = field(default=None, init=False, repr=False)
    """Set when serve() returns: shutdown waits for it before closing the collectives the loop uses."""
    _rendezvous_listener: socket.socket | None = field(default=None, init=False, repr=False)
    """Rank 0: the socket listening at its rendezvous port from the port's choice until its store
    takes it over in init_backend."""

    def describe(self) -> dict:
        """Where this rank runs: used for error messages and rendezvous."""
        return {"rank": self.spec.rank, "pid": os.getpid(), "hostname": socket.gethostname()}

    def rendezvous_port(self, host: str) -> int:
        """Called on rank 0 only: a port on rank 0's `host` address (where its store listens) for the
        process group, listened on from now: the store starts only in init_backend, after a round
        trip through the driver, and a port merely found free could meanwhile be bound by anything
        else (a port of the OS's ephemeral range by any outbound connection, Ray makes many), failing
        the group's start with "Address already in use". Below the ephemeral range all the same, as
        the Neuron backend's second port is picked there and bound later."""
        if self._rendezvous_listener is not None:  # asked again (a retried call): one port held at a time
            self._rendezvous_listener.close()
        self._rendezvous_listener = listener_below_the_ephemeral_range(host, backlog=rendezvous_backlog(self.spec.world_size))
        return self._rendezvous_listener.getsockname()[1]

    def prepare_backend(self) -> dict:
        """Import the backend (torch with it) and set the process up, once. The driver waits for it
        under the start-up timeout, before the rendezvous, whose timeout then counts the joining
        alone (torch's import takes seconds a rank, more when several ranks import it at once on a
        busy host)."""
        from shardlib.env_settings import check_environment

        start = time.perf_counter()
        # This rank's own environment (a running cluster's, not the driver's, which the plan
        # checked): a bad switch is named at start, not at the kernel's first use mid-request.
        check_environment()
        self._set_up_backend()
        return {"rank": self.spec.rank, "prepare_s": time.perf_counter() - start}

    def _set_up_backend(self) -> None:
        # Not prepare_backend itself: an actor's override hands that to its compute thread, which
        # init_backend (running on that thread) would then wait for forever.
        if self._backend is None:
            options = {name: getattr(self.spec, name) for name in backend_entry(self.spec.backend).constructor_options}
            backend = get_backend(self.spec.backend, **options)
            backend.setup_process(self.spec.rank, self.spec.world_size, self.spec.threads)
            self._backend = backend

    def init_backend(self, host: str, port: int, timeout_s: float,
                     node_groups: list[list[int]] | None = None) -> dict:
        """Join the process group (all ranks call this concurrently), after prepare_backend (run here
        when it was not called).

        node_groups: the ranks on each node (see Backend.init_process_group)."""
        start = time.perf_counter()
        self._set_up_backend()
        listener, self._rendezvous_listener = self._rendezvous_listener, None  # the store's from here on
        if listener is not None and listener.getsockname()[1] != port:  # not the port this rank chose
            listener.close()
            listener = None
        self._collectives = self._backend.init_process_group(
            RendezvousInfo(host, port, listener), self.spec.rank, self.spec.world_size, timeout_s, node_groups)
        return {"rank": self.spec.rank, "init_time_s": time.perf_counter() - start}

    def load(self, load_spec: LoadSpec) -> LoadStats:
        """Read only this rank's slices and build the sharded model."""
        from workers.model import ShardedCausalLM

        assert self._backend is not None, "init_backend must run before load"
        start = time.perf_counter()
        if load_spec.compile:
            self._backend.prefetch_compiler()  # overlaps reading the shard
        if load_spec.presharded_dir:
            from shardlib.presharded import load_presharded

            shard = load_presharded(load_spec.presharded_dir, load_spec.config, load_spec.layout,
                                    self.spec.rank, dtype=load_spec.dtype)
            source = "presharded"
        else:
            from shardlib.checkpoint import load_rank_shard

            shard = load_rank_shard(load_spec.model_dir, load_spec.config, load_spec.layout,
                                    self.spec.rank, dtype=load_spec.dtype)
            source = "checkpoint"
        shard_bytes = sum(t.numel() * t.element_size() for t in shard.values())
        # The family's own name (DBRX: transformer.wte.weight): a lookup reads one row a token.
        embed = model_names(load_spec.config).embed
        looked_up = shard.get(embed) if not load_spec.config.tie_word_embeddings else None
        decode_read_bytes = shard_bytes - (0 if looked_up is None else looked_up.numel() * looked_up.element_size())
        model = ShardedCausalLM(load_spec.config, load_spec.layout, self.spec.rank, shard,
                                self._collectives, load_spec.dtype)
        # The model holds the shard's tensors now: without the dict, each one goes as soon as it is
        # replaced (fused projections, the cpu backend's packed weights), not at the end of load.
        del shard
        if load_spec.kv_cache_dtype is not None:
            from workers.kv_quant import kv_storage_dtype

            model.kv_cache_dtype = kv_storage_dtype(load_spec.kv_cache_dtype, model.dtype)
        model.sequence_parallel = load_spec.sequence_parallel
        if load_spec.fused_projections:
            from workers.fused_projections import fuse_projections

            fuse_projections(model)
        self._model = self._backend.prepare_model(model, self._compile_options(load_spec))
        self._buckets = load_spec.buckets
        self._vocabulary = (load_spec.model_dir, load_spec.config.vocab_size)  # structured output's tokenizer
        return LoadStats(load_time_s=time.perf_counter() - start, shard_bytes=shard_bytes,
                         peak_rss_bytes=peak_rss_bytes(), source=source, compile=self.compile_stats(),
                         decode_read_bytes=decode_read_bytes)

    def _compile_options(self, load_spec: LoadSpec):
        if not load_spec.compile:
            return None
        from workers.backends.base import CompileOptions
        from workers.compiled import check_versions

        if load_spec.buckets is None:
            raise ValueError("compiling needs buckets (LoadSpec.buckets); pass them, or load with compile=False")
        if load_spec.expected_versions is not None:
            check_versions(load_spec.expected_versions, where=f"rank {self.spec.rank} ({socket.gethostname()})")
        progress = None
        if load_spec.progress_file and self.spec.rank == 0:
            path = Path(load_spec.progress_file)

            def progress(done: int, total: int, shape: tuple[str, int, int], seconds: float) -> None:
                with path.open("a") as fh:
                    fh.write(f"{done} {total} {shape[0]} {shape[1]} {shape[2]} {seconds:.3f}\n")
        self._graph_progress = progress  # the serving warm-up's graphs are shown too (prepare_serving)

        return CompileOptions(buckets=load_spec.buckets, cache_dir=load_spec.compile_cache_dir,
                              granularity=load_spec.compile_granularity, warm_up=load_spec.warm_up,
                              progress=progress, announce=None if self.spec.rank == 0 else _silent)

    def compile_stats(self) -> dict | None:
        """The compiled model's graphs built so far and its compile-cache counters; None when eager."""
        stats = getattr(self._model, "stats", None)
        return stats().to_dict() if callable(stats) else None

    def generate(self, request: GenerateRequest, static_id: int | None = None):
        """Run one batch; rank 0 returns the outputs, other ranks return None. While the serving loop
        runs, the batch waits there for its turn (static_id: the same number on every rank)."""
        assert self._model is not None, "load must run before generate"
        loop = self._loop  # once: serve() clears it, on another thread, when the loop ends
        if loop is not None:
            if static_id is None:
                raise ValueError("this group is serving: a static batch needs the static_id every rank shares")
            outputs = loop.static(static_id, request).result()
        elif static_id is not None:
            # Sent to a serving loop that has ended since (its error is the group's to report). Run
            # eagerly here instead, its collectives would wait for ranks that never join them, until
            # the driver's request timeout.
            raise RuntimeError(f"rank {self.spec.rank}'s serving loop ended before static batch {static_id} ran "
                               f"(the group is no longer serving)")
        else:
            outputs = self._run_batch(request)
        return outputs if self.spec.rank == 0 else None

    def _run_batch(self, request: GenerateRequest):
        """One static batch through workers/engine.py, on this rank."""
        from workers.engine import generate

        return generate(self._model, request.prompts, request.params, request.max_new_tokens,
                        request.stop_token_ids, max_seq_len=request.max_seq_len,
                        return_logits=request.return_logits, buckets=self._buckets)

    # ---- serving ---------------------------------------------------------------------------------
    def prepare_serving(self, spec: ServeSpec) -> dict:
        """Allocate the serving cache (and build graphs, when asked); every rank, before serve()."""
        from shardlib.serving_shapes import ServingShapes
        from workers.serving.loop import ServingConfig, ServingLoop, warm_up_shapes_for

        assert self._model is not None, "load must run before prepare_serving"
        buckets = self._buckets
        shapes = ServingShapes.build(buckets, spec.max_num_seqs, spec.max_prefill_tokens) if buckets else None
        slots = buckets.max_seq_len if buckets is not None else spec.cache_slots
        if slots is None:
            raise ValueError("serving without buckets needs ServeSpec.cache_slots")
        model = self._model
        if shapes is not None and hasattr(model, "reserve_graphs"):
            model.reserve_graphs(len(shapes.shapes()))
        start = time.perf_counter()
        # Every rank builds its loop here, at once: the loop's constructor agrees with the other ranks
        # (a collective) on which prefill calls run eagerly, so the warm-up below runs the same
        # shapes, with the same collectives, on every rank whatever each host's prefill kernel.
        loop = ServingLoop(model, ServingConfig(spec.max_num_seqs, spec.max_prefill_tokens, slots, shapes,
                                               spec.burst_wait_s, spec.prefix_caching),
                           self._run_batch, self._grammar_tokenizer())
        if shapes is not None and spec.warm_up_max_length is not None and hasattr(model, "warming_up"):
            with model.warming_up():
                loop.warm_up(warm_up_shapes_for(shapes, loop.continues_eagerly, loop.eager_from_width,
                                                 spec.warm_up_max_length or None),
                             progress=self._graph_progress)
        self._loop = self._prepared_loop = loop
        return {"rank": self.spec.rank, "cache_bytes": loop.cache.nbytes(), "prepare_s": time.perf_counter() - start,
                "compile": self.compile_stats()}  # the warm-up's graphs: built at start, not in a request

    def _grammar_tokenizer(self):
        """The leader's tokenizer for structured output (built at its first structured request);
        None on the other ranks, which never choose tokens."""
        if self.spec.rank != 0:
            return None
        from workers.structured.matchers import GrammarTokenizer

        model_dir, vocab_size = self._vocabulary

        def load():
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(model_dir)

        return GrammarTokenizer(load, vocab_size)

    def serve(self) -> dict:
        """Run the serving loop until stop_serving(); the loop's step counters when it ends."""
        loop = self._loop
        assert loop is not None, "prepare_serving must run before serve"
        ended = self._serve_ended = threading.Event()
        try:
            loop.run()
        finally:
            self._loop = None
            ended.set()
        return loop_counters(loop)

    def submit_requests(self, requests: list, number: int | None = None) -> None:
        """Hand requests to the serving loop; `number`: this call's place among the driver's
        submissions and cancellations to this group (workers/serving/numbered_calls.py)."""
        self._in_order(number, lambda: self._leader_loop().submit(requests))

    def cancel_requests(self, request_ids: list[str], number: int | None = None) -> None:
        self._in_order(number, lambda: self._leader_loop().cancel(request_ids))

    def _in_order(self, number: int | None, call) -> None:
        if number is None:  # a caller that does not number its calls
            call()
        else:
            self._numbered.run(number, call)

    def stream_events(self, host: str, port: int, token: bytes, timeout_s: float) -> None:
        """Connect to the driver's event port and stream the loop's events there until it ends
        (workers/serving/event_stream.py); returns once connected."""
        from workers.serving.event_stream import EventSender

        if self.spec.rank != 0:
            raise ValueError(f"rank {self.spec.rank} is a follower: events come from rank 0")
        # The loop prepare_serving made, even when it has already ended (its first step failed): its
        # closed outbox then ends the stream at once, and the driver asks Ray for the loop's error.
        loop, self._prepared_loop = self._prepared_loop, None  # the sender holds it from here on
        if loop is None:
            raise RuntimeError("prepare_serving must run before stream_events (once per loop)")
        EventSender(loop.outbox, lambda: loop_counters(loop)).connect(host, port, token, timeout_s)

    def stop_serving(self) -> None:
        if self._loop is not None:
            self._loop.stop()

    def _leader_loop(self):
        if self.spec.rank != 0:
            raise ValueError(f"rank {self.spec.rank} is a follower: requests go to rank 0")
        if self._loop is None:
            raise RuntimeError("this group is not serving (prepare_serving and serve were not called, or it stopped)")
        return self._loop

    def shutdown(self) -> None:
        self._end_serving()
        self._release()

    def _end_serving(self) -> None:
        """Stop the serving loop and wait for serve() to return, at most SHUTDOWN_LOOP_WAIT_S; a loop
        still inside a collective then (a peer stopped first, or died) gets its collectives closed
        under it, so that call raises CollectivesClosed and the loop ends. Safe on another thread
        than the loop's (the actor's: launcher/cluster/ray_worker.py)."""
        self._prepared_loop = None
        loop = self._loop  # once: serve() clears it, on the loop's thread, when the loop ends
        if loop is not None:
            loop.stop()
        # Waited for first, so a loop that can still end stops between steps rather than failing on
        # closed collectives. Bounded, as a rank stuck for good must not hold the shutdown: close()
        # is safe anyway (a call in flight raises CollectivesClosed; the memory stays mapped until
        # it leaves).
        ended = self._serve_ended
        if ended is not None and not ended.wait(SHUTDOWN_LOOP_WAIT_S):
            print(f"rank {self.spec.rank}: the serving loop had not ended {SHUTDOWN_LOOP_WAIT_S:g} s after "
                  f"stop; closing its collectives under it", flush=True)
            self._close_collectives()

    def _release(self) -> None:
        """Drop the model, the collectives and the backend's process group (on the thread that computes)."""
        # The model holds the collectives: drop it, then release the shared memory before the
        # process group is destroyed.
        self._model = None
        self._close_collectives()
        if self._rendezvous_listener is not None:  # a port chosen for a start that never came
            self._rendezvous_listener.close()
            self._rendezvous_listener = None
        if self._backend is not None:
            self._backend.shutdown()

    def _close_collectives(self) -> None:
        # Either thread may get here (the actor's, the compute thread's): close() is idempotent.
        collectives, self._collectives = self._collectives, None
        if collectives is not None:
            collectives.close()


def loop_counters(loop) -> dict:
    """A serving loop's counters: steps, forward and planning seconds (the overhead benchmark), and
    static batches run (with steps, the progress the driver's hung-group check looks for)."""
    return {"steps": loop.steps, "step_s": loop.step_seconds, "plan_s": loop.plan_seconds,
            "static_batches": loop.static_batches}
