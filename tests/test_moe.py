"""Mixture-of-experts models (Mixtral, Qwen3-MoE, DBRX) against transformers: identical greedy tokens.

Each family runs at TP 1, at TP 2 under both expert shardings (tensor-parallel experts and expert
parallelism), and at TP 4, where the KV heads are replicated instead of split (replicate_to_tp);
every case also runs both prompts as one left-padded batch. Multi-rank cases run every rank as a
thread of this process (tests/tp_harness.py), from the tensors transformers' save_pretrained
writes; the sharded loader is checked to cut the same shards from the safetensors files, and one
case runs through the Launcher (in-process groups; the Ray version is marked slow).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from shardlib.checkpoint import load_rank_shard
from shardlib.expert_sharding import EXPERT_PARALLEL, TENSOR_PARALLEL
from shardlib.model_config import ModelConfig
from shardlib.sharding import KVStrategy, ShardLayout
from tests.model_factory import build_random_model, checkpoint_state_dict, save_model
from tests.tp_harness import Case, Request, build_rank_model, run_tp_in_process, shard_for_rank, token_ids
from workers.collectives import SingleRank
from workers.engine import generate
from workers.sampling import SamplingParams

PROMPTS = [[5, 9, 33, 17, 80, 3, 44, 12, 61], [7, 100, 21]]
NEW_TOKENS = 8
EOS = 2

FAMILIES = {
    "mixtral": dict(model_type="mixtral"),
    # norm_topk_prob false: the top-k weights are used unnormalised (the family's default)
    "qwen3_moe": dict(model_type="qwen3_moe"),
    # clip_qkv small enough to clamp many of q, k, v; moe_normalize_expert_weights 2: an L2 norm
    "dbrx": dict(model_type="dbrx", moe_options=dict(clip_qkv=0.8, moe_normalize_expert_weights=2.0)),
}
# Windows by the families' rule (shardlib/families.py), applied by workers/step.py's masks: the
# prompts' 9 tokens are past a window of 4. Not in the multi-rank degrees above (time).
WINDOWED = {
    "mixtral_window": dict(model_type="mixtral", sliding_window=4),
    "qwen3_moe_window": dict(model_type="qwen3_moe", sliding_window=4, use_sliding_window=True),
}
# Rope scaling on the families that take it: the prompts' 9 tokens and 8 new ones run past the
# original context of 8. (Mixtral's config has no head_dim of its own to scale by: given here.)
ROPE_SCALED = {
    "mixtral_yarn": dict(model_type="mixtral", head_dim=16, max_position_embeddings=64,
                         rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}),
    "qwen3_moe_llama3": dict(model_type="qwen3_moe", max_position_embeddings=64,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8}),
}
# Qwen3-MoE's attention_bias biases q, k, v and o_proj (random here: tests/model_factory.py)
BIASED = {"qwen3_moe_bias": dict(model_type="qwen3_moe", attention_bias=True)}
# (tp, moe sharding, the KV strategy the layout must pick); 4 KV-head-2 models at TP 4 replicate
DEGREES = [(2, TENSOR_PARALLEL, KVStrategy.SHARD), (2, EXPERT_PARALLEL, KVStrategy.SHARD),
           (4, TENSOR_PARALLEL, KVStrategy.REPLICATE_TO_TP), (4, EXPERT_PARALLEL, KVStrategy.REPLICATE_TO_TP)]


def hf_greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                         eos_token_id=EOS, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@functools.lru_cache(maxsize=None)
def reference(family: str):
    """(transformers model, ModelConfig, checkpoint tensors, greedy tokens per prompt)."""
    model = build_random_model(**{**FAMILIES, **WINDOWED, **ROPE_SCALED, **BIASED}[family])
    with torch.no_grad():  # the MoE factories leave biases at their zero start: random, so they count
        for name, tensor in model.named_parameters():
            if name.endswith(".bias"):
                tensor.normal_(0.0, 0.1)
    config = ModelConfig.from_dict(model.config.to_dict())
    with torch.inference_mode():
        refs = [hf_greedy(model, prompt) for prompt in PROMPTS]
    return model, config, checkpoint_state_dict(model), refs


def requests() -> list[Request]:
    return [Request([p], NEW_TOKENS, [EOS]) for p in PROMPTS] + [Request(PROMPTS, NEW_TOKENS, [EOS])]


@pytest.fixture(scope="module")
def multi_rank_outputs() -> dict[tuple[str, int, str], dict[int, list[list]]]:
    """{(family, tp, sharding): {rank: outputs per request}}, each degree's cases in one group."""
    outputs = {}
    for tp in sorted({tp for tp, _, _ in DEGREES}):
        cases = [Case(f"{family}-{sharding}", reference(family)[1], reference(family)[2], requests(),
                      moe_sharding=sharding)
                 for family in FAMILIES for t, sharding, _ in DEGREES if t == tp]
        by_rank = run_tp_in_process(tp, cases, timeout_s=180)
        for case in cases:
            family, sharding = case.name.split("-")
            outputs[family, tp, sharding] = {rank: by_rank[rank][case.name] for rank in by_rank}
    return outputs


