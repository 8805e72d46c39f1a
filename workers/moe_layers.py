"""The decoder layers of the mixture-of-experts families (Mixtral, Qwen3-MoE, DBRX), built from one
rank's shard with the dense decoder's DecoderLayer: what differs is only the parts plugged in.

- attention: Mixtral's and Qwen3-MoE's is the dense Attention, built by workers/family_layers.py
  (Qwen3-MoE's per-head q/k RMSNorm included, as for Qwen3); DBRX's is `FusedQKVAttention`, the
  dense Attention fed by one fused [Q | K | V] projection (Wqkv, cut per rank so its Q, K and V heads
  stay together) and clamped by clip_qkv (--fused-projections builds the same class for the others);
- feed-forward: workers/moe.py's MoEBlock over the rank's experts;
- norms: family_layers.family_norm (RMSNorm, or DBRX's LayerNorm without bias).
"""

from __future__ import annotations

import torch
from torch import nn

from shardlib.expert_sharding import local_experts
from shardlib.model_config import ModelConfig
from shardlib.moe_params import layer_names
from shardlib.sharding import ShardLayout
from workers.collectives import Collectives
from workers.family_layers import family_attention, family_norm
from workers.layers import Attention, DecoderLayer, as_param, linear
from workers.moe import MoEBlock


class FusedQKVAttention(Attention):
    """Attention whose q, k, v come from one fused matrix (DBRX's Wqkv, or workers/fused_projections.py's
    fusion of the separate ones), optionally clamped to [-clip, clip] (DBRX). Everything after the
    projection is the dense Attention's: the per-head q/k norms, scale and o_proj bias it is given."""

    def __init__(self, qkv: torch.Tensor, o: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, collectives: Collectives, *, qkv_bias: torch.Tensor | None = None,
                 clip: float | None = None, q_norm: nn.Module | None = None, k_norm: nn.Module | None = None,
                 scale: float | None = None, o_bias: torch.Tensor | None = None) -> None:
        nn.Module.__init__(self)
        self.q_heads, self.kv_heads, self.head_dim = q_heads, kv_heads, head_dim
        self.collectives, self.clip, self.scale = collectives, clip, scale
        self.o_bias = None if o_bias is None else as_param(o_bias, dtype)
        self.split = (q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
        self.qkv_weight = as_param(qkv, dtype)  # this rank's [Q | K | V] rows
        self.qkv_bias = None if qkv_bias is None else as_param(qkv_bias, dtype)
        self.o_weight = as_param(o, dtype)
        self.q_norm, self.k_norm = q_norm, k_norm

    def project(self, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = linear(x, self.qkv_weight, self.qkv_bias).split(self.split, dim=-1)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        return self.heads(q, k, v, cos, sin)


def moe_decoder_layer(config: ModelConfig, layout: ShardLayout, rank: int, shard: dict[str, torch.Tensor],
                      layer: int, kind: int, dtype: torch.dtype, collectives: Collectives) -> DecoderLayer:
    """Layer `layer` of a MoE model from this rank's shard (names: shardlib/moe_params.py); kind: its
    attention kind (sliding window or not, workers/family_layers.layer_kinds)."""
    n = layer_names(config, layer)
    if n.qkv is not None:
        attention = FusedQKVAttention(shard[n.qkv], shard[n.o], layout.q_heads_per_rank, layout.kv_heads_per_rank,
                                      config.head_dim, dtype, collectives, clip=config.clip_qkv)
    else:
        attention = family_attention(config, layout, shard, layer, dtype, collectives)
    owned = local_experts(layout, rank)
    if config.model_type == "dbrx":  # one (local experts x rows, hidden) tensor per projection
        fused = [shard[name].view(len(owned), -1, config.hidden_size) for name in n.experts[0]]
        experts = [tuple(t[j] for t in fused) for j in range(len(owned))]
    else:
        experts = [tuple(shard[name] for name in n.experts[e]) for e in owned]
    moe = MoEBlock(shard[n.router], experts, owned.start, config.num_experts_per_tok, config.moe_topk_norm,
                   down_transposed=config.model_type == "dbrx", dtype=dtype, collectives=collectives)
    return DecoderLayer(attention, moe, family_norm(config, shard[n.input_norm], dtype),
                        family_norm(config, shard[n.post_attention_norm], dtype), kind=kind)
