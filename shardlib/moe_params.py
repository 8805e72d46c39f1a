"""Parameter names and full shapes of the mixture-of-experts families' checkpoints.

Mixtral and Qwen3-MoE keep Llama's attention and norms and store one gate/up/down triple per
expert (as transformers' save_pretrained writes them, per expert, not its in-memory fused 3-D
tensors). DBRX names everything its own way and stores each layer's experts fused: w1 (gate),
v1 (up) and w2 (down, transposed) are each (experts x ffn_hidden_size, d_model), expert e's rows
at [e * ffn_hidden_size, (e + 1) * ffn_hidden_size); q, k and v are one Wqkv of rows [Q | K | V].
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlib.families import traits
from shardlib.model_config import ModelConfig


@dataclass(frozen=True)
class LayerNames:
    """The checkpoint names one decoder layer's parts read (None where the family has none)."""

    prefix: str
    q: str | None
    k: str | None
    v: str | None
    qkv: str | None
    """DBRX's fused Wqkv."""
    o: str
    input_norm: str
    post_attention_norm: str
    router: str
    experts: tuple[tuple[str, str, str], ...]
    """(gate, up, down) per expert; for DBRX one triple of fused tensors (w1, v1, w2)."""
    q_norm: str | None = None
    k_norm: str | None = None


@dataclass(frozen=True)
class ModelNames:
    embed: str
    final_norm: str
    lm_head: str = "lm_head.weight"


def model_names(config: ModelConfig) -> ModelNames:
    if config.model_type == "dbrx":
        return ModelNames("transformer.wte.weight", "transformer.norm_f.weight")
    return ModelNames("model.embed_tokens.weight", "model.norm.weight")


def layer_names(config: ModelConfig, layer: int) -> LayerNames:
    experts = range(config.num_local_experts)
    if config.model_type == "dbrx":
        p = f"transformer.blocks.{layer}."
        a = p + "norm_attn_norm."
        x = p + "ffn.experts.mlp."
        return LayerNames(p, None, None, None, a + "attn.Wqkv.weight", a + "attn.out_proj.weight",
                          a + "norm_1.weight", a + "norm_2.weight", p + "ffn.router.layer.weight",
                          ((x + "w1", x + "v1", x + "w2"),))
    p = f"model.layers.{layer}."
    s = p + "self_attn."
    if config.model_type == "mixtral":
        m = p + "block_sparse_moe."
        triples = tuple(tuple(f"{m}experts.{e}.{w}.weight" for w in ("w1", "w3", "w2")) for e in experts)
    else:
        m = p + "mlp."
        triples = tuple(tuple(f"{m}experts.{e}.{w}_proj.weight" for w in ("gate", "up", "down")) for e in experts)
    norms = (s + "q_norm.weight", s + "k_norm.weight") if traits(config.model_type).qk_norm else (None, None)
    return LayerNames(p, s + "q_proj.weight", s + "k_proj.weight", s + "v_proj.weight", None, s + "o_proj.weight",
                      p + "input_layernorm.weight", p + "post_attention_layernorm.weight", m + "gate.weight",
                      triples, *norms)


def moe_expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> full shape of every tensor a MoE checkpoint must hold (see param_shapes)."""
    h, i, e, v = config.hidden_size, config.intermediate_size, config.num_local_experts, config.vocab_size
    q, kv = config.q_size, config.kv_size
    names = model_names(config)
    shapes: dict[str, tuple[int, ...]] = {names.embed: (v, h)}
    for layer in range(config.num_hidden_layers):
        n = layer_names(config, layer)
        if n.qkv is not None:
            shapes[n.qkv] = (q + 2 * kv, h)
        else:
            shapes.update({n.q: (q, h), n.k: (kv, h), n.v: (kv, h)})
            if config.attention_bias:
                shapes.update({n.q[:-6] + "bias": (q,), n.k[:-6] + "bias": (kv,), n.v[:-6] + "bias": (kv,)})
        shapes[n.o] = (h, q)
        if config.output_bias:  # Qwen3-MoE's attention_bias biases o_proj too (DBRX has none)
            shapes[n.o[:-6] + "bias"] = (h,)
        if n.q_norm is not None:
            shapes.update({n.q_norm: (config.head_dim,), n.k_norm: (config.head_dim,)})
        shapes[n.router] = (e, h)
        for gate, up, down in n.experts:
            if config.model_type == "dbrx":
                shapes.update({gate: (e * i, h), up: (e * i, h), down: (e * i, h)})
            else:
                shapes.update({gate: (i, h), up: (i, h), down: (h, i)})
        shapes[n.input_norm] = (h,)
        shapes[n.post_attention_norm] = (h,)
    shapes[names.final_norm] = (h,)
    if not config.tie_word_embeddings:
        shapes[names.lm_head] = (v, h)
    return shapes
