"""Fused projections (workers/fused_projections.py): the same greedy tokens as transformers with
each rank's q/k/v and gate/up matrices fused, at TP 1 and on in-process ranks at TP 2 (split KV
heads, Qwen2's q/k/v biases) and TP 3 (KV heads converted to MHA); Qwen3 and Gemma 3 keep their q/k
norms, score scale, activation and sandwich norms; a MoE model fuses its attention."""

from __future__ import annotations

import pytest
import torch

from tests.test_model_tp import PROMPTS, reference, requests_for
from tests.tp_harness import Case, build_rank_model, run_tp_in_process, token_ids
from workers.collectives import SingleRank
from workers.engine import generate
from workers.fused_projections import FusedMLP, fuse_projections
from workers.moe_layers import FusedQKVAttention
from workers.sampling import SamplingParams

MULTI_RANK = {2: ["llama_split_tp2", "qwen2_bias_tp2"], 3: ["convert_to_mha_tp3"]}


def test_fused_tp1_model_matches_transformers_and_holds_one_matrix_per_group():
    config, state_dict, refs = reference("qwen2_tp1")
    model = build_rank_model(config, state_dict, 0, 1, SingleRank())
    separate_bytes = sum(p.numel() for p in model.parameters())
    fuse_projections(model)
    assert all(isinstance(b.attention, FusedQKVAttention) and b.attention.qkv_weight is not None
               and isinstance(b.mlp, FusedMLP) for b in model.layers)
    assert sum(p.numel() for p in model.parameters()) == separate_bytes  # fused, not copied twice
    outputs = generate(model, PROMPTS, [SamplingParams()] * len(PROMPTS), 10, [2])
    assert [o.token_ids for o in outputs] == refs


@pytest.mark.parametrize("tp", sorted(MULTI_RANK))
def test_fused_multi_rank_models_match_transformers(tp):
    cases = [Case(name, reference(name)[0], reference(name)[1], requests_for(name), fused_projections=True)
             for name in MULTI_RANK[tp]]
    by_rank = run_tp_in_process(tp, cases, timeout_s=120)
    for case in cases:
        refs = reference(case.name)[2]
        for rank in range(tp):
            assert [token_ids(r) for r in by_rank[rank][case.name][:len(PROMPTS)]] == [[r] for r in refs]


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_fused_families_keep_their_norms_and_match_transformers(name):
    from tests.test_families import check, reference as family_reference, requests as family_requests

    config, state_dict, _ = family_reference(name)
    model = build_rank_model(config, state_dict, 0, 1, SingleRank())
    fuse_projections(model)
    assert all(isinstance(b.attention, FusedQKVAttention) and b.attention.q_norm is not None for b in model.layers)
    with torch.inference_mode():
        check(name, [generate(model, r.prompts, r.sampling(), r.max_new_tokens, r.stop_token_ids)
                     for r in family_requests()])


def test_moe_attention_is_fused_and_experts_kept():
    from tests.test_moe import reference as moe_reference

    _, config, state_dict, refs = moe_reference("mixtral")
    model = build_rank_model(config, state_dict, 0, 1, SingleRank())
    fuse_projections(model)
    assert all(b.attention.qkv_weight is not None for b in model.layers)
    with torch.inference_mode():
        outputs = generate(model, PROMPTS, [SamplingParams()] * 2, 8, [2])
    assert [o.token_ids for o in outputs] == refs
