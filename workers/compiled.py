"""`CompiledCausalLM`: a ShardedCausalLM run through one static-shape inductor graph per bucket (CPU).

Two phases, each with its own graphs (shapes from shardlib.buckets):

- context encoding (prefill) at (batch bucket, context bucket): the padded prompts start at cache
  slot 0, so the prompt is the whole history and attention runs over its own keys and values. The
  graph returns the logits at the last real column plus every layer's k and v (batch, kv_heads,
  context, head_dim); the runner copies them into the request's KV cache prefix. The graph does not
  depend on the cache length: one graph per context bucket (and batch bucket).
- token generation (decode) at (batch bucket, token bucket): one token per row is written into the
  cache (batch, kv_heads, token bucket, head_dim) at its slot and attends over the whole cache.

Granularity (what one graph covers):
- TP 1 ("layer", the default): one graph per decoder layer call, shared by every layer (weights are
  graph inputs, not constants), plus a small prologue and epilogue graph. "model" (one graph for
  the whole step) decodes ~15% faster but compiles ~3x slower, and its compile and warm-start
  times grow with the number of layers; `corelaunch compile --granularity model` selects it.
- TP > 1 ("collective"): collectives stay outside compiled code whatever implements them (gloo,
  shared memory, ...): each layer is cut at its two all-reduces into an attention and an MLP
  region, compiled once per shape and shared by all layers; the runner calls the collectives
  eagerly between regions (two graph boundaries per layer, ~70 us of call overhead per region).

Decode matmuls: with one row per step, workers.layers.linear writes the product as a
multiply-and-sum inside compiled graphs, which inductor turns into a vectorised reduction split
over the threads: 30 layers of SmolLM2-shaped weights stream at ~29 GB/s that way against ~11 GB/s
through the BLAS GEMV that F.linear calls (measured in isolation, 2 threads). That, not the removed
Python overhead (~5%), is most of the compiled speed-up. Batches of 2-8 rows measured the same
either way, so they keep F.linear.

Measured choice: torch.compile (inductor) with its cache persisted, not AOTInductor. SmolLM2-135M
fp32, 2 threads, on the shared 2-core development machine (noisy; quiet-period numbers):
- benchmarks/decode.py (batch 1, 128-token prompt, 128 new tokens, medians of 3): decode tokens/s
  transformers generate() 14.2, eager 15.3, "layer" 48.0, "model" 56.0; weights over bandwidth
  53.9 (29 GB/s) to 61.3 (33 GB/s);
- one decode graph (cache 256) from an empty cache, then raw forward steps/s: torch.compile
  "layer" 13.7 s, 38.9/s; torch.compile "model" 44.8 s, 42.2/s; AOTInductor (torch.export +
  aoti_compile_and_package, weights given with load_constants) 44.1 s including a 4.0 s export,
  45.5/s, and 0.006 s to load a compiled package against ~1-4 s for torch.compile to trace and
  fetch the same graph from its cache.
AOTInductor would gain ~8% decode over the whole-model graph and a few seconds of warm start, but
torch.export cannot leave our eager collectives outside the graph (TP > 1 would need every region
exported and packaged per shape), and plain `corelaunch generate` would still need torch.compile to
build the shapes nobody precompiled. One mechanism covers both here: graphs built on first use,
and the same graphs persisted by `corelaunch compile`. The warm start meets its target without it
(benchmarks/decode.py: cold 36.5 s, warm 17.3 s from a compiled-model directory).

Persisted compilation: inductor's FX-graph and AOTAutograd caches live under TORCHINDUCTOR_CACHE_DIR
(set per worker by the CPU backend, pointing into a compiled-model directory); a later process that
traces the same graphs finds them there and compiles nothing (stats() counts the cache hits).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from shardlib.buckets import Buckets
from workers.kv_cache import KVCache
from workers.model import ShardedCausalLM, attention_bias_mask


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
    return [f"{name}: expected {expected.get(name)!r}, found {found[name]!r}"
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
    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path


# ---- the regions between collectives ------------------------------------------------------------
# Pure functions of modules and tensors; compiled as they are (TP > 1) or inlined into one step graph
# (TP 1). `m` is the previous block's output still to be added to the residual stream.

def _prologue(model: ShardedCausalLM, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor):
    """Embedding slice, a zero first block output, rotary cos/sin, and the mask passed through."""
    cos, sin = model.rotary.lookup(position_ids, model.dtype)
    x = model.embed.partial(input_ids)
    return x, torch.zeros_like(x), cos, sin, mask


def context_prologue(model: ShardedCausalLM, input_ids: torch.Tensor, position_ids: torch.Tensor,
                     attention_mask: torch.Tensor):
    """_prologue with the (batch, 1, seq, seq) mask over the prompt itself."""
    seq = input_ids.shape[1]
    mask = attention_bias_mask(seq, torch.arange(seq, device=input_ids.device), attention_mask[:, :seq])
    return _prologue(model, input_ids, position_ids, mask)


def token_prologue(model: ShardedCausalLM, input_ids: torch.Tensor, position_ids: torch.Tensor,
                   attention_mask: torch.Tensor, cache_positions: torch.Tensor):
    """_prologue with the (batch, 1, 1, slots) mask over the cache."""
    mask = attention_bias_mask(attention_mask.shape[1], cache_positions, attention_mask)
    return _prologue(model, input_ids, position_ids, mask)


def context_attention(layer, x, m, cos, sin, mask):
    """Residual add, norm, attention over the prompt's own k/v: (x, o_proj partial, k, v)."""
    x = x + m
    q, k, v = layer.attention.project(layer.input_norm(x), cos, sin)
    return x, layer.attention.attend(q, k, v, mask), k, v


