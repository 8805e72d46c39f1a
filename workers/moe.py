"""A mixture-of-experts feed-forward block over one rank's experts, with static shapes only.

Routing (each family's, transformers' order of operations): router logits = x W_router^T, a
softmax over all experts in float32, the top-k of those probabilities, then optionally divided by
their L-p norm (ModelConfig.moe_topk_norm: p = 1 is their sum, as Mixtral, Qwen3-MoE with
norm_topk_prob and DBRX with moe_normalize_expert_weights 1 do).

Static formulation: the top-k weights are scattered into a dense (tokens, experts) matrix, zero for
the experts a token was not routed to, and every local expert runs on every token; its output is
scaled by its column of that matrix and summed. No shape depends on the routing (no gather of the
tokens routed to an expert, no per-expert token counts), so one compiled graph serves every batch
of a bucket and every routing. The price is compute: every local expert runs for every token,
num_experts / top_k times the sparse FLOPs (Mixtral 8 / 2 = 4x); at decode the weights of every
local expert are read whatever the routing (benchmarks/moe_dense_routing.py measures both).

Parallelism: under tensor_parallel experts each rank holds a slice of every expert's intermediate
dimension; under expert_parallel each rank holds whole experts and multiplies only its columns of
the routing matrix. Either way a rank's output is a partial sum of the block's output, and one
all-reduce completes it (shardlib/expert_sharding.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.collectives import Collectives
from workers.layers import Reduce, as_param, linear


def routing_weights(router_logits: torch.Tensor, top_k: int, norm_p: float | None) -> torch.Tensor:
    """(tokens, experts) float32: each token's top-k routing weights at their experts, zeros elsewhere."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    top, chosen = torch.topk(probs, top_k, dim=-1)
    if norm_p == 1.0:
        top = top / top.sum(dim=-1, keepdim=True)
    elif norm_p is not None:
        top = top / torch.linalg.vector_norm(top, ord=norm_p, dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter(-1, chosen, top)


def down_projection(h: torch.Tensor, weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """h W^T for a (hidden, intermediate) W; h W for DBRX's w2, stored (intermediate, hidden)."""
    if not transposed:
        return linear(h, weight)
    if torch.compiler.is_compiling() and h.numel() // h.shape[-1] <= 1:
        return (h.unsqueeze(-1) * weight).sum(-2)  # the decode multiply-and-sum of layers.linear
    return h @ weight


class MoEBlock(nn.Module):
    """sum over local experts e of routing[:, e] * down_e(silu(gate_e(x)) * up_e(x)), all-reduced.

    experts: (gate, up, down) per local expert, in expert order; first_expert: the global index of
    the first (the routing matrix's columns are global expert ids)."""

    def __init__(self, router_weight: torch.Tensor, experts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                 first_expert: int, top_k: int, norm_p: float | None, down_transposed: bool, dtype: torch.dtype,
                 collectives: Collectives) -> None:
        super().__init__()
        self.router_weight = as_param(router_weight, dtype)  # (experts, hidden), replicated
        self.gates = nn.ParameterList([as_param(g, dtype) for g, _, _ in experts])
        self.ups = nn.ParameterList([as_param(u, dtype) for _, u, _ in experts])
        self.downs = nn.ParameterList([as_param(d, dtype) for _, _, d in experts])
        self.first_expert, self.top_k, self.norm_p = first_expert, top_k, norm_p
        self.down_transposed = down_transposed
        self.collectives = collectives

    def forward(self, x: torch.Tensor, reduce: Reduce | None = None) -> torch.Tensor:
        weights = routing_weights(linear(x, self.router_weight), self.top_k, self.norm_p)  # (batch, seq, experts)
        out = torch.zeros_like(x)
        for j, (gate, up, down) in enumerate(zip(self.gates, self.ups, self.downs)):
            h = F.silu(linear(x, gate)) * linear(x, up)
            y = down_projection(h, down, self.down_transposed)
            column = weights[..., self.first_expert + j, None]
            out = out + (y * column).to(x.dtype)  # weighted in float32 (transformers' Mixtral too; its Qwen3-MoE and DBRX in the model dtype)
        return (reduce or self.collectives.all_reduce)(out)
