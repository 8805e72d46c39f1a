"""`corelaunch check`'s default tolerances hold for the built-in SmolLM2 quantized as the README shows.

The defaults (shardlib/evaluation/quantized_tolerances.py) are measured on this model; an entry
copied from another granularity, or measured without `quantize --embedding` alone, failed the
README's own workflow (f8e4m3 per channel with --embedding: divergence differences up to 0.67
against 0.15; f8e5m2 per channel: 1.26 against 0.7). Each fp8 entry is sized on the --embedding case,
the larger error of each format and granularity, so that case is the one run here. These run check's
logit matching in this process: check's transformers reference, the quantized checkpoint on the
worker code eagerly at TP 1, check's default tolerances.
"""

from __future__ import annotations

import pytest

from launcher.cli.check_command import DEFAULT_NUM_TOKENS, DEFAULT_PROMPT, reference_outputs
from shardlib.evaluation.accuracy import logit_matching, parse_tol_map
from shardlib.evaluation.quantized_tolerances import default_tolerances

PROMPTS = (DEFAULT_PROMPT, "The capital of France is")  # the prompts the tolerances were measured on


@pytest.fixture(scope="module")
def demo_reference():
    """(demo model directory, its prompts' ids, check's float32 transformers reference for them)."""
    from launcher.api import load_tokenizer
    from shardlib.demo_model import ensure_demo_model

    demo = ensure_demo_model()
    tokenizer = load_tokenizer(demo)
    prompts = [list(tokenizer(text)["input_ids"]) for text in PROMPTS]
    return demo, prompts, reference_outputs(demo, prompts, DEFAULT_NUM_TOKENS, quiet=True)


def _eager_tp1_model(model_dir):
    from shardlib.checkpoint import load_rank_shard
    from shardlib.model_config import load_model_config
    from shardlib.sharding import ShardLayout
    from workers.collectives import SingleRank
    from workers.model import ShardedCausalLM

    config = load_model_config(model_dir)
    layout = ShardLayout.for_model(config, 1)
    return config, ShardedCausalLM(config, layout, 0, load_rank_shard(model_dir, config, layout, 0), SingleRank())


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["f8e4m3", "f8e5m2"])
@pytest.mark.parametrize("per_channel", [True, False], ids=["per_channel", "per_tensor"])
def test_fp8_with_embedding_passes_check_with_its_default_tolerances(demo_reference, tmp_path, dtype,
                                                                     per_channel):
    from launcher.cli import main
    from workers.engine import generate
    from workers.sampling import SamplingParams

    demo, prompts, expected = demo_reference
    out = tmp_path / "q"
    assert main(["quantize", "--model", str(demo), "--dtype", dtype, "--embedding", "--out", str(out)]
                + ([] if per_channel else ["--per-tensor"])) == 0
    config, model = _eager_tp1_model(out)
    assert (config.quantization.dtype, config.quantization.per_channel) == (dtype, per_channel)
    assert "+embed" in config.quantization.modules  # the case each fp8 entry is sized on
    spec, divergence_tol = default_tolerances(config.quantization, None)

    def run_corelaunch(ids: list[int], count: int):
        [result] = generate(model, [ids], [SamplingParams()], count, [], return_logits=True)
        return result.token_ids, result.logits

    for i, ids in enumerate(prompts):
        result = logit_matching(ids, expected.logits[i], run_corelaunch, expected_tokens=expected.tokens[i],
                                tol_map=parse_tol_map(spec), divergence_difference_tol=divergence_tol)
        differences = [round(p.divergence_difference, 3) for p in result.positions if p.diverged]
        worst = {g.top_k: round(g.max_rel_error, 3) for g in result.groups}
        assert result.passed, (PROMPTS[i], spec, divergence_tol, "divergence differences", differences,
                               "max relative errors", worst)