@pytest.mark.parametrize("family", FAMILIES)
def test_tp1_greedy_matches_transformers(family):
    _, config, state_dict, refs = reference(family)
    model = build_rank_model(config, state_dict, 0, 1, SingleRank())
    for prompt, ref in zip(PROMPTS, refs):
        [out] = generate(model, [prompt], [SamplingParams()], NEW_TOKENS, [EOS])
        assert out.token_ids == ref
    batch = generate(model, PROMPTS, [SamplingParams()] * 2, NEW_TOKENS, [EOS])
    assert [out.token_ids for out in batch] == refs


@pytest.mark.parametrize("tp,sharding,strategy", DEGREES, ids=[f"tp{t}-{s}" for t, s, _ in DEGREES])
@pytest.mark.parametrize("family", FAMILIES)
def test_multi_rank_greedy_matches_transformers(family, tp, sharding, strategy, multi_rank_outputs):
    _, config, _, refs = reference(family)
    layout = ShardLayout.for_model(config, tp, moe_sharding=sharding)
    assert layout.kv_strategy is strategy and layout.moe_sharding == sharding  # the case tests what it claims
    by_rank = multi_rank_outputs[family, tp, sharding]
    assert sorted(by_rank) == list(range(tp))
    alone, batch = by_rank[0][:len(PROMPTS)], by_rank[0][len(PROMPTS)]
    assert [token_ids(out) for out in alone] == [[ref] for ref in refs]
    assert token_ids(batch) == refs  # two prompts of different lengths in one left-padded batch
    for rank in range(1, tp):
        assert [token_ids(r) for r in by_rank[rank]] == [token_ids(r) for r in by_rank[0]], f"rank {rank}"


def tp1_tokens(config: ModelConfig, state_dict: dict) -> list[list[int]]:
    model = build_rank_model(config, state_dict, 0, 1, SingleRank())
    return [out.token_ids for out in generate(model, PROMPTS, [SamplingParams()] * 2, NEW_TOKENS, [EOS])]


@pytest.mark.parametrize("family", WINDOWED)
def test_moe_sliding_windows_match_transformers(family):
    _, config, state_dict, refs = reference(family)
    assert all(config.window_of(layer) == 4 for layer in range(config.num_hidden_layers))
    assert tp1_tokens(config, state_dict) == refs
    unwindowed = dataclasses.replace(config, sliding_window=None, layer_types=None)
    assert tp1_tokens(unwindowed, state_dict) != refs  # the window is what makes them equal


