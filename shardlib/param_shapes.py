"""The full (unsharded) shape of every parameter a checkpoint must hold, derived from ModelConfig.

Names are Hugging Face's, as in model.state_dict(). Weights are (out_features, in_features) like
nn.Linear. The checkpoint reader checks a checkpoint against this table before reading any bytes;
the planner and the pre-sharded format use it to size shards without opening a checkpoint.
"""

from __future__ import annotations

from shardlib.families import traits
from shardlib.model_config import ModelConfig
from shardlib.quantization import scale_name

LM_HEAD = "lm_head.weight"
EMBED = "model.embed_tokens.weight"


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Parameter name -> full shape, for every tensor the model needs.

    With tie_word_embeddings the LM head is the embedding matrix, so LM_HEAD is not listed (a
    checkpoint may still carry a copy of it; readers ignore it).
    """
    if config.is_moe:
        from shardlib.moe_params import moe_expected_shapes

        shapes = moe_expected_shapes(config)
    else:
        shapes = _dense_shapes(config)
    quant = config.quantization
    if quant is not None:  # each quantized weight's scale, named beside it (every family alike)
        for name, shape in list(shapes.items()):
            if quant.is_quantized(name, config.tie_word_embeddings):
                shapes[scale_name(name)] = quant.scale_shape(shape)
    return shapes


def _dense_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """expected_shapes of a dense (Llama-family) checkpoint, before quantization scales."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.q_size, config.kv_size
    family = traits(config.model_type)
    shapes: dict[str, tuple[int, ...]] = {EMBED: (v, h)}
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if config.output_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if family.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (config.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (config.head_dim,)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
        if config.mlp_bias:
            shapes[p + "mlp.gate_proj.bias"] = (i,)
            shapes[p + "mlp.up_proj.bias"] = (i,)
            shapes[p + "mlp.down_proj.bias"] = (h,)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if family.sandwich_norms:
            shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes[LM_HEAD] = (v, h)
    return shapes
