"""The planner: prove a tensor-parallel layout fits before any process starts.

`plan(config, instance=..., tp=...)` is pure arithmetic on a ModelConfig and the instance table: no
Ray, no tensors, well under a millisecond per TP degree, so even Llama-3.1-405B plans instantly.
Every rule is checked and every failure is reported (not just the first), each message naming the
values, the rule and the ways out. Rules and their error codes (the facts behind them: the README's
"Neuron facts the planner encodes"):

- heads_not_divisible:   num_attention_heads % tp != 0 (unless pad_q_heads pads Q heads).
- kv_heads_incompatible: an explicit kv_strategy that cannot split the KV heads at this degree.
- insufficient_memory:   a rank's weight shard plus its KV cache (plus, on `cpu`, its process,
                         RANK_PROCESS_BYTES, and with float32 weights the largest matrix it packs:
                         MemoryEstimate) exceed the memory of the cores it drives (its GPU on a gpu
                         node), less RESERVE_FRACTION (on `cpu`: the ranks of one node against its RAM).
- unsupported_tp_degree: the ranks per node are not a degree NxD Inference supports on the family,
                         a neuron TP 4 group spans nodes (NXD_LOCAL_TP_DEGREE), or TP 64 at LNC 1
                         on trn2 (TRN2_LNC1_SPLIT_TP).
- not_enough_cores:      TP x cores per rank exceeds the NeuronCores (or GPUs) of the nodes.
- invalid_lnc:           LNC other than 1 or 2, or LNC 2 where the hardware has no LNC 2.
- moe_sharding_incompatible: mixture-of-experts models: the asked moe_sharding breaks its rule at
                         this degree (expert_parallel: experts % tp; tensor_parallel of DBRX's fused
                         expert tensors: expert intermediate % tp), or, with none asked, both do
                         (shardlib/expert_sharding.py; the planner otherwise picks the one with the
                         smaller shard, tensor_parallel on a tie).
- no_valid_tp_degree:    tp="auto" and no degree passes every rule (followed by the errors of the
                         degree that fails the fewest).

Per-rank weights count each rank's real shard as shardlib.sharding cuts it: Q/O by whole heads,
K/V by the strategy's KV heads (replication and MHA conversion hold copies, so they cost more),
MLP (and, under tensor_parallel experts, every expert) column/row split with padding to a multiple
of TP, under expert_parallel experts / TP whole experts per rank, vocabulary split padded to a
multiple of TP, norms and the MoE router replicated.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

from shardlib.expert_sharding import (EXPERT_PARALLEL, MOE_SHARDINGS, check_moe_sharding_name,
                                      default_moe_sharding, expert_elements_per_rank, moe_sharding_problem)
from shardlib.instances import CPU_TARGET, GIB, NEURON_FAMILIES, NEURON_INSTANCES, InstanceType, get_instance
from shardlib.families import layer_norm_elements
from shardlib.model_config import DTYPE_BYTES, ModelConfig, normalize_dtype
from shardlib.param_shapes import LM_HEAD
from shardlib.quantization import PLANNER_DTYPE, UNQUANTIZABLE_MODEL_TYPES, Quantization, normalize_quant_dtype
from shardlib.sharding import FUSED_QKV_MODEL_TYPES
from shardlib.quantized_sizes import kv_dtype_name, planned_quantization, weight_bytes
from shardlib.positive_int import is_non_negative_int, positive_int

RESERVE_FRACTION = 0.10
# Why 10%: the Neuron runtime, the loaded compiled graphs (one per bucket) and their scratchpad for
# activations live in the same device memory as the weights and the KV cache; on the cpu target the
# OS, Python and torch of every rank share the RAM. NxD Inference's own sizing examples (8B in
# 16 GB, 70B in 148 GB) leave about this much headroom. It is a heuristic, not a measurement: very
# large batch x seq_len prefill activations can need more.
RESERVE_REASON = ("10% of each rank's memory is kept free for the runtime, the compiled graphs and "
                  "their activation scratchpad (RAM for the OS, the driver and Ray on cpu)")

RANK_PROCESS_BYTES = 384 * 2**20
"""What a cpu rank's process holds beyond its weights, KV cache and packing scratch (Python, torch,
Ray's worker, the compiled graphs): measured 190-200 MiB eager and about 330 MiB compiled with
SmolLM2 (README Measured). On the cpu target it is one part of each rank's memory (MemoryEstimate),
so the plan's verdict is the launch's: a launch counts the same bytes before it starts the ranks,
and a plan without them called layouts valid that every launch then refused. The 10% reserve
stays the share of the OS, the driver and Ray. Device targets leave it out: there the estimate is
the device's memory, and the process lives in the host's RAM."""

DEFAULT_MAX_SEQ_LEN = 4096
"""seq_len when none is given: min(max_position_embeddings, 4096). Long-context checkpoints
(131072 positions) would otherwise size a KV cache nobody asked for; 4096 is the sequence length
of NxD Inference's and optimum-neuron's usual compiled configurations."""

KV_STRATEGIES = ("shard", "replicate_to_tp", "convert_to_mha")
_LOWER_DTYPES = ("bfloat16", "float8_e4m3")  # suggested in this order when memory runs out
_MAX_SUGGESTED_NODES = 8
_NOTHING_FITS = ("none found with up to {nodes} nodes{instances} and the lower-precision dtypes; a smaller "
                 "seq_len or {rows} only shrinks the KV cache")
QUANTIZE_DTYPE = {"float8_e4m3": "f8e4m3"}
"""The 1-byte dtypes a way out names, as `corelaunch quantize --dtype` spells them: a launch's --dtype
takes the compute dtypes alone, so 1-byte weights come from a checkpoint quantize writes."""


NXD_LOCAL_TP_DEGREE = 4
"""neuronx-distributed's parallel_state lays out TP 4 as a special case (trn1's ring of four cores
within a node): its group mesh divides LOCAL_WORLD_SIZE by 4, so the four ranks must be on one node."""

TRN2_LNC1_SPLIT_TP = 64
"""A TP degree neuronx-distributed (0.19) does not build as one group on trn2 at LNC 1: its
parallel_state picks a ring layout for a 64-rank world at LNC 1 on trn2 that makes two TP groups of
32 ranks, so a model sharded 64 ways would not match the groups it runs in. LNC 2 (trn2's default)
or TP 32 are the layouts it builds as asked."""

@dataclass(frozen=True)
class PlanIssue:
    """One failed rule."""

    code: str
    """Machine-readable rule name (see the module docstring)."""
    message: str
    """The values involved, the rule, and the ways out."""

    def to_dict(self) -> dict:
        return {"code": self.code, "message": self.message}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank needs and has (every rank holds the same padded shard sizes)."""

    weight_bytes_per_rank: int
    kv_cache_bytes_per_rank: int
    """2 x layers x batch x seq_len x kv_heads_per_rank x head_dim x bytes(kv_cache_dtype)."""
    capacity_bytes_per_rank: int
    """Memory of the cores a rank drives (cpu: its share of one node's RAM, which holds up to
    ceil(tp / nodes) ranks)."""
    capacity_bytes_per_core: int
    """Per physical NeuronCore (cpu: host RAM / CPU cores)."""
    reserve_fraction: float
    model_weight_bytes: int
    """The unsharded checkpoint at the plan's dtype (what one TP-1 rank would hold)."""
    kv_cache_dtype: str
    tp_degree: int
    packing_scratch_bytes_per_rank: int = 0
    """On the cpu target with float32 weights, the largest matrix a rank repacks as column panels
    (workers/packed_weight.py): while loading, each matrix's panels exist beside the original for a
    moment, and a prefill of 1024 rows or more unpacks one matrix into a temporary while it runs.
    0 elsewhere, and where a rank packs nothing (a dense model quantized with its LM head)."""
    process_bytes_per_rank: int = 0
    """On the cpu target, RANK_PROCESS_BYTES: the rank's own process, in the same RAM as its
    tensors. 0 on devices (the process is in the host's RAM, not the device's)."""

    @property
    def parts(self) -> tuple[tuple[str, int], ...]:
        """What a rank's total is made of, named as messages name it (packing scratch only where a
        rank packs, the rank process only where it shares the memory counted)."""
        parts = (("weights", self.weight_bytes_per_rank), ("KV cache", self.kv_cache_bytes_per_rank))
        if self.packing_scratch_bytes_per_rank:
            parts += (("packing scratch", self.packing_scratch_bytes_per_rank),)
        if self.process_bytes_per_rank:
            parts += (("rank process", self.process_bytes_per_rank),)
        return parts

    @property
    def fixed_bytes_per_rank(self) -> int:
        """Everything but the KV cache: what a smaller seq_len or fewer rows leave as it is."""
        return self.total_bytes_per_rank - self.kv_cache_bytes_per_rank

    @property
    def total_bytes_per_rank(self) -> int:
        return sum(n for _, n in self.parts)

    @property
    def usable_bytes_per_rank(self) -> int:
        return int(self.capacity_bytes_per_rank * (1 - self.reserve_fraction))

    @property
    def total_bytes_all_ranks(self) -> int:
        return self.total_bytes_per_rank * self.tp_degree

    def to_dict(self) -> dict:
        return {
            "weight_bytes_per_rank": self.weight_bytes_per_rank,
            "kv_cache_bytes_per_rank": self.kv_cache_bytes_per_rank,
            "packing_scratch_bytes_per_rank": self.packing_scratch_bytes_per_rank,
            "process_bytes_per_rank": self.process_bytes_per_rank,
            "total_bytes_per_rank": self.total_bytes_per_rank,
            "capacity_bytes_per_rank": self.capacity_bytes_per_rank,
            "capacity_bytes_per_core": self.capacity_bytes_per_core,
            "usable_bytes_per_rank": self.usable_bytes_per_rank,
            "reserve_fraction": self.reserve_fraction,
            "reserve_reason": RESERVE_REASON,
            "total_bytes_all_ranks": self.total_bytes_all_ranks,
            "model_weight_bytes": self.model_weight_bytes,
            "kv_cache_dtype": self.kv_cache_dtype,
        }


@dataclass(frozen=True)
class PaddingWaste:
    """What padding Q heads with zero heads costs (pad_q_heads=True)."""

    extra_q_heads: int
    extra_qo_weight_bytes: int
    """Zero rows of q_proj (and its bias) plus zero columns of o_proj, all layers, all ranks."""
    extra_qo_fraction: float
    """extra_qo_weight_bytes over the real Q/O weight bytes."""
    extra_model_fraction: float
    """extra_qo_weight_bytes over the whole checkpoint."""
    extra_kv_heads: int = 0
    """Zero KV heads beside the zero Q heads (convert_to_mha only: one KV head per Q head)."""
    extra_kv_weight_bytes: int = 0
    """Their k_proj and v_proj rows (and biases), all layers, all ranks."""
    extra_kv_cache_bytes: int = 0
    """Their KV cache, all layers, all ranks, at the plan's rows and seq_len."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Plan:
    """The verdict on one layout, with the numbers behind it. Build it with plan()."""

    valid: bool
    tp_degree: int
    """The degree checked: the requested one, auto's pick, or (auto, none valid) the representative."""
    tp_requested: int | str
    instance: str
    family: str
    nodes: int
    lnc: int
    """The LNC asked for (or the instance default); an invalid one is reported, checks use the default."""
    cores_per_rank: int
    """Physical NeuronCores a rank drives (= LNC; one logical core, one of Ray's `neuron_cores`); 1 on cpu."""
    ranks_per_node: int
    logical_cores_per_node: int | None
    """None when the node's core count is unknown (see InstanceType.core_count_known)."""
    dtype: str
    batch_size: int
    seq_len: int
    kv_strategy: str | None
    """"shard", "replicate_to_tp" or "convert_to_mha"; None when no strategy fits the degree."""
    q_heads_per_rank: int | None
    kv_heads_per_rank: int | None
    padded_q_heads: int | None
    """With pad_q_heads: Q heads after padding to ceil(H/T)*T; None otherwise."""
    padding_waste: PaddingWaste | None
    memory: MemoryEstimate
    moe_sharding: str | None
    """Mixture-of-experts models: "tensor_parallel" or "expert_parallel" (None: dense, or none fits)."""
    valid_tp_degrees: tuple[int, ...]
    """Every candidate degree on this instance and node count that passes every rule."""
    errors: tuple[PlanIssue, ...]
    warnings: tuple[str, ...]
    config: ModelConfig = field(repr=False, compare=False)
    serving_rows: int = 0
    """KV cache rows a serving loop holds besides batch_size (plan()'s serving_rows)."""

    @property
    def error_codes(self) -> tuple[str, ...]:
        return tuple(issue.code for issue in self.errors)

    def layout(self):
        """The shardlib.sharding.ShardLayout of this plan (ValueError when the plan is invalid)."""
        if not self.valid:
            raise ValueError(f"no layout for an invalid plan (errors: {', '.join(self.error_codes)}); "
                             f"fix the errors `corelaunch plan` reports first")
        from shardlib.sharding import ShardLayout

        return ShardLayout.for_model(self.config, self.tp_degree, self.kv_strategy,
                                     pad_q_heads=self.padded_q_heads is not None, moe_sharding=self.moe_sharding)

    def _dtypes_dict(self) -> dict:
        """What "dtype" alone leaves out, as the text report says it ("float32, int8 weights, KV cache
        float8_e4m3"): the compute dtype of the unquantized tensors, and the weights' quantization (a
        quantized checkpoint's, or the one a 1-byte dtype stands for; None: unquantized). The KV
        cache's dtype is memory.kv_cache_dtype."""
        quantization, compute = planned_quantization(self.config, self.dtype, self.family in NEURON_FAMILIES)
        weights = None if quantization is None else {
            "dtype": quantization.dtype, "granularity": quantization.granularity, "modules": quantization.modules}
        return {"compute_dtype": compute, "weights_quantization": weights}

    def to_dict(self) -> dict:
        cfg = self.config
        return {
            "valid": self.valid,
            "model": {"model_type": cfg.model_type, "num_hidden_layers": cfg.num_hidden_layers,
                      "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_attention_heads,
                      "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
                      "vocab_size": cfg.vocab_size, "num_local_experts": cfg.num_local_experts,
                      "param_count": cfg.param_count()},
            "tp_degree": self.tp_degree, "tp_requested": self.tp_requested,
            "instance": self.instance, "family": self.family, "nodes": self.nodes, "lnc": self.lnc,
            "cores_per_rank": self.cores_per_rank, "ranks_per_node": self.ranks_per_node,
            "logical_cores_per_node": self.logical_cores_per_node,
            "dtype": self.dtype, **self._dtypes_dict(),
            "batch_size": self.batch_size, "serving_rows": self.serving_rows, "seq_len": self.seq_len,
            "kv_strategy": self.kv_strategy, "q_heads_per_rank": self.q_heads_per_rank,
            "kv_heads_per_rank": self.kv_heads_per_rank, "padded_q_heads": self.padded_q_heads,
            "moe_sharding": self.moe_sharding,
            "padding_waste": self.padding_waste.to_dict() if self.padding_waste else None,
            "memory": self.memory.to_dict(),
            "valid_tp_degrees": list(self.valid_tp_degrees),
            "errors": [issue.to_dict() for issue in self.errors],
            "warnings": list(self.warnings),
        }


# ---- normalized request and the per-degree check ------------------------------------------------
@dataclass(frozen=True)
class _Request:
    config: ModelConfig
    inst: InstanceType
    nodes: int
    lnc: int
    """Effective LNC: the requested one, or the instance default when the request is invalid."""
    lnc_requested: int
    lnc_problem: str | None
    batch: int
    seq_len: int
    dtype: str
    kv_override: str | None
    pad: bool
    kv_cache_dtype: str | None = None
    """The planner's name of an fp8 KV cache (shardlib/quantized_sizes.py); None: the compute dtype."""
    moe_override: str | None = None
    serving_rows: int = 0
    """KV cache rows held besides the batch's (a serving loop's sequence slots and scratch row)."""

    @property
    def cache_rows(self) -> int:
        return self.batch + self.serving_rows

    def rows_text(self) -> str:
        return kv_rows_text(self.batch, self.serving_rows)

    def nothing_fits(self) -> str:
        """The ways-out text when no change the planner tries fits: what else shrinks the cache
        (no batch_size to lower where there is no static batch)."""
        rows = "batch_size" if self.batch else "fewer serving rows (--max-num-seqs)"
        # other instances are tried for Neuron targets alone (_ways_out)
        instances = ", the known instances" if self.inst.is_neuron else ""
        return _NOTHING_FITS.format(nodes=_MAX_SUGGESTED_NODES, instances=instances, rows=rows)


@dataclass(frozen=True)
class _Check:
    tp: int
    codes: tuple[str, ...]
    q_heads_total: int  # after padding (== H without padding)
    q_per_rank: int
    kv_strategy: str | None
    kv_problem: str | None
    kv_per_rank: int
    ranks_per_node: int
    memory: MemoryEstimate
    moe_sharding: str | None = None
    moe_problem: str | None = None


def _choose_moe_sharding(req: _Request, tp: int) -> tuple[str | None, str | None]:
    """(the experts' sharding at this degree, why it cannot be used or None)."""
    cfg = req.config
    if not cfg.is_moe:
        return None, None
    if req.moe_override:
        return req.moe_override, moe_sharding_problem(cfg.model_type, cfg.num_local_experts,
                                                      cfg.intermediate_size, tp, req.moe_override)
    chosen = default_moe_sharding(cfg, tp)
    if chosen:
        return chosen, None
    return MOE_SHARDINGS[0], "; ".join(moe_sharding_problem(cfg.model_type, cfg.num_local_experts,
                                                            cfg.intermediate_size, tp, s) for s in MOE_SHARDINGS)


def _weight_elements(cfg: ModelConfig, tp: int, q_per_rank: int, kv_per_rank: int,
                     moe_sharding: str | None = None) -> int:
    """Parameters one rank holds (see the module docstring for the split of each tensor)."""
    h, d = cfg.hidden_size, cfg.head_dim
    vocab = math.ceil(cfg.vocab_size / tp) * h
    embed = vocab if cfg.tie_word_embeddings else 2 * vocab  # tied: one tensor is both
    attn = 2 * q_per_rank * d * h + 2 * kv_per_rank * d * h  # q, o + k, v
    if cfg.attention_bias:
        attn += (q_per_rank + 2 * kv_per_rank) * d
    if cfg.output_bias:
        attn += h  # replicated: added once after the all-reduce
    mlp = 3 * h * math.ceil(cfg.intermediate_size / tp)  # gate/up (w1/w3) columns, down (w2) rows
    if cfg.mlp_bias:
        mlp += 2 * math.ceil(cfg.intermediate_size / tp) + h
    if cfg.is_moe:  # experts + router
        mlp = expert_elements_per_rank(cfg, tp, moe_sharding or "tensor_parallel")
    return embed + cfg.num_hidden_layers * (attn + mlp + layer_norm_elements(cfg)) + h


def _packing_scratch_elements(cfg: ModelConfig, tp: int, q_per_rank: int, kv_per_rank: int,
                              quantization: Quantization | None) -> int:
    """The largest matrix one rank packs (0 when it packs none): the vocabulary shard (the LM head, or
    the tied table that is both) unless it is quantized, a mixture-of-experts router, and for dense
    float32 layers the attention and MLP matrices, fused or not (the planner is not told whether
    projections are fused, so it counts the larger). Quantized weights (QuantizedWeight) and
    mixture-of-experts expert stacks are not packed (workers/packed_weight.py)."""
    h, d = cfg.hidden_size, cfg.head_dim
    largest = cfg.num_local_experts * h  # the router: float32, replicated, packed (0 for a dense model)
    if not _lm_head_is_quantized(cfg, quantization):
        largest = max(largest, math.ceil(cfg.vocab_size / tp) * h)
    if quantization is None:
        largest = max(largest, (q_per_rank + 2 * kv_per_rank) * d * h, h * q_per_rank * d)
        if not cfg.is_moe:
            largest = max(largest, 2 * math.ceil(cfg.intermediate_size / tp) * h)
    return largest


def _lm_head_is_quantized(cfg: ModelConfig, quantization: Quantization | None) -> bool:
    # A tied LM head is the embedding table (quantized with `+embed`); an untied one is quantized
    # with `+lm_head`. Either way it is then a QuantizedWeight, which is never packed.
    if quantization is None:
        return False
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else LM_HEAD
    return quantization.is_quantized(head, cfg.tie_word_embeddings)


def _kv_cache_dtype(config: ModelConfig, dtype: str, on_neuron: bool) -> str:
    # The cache is in the compute dtype (a quantized model's: shardlib/quantized_sizes.py) unless
    # kv_cache_dtype asks for fp8.
    return planned_quantization(config, dtype, on_neuron)[1]


def _check(req: _Request, tp: int) -> _Check:
    from shardlib.sharding import default_kv_strategy, kv_strategy_problem

    cfg, inst = req.config, req.inst
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    codes = []
    if req.lnc_problem:
        codes.append("invalid_lnc")
    heads_total = math.ceil(heads / tp) * tp if req.pad else heads
    if heads_total % tp:
        codes.append("heads_not_divisible")
    q_per_rank = math.ceil(heads_total / tp)

    strategy = req.kv_override or _value(default_kv_strategy(heads_total, kv_heads, tp))
    kv_problem = kv_strategy_problem(strategy, heads_total, kv_heads, tp) if strategy else None
    # convert_to_mha's only condition is the heads rule, already reported above
    if kv_problem and strategy != "convert_to_mha":
        codes.append("kv_heads_incompatible")
    if strategy and not kv_problem:
        kv_per_rank = {"shard": kv_heads // tp, "replicate_to_tp": 1,
                       "convert_to_mha": heads_total // tp}[strategy]
    else:
        kv_per_rank = max(1, math.ceil(kv_heads / tp))  # an estimate: the layout does not exist

    moe_sharding, moe_problem = _choose_moe_sharding(req, tp)
    if moe_problem:
        codes.append("moe_sharding_incompatible")

    per_node = ranks_per_node(tp, req.nodes)
    supported = inst.supported_tp_degrees(req.lnc)
    if supported is not None and (tp % req.nodes or per_node not in supported):
        codes.append("unsupported_tp_degree")
    elif inst.is_neuron and tp == NXD_LOCAL_TP_DEGREE and req.nodes > 1:
        codes.append("unsupported_tp_degree")
    elif _splits_on_trn2_lnc1(inst, req.lnc, tp):
        codes.append("unsupported_tp_degree")
    if inst.limits_ranks_per_node and per_node > inst.logical_cores(req.lnc):
        codes.append("not_enough_cores")

    kv_dtype = req.kv_cache_dtype or _kv_cache_dtype(req.config, req.dtype, inst.is_neuron)
    # The cpu backend packs float32 matrices (workers/packed_weight.py); no other target packs.
    quantization, compute = planned_quantization(cfg, req.dtype, inst.is_neuron)
    packs = inst.family == "cpu" and compute == "float32"
    kv_bytes = (2 * cfg.num_hidden_layers * req.cache_rows * req.seq_len * kv_per_rank * cfg.head_dim
                * DTYPE_BYTES[kv_dtype])
    if inst.per_rank_memory:
        per_core = inst.memory_per_physical_core
        capacity = per_core * req.lnc
    else:
        per_core = inst.memory_bytes // inst.physical_cores
        capacity = inst.memory_bytes // per_node  # each node's RAM is its own: never pooled
    memory = MemoryEstimate(
        weight_bytes_per_rank=weight_bytes(cfg, req.dtype, _weight_elements(cfg, tp, q_per_rank, kv_per_rank,
                                                                            moe_sharding),
                                           tp, q_per_rank, kv_per_rank, inst.is_neuron,
                                           expert_parallel=moe_sharding == EXPERT_PARALLEL),
        kv_cache_bytes_per_rank=kv_bytes, capacity_bytes_per_rank=capacity,
        capacity_bytes_per_core=per_core, reserve_fraction=RESERVE_FRACTION,
        model_weight_bytes=weight_bytes(cfg, req.dtype, _weight_elements(cfg, 1, heads, kv_heads), 1, heads,
                                        kv_heads, inst.is_neuron),
        kv_cache_dtype=kv_dtype, tp_degree=tp,
        packing_scratch_bytes_per_rank=(_packing_scratch_elements(cfg, tp, q_per_rank, kv_per_rank, quantization)
                                        * DTYPE_BYTES["float32"] if packs else 0),
        process_bytes_per_rank=RANK_PROCESS_BYTES if inst.family == "cpu" else 0)
    # On cpu the capacity is a rank's share of its node's RAM (the fullest node decides), so this
    # is the node's check; per rank, in whole bytes, as the launcher divides this host's RAM.
    fits = memory.total_bytes_per_rank <= memory.usable_bytes_per_rank
    if not fits:
        codes.append("insufficient_memory")
    return _Check(tp=tp, codes=tuple(codes), q_heads_total=heads_total, q_per_rank=q_per_rank,
                  kv_strategy=strategy, kv_problem=kv_problem, kv_per_rank=kv_per_rank,
                  ranks_per_node=per_node, memory=memory, moe_sharding=moe_sharding,
                  moe_problem=moe_problem)


def _splits_on_trn2_lnc1(inst: InstanceType, lnc: int, tp: int) -> bool:
    """Whether neuronx-distributed would build `tp` as two groups on this trn2 (TRN2_LNC1_SPLIT_TP)."""
    return inst.family == "trn2" and lnc == 1 and tp == TRN2_LNC1_SPLIT_TP


def _value(strategy) -> str | None:
    return None if strategy is None else strategy.value


def _candidates(req: _Request) -> list[int]:
    supported = req.inst.supported_tp_degrees(req.lnc)
    if supported is not None:
        return [d * req.nodes for d in supported]
    heads = req.config.num_attention_heads  # cpu: any degree; these are the ones heads allow
    # (with padding every degree up to the head count is a candidate, and each is listed)
    return list(range(1, heads + 1)) if req.pad else list(divisors(heads))


@functools.lru_cache(maxsize=32)
def ranks_per_node(tp: int, nodes: int) -> int:
    """The most ranks of a TP group one node holds, and so the ranks whose memory the plan counts
    against one node: ceil(tp / nodes), in integers (a float ceil is wrong past 2**53)."""
    return -(-tp // max(nodes, 1))


def divisors(n: int) -> tuple[int, ...]:
    """The divisors of n in increasing order, in O(sqrt(n)) steps: planning time does not grow with
    the head count (a loop over every degree took minutes at 10**8 heads)."""
    small, large = [], []
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
    return tuple(small + large[::-1])


def _valid_degrees(req: _Request) -> list[int]:
    return [t for t in _candidates(req) if not _check(req, t).codes]


# ---- messages -----------------------------------------------------------------------------------
def _fmt_list(values) -> str:
    return ", ".join(str(v) for v in values) if values else "none"


def format_bytes(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def _parts(mem: MemoryEstimate) -> str:
    return " + ".join(f"{name} {format_bytes(n)}" for name, n in mem.parts)


def _ways_out(req: _Request, check: _Check) -> list[str]:
    """Concrete changes under which a degree passes every rule (memory-related ones first)."""
    if req.lnc_problem:
        fixed = _valid_degrees(dataclasses.replace(req, lnc_problem=None))
        return [f"omit lnc (the default is {req.inst.default_lnc}); degrees that work then: "
                f"{_fmt_list(fixed)}"]
    ways = []
    for lnc in req.inst.allowed_lncs:  # trn2 at LNC 1 has half the memory per rank of its default LNC 2
        fits = _valid_degrees(dataclasses.replace(req, lnc=lnc, lnc_requested=lnc)) if lnc != req.lnc else []
        if check.tp in fits:  # named where it keeps the degree asked (other degrees have their own way out)
            default = "the default, " if lnc == req.inst.default_lnc else ""
            ways.append(f"--lnc {lnc} ({default}{format_bytes(req.inst.memory_per_logical_core(lnc))} per logical "
                        f"core) fits at tp {_fmt_list(fits)}")
    mem = check.memory
    per_token = mem.kv_cache_bytes_per_rank // (req.cache_rows * req.seq_len)  # KV bytes per position of one sequence
    if "insufficient_memory" in check.codes:
        # what the KV cache may take: a rank's usable memory (on cpu its share of the node's RAM)
        # less all that a smaller cache leaves as it is (on cpu the rank process too)
        room = mem.usable_bytes_per_rank - mem.fixed_bytes_per_rank
        if room > 0 and per_token:
            longest = room // (per_token * req.cache_rows)
            limit = req.config.max_position_embeddings  # a longer one fits the memory but not the model
            if longest >= 2:  # seq_len 1 is refused (a prompt token and a generated one): never offered
                ways.append(f"a smaller seq_len (at most {min(longest, limit)} at {req.rows_text()}"
                            + (", the model's max_position_embeddings)" if longest >= limit else ")"))
            batch_fits = room // (per_token * req.seq_len) - req.serving_rows
            serving_fits = room // (per_token * req.seq_len) - req.batch  # rows, the scratch row included
            if req.serving_rows and 2 <= serving_fits < req.serving_rows:
                beside = f" at batch_size {req.batch}" if req.batch else ""
                ways.append(f"fewer serving rows (--max-num-seqs at most {serving_fits - 1}{beside})")
            if req.batch > 1 and batch_fits >= 1:
                ways.append(f"a smaller batch_size (at most {batch_fits}"
                            + (f" besides the {req.serving_rows} serving rows)" if req.serving_rows else ")"))
    if check.moe_sharding is not None and req.moe_override is None:
        # the other sharding of the experts: with 1-byte weights expert_parallel holds fewer scales
        # (each rank's experts' rows, not every expert's down rows), so a plan refused at the
        # default tensor_parallel (equal elements: NxD's choice) fits with it and was never told
        other = next(s for s in MOE_SHARDINGS if s != check.moe_sharding)
        fits = _valid_degrees(dataclasses.replace(req, moe_override=other))
        if check.tp in fits:
            ways.append(f"--moe-sharding {other} fits at tp {_fmt_list(fits)}")
    for dtype in _LOWER_DTYPES:
        # A 1-byte dtype quantizes the weights: not for DBRX, and already done for a quantized
        # checkpoint (whose planning refuses any 1-byte dtype but its own: a crash here before).
        one_byte_out = DTYPE_BYTES[dtype] == 1 and (req.config.model_type in UNQUANTIZABLE_MODEL_TYPES
                                                     or req.config.quantization is not None)
        if DTYPE_BYTES[dtype] < DTYPE_BYTES[req.dtype] and not one_byte_out:
            fits = _valid_degrees(dataclasses.replace(req, dtype=dtype))
            if fits:
                ways.append(_lower_dtype_way(dtype, fits))
                break
    ways += _node_count_ways(req)
    if req.inst.is_neuron:
        bigger = []
        for other in sorted(NEURON_INSTANCES.values(), key=lambda i: i.memory_bytes):
            if other.name != req.inst.name:
                alt = dataclasses.replace(req, inst=other, lnc=other.default_lnc, lnc_problem=None)
                fits = _valid_degrees(alt)
                if fits:
                    bigger.append(f"{other.name} (tp {fits[0]})")
        if bigger:
            ways.append(f"another instance: {', '.join(bigger[:3])}")
    return ways


def _node_count_ways(req: _Request) -> list[str]:
    """The nearest node counts (more, and fewer where none works at this count) with degrees that
    pass every rule."""
    ways, here = [], set(_valid_degrees(req))
    for nodes in range(req.nodes + 1, _MAX_SUGGESTED_NODES + 1):
        # the degrees more nodes make work: one that works already is "a degree that fits"
        fits = [tp for tp in _valid_degrees(dataclasses.replace(req, nodes=nodes)) if tp not in here]
        if fits:
            ways.append(f"more nodes: --nodes {nodes} fits at tp {_fmt_list(fits)}")
            break
    # Fewer nodes can fit where this count cannot: no supported degree splits evenly over it
    # (3 trn1 nodes for a 64-head model), which more nodes would not cure either.
    for nodes in range(req.nodes - 1, 0, -1) if not _valid_degrees(req) else ():
        fits = _valid_degrees(dataclasses.replace(req, nodes=nodes))
        if fits:
            ways.append(f"fewer nodes: --nodes {nodes} fits at tp {_fmt_list(fits)}")
            break
    return ways


def _lower_dtype_way(dtype: str, fits: list[int]) -> str:
    """A lower dtype as a way out. A 2-byte one is a --dtype every command takes; 1-byte weights are
    a quantized checkpoint (generate's and serve's --dtype offer float32, bfloat16 and float16 alone),
    which `corelaunch plan --dtype float8_e4m3` plans and `corelaunch quantize` writes."""
    if dtype not in QUANTIZE_DTYPE:
        return f"a lower-precision dtype: {dtype} fits at tp {_fmt_list(fits)}"
    return (f"1-byte weights: {dtype} fits at tp {_fmt_list(fits)}; write them with `corelaunch quantize "
            f"--dtype {QUANTIZE_DTYPE[dtype]} --out QDIR` and launch QDIR (--model QDIR)")


def _fits_memory_at_lnc(req: _Request, tp: int, lnc: int) -> bool:
    """Whether degree `tp` passes the memory check at `lnc` (each rank's memory is its cores')."""
    return "insufficient_memory" not in _check(dataclasses.replace(req, lnc=lnc, lnc_requested=lnc), tp).codes


def _one_node_way_out(tp: int, req: _Request) -> str:
    """The way out for a neuron TP group that must sit on one node: a larger instance of the same
    family only where the family supports that degree at all (trn1 has no TP 4: its larger instance
    was named, then refused), else the families that do."""
    family = req.inst.family
    if tp in (req.inst.supported_tp_degrees(req.lnc) or (tp,)):
        one_node = "--nodes 1 on " if req.nodes > 1 else ""
        larger = sorted((i for i in NEURON_INSTANCES.values() if i.family == family
                         and tp <= i.logical_cores(req.lnc)), key=lambda i: i.physical_cores)
        named = f" ({_fmt_list([i.name for i in larger])})" if larger else ""
        return f"use {one_node}an instance with {tp * req.lnc} or more NeuronCores{named}, or another degree"
    others = sorted({i.name for i in NEURON_INSTANCES.values() if i.family != family
                     and tp in (i.supported_tp_degrees(i.default_lnc) or ())
                     and tp <= i.logical_cores(i.default_lnc)})
    elsewhere = f" (instances that run tp {tp}: {_fmt_list(others)})" if others else ""
    return f"{family} supports no tp {tp} on any instance: use another degree{elsewhere}"


def _describe(code: str, req: _Request, check: _Check, hint_degrees: list[int], node_ways: list[str]) -> str:
    """The message of rule `code` at `check`'s degree. node_ways: the node counts that work, named
    where no degree works at this one (an explicit tp; "none" was the whole advice)."""
    cfg, inst, tp = req.config, req.inst, check.tp
    where = inst.name if req.nodes == 1 else f"{req.nodes} x {inst.name}"  # the degrees are for this many nodes
    works = f"degrees that work for this model on {where}: {_fmt_list(hint_degrees)}"
    if not hint_degrees and node_ways:
        works += "; " + "; ".join(node_ways)
    if code == "invalid_lnc":
        return req.lnc_problem
    if code == "heads_not_divisible":
        padded = None if cfg.model_type in FUSED_QKV_MODEL_TYPES else _check(dataclasses.replace(req, pad=True), tp)
        # offered only where it would pass: padding fixes the heads, not an unsupported degree or the memory
        pad = "; or pad Q heads with zero heads (pad_q_heads, --pad-q-heads)" if padded and not padded.codes else ""
        return f"num_attention_heads ({cfg.num_attention_heads}) is not divisible by tp_degree ({tp}); {works}{pad}"
    if code == "kv_heads_incompatible":
        from shardlib.sharding import default_kv_strategy, kv_strategy_problem

        ok = [s for s in KV_STRATEGIES
              if not kv_strategy_problem(s, check.q_heads_total, cfg.num_key_value_heads, tp)]
        default = _value(default_kv_strategy(check.q_heads_total, cfg.num_key_value_heads, tp))
        return (f"{check.kv_problem}; strategies that work at tp_degree {tp}: {_fmt_list(ok)}"
                + (f"; or leave kv_strategy (--kv-strategy) unset for the default ({default})" if default else ""))
    if code == "moe_sharding_incompatible":
        ok = [s for s in MOE_SHARDINGS if not moe_sharding_problem(
            cfg.model_type, cfg.num_local_experts, cfg.intermediate_size, tp, s)]
        return (f"{check.moe_problem}; moe shardings that work at tp_degree {tp}: {_fmt_list(ok)}; {works}")
    if code == "unsupported_tp_degree":
        supported = inst.supported_tp_degrees(req.lnc)
        at_lnc = f" at LNC {req.lnc}" if len(inst.allowed_lncs) > 1 else ""
        if tp % req.nodes:
            what = f"tp_degree ({tp}) does not split evenly over {req.nodes} nodes"
        elif inst.is_neuron and tp == NXD_LOCAL_TP_DEGREE and req.nodes > 1:
            return (f"tp_degree ({tp}) over {req.nodes} nodes: neuronx-distributed builds a TP {tp} group from "
                    f"{tp} ranks of one node (its process groups divide the node's ranks by {tp}), so a group "
                    f"split over nodes fails as it starts; {_one_node_way_out(tp, req)}; {works}")
        elif _splits_on_trn2_lnc1(inst, req.lnc, tp) and (tp // req.nodes) in supported:
            half = tp // 2
            # LNC 2 doubles each rank's memory and holds 64 ranks a node: it always fits where LNC 1 did
            smaller = f", or tp {half}" if half in hint_degrees else ""
            return (f"tp_degree ({tp}) at LNC 1 on trn2: neuronx-distributed lays out a {tp}-rank world at LNC 1 "
                    f"as two TP groups of {half} ranks each, so the {tp}-way shards would not match the groups "
                    f"they run in; use --lnc 2 (trn2's default: {inst.logical_cores(2)} logical cores per node) "
                    f"at tp {tp}{smaller}; {works}")
        elif req.nodes > 1:
            what = (f"tp_degree ({tp}) over {req.nodes} nodes puts {check.ranks_per_node} ranks on each "
                    f"node, which is not a supported degree on {inst.family}")
        else:
            what = f"tp_degree ({tp}) is not a supported degree on {inst.family}"
        return f"{what} (NxD Inference supports {_fmt_list(supported)} per node{at_lnc}); {works}"
    if code == "not_enough_cores" and not inst.is_neuron:
        return (f"tp_degree ({tp}) puts {check.ranks_per_node} ranks on a node, one per GPU, but {inst.name} "
                f"has {inst.physical_cores} GPU(s) per node; use --nodes {-(-tp // inst.physical_cores)}; {works}")
    if code == "not_enough_cores":
        logical = inst.logical_cores(req.lnc)
        supported = inst.supported_tp_degrees(req.lnc)
        # the fewest nodes that hold the ranks evenly, at a degree per node NxD Inference supports
        # (one rank per node always is one). Searched over the ranks a node can take, at most its
        # cores: a search over node counts took as many steps as the degree (a prime 1000000007 hung).
        per_node = next(r for r in range(logical, 0, -1)
                        if tp % r == 0 and (supported is None or r in supported or r == 1))
        nodes = tp // per_node
        if tp == NXD_LOCAL_TP_DEGREE:  # never split over nodes: the way out is a larger instance
            return (f"tp_degree ({tp}) needs {tp} logical NeuronCores on one node (neuronx-distributed builds a "
                    f"TP {tp} group from one node's ranks) but {inst.name} has {logical} at LNC {req.lnc}; "
                    f"{_one_node_way_out(tp, req)}; {works}")
        msg = (f"tp_degree ({tp}) needs {tp} logical NeuronCores ({req.lnc} physical per rank at LNC "
               f"{req.lnc}) but {inst.name} has {logical} per node x {req.nodes} node(s) = "
               f"{logical * req.nodes}; use --nodes {nodes} ({tp // nodes} ranks per node)")
        for lnc in inst.allowed_lncs:
            # a lower LNC gives each rank fewer cores' memory (trn2 at LNC 1: half): named where it fits
            if lnc < req.lnc and tp <= inst.logical_cores(lnc) * req.nodes and _fits_memory_at_lnc(req, tp, lnc):
                msg += (f", or --lnc {lnc} ({inst.logical_cores(lnc)} cores per node of "
                        f"{format_bytes(inst.memory_per_logical_core(lnc))} each)")
        return f"{msg}; {works}"
    if code == "insufficient_memory":
        mem = check.memory
        if inst.per_rank_memory:
            cores = f"{req.lnc} NeuronCore(s)" if inst.is_neuron else "one GPU"
            need = (f"tp_degree ({tp}) needs {format_bytes(mem.total_bytes_per_rank)} per rank ({_parts(mem)}) "
                    f"but a rank on {inst.name} has {format_bytes(mem.usable_bytes_per_rank)} usable "
                    f"({format_bytes(mem.capacity_bytes_per_rank)} of {cores} less the "
                    f"{RESERVE_FRACTION:.0%} reserve){_short_by(mem.total_bytes_per_rank, mem.usable_bytes_per_rank)}")
        else:
            on_one = check.ranks_per_node
            whose = (("for its one rank" if tp == 1 else f"for all {tp} ranks") if req.nodes == 1 else
                     f"for the {on_one} rank{'' if on_one == 1 else 's'} of one node ({tp} over {req.nodes} nodes)")
            need = (f"tp_degree ({tp}) needs {format_bytes(mem.total_bytes_per_rank * on_one)} {whose} "
                    f"(per rank: {_parts(mem)}) but {'this host' if req.nodes == 1 else 'a node'} has "
                    f"{format_bytes(inst.memory_bytes)} RAM, "
                    f"{format_bytes(inst.memory_bytes * (1 - RESERVE_FRACTION))} after the "
                    f"{RESERVE_FRACTION:.0%} reserve"
                    f"{_short_by(mem.total_bytes_per_rank * on_one, inst.memory_bytes * (1 - RESERVE_FRACTION))}")
        ways = [f"a degree that fits: {_fmt_list(hint_degrees)}"] if hint_degrees else []
        ways += _ways_out(req, check)
        return f"{need} ({req.rows_text()}, seq_len {req.seq_len}, {req.dtype}); ways out: " + (
            "; ".join(ways) if ways else req.nothing_fits())
    raise AssertionError(f"no message for rule {code}")


def _short_by(needed: float, usable: float) -> str:
    """The shortfall, said: both figures rounded alike read as if the layout fit ("needs 21.2 GiB ...
    21.2 GiB after the 10% reserve")."""
    return f", short by {format_bytes(needed - usable)}"


# ---- the public entry point ---------------------------------------------------------------------
def kv_rows_text(batch_size: int, serving_rows: int) -> str:
    """The KV cache rows a plan counts, as its messages and `corelaunch plan` name them: the batch as
    the user gave it and the serving rows on top when there are any; the serving rows alone where
    there is no static batch (serve's and generate's launches)."""
    if not batch_size:
        return f"{serving_rows} serving rows"
    return f"batch_size {batch_size}" + (f" + {serving_rows} serving rows" if serving_rows else "")


def _non_negative_rows(rows) -> int:
    if not is_non_negative_int(rows):
        raise ValueError(f"serving_rows ({rows!r}) must be a whole number >= 0 (0: no serving loop)")
    return rows


def _checked_batch(batch_size, serving_rows: int) -> int:
    """batch_size, or ValueError. 0 (no static batch: serve's and generate's launches, which run
    continuous batching alone) is taken where serving rows are there to plan."""
    if not is_non_negative_int(batch_size):
        raise ValueError(f"batch_size ({batch_size!r}) must be a positive integer, or 0 for no static batch (the "
                         f"serving rows alone)")
    if batch_size == 0 and not serving_rows:
        raise ValueError("batch_size (0) plans no static batch, and there are no serving rows either (serving_rows "
                         "0, --max-num-seqs 0): there is no KV cache row to plan; give it 1 or more, or serving rows "
                         "(--max-num-seqs 1 or more)")
    return batch_size


def _resolve_dtype(name: str | None, config: ModelConfig) -> str:
    if name is None:
        return config.torch_dtype
    key = str(name).replace("torch.", "").lower()
    if key in DTYPE_BYTES:
        return key
    try:
        return normalize_dtype(name)
    except ValueError:
        pass
    try:  # quantize's and --kv-cache-dtype's spellings of the 8-bit formats (f8e4m3, fp8_e5m2)
        return PLANNER_DTYPE[normalize_quant_dtype(name)]
    except ValueError:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(DTYPE_BYTES)} "
                         f"(or bf16, fp16, fp32, f8e4m3, f8e5m2)") from None


def _lnc_problem(lnc: int, inst: InstanceType) -> str | None:
    if lnc not in (1, 2):
        return (f"lnc ({lnc}) must be 1 or 2 (the logical NeuronCore config); omit it for "
                f"{inst.name}'s default ({inst.default_lnc})")
    if lnc in inst.allowed_lncs:
        return None
    if not inst.is_neuron:
        return f"lnc ({lnc}) has no meaning on the {inst.name} target (it has no NeuronCores); omit --lnc"
    return (f"lnc ({lnc}) is not available on {inst.name}: LNC 2 exists only on trn2 hardware "
            f"({inst.name} is {inst.family}); use --lnc 1 or omit --lnc")


def _checked_seq_len(seq_len) -> int:
    """seq_len, or ValueError: a sequence needs a position for its prompt and one for a new token,
    which is what the launcher asks of its own seq_len too."""
    if positive_int("seq_len", seq_len) < 2:
        raise ValueError(f"seq_len ({seq_len!r}) must be at least 2: one position for a prompt token "
                         f"and one for a generated token")
    return seq_len


def plan(config: ModelConfig, *, instance: str | InstanceType = CPU_TARGET, tp: int | str = "auto",
         nodes: int = 1, lnc: int | None = None, batch_size: int = 1, seq_len: int | None = None,
         dtype: str | None = None, kv_strategy: str | None = None, pad_q_heads: bool = False,
         kv_cache_dtype: str | None = None, moe_sharding: str | None = None, serving_rows: int = 0) -> Plan:
    """Check serving `config` at TP degree `tp` ("auto": the smallest degree that passes) on `nodes`
    nodes of `instance` (a name from the instance table, or an InstanceType such as
    shardlib.instances.gpu_node's). serving_rows: KV cache rows a serving loop holds besides the
    batch_size a static batch may use (counted in memory, named apart in messages); batch_size 0:
    no static batch, the serving rows alone (taken only with serving_rows). ValueError for
    malformed arguments; rule failures land in Plan.errors."""
    inst = instance if isinstance(instance, InstanceType) else get_instance(instance)
    if isinstance(tp, str) and tp != "auto":
        if not (tp.isascii() and tp.isdigit()):
            raise ValueError(f"tp ({tp!r}) must be a positive integer or 'auto'")
        tp = int(tp)
    if tp != "auto":
        positive_int("tp", tp)
    if kv_strategy is not None:
        kv_strategy = getattr(kv_strategy, "value", kv_strategy)
        if kv_strategy not in KV_STRATEGIES:
            raise ValueError(f"kv_strategy ({kv_strategy!r}) must be one of {', '.join(KV_STRATEGIES)}, "
                             f"or None for the default")
    if lnc is not None and (isinstance(lnc, bool) or not isinstance(lnc, int)):  # "2", 2.0, True: not an LNC
        raise ValueError(f"lnc ({lnc!r}) must be an integer, 1 or 2")
    lnc_problem = None if lnc is None else _lnc_problem(lnc, inst)  # 0 or 3: the invalid_lnc rule
    req = _Request(
        config=config, inst=inst, nodes=positive_int("nodes", nodes),
        lnc=inst.default_lnc if lnc is None or lnc_problem else lnc,
        lnc_requested=inst.default_lnc if lnc is None else lnc, lnc_problem=lnc_problem,
        batch=_checked_batch(batch_size, _non_negative_rows(serving_rows)), serving_rows=serving_rows,
        seq_len=_checked_seq_len(seq_len) if seq_len is not None
        else min(config.max_position_embeddings, DEFAULT_MAX_SEQ_LEN),
        dtype=_resolve_dtype(dtype, config), kv_override=kv_strategy, pad=bool(pad_q_heads),
        kv_cache_dtype=kv_dtype_name(kv_cache_dtype), moe_override=check_moe_sharding_name(moe_sharding))
    if (DTYPE_BYTES[req.dtype] == 1 and config.quantization is None
            and config.model_type in UNQUANTIZABLE_MODEL_TYPES):  # the checkpoint `quantize` would write
        raise ValueError(f"dtype {req.dtype}: corelaunch quantize does not quantize {config.model_type} models "
                         f"(their fused attention and expert matrices); plan bfloat16 or float32")
    if pad_q_heads:
        if config.model_type in FUSED_QKV_MODEL_TYPES:  # as the layout would refuse it, but before any start-up
            raise ValueError(f"pad_q_heads (--pad-q-heads) is not supported for {config.model_type}: its fused Wqkv "
                             f"keeps Q, K and V in one matrix, which zero Q heads cannot be inserted into; use a "
                             f"tp_degree that divides num_attention_heads ({config.num_attention_heads})")
    if moe_sharding is not None and not config.is_moe:
        raise ValueError(f"moe_sharding ({moe_sharding!r}) applies to mixture-of-experts models; this "
                         f"{config.model_type} model has no experts: leave it unset")

    valid = _valid_degrees(req)
    # degrees named in messages: with a bad LNC every degree fails, so name those the default LNC allows
    hints = valid if lnc_problem is None else _valid_degrees(dataclasses.replace(req, lnc_problem=None))
    errors: list[PlanIssue] = []
    if tp == "auto" and valid:
        check = _check(req, valid[0])
    elif tp == "auto":
        # The degree that fails the fewest rules; among equals, with per-rank device memory the
        # largest (the smallest shard per rank), on cpu the smallest (all ranks share the RAM, so
        # fewer copies is closer).
        sign = -1 if inst.per_rank_memory else 1
        check = min((_check(req, t) for t in _candidates(req)), key=lambda c: (len(c.codes), sign * c.tp))
        summary = (f"no tp_degree passes every rule for this {config.model_type} model on {req.nodes} x "
                   f"{inst.name} ({req.dtype}, {req.rows_text()}, seq_len {req.seq_len}); the errors "
                   f"below are those of tp_degree {check.tp}, which fails the fewest")
        if "insufficient_memory" not in check.codes:  # that message lists the ways out itself
            ways = _ways_out(req, check)
            summary += "; ways out: " + (
                "; ".join(ways) if ways else req.nothing_fits())
        errors.append(PlanIssue("no_valid_tp_degree", summary))
    else:
        check = _check(req, tp)
    # an explicit degree with none working at this node count: the node counts that work are the way out
    node_ways = _node_count_ways(dataclasses.replace(req, lnc_problem=None)) if tp != "auto" and not hints else []
    errors += [PlanIssue(code, _describe(code, req, check, hints, node_ways)) for code in check.codes]
    if req.seq_len > config.max_position_embeddings:  # every degree alike: one error, not a rule per degree
        errors.append(PlanIssue("seq_len_too_long", (
            f"seq_len ({req.seq_len}) exceeds the model's max_position_embeddings ({config.max_position_embeddings}): "
            f"no request runs past that position, so the cache slots above it would be held and never used; "
            f"lower seq_len (--seq-len) to {config.max_position_embeddings} or less")))
        valid = []  # no degree holds it (`plan` listed them as valid beside this error)
    return _build(req, check, tp, valid, errors)


def _build(req: _Request, check: _Check, tp_requested, valid: list[int], errors: list[PlanIssue]) -> Plan:
    cfg, inst = req.config, req.inst
    heads_ok = check.q_heads_total % check.tp == 0
    kv_ok = heads_ok and check.kv_strategy is not None and check.kv_problem is None
    padded = check.q_heads_total if req.pad else None
    waste = None
    if padded is not None:
        extra = padded - cfg.num_attention_heads
        per_head = (2 * cfg.hidden_size + (1 if cfg.attention_bias else 0)) * cfg.head_dim
        # a quantized checkpoint's projections are 1 byte whatever the compute dtype (scales not counted)
        weight_bytes = 1 if cfg.quantization is not None else DTYPE_BYTES[req.dtype]
        extra_bytes = extra * per_head * cfg.num_hidden_layers * weight_bytes
        zero_kv = extra if check.kv_strategy == "convert_to_mha" and kv_ok else 0
        kv_per_head = 2 * (cfg.hidden_size + (1 if cfg.attention_bias else 0)) * cfg.head_dim
        waste = PaddingWaste(extra_q_heads=extra, extra_qo_weight_bytes=extra_bytes,
                             extra_qo_fraction=extra / cfg.num_attention_heads,
                             extra_model_fraction=extra_bytes / check.memory.model_weight_bytes,
                             extra_kv_heads=zero_kv,
                             extra_kv_weight_bytes=zero_kv * kv_per_head * cfg.num_hidden_layers * weight_bytes,
                             extra_kv_cache_bytes=(zero_kv * 2 * cfg.num_hidden_layers * req.cache_rows * req.seq_len
                                                   * cfg.head_dim * DTYPE_BYTES[check.memory.kv_cache_dtype]))
    return Plan(
        valid=not errors, tp_degree=check.tp, tp_requested=tp_requested, instance=inst.name,
        family=inst.family, nodes=req.nodes, lnc=req.lnc_requested,
        cores_per_rank=req.lnc if inst.is_neuron else 1, ranks_per_node=check.ranks_per_node,
        logical_cores_per_node=inst.logical_cores(req.lnc) if inst.core_count_known else None, dtype=req.dtype, batch_size=req.batch,
        serving_rows=req.serving_rows,
        seq_len=req.seq_len, kv_strategy=check.kv_strategy if kv_ok else None,
        q_heads_per_rank=check.q_per_rank if heads_ok else None,
        kv_heads_per_rank=check.kv_per_rank if kv_ok else None,
        padded_q_heads=padded, padding_waste=waste, memory=check.memory,
        moe_sharding=None if check.moe_problem else check.moe_sharding,
        valid_tp_degrees=tuple(valid), errors=tuple(errors), warnings=tuple(_warnings(req, check)),
        config=cfg)


def pads_nothing(heads: int, tp: int) -> str:
    """What pad_q_heads does at a degree that divides the heads: nothing (said, not silently taken)."""
    return (f"pad_q_heads (--pad-q-heads) pads nothing: tp_degree {tp} divides num_attention_heads ({heads}) "
            f"evenly, so the layout is the unpadded one")


def _warnings(req: _Request, check: _Check) -> list[str]:
    cfg, inst, tp = req.config, req.inst, check.tp
    out = []
    if not inst.per_rank_memory and tp > inst.physical_cores * req.nodes:
        out.append(f"tp_degree {tp} runs {tp} ranks on {inst.physical_cores} CPU core(s) x {req.nodes} "
                   f"node(s): ranks time-share the cores (fine for development and tests, slow to serve)")
    if not inst.per_rank_memory and tp % req.nodes:
        out.append(f"tp_degree {tp} does not split evenly over {req.nodes} nodes: up to "
                   f"{check.ranks_per_node} ranks on one node")
    if not inst.per_rank_memory and req.nodes > 1:
        out.append("the cpu target assumes every node has this host's cores and RAM")
    if req.pad and check.q_heads_total == cfg.num_attention_heads:
        out.append(pads_nothing(cfg.num_attention_heads, tp))
    if check.q_heads_total > cfg.num_attention_heads:
        out.append(f"Q heads padded from {cfg.num_attention_heads} to {check.q_heads_total} with zero "
                   f"heads: their rows of q_proj and columns of o_proj are computed and contribute nothing")
    if check.kv_strategy == "convert_to_mha" and check.kv_problem is None:
        kv, held = cfg.num_key_value_heads, check.q_heads_total  # one KV head per Q head, padded ones too
        zero = held - cfg.num_attention_heads
        out.append(f"kv strategy convert_to_mha copies each of the {kv} KV heads "
                   f"{cfg.num_attention_heads // kv} times" + (f", plus {zero} zero KV head(s) beside the padded Q "
                                                             f"heads" if zero else "")
                   + f": KV weights and KV cache cost {held / kv:.3g}x the checkpoint's layout")
    if DTYPE_BYTES[req.dtype] == 1 and cfg.quantization is None:
        rest = planned_quantization(cfg, req.dtype, req.inst.is_neuron)[1]
        launch = (f", and launch it with --dtype {rest} (it keeps {cfg.torch_dtype})"
                  if rest != cfg.torch_dtype else "")
        out.append(f"{req.dtype} plans the weights quantized per channel ({rest} for the rest and the KV "
                   f"cache); run `corelaunch quantize` to produce that checkpoint before launching it{launch}")
    elif DTYPE_BYTES[req.dtype] == 1:  # a quantized checkpoint planned at its own 1-byte format
        rest = planned_quantization(cfg, req.dtype, req.inst.is_neuron)[1]
        if rest != cfg.torch_dtype:  # a launch without --dtype holds the checkpoint's dtype, not the plan's
            out.append(f"{req.dtype} plans this quantized checkpoint's other tensors and KV cache in {rest}, but it "
                       f"keeps {cfg.torch_dtype}, which a launch holds unless told otherwise: launch it with "
                       f"--dtype {rest} for the memory this plan counts (or plan --dtype {cfg.torch_dtype} for "
                       f"what it holds without)")
    if req.kv_cache_dtype is not None and inst.is_neuron:
        # workers.backends: the neuron entry's compiled_fp8_kv_cache is False (its graphs hold the cache
        # in the model's dtype); generate and serve refuse the option unless run eagerly
        out.append(f"kv_cache_dtype {req.kv_cache_dtype}: the neuron backend's compiled graphs keep the KV cache in "
                   f"the compute dtype, so a launch refuses --kv-cache-dtype unless it runs eagerly (--no-compile); "
                   f"this plan counts the {req.kv_cache_dtype} cache that eager run holds")
    # Sizing stays valid (NxD Inference may run these), but corelaunch's own workers cannot.
    out.extend(f"not runnable by corelaunch's workers: {gap}" for gap in cfg.executor_gaps(req.seq_len))
    return out
