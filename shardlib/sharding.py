"""Tensor-parallel sharding math: which slice of each checkpoint tensor a rank holds.

Everything here is a pure function of (parameter name, full shape, rank, layout). A slice is
described as index ranges (`TensorSlice`) rather than computed on a tensor, so the checkpoint reader
can fetch exactly those bytes from disk and `apply_slice` can cut an in-memory tensor the same way.

Styles (Megatron / fairscale terms; W is stored as (out_features, in_features) like nn.Linear):
- COLUMN:    Y = X W^T with W split along out_features (dim 0); each rank computes a slice of Y.
             Padded with zero rows when out_features does not divide (the MLP intermediate of
             SmolLM2, 1536, at TP 9): a zero gate/up row gives silu(0) * 0 = 0, so padding is exact.
- Q_HEADS:   COLUMN by whole attention heads (q_proj weight and bias); with pad_q_heads a rank's
             zero heads are zero rows after its real ones (ShardLayout.q_head_sources).
- KV_HEADS:  COLUMN by the KV heads the rank's strategy assigns (k_proj / v_proj weight and bias);
             under replication or MHA conversion one original head appears on several ranks.
- ROW:       W split along in_features (dim 1); partial outputs are summed by an all-reduce.
- ROW_HEADS: ROW by whole attention heads (o_proj, whose input is the rank's Q heads).
- VOCAB:     embedding / LM head split along the vocabulary (dim 0), padded to a multiple of TP.
             Embedding: each rank looks up the ids it owns, others give zero, all-reduce sums.
             LM head: each rank produces logits for its vocabulary slice, gathered on rank 0.
- REPLICATE: every rank holds the whole tensor (norms, MoE router).
- SKIP:      not a weight the model uses (rotary inv_freq buffers in older checkpoints).
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence


from shardlib.model_config import ModelConfig
from shardlib.quantization import SCALE_SUFFIX, weight_name_of

if TYPE_CHECKING:  # torch is imported only where tensors are cut, so planning stays torch-free
    import torch


SLICING_VERSION = 1
"""The version of what this module cuts: bump it whenever the contents of any rank's slice change
(another padding, head order, split point), even where every shape stays the same. A pre-sharded copy
records the version it was cut by (shardlib.presharded), a load refuses a copy cut by another, and the
pre-sharded cache's key holds it (launcher/artifacts/presharded_cache.py), so a bump writes a new copy
instead of serving slices this code no longer cuts."""


class KVStrategy(str, enum.Enum):
    """How KV heads are laid out over TP ranks (names follow NxD Inference's GQA strategies)."""

    SHARD = "shard"
    """K % T == 0: K/T whole KV heads per rank."""
    REPLICATE_TO_TP = "replicate_to_tp"
    """T % K == 0: each KV head copied T/K times, one KV head per rank."""
    CONVERT_TO_MHA = "convert_to_mha"
    """Each KV head copied H/K times (becomes MHA), then split: H/T KV heads per rank."""


class Style(str, enum.Enum):
    COLUMN = "column"
    Q_HEADS = "q_heads"
    KV_HEADS = "kv_heads"
    ROW = "row"
    ROW_HEADS = "row_heads"
    VOCAB = "vocab"
    REPLICATE = "replicate"
    SKIP = "skip"
    QKV_FUSED = "qkv_fused"
    """One [Q | K | V] matrix: the rank's Q heads, then its K heads, then its V heads."""
    EXPERT_COLUMN = "expert_column"
    EXPERT_ROW = "expert_row"
    EXPERTS_FUSED = "experts_fused"
    """The three expert styles are cut by shardlib/expert_sharding.py."""


def default_kv_strategy(num_heads: int, num_kv_heads: int, tp: int) -> KVStrategy | None:
    """The strategy NxD Inference would pick, or None when no strategy works (H % T != 0)."""
    if num_heads % tp:
        return None  # every strategy needs whole Q heads per rank (H=6, K=2, T=4 is not replicable)
    if num_kv_heads % tp == 0:
        return KVStrategy.SHARD
    if tp % num_kv_heads == 0:
        return KVStrategy.REPLICATE_TO_TP
    if num_heads % tp == 0:
        return KVStrategy.CONVERT_TO_MHA
    return None


def kv_strategy_problem(strategy: KVStrategy, num_heads: int, num_kv_heads: int, tp: int) -> str | None:
    """Why `strategy` cannot be used at this TP degree, or None when it can."""
    strategy = KVStrategy(strategy)
    if strategy is KVStrategy.SHARD and num_kv_heads % tp:
        return f"kv strategy 'shard' needs num_key_value_heads ({num_kv_heads}) divisible by tp_degree ({tp})"
    if strategy is KVStrategy.REPLICATE_TO_TP and tp % num_kv_heads:
        return (f"kv strategy 'replicate_to_tp' needs tp_degree ({tp}) to be a multiple of "
                f"num_key_value_heads ({num_kv_heads})")
    if strategy is KVStrategy.CONVERT_TO_MHA and num_heads % tp:
        return (f"kv strategy 'convert_to_mha' needs num_attention_heads ({num_heads}) divisible by "
                f"tp_degree ({tp})")
    return None


@dataclass(frozen=True)
class ShardLayout:
    """The TP layout of one model: the single source of per-rank sizes and head assignments."""

    tp_degree: int
    kv_strategy: KVStrategy
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_experts: int = 0
    """Experts per MoE layer (0: dense); intermediate_size is then each expert's."""
    moe_sharding: str | None = None
    """How the experts are split: shardlib.expert_sharding's MOE_SHARDINGS; None for dense models."""

    pad_q_heads: bool = False
    """Pad Q heads with zero heads to a multiple of tp_degree (NxD Inference's layout, see
    q_head_sources) instead of requiring tp_degree to divide them."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_strategy", KVStrategy(self.kv_strategy))
        if (self.moe_sharding is None) != (self.num_experts == 0):
            raise ValueError(f"moe_sharding ({self.moe_sharding!r}) must be given exactly when the model has "
                             f"experts (num_experts {self.num_experts}); build it with ShardLayout.for_model")
        if self.tp_degree < 1:
            raise ValueError(f"tp_degree ({self.tp_degree}) must be at least 1")
        if self.num_heads < 1 or self.num_kv_heads < 1:
            raise ValueError(f"num_attention_heads ({self.num_heads}) and num_key_value_heads "
                             f"({self.num_kv_heads}) must be at least 1")
        if self.num_heads % self.num_kv_heads:
            # Otherwise kv_head_ids would name KV heads the checkpoint does not have.
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) is not a multiple of num_key_value_heads "
                f"({self.num_kv_heads}): not a valid GQA config"
            )
        if self.num_heads % self.tp_degree and not self.pad_q_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) is not divisible by tp_degree "
                f"({self.tp_degree}); pad Q heads (--pad-q-heads), or run `corelaunch plan` to list the "
                f"degrees that work"
            )
        problem = kv_strategy_problem(self.kv_strategy, self.padded_heads, self.num_kv_heads, self.tp_degree)
        if problem:
            raise ValueError(problem)

    @classmethod
    def for_model(cls, config: ModelConfig, tp_degree: int, kv_strategy: KVStrategy | str | None = None,
                  pad_q_heads: bool = False, moe_sharding: str | None = None) -> "ShardLayout":
        """moe_sharding: for MoE models, one of expert_sharding.MOE_SHARDINGS, or None for the
        planner's choice (ValueError when the chosen one, or every one, breaks its rule)."""
        heads = config.num_attention_heads
        padded = math.ceil(heads / tp_degree) * tp_degree if pad_q_heads else heads
        if padded != heads and config.model_type in FUSED_QKV_MODEL_TYPES:
            raise ValueError(f"--pad-q-heads is not supported for {config.model_type}: its fused Wqkv keeps Q, K "
                             f"and V in one matrix, which zero Q heads cannot be inserted into; use a tp_degree "
                             f"that divides num_attention_heads ({heads})")
        if kv_strategy is None:
            kv_strategy = default_kv_strategy(padded, config.num_key_value_heads, tp_degree)
            if kv_strategy is None:
                raise ValueError(
                    f"num_attention_heads ({heads}) is not divisible by tp_degree "
                    f"({tp_degree}); pad Q heads (--pad-q-heads), or run `corelaunch plan` to list the "
                    f"degrees that work"
                )
        from shardlib.expert_sharding import resolve_moe_sharding

        return cls(tp_degree=tp_degree, kv_strategy=KVStrategy(kv_strategy),
                   num_heads=heads, num_kv_heads=config.num_key_value_heads,
                   head_dim=config.head_dim, hidden_size=config.hidden_size,
                   intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
                   pad_q_heads=bool(pad_q_heads) and padded != heads,
                   num_experts=config.num_local_experts,
                   moe_sharding=resolve_moe_sharding(config, tp_degree, moe_sharding))

    # ---- per-rank sizes ----------------------------------------------------------------------
    @property
    def padded_heads(self) -> int:
        """Q heads after padding: the next multiple of tp_degree with pad_q_heads, else num_heads."""
        return math.ceil(self.num_heads / self.tp_degree) * self.tp_degree if self.pad_q_heads else self.num_heads

    @property
    def q_heads_per_rank(self) -> int:
        return self.padded_heads // self.tp_degree

    @property
    def kv_heads_per_rank(self) -> int:
        return len(self.kv_head_ids(0))

    @property
    def kv_replication(self) -> int:
        """Copies of each original KV head over all ranks (a padded Q head's KV slot is none)."""
        held = sum(1 for rank in range(self.tp_degree) for kv in self.kv_head_ids(rank) if kv is not None)
        return held // self.num_kv_heads

    @property
    def intermediate_per_rank(self) -> int:
        return math.ceil(self.intermediate_size / self.tp_degree)

    @property
    def vocab_per_rank(self) -> int:
        return math.ceil(self.vocab_size / self.tp_degree)

    @property
    def padded_vocab_size(self) -> int:
        return self.vocab_per_rank * self.tp_degree

    def q_head_ids(self, rank: int) -> range:
        """Padded Q head slots of `rank` (the original heads' numbers when nothing is padded)."""
        self._check_rank(rank)
        n = self.q_heads_per_rank
        return range(rank * n, (rank + 1) * n)

    def q_head_sources(self, rank: int) -> list[int | None]:
        """The original Q head in each of `rank`'s Q head slots, None for a zero (padding) head.

        Padding follows NxD Inference (gqa.py): with KV heads replicated or split, the zero heads are
        interleaved, appended to each KV head's group of Q heads, so the padded group still spans
        whole ranks and every rank's Q heads read the one KV head it holds; with convert_to_mha
        (every Q head its own KV copy) they are appended after the last head, KV heads likewise.
        Either way a rank's zero heads come after its real ones."""
        slots = self.q_head_ids(rank)
        if self.padded_heads == self.num_heads:
            return list(slots)
        if self.kv_strategy is KVStrategy.CONVERT_TO_MHA:
            return [s if s < self.num_heads else None for s in slots]
        group, padded_group = self.num_heads // self.num_kv_heads, self.padded_heads // self.num_kv_heads
        return [(s // padded_group) * group + s % padded_group if s % padded_group < group else None for s in slots]

    def kv_head_ids(self, rank: int) -> list[int | None]:
        """Original KV head index of each KV head slot on `rank`, in order (None: a zero head,
        convert_to_mha's copy for a padded Q head)."""
        self._check_rank(rank)
        t, k, h = self.tp_degree, self.num_kv_heads, self.num_heads
        if self.kv_strategy is KVStrategy.SHARD:
            n = k // t
            return list(range(rank * n, (rank + 1) * n))
        if self.kv_strategy is KVStrategy.REPLICATE_TO_TP:
            return [rank // (t // k)]
        group = h // k  # Q heads per original KV head
        return [None if q is None else q // group for q in self.q_head_sources(rank)]

    def vocab_range(self, rank: int) -> tuple[int, int]:
        """Real token ids [start, stop) owned by `rank` (stop - start may be < vocab_per_rank)."""
        self._check_rank(rank)
        start = rank * self.vocab_per_rank
        return min(start, self.vocab_size), min(start + self.vocab_per_rank, self.vocab_size)

    def _check_rank(self, rank: int) -> None:
        assert 0 <= rank < self.tp_degree, f"rank {rank} outside tp_degree {self.tp_degree}"


@dataclass(frozen=True)
class TensorSlice:
    """Rows (or columns) to take along `dim`, concatenated in order, then zero-padded to `pad_to`.

    `ranges` empty and dim None means: the whole tensor (replicated).
    """

    dim: int | None
    ranges: tuple[tuple[int, int], ...] = ()
    pad_to: int | None = None

    @property
    def is_whole(self) -> bool:
        return self.dim is None

    def length(self) -> int:
        return sum(stop - start for start, stop in self.ranges)

    def shape(self, full_shape: Sequence[int]) -> tuple[int, ...]:
        if self.is_whole:
            return tuple(full_shape)
        out = list(full_shape)
        out[self.dim] = self.pad_to if self.pad_to is not None else self.length()
        return tuple(out)


def _merge(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Join touching ranges so a reader issues as few reads as possible."""
    merged: list[tuple[int, int]] = []
    for start, stop in ranges:
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], stop)
        else:
            merged.append((start, stop))
    return tuple(merged)


def _even(size: int, rank: int, tp: int, dim: int) -> TensorSlice:
    per = math.ceil(size / tp)
    start, stop = min(rank * per, size), min((rank + 1) * per, size)
    ranges = ((start, stop),) if stop > start else ()
    return TensorSlice(dim=dim, ranges=ranges, pad_to=per if per * tp != size else None)


def _heads(head_ids: Sequence[int | None], head_dim: int, dim: int) -> TensorSlice:
    """Whole heads in order; None (zero heads, which come last) become zero padding."""
    real = [h for h in head_ids if h is not None]
    padded = len(real) < len(head_ids)
    return TensorSlice(dim=dim, ranges=_merge([(h * head_dim, (h + 1) * head_dim) for h in real]),
                       pad_to=len(head_ids) * head_dim if padded else None)


def slice_for_style(style: Style, full_shape: Sequence[int], rank: int, layout: ShardLayout) -> TensorSlice:
    """The slice of a tensor of `full_shape` that `rank` holds under `style`."""
    layout._check_rank(rank)
    style = Style(style)  # accept the plain string too ("column"), as KVStrategy does
    tp, d = layout.tp_degree, layout.head_dim
    if style is Style.REPLICATE:
        return TensorSlice(dim=None)
    if style is Style.Q_HEADS:
        return _heads(layout.q_head_sources(rank), d, dim=0)
    if style is Style.KV_HEADS:
        return _heads(layout.kv_head_ids(rank), d, dim=0)
    if style is Style.ROW_HEADS:
        return _heads(layout.q_head_sources(rank), d, dim=1)
    if style is Style.QKV_FUSED:
        q, kv = layout.num_heads * d, layout.num_kv_heads * d
        offsets = ((0, layout.q_head_ids(rank)), (q, layout.kv_head_ids(rank)), (q + kv, layout.kv_head_ids(rank)))
        return TensorSlice(dim=0, ranges=_merge([(base + h * d, base + (h + 1) * d)
                                                 for base, heads in offsets for h in heads]))
    if style is Style.COLUMN:
        return _even(full_shape[0], rank, tp, dim=0)
    if style is Style.ROW:
        return _even(full_shape[1], rank, tp, dim=1)
    if style is Style.VOCAB:
        return _even(full_shape[0], rank, tp, dim=0)
    raise ValueError(f"style {style} has no slice")


def apply_slice(tensor: "torch.Tensor", tslice: TensorSlice) -> "torch.Tensor":
    """Cut `tensor` as `tslice` says; returns a new contiguous tensor (never a view of the input)."""
    import torch

    if tslice.is_whole:
        return tensor.clone()
    parts = [tensor.narrow(tslice.dim, start, stop - start) for start, stop in tslice.ranges]
    out = torch.cat(parts, dim=tslice.dim) if parts else tensor.narrow(tslice.dim, 0, 0).clone()
    if tslice.pad_to is not None and out.shape[tslice.dim] < tslice.pad_to:
        pad_shape = list(out.shape)
        pad_shape[tslice.dim] = tslice.pad_to - out.shape[tslice.dim]
        out = torch.cat([out, out.new_zeros(pad_shape)], dim=tslice.dim)
    return out.contiguous()


# ---- per-architecture sharding plans: parameter-name pattern -> style --------------------------
_LAYER = r"model\.layers\.\d+\."
_DENSE_PLAN: tuple[tuple[str, Style], ...] = (
    (r"model\.embed_tokens\.weight", Style.VOCAB),
    (r"lm_head\.weight", Style.VOCAB),
    (_LAYER + r"self_attn\.q_proj\.(weight|bias)", Style.Q_HEADS),
    (_LAYER + r"self_attn\.[kv]_proj\.(weight|bias)", Style.KV_HEADS),
    (_LAYER + r"self_attn\.o_proj\.weight", Style.ROW_HEADS),
    (_LAYER + r"self_attn\.o_proj\.bias", Style.REPLICATE),  # added once, after the all-reduce
    (_LAYER + r"self_attn\.[qk]_norm\.weight", Style.REPLICATE),  # per head: (head_dim,)
    (_LAYER + r"mlp\.(gate|up)_proj\.(weight|bias)", Style.COLUMN),
    (_LAYER + r"mlp\.down_proj\.weight", Style.ROW),
    (_LAYER + r"mlp\.down_proj\.bias", Style.REPLICATE),  # added once, after the all-reduce
    (_LAYER + r"(input|post_attention|pre_feedforward|post_feedforward)_layernorm\.weight", Style.REPLICATE),
    (r"model\.norm\.weight", Style.REPLICATE),
    (_LAYER + r"self_attn\.rotary_emb\.inv_freq", Style.SKIP),
)
_ATTENTION_PLAN = tuple(p for p in _DENSE_PLAN if "mlp" not in p[0])
_MOE_PLAN: tuple[tuple[str, Style], ...] = _ATTENTION_PLAN + (
    (_LAYER + r"block_sparse_moe\.gate\.weight", Style.REPLICATE),
    (_LAYER + r"block_sparse_moe\.experts\.\d+\.w[13]\.weight", Style.EXPERT_COLUMN),
    (_LAYER + r"block_sparse_moe\.experts\.\d+\.w2\.weight", Style.EXPERT_ROW),
)
_QWEN3_MOE_PLAN: tuple[tuple[str, Style], ...] = _ATTENTION_PLAN + (  # q/k norms: in _ATTENTION_PLAN
    (_LAYER + r"mlp\.gate\.weight", Style.REPLICATE),
    (_LAYER + r"mlp\.experts\.\d+\.(gate|up)_proj\.weight", Style.EXPERT_COLUMN),
    (_LAYER + r"mlp\.experts\.\d+\.down_proj\.weight", Style.EXPERT_ROW),
)
_BLOCK = r"transformer\.blocks\.\d+\."
_DBRX_PLAN: tuple[tuple[str, Style], ...] = (
    (r"transformer\.wte\.weight", Style.VOCAB),
    (r"lm_head\.weight", Style.VOCAB),
    (_BLOCK + r"norm_attn_norm\.attn\.Wqkv\.weight", Style.QKV_FUSED),
    (_BLOCK + r"norm_attn_norm\.attn\.out_proj\.weight", Style.ROW_HEADS),
    (_BLOCK + r"norm_attn_norm\.norm_[12]\.weight", Style.REPLICATE),
    (_BLOCK + r"ffn\.router\.layer\.weight", Style.REPLICATE),
    (_BLOCK + r"ffn\.experts\.mlp\.(w1|v1|w2)", Style.EXPERTS_FUSED),  # w2 too: stored (experts x ffn, hidden)
    (r"transformer\.norm_f\.weight", Style.REPLICATE),
)

SHARDING_PLANS: dict[str, tuple[tuple[str, Style], ...]] = {
    "llama": _DENSE_PLAN,
    "mistral": _DENSE_PLAN,
    "qwen2": _DENSE_PLAN,  # q/k/v biases are matched by the (weight|bias) patterns
    "qwen3": _DENSE_PLAN,
    "gemma3_text": _DENSE_PLAN,
    "mixtral": _MOE_PLAN,
    "qwen3_moe": _QWEN3_MOE_PLAN,
    "dbrx": _DBRX_PLAN,
}

FUSED_QKV_MODEL_TYPES = tuple(arch for arch, plan in SHARDING_PLANS.items() if any(s is Style.QKV_FUSED for _, s in plan))
"""Families with one [Q | K | V] matrix, which padded Q heads cannot be cut from (DBRX)."""

_COMPILED = {arch: tuple((re.compile(p), s) for p, s in plan) for arch, plan in SHARDING_PLANS.items()}


def style_for(model_type: str, name: str) -> Style:
    """The sharding style of parameter `name`; ValueError for a name the plan does not know."""
    if model_type not in _COMPILED:
        raise ValueError(f"no sharding plan for architecture {model_type!r}; known: {sorted(_COMPILED)}")
    for pattern, style in _COMPILED[model_type]:
        if pattern.fullmatch(name):
            return style
    raise ValueError(
        f"tensor {name!r} matches no entry of the {model_type} sharding plan; the checkpoint holds a "
        f"parameter corelaunch does not know how to shard"
    )


def slice_for(model_type: str, name: str, full_shape: Sequence[int], rank: int,
              layout: ShardLayout) -> TensorSlice | None:
    """The slice of checkpoint tensor `name` that `rank` holds; None for tensors to skip."""
    if name.endswith(SCALE_SUFFIX):
        weight = weight_name_of(name)
        return scale_slice(style_for(model_type, weight), full_shape, rank, layout, weight)
    style = style_for(model_type, name)
    if style is Style.SKIP:
        return None
    if style in (Style.EXPERT_COLUMN, Style.EXPERT_ROW, Style.EXPERTS_FUSED):
        from shardlib.expert_sharding import expert_slice

        return expert_slice(style, name, full_shape, rank, layout)
    return slice_for_style(style, full_shape, rank, layout)


_OUTPUT_SPLIT = (Style.COLUMN, Style.Q_HEADS, Style.KV_HEADS, Style.VOCAB)


def scale_slice(weight_style: Style, full_shape: Sequence[int], rank: int, layout: ShardLayout,
                weight_name: str) -> TensorSlice:
    """The slice of a quantized weight's scale (shardlib/quantization.py): a per-channel scale
    (out, 1) is cut like its weight's output dim when the weight is split along it, and kept whole
    for a row-parallel or replicated weight; a per-tensor scale (1,) is replicated. An expert's
    per-channel scale follows its weight (`weight_name`, which names the expert): under tensor
    parallelism cut with a gate or up projection's rows. Under expert parallelism an expert's scale,
    per channel or per tensor, is whole on the rank that owns the expert and empty on the others
    (the planner counts it there only)."""
    if weight_style in (Style.EXPERT_COLUMN, Style.EXPERT_ROW):
        from shardlib.expert_sharding import EXPERT_PARALLEL, expert_slice

        if layout.moe_sharding == EXPERT_PARALLEL:
            return expert_slice(weight_style, weight_name, full_shape, rank, layout)
        if len(full_shape) == 2:
            weight_style = Style.COLUMN if weight_style is Style.EXPERT_COLUMN else Style.ROW
    if len(full_shape) == 2 and weight_style in _OUTPUT_SPLIT:
        return slice_for_style(weight_style, full_shape, rank, layout)
    return TensorSlice(dim=None)
