"""Building one rank's decoder layers for every dense family, and the attention kinds they read.

An attention kind is what differs between layers of one model and is computed once per step, in
the prologue (workers/step.py): the rotary table (Gemma 3's local layers turn at their own base)
and the mask (sliding-window layers see only the last `window` tokens). Llama has one kind;
Mistral one (windowed); Gemma 3 and Qwen2/Qwen3 with max_window_layers two. Each DecoderLayer
names its kind by index, so the layer function (and its compiled graph) stays the same for all.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from shardlib.families import traits
from shardlib.model_config import ModelConfig
from shardlib.sharding import ShardLayout
from workers.collectives import Collectives
from workers.layers import MLP, Attention, DecoderLayer, LayerNorm, RMSNorm


class AttentionKind(NamedTuple):
    window: int | None
    """Sliding window (None: the whole history)."""
    rope_theta: float
    rope_scaling: dict | None


def layer_kinds(config: ModelConfig) -> tuple[tuple[AttentionKind, ...], list[int]]:
    """(the distinct attention kinds, in first-use order; each layer's index into them)."""
    kinds: list[AttentionKind] = []
    index = []
    for layer in range(config.num_hidden_layers):
        window = config.window_of(layer)
        if window is not None and config.local_rope_theta is not None:  # Gemma 3's local layers
            kind = AttentionKind(window, config.local_rope_theta, None)
        else:
            kind = AttentionKind(window, config.rope_theta, config.rope_scaling)
        if kind not in kinds:
            kinds.append(kind)
        index.append(kinds.index(kind))
    return tuple(kinds), index


def family_norm(config: ModelConfig, weight: torch.Tensor, dtype: torch.dtype) -> nn.Module:
    """One of the model's norms: RMSNorm ((1 + w) for Gemma), or DBRX's LayerNorm without bias."""
    if traits(config.model_type).layer_norm:
        return LayerNorm(weight, config.rms_norm_eps, dtype)
    return RMSNorm(weight, config.rms_norm_eps, dtype, traits(config.model_type).norm_offset)


def family_attention(config: ModelConfig, layout: ShardLayout, shard: dict[str, torch.Tensor], layer: int,
                     dtype: torch.dtype, collectives: Collectives) -> Attention:
    """Layer `layer`'s self_attn.* (q/k/v/o_proj, biases, q/k norms) from this rank's shard; the
    mixture-of-experts families with Llama's attention names (Mixtral, Qwen3-MoE) build theirs here too."""
    p = f"model.layers.{layer}.self_attn."
    attn = {k[len(p):]: v for k, v in shard.items() if k.startswith(p)}
    scale = None if config.query_pre_attn_scalar is None else config.query_pre_attn_scalar ** -0.5
    return Attention(attn, layout.q_heads_per_rank, layout.kv_heads_per_rank, config.head_dim, dtype, collectives,
                     eps=config.rms_norm_eps, norm_offset=traits(config.model_type).norm_offset, scale=scale)


def build_layer(config: ModelConfig, layout: ShardLayout, shard: dict[str, torch.Tensor], layer: int,
                kind: int, dtype: torch.dtype, collectives: Collectives) -> DecoderLayer:
    """Decoder layer `layer` from this rank's shard (names as in the checkpoint)."""
    p = f"model.layers.{layer}."
    mlp = {k[len(p + "mlp."):]: v for k, v in shard.items() if k.startswith(p + "mlp.")}

    def norm(name: str) -> nn.Module:
        return family_norm(config, shard[p + name + ".weight"], dtype)

    sandwich = ((norm("pre_feedforward_layernorm"), norm("post_feedforward_layernorm"))
                if traits(config.model_type).sandwich_norms else ())
    return DecoderLayer(
        family_attention(config, layout, shard, layer, dtype, collectives),
        MLP(mlp, dtype, collectives, config.hidden_act),
        norm("input_layernorm"), norm("post_attention_layernorm"), *sandwich, kind=kind)


def embedding_scale(config: ModelConfig, dtype: torch.dtype) -> torch.Tensor | None:
    """Gemma's sqrt(hidden_size), rounded to the weight dtype as transformers does; None for others."""
    if not traits(config.model_type).scaled_embeddings:
        return None
    return torch.tensor(config.hidden_size ** 0.5, dtype=dtype)
