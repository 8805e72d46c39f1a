"""Qwen3, Gemma 3, a windowed Mistral and padded Q heads through the whole Launcher: checkpoints
written as safetensors, planned, loaded by the sharded loader, run by the engine, greedy tokens
equal to transformers'. Ranks are threads of this process (tests/in_process_cluster.py); one case
also runs through real Ray workers (slow lane).
"""

from __future__ import annotations

import pytest

from tests.test_launcher_generate import check_case

WINDOW = 3  # the first prompt (6 tokens) plus 8 new ones runs well past it
CASES = [
    # (id, model_type, shape, format, tp, expected kv strategy), Launcher options
    (("qwen3-tp2", "qwen3", dict(head_dim=32), "safetensors", 2, "shard"), {}),
    (("gemma3-tp2", "gemma3_text", dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                        layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=5.0,
                                        tie_word_embeddings=False),
      "safetensors_sharded", 2, "shard"), {}),
    (("mistral-window-tp2", "mistral", dict(sliding_window=WINDOW), "safetensors", 2, "shard"), {}),
    (("padded-q-tp4", "llama", dict(hidden_size=48, num_heads=6, num_kv_heads=2), "safetensors", 4,
      "replicate_to_tp"), {"pad_q_heads": True}),
]


@pytest.mark.parametrize("case, launch", CASES, ids=[c[0][0] for c in CASES])
def test_in_process_launcher_matches_transformers(case, launch, tmp_path, in_process_cluster):
    check_case(case, tmp_path, **launch)


@pytest.mark.slow
def test_ray_launcher_runs_gemma3_with_windows(tmp_path, ray_session):
    check_case(CASES[1][0], tmp_path)
