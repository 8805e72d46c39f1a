"""Per-bucket Neuron graphs through neuronx-distributed's ModelBuilder (V2) — UNVERIFIED.

Written against the documented neuronx-distributed API (ModelBuilder(model).trace(args, tag=...)
once per bucket, .compile(compiler_workdir=...) -> NxDModel; NxDModel.set_weights, .to_neuron,
.save / NxDModel.load with start_rank and local_ranks_size; forward routes inputs to the graph whose
example shapes they match). No Neuron device exists where corelaunch is developed, so none of this
has run; it is kept behind the backend seam (workers/backends/neuron.py) and nothing else imports it.

The design differs from the CPU path (workers/compiled.py) where the device forces it:
- the KV cache lives on the device as the traced module's buffers, which neuronx-distributed keeps
  as state between calls: one cache of (largest batch bucket, kv_heads, largest token bucket,
  head_dim) per layer. Graphs for smaller buckets use its leading rows and slots (NxD Inference
  does the same), so every graph shares one set of state tensors. ModelBuilder keeps a buffer's
  update only when forward assigns the buffer a new tensor of the same shape and dtype (it aliases
  that output to the buffer); an in-place write into the buffer is not supported. So each step
  writes into a copy of every cache and assigns the copy back;
- the graphs are compiled for the plan's LNC (`--lnc`: neuronx-cc otherwise builds for trn2's
  default, 2, and a graph runs only at the LNC it was built for);
- a context-encoding graph writes slots [0, context) and attends over the prompt itself; a
  token-generation graph for bucket t writes one slot and attends over slots [0, t);
- each Ray actor drives one rank: the NxDModel is built with start_rank=rank, local_ranks_size=1,
  and holds only this rank's weights.
Compiled graphs are saved with NxDModel.save into the compile cache directory (a compiled-model
directory's cache/neuron-rank-N.pt) and loaded from there by later processes instead of compiling.
- every rank of a node compiles at once, each with up to ModelBuilder.compile's max_workers
  neuronx-cc jobs: left at None that is ThreadPoolExecutor's default, min(32, CPUs + 4), per rank,
  so a 32-rank node ran about a thousand compiler jobs on its CPUs. Each rank gets its share of the
  node's CPUs instead (compile_workers);
- a call names the graph it runs (NxDModel.forward's model_name, the bucket's trace tag) where the
  loaded model takes it, rather than leaving the choice to matching shapes, which the API reference
  says must be named when ambiguous.
"""

from __future__ import annotations

import inspect
import tempfile
from pathlib import Path

import torch
from torch import nn

from shardlib.buckets import Buckets
from shardlib.host_cpus import host_cpus
from workers.kv_cache import write_kv
from workers.model import ShardedCausalLM
from workers.step import EAGER, run_step

COMPILER_ARGS = "--enable-saturate-infinity --auto-cast=none --model-type=transformer -O1"
"""ModelBuilder.compile's documented defaults, which apply only when no compiler_args are given:
kept, with --lnc added (compiler_args)."""


def compiler_args(lnc: int) -> str:
    return f"{COMPILER_ARGS} --lnc={lnc}"


