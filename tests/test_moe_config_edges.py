"""Expert fields at the edges of what config.json and checkpoints hold, read as transformers reads
them: stray expert fields on a dense model (and a Mixtral saved as one), Mixtral's num_experts
alias, Qwen3-MoE's null and out-of-range settings (its nulls as transformers 4.x reads them:
transformers 5.25 refuses a null norm_topk_prob and leaves a null expert count None), and a
checkpoint saved from transformers' fused in-memory experts."""

from __future__ import annotations

import json

import pytest
import torch

from launcher.cli.plan_command import format_report
from shardlib.checkpoint import load_rank_shard
from shardlib.checkpoint_files import check_checkpoint
from shardlib.model_config import ModelConfig, load_model_config
from shardlib.planner import plan
from shardlib.sharding import ShardLayout
from tests.model_factory import build_random_model, checkpoint_state_dict, save_model

STRAY_EXPERTS = {"num_local_experts": 4, "num_experts_per_tok": 2}
QWEN3_MOE = dict(model_type="qwen3_moe", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128, head_dim=16, intermediate_size=200,
                 moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)


# ---- a dense model with stray expert fields ----------------------------------------------------
def test_dense_llama_with_stray_expert_fields_loads_and_plans_as_dense(tmp_path):
    """They made the Llama an MoE model, whose dense MLP tensors check_checkpoint then refused as
    tensors the config does not describe."""
    import transformers

    model = build_random_model("llama")
    save_model(model, tmp_path)
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **STRAY_EXPERTS}))
    # transformers' Llama keeps the fields but never reads them: it loads the dense MLPs
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert hasattr(reloaded.model.layers[0].mlp, "gate_proj")

    config = load_model_config(tmp_path)
    assert not config.is_moe and (config.num_local_experts, config.num_experts_per_tok) == (0, 0)
    check_checkpoint(tmp_path, config)
    loaded = load_rank_shard(tmp_path, config, ShardLayout.for_model(config, 1), 0)
    expected = checkpoint_state_dict(model)
    assert loaded.keys() == expected.keys() and all(torch.equal(loaded[n], expected[n]) for n in expected)
    planned = plan(config, tp=2)
    assert planned.moe_sharding is None and "experts" not in format_report(planned).splitlines()[1]


def test_dense_config_built_directly_with_experts_is_refused():
    """is_moe stands for an MoE family: a dense one given experts would be planned with them."""
    dense = build_random_model("llama").config.to_dict()
    with pytest.raises(ValueError, match="num_local_experts=4 is set for a llama model, which has no experts"):
        ModelConfig(**{**ModelConfig.from_dict(dense).__dict__, **STRAY_EXPERTS})


def _saved_mixtral(directory, **config_changes) -> dict:
    """A saved tiny Mixtral (4 experts) whose config.json is edited: key -> value, None deletes it."""
    save_model(build_random_model("mixtral"), directory)
    raw = json.loads((directory / "config.json").read_text())
    raw.update({k: v for k, v in config_changes.items() if v is not None})
    for key in (k for k, v in config_changes.items() if v is None):
        raw.pop(key)
    (directory / "config.json").write_text(json.dumps(raw))
    return raw


@pytest.mark.parametrize("dense_type", ["mistral", "llama"])
def test_a_mixtral_saved_as_a_dense_family_is_refused_naming_model_type(tmp_path, dense_type):
    """transformers reads it dense, and so does corelaunch; the refusal said "check that config.json
    belongs to these weights (num_hidden_layers=..., attention_bias=...)", not which field is wrong."""
    _saved_mixtral(tmp_path, model_type=dense_type)
    config = load_model_config(tmp_path)
    assert not config.is_moe
    with pytest.raises(ValueError) as refused:
        check_checkpoint(tmp_path, config)
    assert str(refused.value).endswith(
        f"'model.layers.0.block_sparse_moe.experts.0.w1.weight' is a mixture-of-experts tensor while config.json's "
        f"model_type is {dense_type} (a dense family, read without experts as transformers reads it): set "
        f"model_type in config.json to the family these weights were saved as (mixtral), and num_local_experts "
        f"to 4"), refused.value


def test_a_raw_moe_state_dict_saved_as_a_dense_family_names_model_type_first(tmp_path):
    """Fused in-memory experts under a dense model_type: the model_type is the first thing to fix."""
    save_model(build_random_model("qwen3_moe"), tmp_path, fmt="bin")
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "model_type": "qwen3"}))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.experts\.gate_up_proj' is a mixture-of-"
                                         r"experts tensor while config\.json's model_type is qwen3 .* \(qwen3_moe "
                                         r"or mixtral\)$"):
        check_checkpoint(tmp_path, load_model_config(tmp_path))


def test_mixtral_reads_num_experts_as_num_local_experts(tmp_path):
    """transformers 5's MixtralConfig maps num_experts to num_local_experts; corelaunch took the
    family default of 8 experts for the saved 4, and refused the checkpoint's tensors."""
    import transformers

    _saved_mixtral(tmp_path, num_local_experts=None, num_experts=4)
    assert transformers.AutoConfig.from_pretrained(tmp_path).num_local_experts == 4
    config = load_model_config(tmp_path)
    assert config.num_local_experts == 4
    check_checkpoint(tmp_path, config)
    # an explicit null beside it is the same file
    assert ModelConfig.from_dict({**json.loads((tmp_path / "config.json").read_text()),
                                  "num_local_experts": None}).num_local_experts == 4
    both = {**json.loads((tmp_path / "config.json").read_text()), "num_local_experts": 8}
    assert transformers.MixtralConfig(**both).num_local_experts == 4  # where both are set, num_experts wins
    assert ModelConfig.from_dict(both).num_local_experts == 4


