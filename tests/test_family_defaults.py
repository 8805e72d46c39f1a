"""What a config.json leaves out, or sets where the family's modules never read it, means what it
means to transformers: each family's defaults (shardlib/families.py) against the installed
transformers' config classes, the bias flags against the modules transformers builds, and rope
fields transformers moves around (Phi-3's top-level original_max_position_embeddings). Config
reading only: the tokens these configs give are compared with transformers in test_families.py
and test_llama_variants.py."""

from __future__ import annotations

import pytest

from shardlib.families import traits
from shardlib.model_config import SUPPORTED_MODEL_TYPES, ModelConfig

# DBRX's config nests its fields (attn_config, ffn_config): shardlib/moe_configs.py reads them.
FLAT_FAMILIES = [t for t in SUPPORTED_MODEL_TYPES if t != "dbrx"]
TINY = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, vocab_size=64)


EXPERTS = {"mixtral": dict(num_local_experts=2, num_experts_per_tok=1),
           "qwen3_moe": dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=48)}


def tiny(model_type: str, **fields) -> dict:
    """A tiny config.json of the family, with `fields` on top."""
    return {"model_type": model_type, **TINY, **EXPERTS.get(model_type, {}), **fields}


def reference_config(model_type: str, **fields):
    """transformers' own config class for the family, with `fields` set."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **fields)


@pytest.mark.parametrize("model_type", FLAT_FAMILIES)
def test_each_family_defaults_as_transformers_config_class_does(model_type):
    reference = reference_config(model_type, use_sliding_window=True)  # the Qwen families' window needs it
    family = traits(model_type)
    if model_type != "gemma3_text":  # Gemma 3's thetas per layer kind: families._gemma_rope
        assert family.rope_theta == reference.rope_parameters["rope_theta"]
    assert family.rms_norm_eps == reference.rms_norm_eps
    assert family.max_position_embeddings == reference.max_position_embeddings
    assert family.sliding_window == getattr(reference, "sliding_window", None)
    assert family.tied_by_default == reference.tie_word_embeddings


@pytest.mark.parametrize("model_type", FLAT_FAMILIES)
def test_a_config_without_those_fields_gets_the_family_defaults(model_type):
    raw = tiny(model_type, use_sliding_window=True, max_window_layers=0)  # read by the Qwen families only:
    # the window on every layer (Qwen2 and Qwen3 keep it off the first max_window_layers, 28 by default)
    if model_type == "gemma3_text":
        raw["layer_types"] = ["sliding_attention"]
    config = ModelConfig.from_dict(raw)
    reference = reference_config(**raw)
    if model_type != "gemma3_text":
        assert config.rope_theta == reference.rope_parameters["rope_theta"]  # Mixtral: 1e6, not 1e4
    assert config.rms_norm_eps == reference.rms_norm_eps  # Mixtral: 1e-5
    assert config.max_position_embeddings == reference.max_position_embeddings
    # Mistral and Gemma 3 apply a 4096 window when the key is missing altogether
    assert config.sliding_window == getattr(reference, "sliding_window", None)
    if model_type == "gemma3_text":  # its sliding layers need a window (and take the local rope base)
        with pytest.raises(ValueError, match="sliding_window=None leaves Gemma 3's sliding_attention layers"):
            ModelConfig.from_dict({**raw, "sliding_window": None})
    else:
        assert ModelConfig.from_dict({**raw, "sliding_window": None}).sliding_window is None  # null: no window


@pytest.mark.parametrize("model_type", FLAT_FAMILIES)
def test_head_dim_and_kv_heads_left_out_take_the_shapes_transformers_builds(model_type):
    """A config.json without head_dim or num_key_value_heads: transformers' config class fills in
    its family's (Qwen3: head_dim 128; Gemma 3: 256; Mistral and Mixtral 8 KV heads, the Qwen
    families 32, Gemma 3 and Qwen3-MoE 4); corelaunch derived hidden_size / heads and the head
    count, so its plan sized other weights than the checkpoint holds."""
    from transformers import AutoModelForCausalLM

    raw = {k: v for k, v in tiny(model_type, hidden_size=256, num_attention_heads=32).items()
           if k not in ("head_dim", "num_key_value_heads")}
    if model_type == "gemma3_text":
        raw["layer_types"] = ["full_attention"]
    config = ModelConfig.from_dict(raw)
    attention = AutoModelForCausalLM.from_config(reference_config(**raw)).model.layers[0].self_attn
    assert config.head_dim == attention.head_dim
    assert config.num_key_value_heads * config.head_dim == attention.k_proj.out_features
    nulls = ModelConfig.from_dict({**raw, "head_dim": None, "num_key_value_heads": None})  # null: derived
    assert (nulls.head_dim, nulls.num_key_value_heads) == (256 // 32, 32)


def test_a_default_kv_head_count_that_cannot_divide_the_heads_names_the_missing_key():
    raw = {k: v for k, v in tiny("qwen2", hidden_size=56, num_attention_heads=14).items()
           if k != "num_key_value_heads"}
    with pytest.raises(ValueError, match=r"num_attention_heads=14 is not a multiple of 32, the num_key_value_heads "
                                         r"a qwen2 config has when it leaves that key out .* add num_key_value_heads"):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("model_type", FLAT_FAMILIES)
def test_bias_flags_count_only_where_the_familys_modules_read_them(model_type):
    """transformers' Mistral, Mixtral and Qwen2 ignore attention_bias and mlp_bias (their
    projections' biases are fixed); corelaunch expected bias tensors there and called such a
    checkpoint incomplete."""
    from transformers import AutoModelForCausalLM

    fields = tiny(model_type, attention_bias=True, mlp_bias=True)
    if model_type == "gemma3_text":
        fields["layer_types"] = ["full_attention"]
    reference = reference_config(**fields)
    names = {name for name, _ in AutoModelForCausalLM.from_config(reference).named_parameters()}
    layer = "model.layers.0."
    config = ModelConfig.from_dict(fields)
    assert config.attention_bias == (layer + "self_attn.q_proj.bias" in names)
    assert config.output_bias == (layer + "self_attn.o_proj.bias" in names)
    if not config.num_local_experts:  # experts: never biased
        assert config.mlp_bias == (layer + "mlp.gate_proj.bias" in names)


@pytest.mark.parametrize("rope_type, block", [
    ("yarn", {"factor": 4.0}),
    ("yarn", {"factor": 4.0, "original_max_position_embeddings": 16}),
    ("longrope", {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8}),
    ("llama3", {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    ("llama3", {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}),  # completed by the top-level one
])
def test_a_top_level_original_context_takes_precedence_as_in_transformers(tmp_path, rope_type, block):
    """Phi-3's layout: original_max_position_embeddings beside the rope block. transformers' model
    loading uses it over the block's own (its AutoConfig alone, in 5.24, does not); corelaunch fell
    back to the block's, or to max_position_embeddings."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    fields = {**TINY, "max_position_embeddings": 64, "rope_scaling": {"rope_type": rope_type, **block}}
    AutoModelForCausalLM.from_config(reference_config("llama", **fields)).save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    written["original_max_position_embeddings"] = 8
    for key in ("rope_scaling", "rope_parameters"):  # save_pretrained fills the block's own in: as given
        if isinstance(written.get(key), dict):
            written[key] = {"rope_type": rope_type, **block}
    (tmp_path / "config.json").write_text(json.dumps(written))
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).config
    assert reference.rope_parameters["original_max_position_embeddings"] == 8
    assert ModelConfig.from_dict(written).rope_scaling["original_max_position_embeddings"] == 8