@pytest.mark.parametrize("family", ROPE_SCALED)
def test_moe_rope_scaling_matches_transformers(family):
    """The test factory dropped rope_scaling for these families, so no test had scaled their rope."""
    model, config, state_dict, refs = reference(family)
    wanted = ROPE_SCALED[family]["rope_scaling"]["rope_type"]
    assert model.config.rope_parameters["rope_type"] == wanted and config.rope_scaling["rope_type"] == wanted
    assert tp1_tokens(config, state_dict) == refs
    assert tp1_tokens(dataclasses.replace(config, rope_scaling=None), state_dict) != refs  # the scaling mattered


def test_qwen3_moe_attention_biases_load_and_match_transformers(tmp_path):
    """Its checkpoints hold self_attn.o_proj.bias, which the MoE tensor list lacked: every such
    checkpoint was refused as holding tensors its config does not describe."""
    model, config, state_dict, refs = reference("qwen3_moe_bias")
    assert config.attention_bias and config.output_bias
    assert any(name.endswith("self_attn.o_proj.bias") and bool(t.any()) for name, t in state_dict.items())
    assert tp1_tokens(config, state_dict) == refs
    save_model(model, tmp_path)
    cases = []
    for sharding in (TENSOR_PARALLEL, EXPERT_PARALLEL):
        layout = ShardLayout.for_model(config, 2, moe_sharding=sharding)
        for rank in range(2):
            loaded = load_rank_shard(tmp_path, config, layout, rank)  # refused before: o_proj.bias not described
            expected = shard_for_rank(config, state_dict, rank, layout)
            assert loaded.keys() == expected.keys() and all(torch.equal(loaded[n], expected[n]) for n in expected)
        cases.append(Case(sharding, config, state_dict, requests(), moe_sharding=sharding))
    by_rank = run_tp_in_process(2, cases, timeout_s=180)
    for sharding in (TENSOR_PARALLEL, EXPERT_PARALLEL):
        alone, batch = by_rank[0][sharding][:len(PROMPTS)], by_rank[0][sharding][len(PROMPTS)]
        assert [token_ids(out) for out in alone] == [[ref] for ref in refs] and token_ids(batch) == refs, sharding


def test_padded_q_heads_with_windowed_tensor_parallel_experts():
    """4 Q heads at TP 3: padded to 6 (NxD Inference's layout), experts split 32 columns per rank."""
    _, config, state_dict, refs = reference("mixtral_window")
    layout = ShardLayout.for_model(config, 3, pad_q_heads=True, moe_sharding=TENSOR_PARALLEL)
    assert layout.q_heads_per_rank == 2 and layout.pad_q_heads
    case = Case("padded", config, state_dict, requests(), pad_q_heads=True, moe_sharding=TENSOR_PARALLEL)
    by_rank = run_tp_in_process(3, [case], timeout_s=120)
    for rank in range(3):
        alone, batch = by_rank[rank]["padded"][:len(PROMPTS)], by_rank[rank]["padded"][len(PROMPTS)]
        assert [token_ids(out) for out in alone] == [[ref] for ref in refs] and token_ids(batch) == refs


def test_fused_wqkv_refuses_padded_q_heads():
    _, config, _, _ = reference("dbrx")
    with pytest.raises(ValueError, match="--pad-q-heads is not supported for dbrx"):
        ShardLayout.for_model(config, 3, pad_q_heads=True)
    # the planner refuses it too, before any start-up (it planned a valid layout the loader then refused),
    # and does not offer padding as a way out
    from shardlib.planner import plan

    with pytest.raises(ValueError, match=r"pad_q_heads \(--pad-q-heads\) is not supported for dbrx"):
        plan(config, tp=3, pad_q_heads=True)
    unpadded = plan(config, tp=3)
    assert [e.code for e in unpadded.errors] == ["heads_not_divisible"]
    assert "pad" not in unpadded.errors[0].message


