"""Mixtral and Qwen3-MoE put their sliding window on every layer, as transformers' models of these
families do, even where config.json lists `layer_types`: transformers never reads that field for
them, and a config carrying ["full_attention", "sliding_attention"] ran windowed on one layer of two
here (last-position logits 7-8 apart from transformers' on a 20-token prompt, window 4). Mistral
keeps the alternating layers: transformers' AutoConfig reads a "mistral" config.json with
layer_types as Ministral, whose layers follow them, and that is what from_pretrained loads."""

from __future__ import annotations

import json

import pytest
import torch

from shardlib.families import ignored_layer_types
from shardlib.model_config import ModelConfig
from tests.model_factory import build_random_model, checkpoint_state_dict
from tests.tp_harness import build_rank_model
from workers.collectives import SingleRank

PROMPT = torch.randint(3, 128, (20,), generator=torch.Generator().manual_seed(3)).tolist()
ALTERNATING = ["full_attention", "sliding_attention"]
WINDOW = 4


def last_logits_both_ways(reference, config: ModelConfig, state: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(transformers' last-position logits, corelaunch's) for PROMPT, without a cache."""
    rank = build_rank_model(config, state, 0, 1, SingleRank())
    ids, positions = torch.tensor([PROMPT]), torch.arange(len(PROMPT))
    with torch.inference_mode():
        expected = reference(ids, use_cache=False).logits[0, -1]
        got = rank(ids, positions[None], rank.new_cache(1, len(PROMPT)), positions)[0]
    return expected, got


@pytest.mark.parametrize("spec", [dict(model_type="mixtral"), dict(model_type="qwen3_moe", use_sliding_window=True)],
                         ids=lambda spec: spec["model_type"])
def test_layer_types_leave_the_window_on_every_layer_as_transformers_does(spec):
    model = build_random_model(**spec, sliding_window=WINDOW, layer_types=ALTERNATING)
    raw = json.loads(model.config.to_json_string())
    assert raw["layer_types"] == ALTERNATING  # the field reaches the config.json a user would have
    config = ModelConfig.from_dict(raw)
    assert config.layer_types == ("sliding_attention",) * 2 and config.sliding_window == WINDOW
    expected, got = last_logits_both_ways(model, config, checkpoint_state_dict(model))
    assert (got - expected).abs().max().item() < 1e-4


def test_a_mistral_config_with_layer_types_runs_them_as_from_pretrained_loads_it(tmp_path):
    from transformers import AutoModelForCausalLM

    model = build_random_model(model_type="mistral", sliding_window=WINDOW, layer_types=ALTERNATING)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    config = ModelConfig.from_dict(json.loads((tmp_path / "config.json").read_text()))
    assert config.layer_types == tuple(ALTERNATING)
    expected, got = last_logits_both_ways(loaded, config, checkpoint_state_dict(model))
    assert (got - expected).abs().max().item() < 1e-4


def test_plan_names_the_layer_types_it_ignores():
    alternating = {"model_type": "mixtral", "sliding_window": WINDOW, "layer_types": ALTERNATING}
    assert ignored_layer_types(alternating) == ("layer_types is ignored for a mixtral model, as transformers "
                                                "ignores it: the sliding window, where the config sets one, "
                                                "applies to every layer")
    # nothing to say where the field changes nothing (every layer slides, or none has a window),
    # or where the family reads it
    assert ignored_layer_types({**alternating, "layer_types": ["sliding_attention"] * 2}) is None
    assert ignored_layer_types({**alternating, "sliding_window": None}) is None
    assert ignored_layer_types({**alternating, "model_type": "qwen3_moe"}) is None  # no use_sliding_window
    assert ignored_layer_types({**alternating, "model_type": "mistral"}) is None
    assert ignored_layer_types({**alternating, "layer_types": None}) is None
