"""Mixture-of-experts configs, sharding rules and routing, without running a model: the published
Qwen3-30B-A3B and DBRX configs read into the planner's fields, the planner's choice between
tensor-parallel and expert-parallel experts and its errors, the slices each rank reads, and the
router's top-k normalisation against transformers' own routers."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

import pytest
import torch

from shardlib.expert_sharding import EXPERT_PARALLEL, TENSOR_PARALLEL
from shardlib.families import traits
from shardlib.model_config import SUPPORTED_MODEL_TYPES, ModelConfig, load_model_config
from shardlib.param_shapes import expected_shapes
from shardlib.planner import plan
from shardlib.sharding import ShardLayout, slice_for
from workers.moe import routing_weights

CONFIGS = Path(__file__).parent / "data" / "configs"
QWEN3_MOE, DBRX, MIXTRAL = (load_model_config(CONFIGS / f"{n}.json")
                            for n in ("qwen3-30b-a3b", "dbrx-instruct", "mixtral-8x7b-v0.1"))


def test_published_configs_read_into_the_planners_fields():
    q = QWEN3_MOE
    assert (q.hidden_size, q.num_attention_heads, q.num_key_value_heads, q.head_dim) == (2048, 32, 4, 128)
    assert (q.intermediate_size, q.num_local_experts, q.num_experts_per_tok) == (768, 128, 8)  # moe_intermediate_size
    assert traits(q.model_type).qk_norm and q.moe_topk_norm == 1.0 and not traits(q.model_type).layer_norm
    d = DBRX  # d_model / n_heads / n_layers and the nested attn_config / ffn_config
    assert (d.hidden_size, d.num_attention_heads, d.num_hidden_layers, d.max_position_embeddings) == (6144, 48, 40, 32768)
    assert (d.num_key_value_heads, d.head_dim, d.rope_theta, d.clip_qkv) == (8, 128, 500000.0, 8.0)
    assert (d.intermediate_size, d.num_local_experts, d.num_experts_per_tok) == (10752, 16, 4)
    assert traits(d.model_type).layer_norm and d.moe_topk_norm == 1.0 and not d.tie_word_embeddings
    assert 131e9 < d.param_count() < 132e9  # DBRX's published 132B
    assert 30e9 < q.param_count() < 31e9  # Qwen3-30B-A3B
    assert MIXTRAL.moe_topk_norm == 1.0
    for config in (QWEN3_MOE, DBRX, MIXTRAL):
        assert config.executor_gaps() == []


def test_dense_config_hashes_are_unchanged_by_the_moe_fields():
    """Compiled and pre-sharded directories record config hashes: the new fields enter the hash only
    when set, so a dense model's hash is the one the fields' absence gave."""
    llama = load_model_config(CONFIGS / "llama-3.1-8b.json")
    fields = dataclasses.asdict(llama)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype",
                 "moe_topk_norm", "clip_qkv"):
        fields.pop(name)
    before = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]
    assert llama.config_hash() == before
    assert DBRX.config_hash() != ModelConfig(**{**DBRX.__dict__, "clip_qkv": None}).config_hash()


@pytest.mark.parametrize("raw,message", [
    (dict(model_type="gpt2", n_embd=768), "corelaunch supports llama, mistral, qwen2, qwen3, gemma3_text, mixtral, qwen3_moe, dbrx"),
    (dict(mlp_only_layers=[0, 2]), "mlp_only_layers=[0, 2]"),
    (dict(decoder_sparse_step=2), "decoder_sparse_step=2"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(norm_topk_prob="yes"), "norm_topk_prob='yes'"),
])
def test_unsupported_configs_are_refused_with_the_reason(raw, message):
    base = json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text())
    with pytest.raises(ValueError, match="^.*" + message.replace("[", r"\[").replace("]", r"\]")):
        ModelConfig.from_dict(base | raw)


@pytest.mark.parametrize("raw,message", [
    ({"attn_config": {"kv_n_heads": 8, "clip_qkv": -1}}, "attn_config.clip_qkv=-1"),
    ({"ffn_config": {"ffn_act_fn": {"name": "gelu"}}}, "ffn_act_fn.name='gelu'"),
    ({"attn_config": 8}, "attn_config=8"),
    ({"n_heads": None}, r"lacks required field\(s\) \['n_heads'\]"),
])
def test_bad_dbrx_configs_are_refused(raw, message):
    base = json.loads((CONFIGS / "dbrx-instruct.json").read_text())
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(base | raw)


def test_a_bad_dbrx_field_is_named_as_its_config_json_has_it():
    """Checked after the rename to Llama's names, they were refused as num_local_experts='4',
    num_experts_per_tok=9, intermediate_size=-3, hidden_size='32', fields a DBRX config.json lacks."""
    base = json.loads((CONFIGS / "dbrx-instruct.json").read_text())
    ffn = base["ffn_config"]
    for raw, name in (({"ffn_config": ffn | {"moe_num_experts": "4"}}, "ffn_config.moe_num_experts='4'"),
                      ({"ffn_config": ffn | {"moe_top_k": 99}}, "ffn_config.moe_top_k=99"),
                      ({"ffn_config": ffn | {"ffn_hidden_size": -3}}, "ffn_config.ffn_hidden_size=-3"),
                      ({"d_model": "32"}, "d_model='32'"), ({"n_heads": 0}, "n_heads=0"),
                      ({"attn_config": base["attn_config"] | {"rope_theta": -1}}, "attn_config.rope_theta=-1")):
        with pytest.raises(ValueError) as refused:
            ModelConfig.from_dict(base | raw)
        message = str(refused.value)
        assert f"config.json field {name}" in message, message
        assert not any(f"field {llama}=" in message for llama in (
            "num_local_experts", "num_experts_per_tok", "intermediate_size", "hidden_size", "num_attention_heads"))


def test_supported_model_types_list_the_moe_families():
    assert {"mixtral", "qwen3_moe", "dbrx"} <= set(SUPPORTED_MODEL_TYPES)


# ---- the planner's two shardings ---------------------------------------------------------------
def test_planner_prefers_tensor_parallel_experts_and_both_hold_the_same_bytes_when_divisible():
    tp = plan(QWEN3_MOE, instance="trn1.32xlarge", tp=32)
    ep = plan(QWEN3_MOE, instance="trn1.32xlarge", tp=32, moe_sharding=EXPERT_PARALLEL)
    assert tp.valid and ep.valid and tp.moe_sharding == TENSOR_PARALLEL and ep.moe_sharding == EXPERT_PARALLEL
    assert tp.memory.weight_bytes_per_rank == ep.memory.weight_bytes_per_rank
    assert ep.layout().moe_sharding == EXPERT_PARALLEL and ep.to_dict()["moe_sharding"] == EXPERT_PARALLEL


def test_planner_picks_expert_parallel_when_tensor_parallel_would_pad():
    # 8 experts of 14336 at TP 8 divide both ways; an intermediate of 100 at TP 8 pads to 104 per
    # expert under tensor_parallel, so whole experts (one per rank) hold less.
    padded = ModelConfig(**{**MIXTRAL.__dict__, "intermediate_size": 100})
    p = plan(padded, instance="trn1.32xlarge", tp=8)
    assert p.valid and p.moe_sharding == EXPERT_PARALLEL
    assert plan(MIXTRAL, instance="trn1.32xlarge", tp=8).moe_sharding == TENSOR_PARALLEL


def test_a_memory_refusal_names_the_other_expert_sharding_where_it_fits():
    """With 1-byte weights expert_parallel holds fewer float32 scales (its own experts' rows, not
    every expert's down rows): a plan refused at the default tensor_parallel fitted with it, and its
    ways out never said so."""
    asked = dict(instance="trn1.32xlarge", tp=8, dtype="int8", seq_len=4096, batch_size=105, serving_rows=9)
    refused = plan(QWEN3_MOE, **asked)
    assert not refused.valid and refused.moe_sharding == TENSOR_PARALLEL
    assert plan(QWEN3_MOE, **asked, moe_sharding=EXPERT_PARALLEL).valid
    text = next(issue.message for issue in refused.errors if issue.code == "insufficient_memory")
    assert "; --moe-sharding expert_parallel fits at tp 8, " in text, text
    forced = plan(QWEN3_MOE, **asked, moe_sharding=TENSOR_PARALLEL)  # the user's own choice: not second-guessed
    assert not forced.valid and "--moe-sharding" not in str(forced.errors)


def test_forced_expert_parallel_needs_experts_divisible_by_tp():
    p = plan(MIXTRAL, instance="trn1.32xlarge", tp=32, moe_sharding=EXPERT_PARALLEL)
    assert not p.valid and "moe_sharding_incompatible" in p.error_codes
    message = next(e.message for e in p.errors if e.code == "moe_sharding_incompatible")
    assert "num_local_experts (8) divisible by tp_degree (32)" in message
    assert "moe shardings that work at tp_degree 32: tensor_parallel" in message
    with pytest.raises(ValueError, match="num_local_experts \\(8\\) divisible by tp_degree \\(32\\)"):
        ShardLayout.for_model(MIXTRAL, 32, moe_sharding=EXPERT_PARALLEL)
    # the report's layout line pointed at no sharding at all ("no sharding fits") while the error
    # below it named tensor_parallel as one that works
    from launcher.cli.plan_command import format_report

    layout = format_report(p).splitlines()[1]
    assert layout.endswith("8 experts (no sharding: see moe_sharding_incompatible)") and "fits" not in layout


def test_report_says_what_each_rank_holds_of_the_experts():
    """The layout line said "per rank: ... 8 experts" under expert_parallel, where each rank holds 2."""
    from launcher.cli.plan_command import format_report

    def layout_line(sharding: str | None, tp: int = 4) -> str:
        return format_report(plan(MIXTRAL, instance="trn1.32xlarge", tp=tp, moe_sharding=sharding)).splitlines()[1]

    heads = "per rank: 8 Q heads, 2 KV heads, "
    assert layout_line(EXPERT_PARALLEL).endswith(heads + "2 whole experts of 8 (expert_parallel)")
    assert layout_line(TENSOR_PARALLEL).endswith(heads + "8 experts, 1/4 of each (tensor_parallel)")
    # one expert a rank was "1 whole experts of 8"; one rank holding them all was "1/1 of each"
    assert layout_line(EXPERT_PARALLEL, tp=8).endswith("1 KV heads, 1 whole expert of 8 (expert_parallel)")
    assert layout_line(None, tp=1).endswith("8 KV heads, 8 experts, whole (tensor_parallel)")


def test_dbrx_fused_experts_need_their_intermediate_divisible_under_tensor_parallel():
    odd = ModelConfig(**{**DBRX.__dict__, "intermediate_size": 10750})  # 10750 % 16 != 0, 16 experts % 16 == 0
    assert plan(odd, instance="trn2.48xlarge", tp=16).moe_sharding == EXPERT_PARALLEL
    forced = plan(odd, instance="trn2.48xlarge", tp=16, moe_sharding=TENSOR_PARALLEL)
    assert "moe_sharding_incompatible" in forced.error_codes
    assert "expert intermediate size (10750) divisible by tp_degree (16)" in forced.errors[0].message
    neither = ModelConfig(**{**odd.__dict__, "num_local_experts": 12})
    p = plan(neither, instance="trn2.48xlarge", tp=16)
    assert not p.valid and "moe_sharding_incompatible" in p.error_codes and p.moe_sharding is None


def test_moe_sharding_is_refused_for_dense_models_and_unknown_names():
    llama = load_model_config(CONFIGS / "llama-3.1-8b.json")
    with pytest.raises(ValueError, match="no experts: leave it unset"):
        plan(llama, moe_sharding=EXPERT_PARALLEL)
    with pytest.raises(ValueError, match="must be one of tensor_parallel, expert_parallel"):
        plan(MIXTRAL, moe_sharding="experts")


def test_planned_bytes_equal_the_slices_each_rank_reads():
    """The planner's per-rank weights are exactly the shard the sharding plan cuts (both shardings,
    the fused DBRX layout included), computed on scaled-down configs."""
    for config in (QWEN3_MOE, DBRX, MIXTRAL):
        small = ModelConfig(**{**config.__dict__, "num_hidden_layers": 1, "vocab_size": 64})
        for sharding in (TENSOR_PARALLEL, EXPERT_PARALLEL):
            p = plan(small, instance="trn2.48xlarge", tp=8, moe_sharding=sharding, dtype="bfloat16")
            layout = p.layout()
            held = sum(math.prod(slice_for(small.model_type, n, s, 3, layout).shape(s))
                       for n, s in expected_shapes(small).items())
            assert p.memory.weight_bytes_per_rank == 2 * held, (small.model_type, sharding)


def test_fused_qkv_slice_keeps_each_ranks_q_k_v_heads_together():
    layout = ShardLayout.for_model(DBRX, 16)  # 48 Q heads, 8 KV heads: replicate_to_tp, 3 Q + 1 KV per rank
    name = "transformer.blocks.0.norm_attn_norm.attn.Wqkv.weight"
    d, q, kv = 128, 48 * 128, 8 * 128
    s = slice_for("dbrx", name, (q + 2 * kv, 6144), 5, layout)
    assert s.ranges == ((15 * d, 18 * d), (q + 2 * d, q + 3 * d), (q + kv + 2 * d, q + kv + 3 * d))


def test_expert_parallel_ranks_read_only_their_own_experts():
    layout = ShardLayout.for_model(MIXTRAL, 4, moe_sharding=EXPERT_PARALLEL)  # experts 2 and 3 on rank 1
    name = "model.layers.0.block_sparse_moe.experts.{}.w2.weight"
    assert [slice_for("mixtral", name.format(e), (4096, 14336), 1, layout).shape((4096, 14336))
            for e in range(4)] == [(0, 14336), (0, 14336), (4096, 14336), (4096, 14336)]
    fused = ShardLayout.for_model(DBRX, 8, moe_sharding=EXPERT_PARALLEL)
    s = slice_for("dbrx", "transformer.blocks.0.ffn.experts.mlp.w2", (16 * 10752, 6144), 3, fused)
    assert s.ranges == ((6 * 10752, 8 * 10752),)


# ---- routing against transformers' routers -----------------------------------------------------
def _dense(weights: torch.Tensor, index: torch.Tensor, experts: int) -> torch.Tensor:
    return torch.zeros(weights.shape[0], experts).scatter(-1, index, weights.float())


def test_routing_weights_equal_transformers_routers():
    import transformers
    from transformers.models.dbrx.modeling_dbrx import DbrxFFN
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    torch.manual_seed(0)
    x = torch.randn(7, 16)
    mixtral = MixtralTopKRouter(transformers.MixtralConfig(hidden_size=16, num_local_experts=6, num_experts_per_tok=2))
    torch.nn.init.normal_(mixtral.weight)
    logits = x @ mixtral.weight.T
    _, w, i = mixtral(x)
    assert torch.equal(routing_weights(logits, 2, 1.0), _dense(w, i, 6))
    for norm in (False, True):
        cfg = transformers.Qwen3MoeConfig(hidden_size=16, num_experts=6, num_experts_per_tok=3, norm_topk_prob=norm)
        qwen = Qwen3MoeTopKRouter(cfg)
        torch.nn.init.normal_(qwen.weight)
        _, w, i = qwen(x)
        assert torch.equal(routing_weights(x @ qwen.weight.T, 3, 1.0 if norm else None), _dense(w, i, 6))
    for p in (1.0, 2.0, None):
        dbrx = DbrxFFN(transformers.DbrxConfig(d_model=16, ffn_config=dict(
            moe_num_experts=6, moe_top_k=3, moe_normalize_expert_weights=p)))
        logits = torch.randn(7, 6)
        w, i = dbrx.route_tokens_to_experts(logits)
        assert torch.allclose(routing_weights(logits, 3, p), _dense(w, i, 6), rtol=0, atol=1e-7), p
