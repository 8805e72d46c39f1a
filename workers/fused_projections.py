"""Fused projections, a load-time option: one [Q | K | V] matrix per attention block and one
[gate | up] matrix per MLP on each rank, instead of three and two.

Each rank fuses its own slices after loading, so the fused matrix is what a column-parallel cut of
a fused checkpoint would give it with each rank's Q, K and V heads (and gate and up rows) kept
together (shardlib.sharding's QKV_FUSED style cuts a fused checkpoint the same way): no rank
needs another's rows, and the math is the separate matrices' (the same products, concatenated).
Fewer, larger products: one read of x and one kernel launch (or one compiled reduction) instead of
three. Whether that is faster is measured by benchmarks/fused_projections.py; the option is off by
default (see the proposal's figures). Loading briefly holds both forms of one layer's weights.
Everything else a family adds (biases, q/k norms, score scale, activation) is carried over.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.collectives import Collectives
from workers.layers import MLP, Attention, Reduce, as_param, linear
from workers.moe_layers import FusedQKVAttention


def _cat(tensors) -> torch.Tensor | None:
    return None if tensors[0] is None else torch.cat(tensors).detach()


class FusedMLP(nn.Module):
    """down(act(g) * u) with [g | u] = x [W_gate | W_up]^T (+ bias) from one (2 x intermediate_per_rank,
    hidden) matrix."""

    def __init__(self, mlp: MLP, collectives: Collectives) -> None:
        super().__init__()
        dtype = mlp.gate_weight.dtype
        self.gate_up_weight = as_param(_cat([mlp.gate_weight, mlp.up_weight]), dtype)
        bias = _cat([mlp.gate_bias, mlp.up_bias])
        self.gate_up_bias = None if bias is None else as_param(bias, dtype)
        self.down_weight, self.down_bias, self.act = mlp.down_weight, mlp.down_bias, mlp.act
        self.collectives = collectives

    def forward(self, x: torch.Tensor, reduce: Reduce | None = None) -> torch.Tensor:
        gate, up = linear(x, self.gate_up_weight, self.gate_up_bias).chunk(2, dim=-1)
        out = (reduce or self.collectives.all_reduce)(linear(self.act(gate) * up, self.down_weight))
        return out if self.down_bias is None else out + self.down_bias


def fused_attention(attn: Attention) -> FusedQKVAttention:
    """The same attention (biases, q/k norms, scale kept) over one [Q | K | V] matrix."""
    return FusedQKVAttention(
        _cat([attn.q_weight, attn.k_weight, attn.v_weight]), attn.o_weight.detach(), attn.q_heads, attn.kv_heads,
        attn.head_dim, attn.q_weight.dtype, attn.collectives, qkv_bias=_cat([attn.q_bias, attn.k_bias, attn.v_bias]),
        q_norm=attn.q_norm, k_norm=attn.k_norm, scale=attn.scale,
        o_bias=None if attn.o_bias is None else attn.o_bias.detach())


def fuse_projections(model) -> None:
    """Replace every layer's separate q/k/v and gate/up matrices of a ShardedCausalLM by fused ones, in place.

    Mixture-of-experts layers keep their experts; DBRX's attention is fused already."""
    if model.config.quantization is not None:
        raise ValueError("fused projections need unquantized weights (each quantized weight keeps its own scale); "
                         "drop --fused-projections for a quantized checkpoint")
    for block in model.layers:
        if type(block.attention) is Attention:
            block.attention = fused_attention(block.attention)
        if type(block.mlp) is MLP:
            block.mlp = FusedMLP(block.mlp, block.mlp.collectives)