def token_attention(layer, x, m, cos, sin, mask, k_cache, v_cache, cache_positions):
    """Residual add, norm, attention writing this token's k/v into the cache: (x, o_proj partial)."""
    x = x + m
    return x, layer.attention.partial(layer.input_norm(x), cos, sin, mask, k_cache, v_cache, cache_positions)


def mlp(layer, x, a):
    """Residual add of the attention output, norm, MLP: (x, down_proj partial)."""
    x = x + a
    return x, layer.mlp.partial(layer.post_attention_norm(x))


def context_layer(layer, x, m, cos, sin, mask):
    """A whole decoder layer when nothing needs reducing (TP 1): (x, MLP output, k, v)."""
    x, a, k, v = context_attention(layer, x, m, cos, sin, mask)
    x, m = mlp(layer, x, a)
    return x, m, k, v


def token_layer(layer, x, m, cos, sin, mask, k_cache, v_cache, cache_positions):
    """A whole decoder layer when nothing needs reducing (TP 1): (x, MLP output)."""
    x, a = token_attention(layer, x, m, cos, sin, mask, k_cache, v_cache, cache_positions)
    return mlp(layer, x, a)


def epilogue(model: ShardedCausalLM, x, m, logit_index):
    """Last residual add, final norm and this rank's LM-head slice at one column: (batch, vocab_per_rank)."""
    return model.local_logits(x + m, logit_index)


@dataclass(frozen=True)
class Regions:
    context_prologue: Callable = context_prologue
    token_prologue: Callable = token_prologue
    context_attention: Callable = context_attention
    token_attention: Callable = token_attention
    mlp: Callable = mlp
    context_layer: Callable = context_layer
    token_layer: Callable = token_layer
    epilogue: Callable = epilogue

    def compiled(self) -> "Regions":
        return Regions(**{name: _compile(fn) for name, fn in self.__dict__.items()})


def context_step(model, regions: Regions, reduce, input_ids, position_ids, attention_mask, logit_index):
    """Prefill from slot 0: (local logits (batch, vocab_per_rank), [k per layer], [v per layer])."""
    x, m, cos, sin, mask = regions.context_prologue(model, input_ids, position_ids, attention_mask)
    if reduce is not None:
        x = reduce(x)
    ks, vs = [], []
    for layer in model.layers:
        if reduce is None:
            x, m, k, v = regions.context_layer(layer, x, m, cos, sin, mask)
        else:
            x, a, k, v = regions.context_attention(layer, x, m, cos, sin, mask)
            x, m = regions.mlp(layer, x, reduce(a))
            m = reduce(m)
        ks.append(k)
        vs.append(v)
    return regions.epilogue(model, x, m, logit_index), ks, vs


def token_step(model, regions: Regions, reduce, input_ids, position_ids, attention_mask, cache_positions,
               k_caches, v_caches):
    """One decode step: local logits (batch, vocab_per_rank); writes each layer's cache in place."""
    x, m, cos, sin, mask = regions.token_prologue(model, input_ids, position_ids, attention_mask, cache_positions)
    if reduce is not None:
        x = reduce(x)
    for layer, k_cache, v_cache in zip(model.layers, k_caches, v_caches):
        if reduce is None:
            x, m = regions.token_layer(layer, x, m, cos, sin, mask, k_cache, v_cache, cache_positions)
        else:
            x, a = regions.token_attention(layer, x, m, cos, sin, mask, k_cache, v_cache, cache_positions)
            x, m = regions.mlp(layer, x, reduce(a))
            m = reduce(m)
    return regions.epilogue(model, x, m, None)


GRANULARITIES = ("model", "layer", "collective")
"""What one compiled graph covers: the whole step, one decoder layer (TP 1), or the code between two
collectives (TP > 1). Layer and collective graphs are shared by every layer."""
DEFAULT_GRANULARITY = "layer"
"""At TP 1; measured in benchmarks/decode.py (see the module docstring)."""


def default_granularity(tp_degree: int) -> str:
    """The only choice at TP > 1 is to cut at the collectives."""
    return DEFAULT_GRANULARITY if tp_degree == 1 else "collective"


def _compile(fn):
    # dynamic=False: a static graph per shape, never a shape-generic one (bucketing's whole point).
    return torch.compile(fn, fullgraph=True, dynamic=False)


def configure_dynamo(graphs: int) -> None:
    """Room for every bucket's graph per compiled function, and an error instead of a silent fall
    back to eager if that is ever exceeded."""
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