# ---- Qwen3-MoE's config fields -----------------------------------------------------------------
def test_qwen3_moe_null_num_local_experts_takes_num_experts():
    """`raw.get("num_local_experts", raw.get("num_experts"))` returned the null, so the family
    default of 128 experts replaced the 4 the file names (transformers 4.x reads num_experts;
    5.25 leaves the count None)."""
    config = ModelConfig.from_dict({**QWEN3_MOE, "num_local_experts": None})
    assert config.num_local_experts == 4
    # both set: num_local_experts wins, as in transformers' Qwen3MoeConfig
    assert ModelConfig.from_dict({**QWEN3_MOE, "num_local_experts": 6}).num_local_experts == 6


def test_qwen3_moe_mlp_only_layers_past_the_last_layer_are_ignored(tmp_path):
    """transformers' layers never reach index 5 of a 2-layer model, so every layer is MoE; it was
    refused as putting dense layers between the MoE ones."""
    model = build_random_model("qwen3_moe", moe_options=dict(mlp_only_layers=[5, -1]))
    assert all(hasattr(layer.mlp, "experts") for layer in model.model.layers)  # transformers: all MoE
    save_model(model, tmp_path)
    config = load_model_config(tmp_path)
    assert config.is_moe
    check_checkpoint(tmp_path, config)
    # an index that names a layer still makes that layer dense, which corelaunch does not run
    with pytest.raises(ValueError, match=r"mlp_only_layers=\[1, 5\] puts dense MLP layers \(layers \[1\]\)"):
        ModelConfig.from_dict({**QWEN3_MOE, "mlp_only_layers": [1, 5]})
    with pytest.raises(ValueError, match="mlp_only_layers='1' must be a list of layer indices"):
        ModelConfig.from_dict({**QWEN3_MOE, "mlp_only_layers": "1"})


def test_qwen3_moe_null_norm_topk_prob_reads_as_false():
    """The router renormalises only when the flag is truthy, as transformers 4.x reads it (5.25
    refuses a null norm_topk_prob); null was refused."""
    assert ModelConfig.from_dict({**QWEN3_MOE, "norm_topk_prob": None}).moe_topk_norm is None
    assert ModelConfig.from_dict({**QWEN3_MOE, "norm_topk_prob": False}).moe_topk_norm is None
    assert ModelConfig.from_dict({**QWEN3_MOE, "norm_topk_prob": True}).moe_topk_norm == 1.0
    with pytest.raises(ValueError, match="norm_topk_prob='yes' must be true or false"):
        ModelConfig.from_dict({**QWEN3_MOE, "norm_topk_prob": "yes"})


# ---- transformers' fused in-memory experts -----------------------------------------------------
def test_fused_in_memory_experts_are_named_with_the_save_pretrained_fix(tmp_path):
    """A raw state_dict of transformers 5's Mixtral holds experts.gate_up_proj / experts.down_proj;
    the refusal blamed config.json ("check that config.json belongs to these weights")."""
    model = build_random_model("mixtral")
    assert any(name.endswith(".experts.gate_up_proj") for name in model.state_dict())
    save_model(model, tmp_path / "raw", fmt="bin")
    config = load_model_config(tmp_path / "raw")
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.experts\.gate_up_proj' is one of transformers' "
                                         r"fused in-memory experts .* model\.save_pretrained\(dir\)") as refusal:
        check_checkpoint(tmp_path / "raw", config)
    assert "config.json belongs" not in str(refusal.value)
    # the fix it names works: save_pretrained writes one tensor per expert
    model.save_pretrained(tmp_path / "saved")
    check_checkpoint(tmp_path / "saved", config)


@pytest.mark.parametrize("field, where", [
    ("d_model", "d_model: the columns of transformer.wte.weight"),
    ("n_layers", "n_layers: the count of transformer.blocks.N in the weights"),
    ("n_heads", "n_heads: 2 x attn_config.kv_n_heads x d_model / (the rows of a block's "
                "norm_attn_norm.attn.Wqkv.weight - d_model)"),
])
def test_a_dbrx_config_without_a_required_field_names_the_file_and_dbrxs_own_tensors(tmp_path, field, where):
    """It said "config.json lacks required field(s) ['d_model'] for a dbrx model": no path, no fix."""
    from pathlib import Path

    raw = json.loads((Path(__file__).parent / "data" / "configs" / "dbrx-instruct.json").read_text())
    del raw[field]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError) as refused:
        load_model_config(tmp_path)
    message = str(refused.value)
    assert message.startswith(f"{tmp_path / 'config.json'} lacks required field(s) ['{field}'] for a dbrx model; "
                              f"add each with the value in the original model's config.json"), message
    assert message.endswith(f"{where})"), message


def test_qwen2_moe_weights_saved_as_qwen2_are_named_as_the_family_corelaunch_does_not_run(tmp_path):
    """Its experts and shared expert under model_type qwen2 were told to set qwen3_moe or mixtral,
    which would refuse the shared expert's tensors in turn."""
    import transformers

    config = transformers.Qwen2MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=16,
                                         shared_expert_intermediate_size=32)
    transformers.Qwen2MoeForCausalLM(config).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "model_type": "qwen2"}))
    with pytest.raises(ValueError, match=r"and a shared expert are Qwen2-MoE's tensors while config\.json's "
                                         r"model_type is qwen2 .*corelaunch does not run Qwen2-MoE"):
        check_checkpoint(tmp_path, load_model_config(tmp_path))
