"""Expert fields at the edges of what config.json and checkpoints hold, read as transformers reads
them: stray expert fields on a dense model, Qwen3-MoE's null and out-of-range settings, and a
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


# ---- Qwen3-MoE's config fields -----------------------------------------------------------------
def test_qwen3_moe_null_num_local_experts_takes_num_experts():
    """`raw.get("num_local_experts", raw.get("num_experts"))` returned the null, so the family
    default of 128 experts replaced the 4 the file names."""
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
    """The router renormalises only when the flag is truthy; null was refused."""
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
