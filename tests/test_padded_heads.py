"""Padded Q heads executed: a TP degree that does not divide the attention heads runs with zero heads
added in NxD Inference's layout, and gives transformers' greedy tokens.

Layout (shardlib/sharding.py, ShardLayout.q_head_sources): with KV heads replicated the zero heads
are interleaved, appended to each KV head's group, so every rank's Q heads read its own KV head;
under convert_to_mha they are appended after the last head, with zero KV heads to match.
"""

from __future__ import annotations

import pytest
import torch

from shardlib.model_config import ModelConfig
from shardlib.planner import plan
from shardlib.sharding import KVStrategy, ShardLayout, apply_slice, slice_for
from tests.model_factory import build_random_model
from tests.test_model_tp import hf_greedy
from tests.tp_harness import Case, Request, hf_state_dict, run_tp_in_process, token_ids

PROMPTS = [[5, 9, 33, 17, 80, 3, 44, 12, 61], [7, 100, 21]]
NEW_TOKENS, EOS = 8, 2

# name: (tp, build_random_model arguments, the KV strategy the padded layout must pick)
SPECS = {
    "interleaved_tp4": (4, dict(hidden_size=48, num_heads=6, num_kv_heads=2), KVStrategy.REPLICATE_TO_TP),
    "interleaved_tp2": (2, dict(hidden_size=48, num_heads=3, num_kv_heads=1), KVStrategy.REPLICATE_TO_TP),
    "tail_mha_tp4": (4, dict(hidden_size=48, num_heads=6, num_kv_heads=3), KVStrategy.CONVERT_TO_MHA),
    "qwen3_tp4": (4, dict(model_type="qwen3", hidden_size=48, num_heads=6, num_kv_heads=2, head_dim=16),
                  KVStrategy.REPLICATE_TO_TP),
}


def config_of(model) -> ModelConfig:
    return ModelConfig.from_dict(model.config.to_dict())


def test_interleaved_layout_lines_q_heads_up_with_kv_heads():
    # 6 Q heads in 2 groups of 3 (one per KV head), padded to 8: groups of 4, two ranks per group
    layout = ShardLayout.for_model(config_of(build_random_model(**SPECS["interleaved_tp4"][1])), 4, pad_q_heads=True)
    assert layout.padded_heads == 8 and layout.q_heads_per_rank == 2
    assert [layout.q_head_sources(r) for r in range(4)] == [[0, 1], [2, None], [3, 4], [5, None]]
    assert [layout.kv_head_ids(r) for r in range(4)] == [[0], [0], [1], [1]]
    group = 6 // 2
    for rank in range(4):  # every real Q head reads the KV head its rank holds
        assert all(q // group == layout.kv_head_ids(rank)[0] for q in layout.q_head_sources(rank) if q is not None)


def test_tail_layout_under_convert_to_mha_pads_kv_heads_too():
    config = config_of(build_random_model(**SPECS["tail_mha_tp4"][1]))
    layout = ShardLayout.for_model(config, 4, pad_q_heads=True)
    assert layout.kv_strategy is KVStrategy.CONVERT_TO_MHA
    assert [layout.q_head_sources(r) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [None, None]]
    assert [layout.kv_head_ids(r) for r in range(4)] == [[0, 0], [1, 1], [2, 2], [None, None]]
    k = torch.randn(3 * 8, 48)
    last = apply_slice(k, slice_for("llama", "model.layers.0.self_attn.k_proj.weight", k.shape, 3, layout))
    assert last.shape == (16, 48) and not last.any()  # zero KV heads for the zero Q heads


def test_without_padding_the_layout_is_refused_with_the_flag_named():
    config = config_of(build_random_model(**SPECS["interleaved_tp4"][1]))
    with pytest.raises(ValueError, match="--pad-q-heads"):
        ShardLayout.for_model(config, 4)
    assert ShardLayout.for_model(config, 2, pad_q_heads=True).pad_q_heads is False  # nothing to pad


def test_the_planner_hands_out_the_padded_layout():
    config = config_of(build_random_model(**SPECS["interleaved_tp4"][1]))
    p = plan(config, tp=4, pad_q_heads=True)
    assert p.valid and p.padded_q_heads == 8 and p.padding_waste.extra_q_heads == 2
    assert p.layout() == ShardLayout.for_model(config, 4, pad_q_heads=True)
    assert not any("sizing only" in w for w in p.warnings)


@pytest.mark.parametrize("tp", [2, 4])
def test_padded_tokens_equal_transformers(tp):
    names = [name for name, spec in SPECS.items() if spec[0] == tp]
    cases, expected = [], {}
    for name in names:
        _, kwargs, strategy = SPECS[name]
        model = build_random_model(**kwargs)
        config = config_of(model)
        assert config.num_attention_heads % tp and ShardLayout.for_model(config, tp, pad_q_heads=True).kv_strategy is strategy
        with torch.inference_mode():
            expected[name] = [hf_greedy(model, prompt, NEW_TOKENS) for prompt in PROMPTS]
        requests = [Request([p], NEW_TOKENS, [EOS]) for p in PROMPTS] + [Request(PROMPTS, NEW_TOKENS, [EOS])]
        cases.append(Case(name, config, hf_state_dict(model), requests, pad_q_heads=True))
    results = run_tp_in_process(tp, cases)
    for name in names:
        outs = results[0][name]
        assert [token_ids(o)[0] for o in outs[:2]] == expected[name], name
        assert token_ids(outs[2]) == expected[name], f"{name}: batch"


def test_the_tail_layout_with_replicated_kv_heads_changes_the_tokens(monkeypatch):
    """The comparison above can fail: with KV heads replicated, zero heads at the tail (convert_to_mha's
    layout) leave Q head 3 on rank 1, which holds KV head 0 where head 3's group reads KV head 1."""
    _, kwargs, _ = SPECS["interleaved_tp4"]
    model = build_random_model(**kwargs)
    with torch.inference_mode():
        expected = [hf_greedy(model, prompt, NEW_TOKENS) for prompt in PROMPTS]

    def tail(layout, rank):
        return [s if s < layout.num_heads else None for s in layout.q_head_ids(rank)]

    monkeypatch.setattr(ShardLayout, "q_head_sources", tail)
    case = Case("tail", config_of(model), hf_state_dict(model), [Request([p], NEW_TOKENS, [EOS]) for p in PROMPTS],
                pad_q_heads=True)
    outs = run_tp_in_process(4, [case])[0]["tail"]
    assert [token_ids(o)[0] for o in outs] != expected


@pytest.mark.parametrize("argv", [["plan"], ["generate", "hi"], ["compile", "--out", "x"], ["check", "hi"], ["bench"],
                                  ["serve"]], ids=lambda argv: argv[0])
def test_every_command_takes_pad_q_heads(argv):
    from launcher.cli import build_parser

    args = build_parser().parse_args(argv + ["--pad-q-heads"])
    assert args.pad_q_heads is True
    if argv[0] == "generate":
        from launcher.cli.generate_command import launch_config

        assert launch_config(args).pad_q_heads is True
    if argv[0] == "serve":
        from launcher.cli.serve_command import server_args

        assert server_args(args)["pad_q_heads"] is True
