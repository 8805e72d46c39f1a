"""`CompiledCausalLM`: the decoder step (workers/step.py) run through static-shape inductor graphs, one
per bucket and phase (CPU; CUDA uses the same class).

Two phases, each with its own graphs (shapes from shardlib.buckets):

- context encoding (prefill) at (batch bucket, context bucket): the padded prompts start at cache
  slot 0, so the prompt is the whole history and attention runs over its own keys and values. The
  graph returns the logits at the last real column plus every layer's k and v (batch, kv_heads,
  context, head_dim); the runner copies them into the request's KV cache prefix. The graph does not
  depend on the cache length: one graph per context bucket (and batch bucket).
- token generation (decode) at (batch bucket, token bucket): one token per row is written into the
  cache (batch, kv_heads, token bucket, head_dim) at its slot and attends over the whole cache.

The collectives are custom operators inside the graphs (workers/collective_ops.py), so what one
graph covers is the same choice at every TP degree (`granularity`):
- "layer": one graph for the decoder layer, shared by every layer (weights are graph inputs), plus a
  prologue and an epilogue graph; a step is (layers + 2) graph calls.
- "model": one graph for the whole step.
- "model-decode": "model" for decode steps, "layer" for prefills. A decode step is mostly memory
  traffic and a (layers + 2)-call step spends a measurable share of it in the calls themselves; a
  prefill is compute and barely notices them, while a whole-model graph takes about three times
  as long to compile as a layer graph.
- "collective": "layer" with the collectives left outside the graphs, so each layer falls apart into
  the code between two collectives; the way TP > 1 ran before the collectives were operators, kept
  to measure against (benchmarks/tp_scaling.py).
The README's Measured table has the figures behind the default.

Decode matmuls: on the cpu backend float32 weights are packed as column panels and every product
is one call of the packed-panel operator (workers/kernels/packed_linear.py), which a graph keeps as
an extern call. Unpacked, a one-row product is written by workers.layers.linear as a
multiply-and-sum that inductor turns into a vectorised reduction split over the threads, streaming
the weights at more than twice the rate of the BLAS GEMV that F.linear calls (the README's
Measured table, "where decode time goes").

Persisted compilation: inductor's FX-graph and AOTAutograd caches live under TORCHINDUCTOR_CACHE_DIR
(set per worker by the backend, pointing into a compiled-model directory); a later process that
traces the same graphs finds them there and compiles nothing (stats() counts the cache hits).
torch.compile with its cache persisted was measured against AOTInductor packages; the README's
"Compiled graphs and buckets" section gives the reasons for the choice, its Measured table the figures.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import platform
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from shardlib.buckets import Buckets
from shardlib.compile_counters import COMPILING_COUNTERS
from shardlib.serving_shapes import PREFILL_CONTINUE, PREFILL_START
from workers.compile_once import BACKEND
from workers.kv_cache import KVCache
from workers.kv_quant import to_cache, writable
from workers.model import ShardedCausalLM
from workers.granularities import DEFAULT_GRANULARITY, GRANULARITIES
from workers.inductor_cache import ensure_private_inductor_cache, point_at
from workers.kernels import decode_attention, prefill_attention, prefill_gemm, small_linear
from workers.step import EAGER, StepParts, run_step

CHECKED_LIBRARIES = ("torch", "transformers", "corelaunch")
"""Libraries whose versions a compiled-model directory must match (compiled code depends on them)."""


def library_versions() -> dict[str, str]:
    """Versions of the libraries compiled graphs depend on (plus Python, recorded but not checked)."""
    versions = {"torch": torch.__version__}
    for name in ("transformers", "corelaunch"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    versions["python"] = platform.python_version()
    return versions


def version_differences(expected: dict[str, str]) -> list[str]:
    """"name: expected X, found Y" for each checked library whose version here differs."""
    found = library_versions()
    return [f"{name}: expected {expected.get(name)!r} (compiled), found {found[name]!r} (installed)"
            for name in CHECKED_LIBRARIES if expected.get(name) != found[name]]


def check_versions(expected: dict[str, str], where: str = "this process") -> None:
    """ValueError naming every checked library whose version differs from `expected`."""
    differ = version_differences(expected)
    if differ:
        raise ValueError(
            f"the compiled graphs were built with other library versions than {where} has: {'; '.join(differ)}. "
            f"Re-run `corelaunch compile` in this environment, or install the versions it was built with"
        )


def use_cache_dir(path: str) -> None:
    """Point this process's inductor caches (FX graphs, AOTAutograd, compiled kernels) at `path`.

    Inductor reads TORCHINDUCTOR_CACHE_DIR each time it looks something up, so this takes effect
    for every graph compiled afterwards."""
    point_at(path)


def _compile(fn, fullgraph: bool = True):
    ensure_private_inductor_cache()  # not torch's default under /tmp, which any user can take first
    small_linear.mark_constants_for_tracing()
    decode_attention.mark_constants_for_tracing()
    prefill_attention.mark_constants_for_tracing()
    prefill_gemm.mark_constants_for_tracing()
    # dynamic=False: a static graph per shape, never a shape-generic one (bucketing's whole point).
    # The backend is inductor's, one compile per graph on the host (workers/compile_once.py).
    return torch.compile(fn, fullgraph=fullgraph, dynamic=False, backend=BACKEND)


def configure_dynamo(graphs: int) -> None:
    """Room for every bucket's graph per compiled function, and an error instead of a silent fall
    back to eager if that is ever exceeded. torch keeps these settings per thread (a user override
    of its config does not reach other threads): they hold where graphs are built because every
    step runs on the one thread that loaded the model (launcher/cluster/ray_worker.py's compute
    thread; the serving loop and the static batches it runs too)."""
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, graphs + 8)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 8 * (graphs + 8))
    dynamo_config.fail_on_recompile_limit_hit = True


@dataclass
class GraphStats:
    phase: str
    batch: int
    length: int
    first_call_s: float
    """Wall time of the call that traced and compiled (or fetched from the cache) this shape."""
    compiled: bool | None = None
    """Whether that call really compiled (shardlib/compile_counters.py) rather than reading the
    compile cache; None where the backend does not say."""


@dataclass
class CompileStats:
    graphs: list[GraphStats] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    """Inductor/AOTAutograd cache counters since the model was wrapped (fxgraph_cache_hit, ...), and
    compiled_by_peer: graphs another rank on the host compiled while this one waited."""

    def to_dict(self) -> dict:
        return {"graphs": [g.__dict__ for g in self.graphs],
                "compile_s": round(sum(g.first_call_s for g in self.graphs), 3), **self.counters}


class CompiledCausalLM:
    """Drop-in for ShardedCausalLM in workers.engine.generate: same call, bucketed shapes only."""

    def __init__(self, model: ShardedCausalLM, buckets: Buckets, *, granularity: str | None = None,
                 announce: Callable[[str], None] | None = None) -> None:
        """announce: called with a line before and after each graph built during a request (not
        during warm_up, which has its own progress); default: print to stderr."""
        self.model, self.buckets = model, buckets
        self.config, self.collectives, self.dtype = model.config, model.collectives, model.dtype
        self.granularity = granularity or DEFAULT_GRANULARITY
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity {self.granularity!r} must be one of {', '.join(GRANULARITIES)}")
        # Rotary tables for every position a bucket can hold, built now so no call rebuilds them
        # (a rebuilt table would be a new graph input and a recompile).
        model._ensure_rotary(buckets.max_seq_len)
        configure_dynamo(len(buckets.shapes()))
        model.collectives.in_graph = self.granularity != "collective"
        model.collectives.handle  # registered now, not while a graph is being traced
        self._peer_compiles_at_start = BACKEND.compiled_by_peer
        per_layer = StepParts(*(_compile(part, self.granularity != "collective") for part in EAGER))
        whole = (EAGER, _compile(run_step))  # parts inlined into one graph
        self._runners = {  # phase -> (parts, step function)
            "context": whole if self.granularity == "model" else (per_layer, run_step),
            "token": whole if self.granularity in ("model", "model-decode") else (per_layer, run_step),
        }
        self._announce = announce if announce is not None else _print_stderr
        self._warming_up = False
        self._seen: set[tuple[str, int, int]] = set()
        self._stats = CompileStats()
        self._counters_at_start = _cache_counters()

    def reserve_graphs(self, extra: int) -> None:
        """Room for `extra` more graphs per compiled function than the static buckets need (the
        serving engine's shapes, shardlib/serving_shapes.py, run through the same functions)."""
        configure_dynamo(len(self.buckets.shapes()) + extra)

    # ---- what engine.generate uses -------------------------------------------------------------
    def new_cache(self, batch: int, max_seq_len: int, long_lived: bool = False) -> KVCache:
        return self.model.new_cache(batch, max_seq_len, long_lived)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache,
                 cache_positions: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 logit_index: torch.Tensor | None = None) -> torch.Tensor:
        """As ShardedCausalLM.forward, at bucketed shapes: a prefill (seq > 1) must start at slot 0."""
        batch, seq = input_ids.shape
        slots = cache.max_seq_len
        phase, length = ("context", seq) if seq > 1 else ("token", slots)
        self._check_shape(phase, batch, length, cache)
        if attention_mask is None:
            attention_mask = torch.ones(batch, slots, dtype=torch.bool, device=input_ids.device)
        parts, step = self._runners[phase]
        if phase == "context":
            if logit_index is None:
                logit_index = torch.tensor([seq - 1], device=input_ids.device)
            if int(cache_positions[0]) != 0:
                raise ValueError("a compiled prefill starts at cache slot 0 (the prompt is the whole history)")
            # a copy of the prompt's columns: the slice kept the cache-wide row stride, which the graph's
            # guards check (even at batch 1, which is "contiguous" either way), so each cache bucket a
            # request ran beside compiled the prefill again, unannounced, inside the request
            prefill_mask = attention_mask[:, :seq].clone(memory_format=torch.contiguous_format)
            with self._graph(phase, batch, length, f"{phase} bucket"):
                logits, ks, vs = step(self.model, parts, input_ids, position_ids, prefill_mask,
                                      cache_positions, None, logit_index)
                for k_cache, v_cache, k, v in zip(cache.k, cache.v, ks, vs):
                    writable(k_cache)[:, :, :seq].copy_(to_cache(k, k_cache))
                    writable(v_cache)[:, :, :seq].copy_(to_cache(v, v_cache))
        else:
            with self._graph(phase, batch, length, f"{phase} bucket"):
                logits, _, _ = step(self.model, parts, input_ids, position_ids, attention_mask,
                                    cache_positions, (cache.k, cache.v), None)
        return logits

    forward = __call__

    def serve_step(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache,
                   cache_positions: torch.Tensor, rows: torch.Tensor, read_slots: int,
                   logit_index: torch.Tensor | None = None) -> torch.Tensor:
        """As ShardedCausalLM.serve_step, through the graph of its shape: a prefill call (seq > 1,
        one graph per batch and chunk length, and per slots read: the chunk's own width when its
        chunks start their sequences, else the whole cache row) or a decode step (one graph per
        batch and slots read). The serving engine pads every step to these shapes
        (workers/serving/step_inputs.py)."""
        batch, seq = input_ids.shape
        if seq == 1:
            phase, length = "serve-decode", read_slots
        else:  # a call of first chunks reads only its own width of slots: a graph of its own
            phase, length = (PREFILL_START if read_slots == seq else PREFILL_CONTINUE), seq
        parts, step = self._runners["context" if seq > 1 else "token"]
        mask = torch.ones(batch, read_slots, dtype=torch.bool, device=input_ids.device)
        with self._graph(phase, batch, length, phase):
            logits, _, _ = step(self.model, parts, input_ids, position_ids, mask, cache_positions,
                                (cache.k, cache.v), logit_index, rows)
        return logits

    def eager_serve_step(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache,
                         cache_positions: torch.Tensor, rows: torch.Tensor, read_slots: int,
                         logit_index: torch.Tensor | None = None) -> torch.Tensor:
        """ShardedCausalLM.serve_step at the inputs' exact shape, no graph: the serving loop's way
        for a prefill call that its bucket would pad several times over (workers/serving/loop.py)."""
        return self.model.serve_step(input_ids, position_ids, cache, cache_positions, rows, read_slots, logit_index)

    def score_step(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache,
                   cache_positions: torch.Tensor, rows: torch.Tensor, read_slots: int) -> torch.Tensor:
        """ShardedCausalLM.score_step, eagerly (no graph is built for it): a prompt scored for its
        log-probabilities is prefilled at its own exact shape, which no bucket's graph has. Its
        compute is the prefill's; what a graph saves there is small against a decode step's."""
        return self.model.score_step(input_ids, position_ids, cache, cache_positions, rows, read_slots)

    def column_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.column_logits(hidden)

    @contextlib.contextmanager
    def _graph(self, phase: str, batch: int, length: int, label: str):
        """Around one call at shape (phase, batch, length): the first time, announce the graph being
        built (unless warming up) and record how long its first call took."""
        key = (phase, batch, length)
        if key in self._seen:
            yield
            return
        # Whether this call compiles or reads the compile cache is known only afterwards.
        if not self._warming_up:
            self._announce(f"corelaunch: setting up the graph for {label} batch {batch} x {length} "
                           f"(first use: from the compile cache, else built and cached for later runs)")
        compiles_before = _compiles_so_far()
        start = time.perf_counter()
        yield
        seconds = time.perf_counter() - start
        compiled = _compiles_so_far() > compiles_before
        self._seen.add(key)
        self._stats.graphs.append(GraphStats(phase, batch, length, seconds, compiled))
        if not self._warming_up:
            if compiled:
                self._announce(f"corelaunch: built the {phase} graph for batch {batch} x {length} in "
                               f"{seconds:.1f} s (cached for later runs)")
            else:
                self._announce(f"corelaunch: took the {phase} graph for batch {batch} x {length} from the "
                               f"compile cache in {seconds:.1f} s")

    @contextlib.contextmanager
    def warming_up(self):
        """Graphs built inside are not announced (the caller shows its own progress)."""
        self._warming_up = True
        try:
            yield
        finally:
            self._warming_up = False

    def _check_shape(self, phase: str, batch: int, length: int, cache: KVCache) -> None:
        lengths = self.buckets.context if phase == "context" else self.buckets.token
        if batch not in self.buckets.batch or length not in lengths:
            kind = "context-encoding" if phase == "context" else "token-generation"
            raise ValueError(
                f"{kind} input of batch {batch} x length {length} is not a bucket shape (batch buckets "
                f"{list(self.buckets.batch)}, {kind} buckets {list(lengths)}); pad it with "
                f"shardlib.buckets.request_shape as workers.engine.generate does"
            )
        if cache.batch != batch:
            raise ValueError(f"input batch {batch} does not match the KV cache's batch {cache.batch}")

    # ---- compiling ahead of requests -------------------------------------------------------------
    def warm_up(self, shapes: list[tuple[str, int, int]] | None = None,
                progress: Callable[[int, int, tuple[str, int, int], float], None] | None = None) -> None:
        """Compile (or fetch from the cache) the graphs of `shapes` (default: every bucket shape) by
        running each once on a scratch cache; progress(done, total, shape, seconds) after each."""
        shapes = self.buckets.shapes() if shapes is None else shapes
        device = self.device
        with self.warming_up(), torch.inference_mode():
            for i, (phase, batch, length) in enumerate(shapes):
                start = time.perf_counter()
                if phase == "context":
                    cache = self.new_cache(batch, self.buckets.token_bucket(length))
                    ids = torch.zeros(batch, length, dtype=torch.int64, device=device)
                    positions = torch.arange(length, device=device).repeat(batch, 1)  # contiguous, as the engine's
                    self(ids, positions, cache, torch.arange(length, device=device), None,
                         torch.tensor([length - 1], device=device))
                else:
                    cache = self.new_cache(batch, length)
                    ids = torch.zeros(batch, 1, dtype=torch.int64, device=device)
                    self(ids, torch.zeros(batch, 1, dtype=torch.int64, device=device), cache,
                         torch.tensor([0], device=device), None)
                if progress is not None:
                    progress(i + 1, len(shapes), (phase, batch, length), time.perf_counter() - start)

    def stats(self) -> CompileStats:
        now = _cache_counters()
        self._stats.counters = {k: now.get(k, 0) - self._counters_at_start.get(k, 0) for k in now}
        # compiled by another rank while this one waited (workers/compile_once.py): a cache hit here
        self._stats.counters["compiled_by_peer"] = BACKEND.compiled_by_peer - self._peer_compiles_at_start
        return self._stats


def _print_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _compiles_so_far() -> int:
    """Graphs really compiled in this process so far (shardlib/compile_counters.py; a hit reads the cache)."""
    counters = {**_cache_counters(), "compiled_by_peer": BACKEND.compiled_by_peer}
    return sum(counters[name] for name in COMPILING_COUNTERS)


def _cache_counters() -> dict[str, int]:
    from torch._dynamo.utils import counters

    inductor, aot = counters["inductor"], counters["aot_autograd"]
    return {"dynamo_graphs": counters["stats"]["unique_graphs"],
            "fxgraph_cache_hit": inductor["fxgraph_cache_hit"], "fxgraph_cache_miss": inductor["fxgraph_cache_miss"],
            "fxgraph_cache_bypass": inductor["fxgraph_cache_bypass"],
            "autograd_cache_hit": aot["autograd_cache_hit"], "autograd_cache_miss": aot["autograd_cache_miss"]}
