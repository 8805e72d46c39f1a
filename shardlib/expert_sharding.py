"""How a mixture-of-experts layer's experts are split over the TP ranks: the two shardings, their
rules, and the slice of each expert tensor a rank holds.

- tensor_parallel: every rank holds a 1/T slice of every expert's intermediate dimension (gate/up
  column-parallel, down row-parallel, as a dense MLP). Every rank computes every expert for every
  token on its slice; the partial outputs meet in the layer's one all-reduce. Works at any degree:
  per-expert tensors are zero-padded to a multiple of T, as dense MLPs are; DBRX's fused expert
  tensors (experts x ffn rows in one matrix) are cut per expert and need ffn_hidden_size % T == 0.
- expert_parallel: rank r holds experts [r E/T, (r+1) E/T) whole and reads no byte of the others.
  Each rank computes its own experts for every token, weighted by the router (zero for tokens not
  routed to them); one all-reduce sums the ranks' outputs. Needs num_local_experts % T == 0.

Both hold the same bytes per rank when nothing is padded; the planner picks tensor_parallel then
(NxD Inference's default, moe_tp_degree = tp) and expert_parallel when it needs less memory (the
intermediate dimension would be padded) or tensor_parallel breaks a rule.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Sequence

from shardlib.model_config import ModelConfig

if TYPE_CHECKING:
    from shardlib.sharding import ShardLayout, Style, TensorSlice

TENSOR_PARALLEL, EXPERT_PARALLEL = "tensor_parallel", "expert_parallel"
MOE_SHARDINGS = (TENSOR_PARALLEL, EXPERT_PARALLEL)
FUSED_EXPERT_TYPES = ("dbrx",)
"""Families whose checkpoints store all of a layer's experts in one matrix per projection."""


def check_moe_sharding_name(sharding: str | None) -> str | None:
    if sharding is not None and sharding not in MOE_SHARDINGS:
        raise ValueError(f"moe_sharding ({sharding!r}) must be one of {', '.join(MOE_SHARDINGS)}, "
                         f"or None for the planner's choice")
    return sharding


def moe_sharding_problem(model_type: str, num_experts: int, intermediate: int, tp: int,
                         sharding: str) -> str | None:
    """Why `sharding` cannot split these experts over `tp` ranks, or None when it can."""
    if sharding == EXPERT_PARALLEL and num_experts % tp:
        return (f"moe sharding 'expert_parallel' needs num_local_experts ({num_experts}) divisible by "
                f"tp_degree ({tp}): every rank holds the same number of whole experts")
    if sharding == TENSOR_PARALLEL and model_type in FUSED_EXPERT_TYPES and intermediate % tp:
        return (f"moe sharding 'tensor_parallel' of {model_type}'s fused expert tensors needs the expert "
                f"intermediate size ({intermediate}) divisible by tp_degree ({tp})")
    return None


def expert_elements_per_rank(config: ModelConfig, tp: int, sharding: str) -> int:
    """Expert weights plus the (replicated) router one rank holds in one layer."""
    h, i, e = config.hidden_size, config.intermediate_size, config.num_local_experts
    if sharding == EXPERT_PARALLEL:
        per_rank = math.ceil(e / tp) * 3 * h * i
    else:
        per_rank = e * 3 * h * math.ceil(i / tp)
    return per_rank + h * e


def default_moe_sharding(config: ModelConfig, tp: int) -> str | None:
    """The planner's choice (see the module docstring); None for a dense model or when neither works."""
    if not config.is_moe:
        return None
    ok = [s for s in MOE_SHARDINGS if not moe_sharding_problem(
        config.model_type, config.num_local_experts, config.intermediate_size, tp, s)]
    return min(ok, key=lambda s: expert_elements_per_rank(config, tp, s), default=None)  # ties: tensor_parallel


def local_experts(layout: "ShardLayout", rank: int) -> range:
    """The experts `rank` computes: all of them (each a slice) or its own whole ones."""
    if layout.moe_sharding == EXPERT_PARALLEL:
        per = layout.num_experts // layout.tp_degree
        return range(rank * per, (rank + 1) * per)
    return range(layout.num_experts)


_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")


def expert_slice(style: "Style", name: str, full_shape: Sequence[int], rank: int,
                 layout: "ShardLayout") -> "TensorSlice":
    """The slice of expert tensor `name` that `rank` holds (styles EXPERT_COLUMN/ROW: one expert's
    gate, up or down; EXPERTS_FUSED: DBRX's (experts x ffn, hidden) matrices, cut along dim 0)."""
    from shardlib.sharding import Style, TensorSlice, slice_for_style

    owned = local_experts(layout, rank)
    if style is Style.EXPERTS_FUSED:
        i, tp = layout.intermediate_size, layout.tp_degree
        if layout.moe_sharding == EXPERT_PARALLEL:
            return TensorSlice(dim=0, ranges=((owned.start * i, owned.stop * i),))
        per = i // tp  # the layout checked i % tp == 0 for fused experts
        return TensorSlice(dim=0, ranges=tuple((e * i + rank * per, e * i + (rank + 1) * per) for e in owned))
    if layout.moe_sharding == EXPERT_PARALLEL:
        expert = int(_EXPERT_INDEX.search(name).group(1))
        # Another rank's expert: an empty slice, so the reader reads none of its bytes.
        return TensorSlice(dim=None) if expert in owned else TensorSlice(dim=0, ranges=())
    return slice_for_style(Style.COLUMN if style is Style.EXPERT_COLUMN else Style.ROW, full_shape, rank, layout)


def resolve_moe_sharding(config: ModelConfig, tp: int, sharding: str | None) -> str | None:
    """The sharding a layout uses: the one asked for (checked) or the planner's; None when dense."""
    if not config.is_moe:
        if sharding is not None:
            raise ValueError(f"moe_sharding ({sharding!r}) applies to mixture-of-experts models; "
                             f"{config.model_type} with no experts takes none")
        return None
    check_moe_sharding_name(sharding)
    chosen = sharding or default_moe_sharding(config, tp)
    problems = [moe_sharding_problem(config.model_type, config.num_local_experts, config.intermediate_size, tp, s)
                for s in ([chosen] if chosen else MOE_SHARDINGS)]
    if any(problems):
        raise ValueError("; ".join(p for p in problems if p) + "; run `corelaunch plan` to list the degrees that work")
    return chosen