@pytest.mark.parametrize("sharding", [TENSOR_PARALLEL, EXPERT_PARALLEL])
@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_loader_reads_the_tested_shards_from_safetensors(family, sharding, tmp_path):
    """load_rank_shard on the saved checkpoint gives each rank exactly the tensors the cases above ran
    on; under expert parallelism a rank holds (and reads) nothing of another rank's experts."""
    model, config, state_dict, _ = reference(family)
    save_model(model, tmp_path)
    for rank in range(2):
        layout = ShardLayout.for_model(config, 2, moe_sharding=sharding)
        loaded = load_rank_shard(tmp_path, config, layout, rank)
        expected = shard_for_rank(config, state_dict, rank, layout)
        assert loaded.keys() == expected.keys()
        assert all(torch.equal(loaded[n], expected[n]) for n in expected)
        expert_bytes = sum(t.numel() for n, t in loaded.items() if ".experts." in n)
        all_expert_bytes = sum(t.numel() for n, t in state_dict.items() if ".experts." in n)
        assert expert_bytes * 2 == all_expert_bytes  # half the experts' weights, either way


def test_launcher_runs_expert_parallel_mixtral(tmp_path, in_process_cluster):
    """Planning, loading from disk and serving with --moe-sharding expert_parallel (no Ray)."""
    from launcher.api import Launcher

    model, _, _, refs = reference("mixtral")
    save_model(model, tmp_path)
    with Launcher(model=str(tmp_path), tp=2, compile=False, moe_sharding=EXPERT_PARALLEL, progress=False) as launcher:
        assert launcher.plan.moe_sharding == EXPERT_PARALLEL
        results = launcher.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    # the launcher stops at the config's EOS (2) as the reference does
    assert [r.token_ids for r in results] == refs


@pytest.mark.slow
def test_ray_group_runs_tensor_parallel_dbrx(tmp_path, ray_session):
    from launcher.api import Launcher

    model, _, _, refs = reference("dbrx")
    save_model(model, tmp_path)
    with Launcher(model=str(tmp_path), tp=2, compile=False, progress=False) as launcher:
        assert launcher.plan.moe_sharding == TENSOR_PARALLEL
        assert [r.token_ids for r in launcher.generate(PROMPTS, max_new_tokens=NEW_TOKENS)] == refs


@pytest.mark.slow  # about a minute of torch.compile on two shared cores
def test_compiled_graphs_give_the_transformers_tokens():
    """The routing is static-shaped: one fullgraph per bucket serves every routing (TP 1, Qwen3-MoE:
    q/k norms and unnormalised top-k; the decode graph uses the multiply-and-sum products)."""
    from shardlib.buckets import Buckets
    from workers.compiled import CompiledCausalLM

    _, config, state_dict, refs = reference("qwen3_moe")
    buckets = Buckets.build(context=[16], token=[32], batch=[2])
    compiled = CompiledCausalLM(build_rank_model(config, state_dict, 0, 1, SingleRank()), buckets)
    outputs = generate(compiled, PROMPTS, [SamplingParams()] * 2, NEW_TOKENS, [EOS])
    assert [out.token_ids for out in outputs] == refs
    assert {(g.phase, g.batch) for g in compiled.stats().graphs} == {("context", 2), ("token", 2)}


def test_presharded_weights_record_and_check_the_moe_sharding(tmp_path):
    from shardlib.presharded import load_presharded, save_presharded

    model, config, state_dict, _ = reference("dbrx")
    save_model(model, tmp_path / "hf")
    ep = ShardLayout.for_model(config, 2, moe_sharding=EXPERT_PARALLEL)
    save_presharded(tmp_path / "pre", tmp_path / "hf", config, ep)
    shard = load_presharded(tmp_path / "pre", config, ep, 1)
    expected = shard_for_rank(config, state_dict, 1, ep)
    assert all(torch.equal(shard[n], expected[n]) for n in expected)
    tp = ShardLayout.for_model(config, 2, moe_sharding=TENSOR_PARALLEL)
    with pytest.raises(ValueError, match="moe_sharding: expected 'tensor_parallel', found 'expert_parallel'"):
        load_presharded(tmp_path / "pre", config, tp, 1)