@dataclass
class CompileStats:
    graphs: list[GraphStats] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    """Inductor/AOTAutograd cache counters since the model was wrapped (fxgraph_cache_hit, ...)."""

    def to_dict(self) -> dict:
        return {"graphs": [g.__dict__ for g in self.graphs],
                "compile_s": round(sum(g.first_call_s for g in self.graphs), 3), **self.counters}


class CompiledCausalLM:
    """Drop-in for ShardedCausalLM in workers.engine.generate: same call, bucketed shapes only."""

    def __init__(self, model: ShardedCausalLM, buckets: Buckets, *, granularity: str | None = None) -> None:
        self.model, self.buckets = model, buckets
        self.config, self.collectives, self.dtype = model.config, model.collectives, model.dtype
        tp1 = model.collectives.world_size == 1
        self.granularity = granularity or default_granularity(model.collectives.world_size)
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity {self.granularity!r} must be one of {', '.join(GRANULARITIES)}")
        if self.granularity != "collective" and not tp1:
            raise ValueError(f"granularity {self.granularity!r} needs TP 1: at TP > 1 the collectives run "
                             f"between compiled regions (granularity 'collective')")
        # Rotary tables for every position a bucket can hold, built now so no call rebuilds them
        # (a rebuilt table would be a new graph input and a recompile).
        model._ensure_rotary(buckets.max_seq_len)
        configure_dynamo(len(buckets.shapes()))
        self._reduce = None if tp1 else model.collectives.all_reduce_sum_
        if self.granularity == "model":
            self._regions = Regions()
            self._context, self._token = _compile(context_step), _compile(token_step)
        else:
            self._regions = Regions().compiled()
            self._context, self._token = context_step, token_step
        self._seen: set[tuple[str, int, int]] = set()
        self._stats = CompileStats()
        self._counters_at_start = _cache_counters()

    # ---- what engine.generate uses -------------------------------------------------------------
    def new_cache(self, batch: int, max_seq_len: int) -> KVCache:
        return self.model.new_cache(batch, max_seq_len)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache,
                 cache_positions: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 logit_index: torch.Tensor | None = None) -> torch.Tensor:
        """As ShardedCausalLM.forward, at bucketed shapes: a prefill (seq > 1) must start at slot 0."""
        batch, seq = input_ids.shape
        slots = cache.max_seq_len
        phase, length = ("context", seq) if seq > 1 else ("token", slots)
        self._check_shape(phase, batch, length, cache)
        if attention_mask is None:
            attention_mask = torch.ones(batch, slots, dtype=torch.bool)
        start = time.perf_counter()
        if phase == "context":
            if logit_index is None:
                logit_index = torch.tensor([seq - 1])
            if int(cache_positions[0]) != 0:
                raise ValueError("a compiled prefill starts at cache slot 0 (the prompt is the whole history)")
            local, ks, vs = self._context(self.model, self._regions, self._reduce, input_ids, position_ids,
                                          attention_mask, logit_index)
            for k_cache, v_cache, k, v in zip(cache.k, cache.v, ks, vs):
                k_cache[:, :, :seq].copy_(k)
                v_cache[:, :, :seq].copy_(v)
        else:
            local = self._token(self.model, self._regions, self._reduce, input_ids, position_ids, attention_mask,
                                cache_positions, cache.k, cache.v)
        logits = self.model.gather_logits(local)
        key = (phase, batch, length)
        if key not in self._seen:
            self._seen.add(key)
            self._stats.graphs.append(GraphStats(phase, batch, length, time.perf_counter() - start))
        return logits

    forward = __call__

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
        with torch.inference_mode():
            for i, (phase, batch, length) in enumerate(shapes):
                start = time.perf_counter()
                if phase == "context":
                    cache = self.new_cache(batch, self.buckets.token_bucket(length))
                    ids = torch.zeros(batch, length, dtype=torch.int64)
                    positions = torch.arange(length).repeat(batch, 1)  # contiguous, as the engine's
                    self(ids, positions, cache, torch.arange(length), None, torch.tensor([length - 1]))
                else:
                    cache = self.new_cache(batch, length)
                    ids = torch.zeros(batch, 1, dtype=torch.int64)
                    self(ids, torch.zeros(batch, 1, dtype=torch.int64), cache, torch.tensor([0]), None)
                if progress is not None:
                    progress(i + 1, len(shapes), (phase, batch, length), time.perf_counter() - start)

    def stats(self) -> CompileStats:
        now = _cache_counters()
        self._stats.counters = {k: now.get(k, 0) - self._counters_at_start.get(k, 0) for k in now}
        return self._stats


def _cache_counters() -> dict[str, int]:
    from torch._dynamo.utils import counters

    inductor, aot = counters["inductor"], counters["aot_autograd"]
    return {"dynamo_graphs": counters["stats"]["unique_graphs"],
            "fxgraph_cache_hit": inductor["fxgraph_cache_hit"], "fxgraph_cache_miss": inductor["fxgraph_cache_miss"],
            "fxgraph_cache_bypass": inductor["fxgraph_cache_bypass"],
            "autograd_cache_hit": aot["autograd_cache_hit"], "autograd_cache_miss": aot["autograd_cache_miss"]}