def test_a_bidirectional_gemma3_is_refused():
    """EmbeddingGemma's setting: transformers attends both ways (and halves the window); corelaunch
    ran it as causal attention, its logits off by up to 1.2."""
    raw = tiny("gemma3_text", layer_types=["sliding_attention"], use_bidirectional_attention=True)
    with pytest.raises(ValueError, match=r"config.json field use_bidirectional_attention=True makes a bidirectional "
                                         r"encoder .* causal attention only"):
        ModelConfig.from_dict(raw)
    assert ModelConfig.from_dict({**raw, "use_bidirectional_attention": False}).model_type == "gemma3_text"


def test_gemma3_keeps_its_own_rope_blocks_original_context():
    """transformers merges Gemma 3's rope_scaling into its per-layer-kind blocks and never applies a
    top-level original_max_position_embeddings there."""
    fields = dict(layer_types=["full_attention"], max_position_embeddings=64, original_max_position_embeddings=8,
                  rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})
    config = ModelConfig.from_dict(tiny("gemma3_text", **fields))
    reference = reference_config("gemma3_text", **{**TINY, **fields})
    assert config.rope_scaling["original_max_position_embeddings"] == 16
    assert reference.rope_parameters["full_attention"]["original_max_position_embeddings"] == 16


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_expert_counts_and_width_left_out_take_transformers_defaults(model_type):
    """A Mixtral or Qwen3-MoE config.json without its expert counts (or Qwen3-MoE's expert width)
    was refused (num_local_experts 0), and Qwen3-MoE's experts took the dense intermediate_size,
    where transformers builds 8 of 2 (Mixtral) and 128 of 8, 768 wide (Qwen3-MoE)."""
    raw = {"model_type": model_type, **TINY, "intermediate_size": 4096}
    config = ModelConfig.from_dict(raw)
    reference = reference_config(**raw)
    experts = reference.num_local_experts if model_type == "mixtral" else reference.num_experts
    assert config.num_local_experts == experts
    assert config.num_experts_per_tok == reference.num_experts_per_tok
    width = getattr(reference, "moe_intermediate_size", reference.intermediate_size)
    assert config.intermediate_size == width
    family = traits(model_type)
    assert (family.num_local_experts, family.num_experts_per_tok) == (config.num_local_experts,
                                                                       config.num_experts_per_tok)
    if model_type == "qwen3_moe":
        assert ModelConfig.from_dict({**raw, "moe_intermediate_size": 48}).intermediate_size == 48


def test_dbrx_nested_defaults_are_transformers():
    from transformers import DbrxConfig

    reference = DbrxConfig()
    config = ModelConfig.from_dict({"model_type": "dbrx", "d_model": 32, "n_heads": 2, "n_layers": 1,
                                    "vocab_size": 64, "max_seq_len": 128})
    assert config.num_local_experts == reference.ffn_config.moe_num_experts
    assert config.num_experts_per_tok == reference.ffn_config.moe_top_k
    assert config.intermediate_size == reference.ffn_config.ffn_hidden_size
    assert config.num_key_value_heads == reference.attn_config.kv_n_heads