def compile_workers(node_cpus: int | None, ranks_on_node: int) -> int:
    """neuronx-cc jobs one rank runs at once: its share of the node's CPUs, at least one (every rank
    on the node compiles at the same time). node_cpus None: unknown, one job."""
    return max(1, (node_cpus or 1) // max(1, ranks_on_node))


def bucket_tag(phase: str, batch: int, length: int) -> str:
    """The name a bucket's graph is traced under and called by."""
    return f"{phase}-b{batch}-l{length}"


def names_graphs(nxd_model, tags: set[str]) -> bool:
    """Whether calls may name their bucket's graph: forward takes model_name and the loaded model
    lists every bucket's tag among its graphs (get_available_keys). NxDModel asserts a name agrees
    with the graph its shapes route to, so a name it does not key graphs by would fail every call
    that shape routing alone runs."""
    listed = getattr(nxd_model, "get_available_keys", None)
    return (takes_keyword(getattr(nxd_model, "forward", None), "model_name") and listed is not None
            and tags <= set(listed()))


def takes_keyword(function, name: str) -> bool:
    """Whether `function` accepts keyword `name` (by name or through **kwargs). False for None or a
    callable without a readable signature: NxDModel.load documents falling back to a TorchScript
    module when it cannot restore an NxDModel, whose forward takes only the traced inputs."""
    if function is None:
        return False
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


class NeuronStep(nn.Module):
    """One phase of one bucket as a traceable module: the model plus the device-resident KV cache.

    The step itself is workers/step.py's run_step, the same code the CPU runs; only where the KV
    cache lives differs (module buffers here, so the device keeps it between calls)."""

    def __init__(self, model: ShardedCausalLM, buckets: Buckets) -> None:
        super().__init__()
        self.model = model
        shape = (buckets.max_batch_size, model.layout.kv_heads_per_rank, buckets.max_seq_len, model.config.head_dim)
        for i in range(model.config.num_hidden_layers):
            self.register_buffer(f"k_cache_{i}", torch.zeros(shape, dtype=model.dtype), persistent=False)
            self.register_buffer(f"v_cache_{i}", torch.zeros(shape, dtype=model.dtype), persistent=False)
        model._ensure_rotary(buckets.max_seq_len)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                cache_positions: torch.Tensor, logit_index: torch.Tensor) -> torch.Tensor:
        """Logits (batch, vocab) at logit_index; a prefill from slot 0 when input_ids has more than
        one column (attention_mask then covers the prompt's own slots), else one decode step over
        the cache's first attention_mask.shape[1] slots."""
        batch, seq = input_ids.shape
        slots = attention_mask.shape[1]
        names = [f"{kind}_cache_{i}" for kind in "kv" for i in range(self.model.config.num_hidden_layers)]
        # Out of place (see the module docstring): the step writes into copies, assigned back below.
        caches = [getattr(self, name).clone() for name in names]
        views = [cache[:batch, :, :slots] for cache in caches]
        ks, vs = views[:len(views) // 2], views[len(views) // 2:]
        if seq > 1:
            logits, new_k, new_v = run_step(self.model, EAGER, input_ids, position_ids, attention_mask,
                                            cache_positions, None, logit_index)
            for k_cache, v_cache, k, v in zip(ks, vs, new_k, new_v):
                write_kv(k_cache, v_cache, cache_positions, k, v)
        else:
            logits, _, _ = run_step(self.model, EAGER, input_ids, position_ids, attention_mask, cache_positions,
                                    (ks, vs), logit_index)
        for name, cache in zip(names, caches):
            setattr(self, name, cache)  # same shape and dtype: ModelBuilder aliases it to the buffer
        return logits


class _DeviceCache:
    """What engine.generate needs of a KV cache when the cache itself lives on the device."""

    def __init__(self, batch: int, max_seq_len: int) -> None:
        self.batch, self.max_seq_len = batch, max_seq_len

    def reset(self) -> None:  # stale slots are masked; the device cache is never read past them
        pass


class NeuronCompiledModel:
    """Drop-in for ShardedCausalLM in workers.engine.generate on a Neuron device (UNVERIFIED)."""

    def __init__(self, model: ShardedCausalLM, buckets: Buckets, rank: int, world_size: int,
                 cache_dir: str | None, import_module, lnc: int = 1, ranks_on_node: int = 1) -> None:
        self.model, self.buckets = model, buckets
        self.config, self.collectives, self.dtype = model.config, model.collectives, model.dtype
        self._graphs: list[tuple[str, int, int]] = list(buckets.shapes())
        """Every bucket's graph, built now or loaded from this rank's saved file (a cache hit
        reported none: the stats said the rank had no graph)."""
        self._built = False
        """Whether the graphs were compiled here (False: loaded from the saved file)."""
        nxd = import_module("neuronx_distributed")
        missing = [name for name in ("ModelBuilder", "NxDModel") if not hasattr(nxd, name)]
        if missing:  # releases before the V2 tracing API: an AttributeError deep in the rank's load
            raise RuntimeError(f"the installed neuronx-distributed has no {' or '.join(missing)} at its top level "
                               f"(the tracing API these graphs are built with); install a newer release from the "
                               f"AWS Neuron pip repository, or run eagerly with --no-compile")
        workdir = Path(cache_dir) if cache_dir else Path(tempfile.mkdtemp(prefix="corelaunch-neuron-"))
        saved = workdir / f"neuron-rank-{rank}.pt"
        step = NeuronStep(model, buckets)
        if not saved.is_file():
            builder = nxd.ModelBuilder(step)
            for phase, batch, length in buckets.shapes():
                builder.trace(args=self._example(phase, batch, length), tag=bucket_tag(phase, batch, length))
            self._built = True
            # max_workers where the installed ModelBuilder takes it (documented for the V2 API)
            # the CPUs this process may use (a container's quota, an affinity), not the host's count
            workers = ({"max_workers": compile_workers(host_cpus(), ranks_on_node)}
                       if takes_keyword(builder.compile, "max_workers") else {})
            builder.compile(compiler_workdir=str(workdir / "neuronx-cc"), compiler_args=compiler_args(lnc),
                            **workers).save(str(saved))
        # Loaded back as this rank alone: one process drives one rank (and holds its weights only).
        self._nxd = nxd.NxDModel.load(str(saved), start_rank=rank, local_ranks_size=1)
        self._names_graphs = names_graphs(self._nxd, {bucket_tag(*shape) for shape in buckets.shapes()})
        """Whether calls name their bucket's graph (model_name); else NxDModel routes by shape."""
        weights = {name: tensor for name, tensor in step.state_dict().items() if "_cache_" not in name}
        self._nxd.set_weights([weights])
        self._nxd.to_neuron()

    def _example(self, phase: str, batch: int, length: int) -> tuple[torch.Tensor, ...]:
        """Inputs of one bucket's shape (their values do not matter to tracing)."""
        seq = length if phase == "context" else 1  # a prefill's mask covers its own slots only
        return (torch.zeros(batch, seq, dtype=torch.int64), torch.zeros(batch, seq, dtype=torch.int64),
                torch.ones(batch, length, dtype=torch.bool), torch.arange(seq), torch.tensor([seq - 1]))

    def new_cache(self, batch: int, max_seq_len: int, long_lived: bool = False) -> _DeviceCache:
        return _DeviceCache(batch, max_seq_len)  # the cache lives on the device, inside the graphs

    def __call__(self, input_ids, position_ids, cache, cache_positions, attention_mask=None, logit_index=None):
        batch, seq = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(batch, cache.max_seq_len, dtype=torch.bool)
        if logit_index is None:
            logit_index = torch.tensor([seq - 1])
        if seq > 1:  # a prefill graph is keyed by its context bucket alone
            attention_mask = attention_mask[:, :seq]
        inputs = (input_ids, position_ids, attention_mask, cache_positions, logit_index)
        if not self._names_graphs:
            return self._nxd(*inputs)
        phase, length = ("context", seq) if seq > 1 else ("token", attention_mask.shape[1])
        return self._nxd(*inputs, model_name=bucket_tag(phase, batch, length))

    forward = __call__

    def stats(self):
        from workers.compiled import CompileStats, GraphStats

        return CompileStats(graphs=[GraphStats(p, b, n, 0.0, compiled=self._built) for p, b, n in self._graphs])
