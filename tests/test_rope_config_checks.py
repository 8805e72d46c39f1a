"""Rope settings are read as transformers reads them, or refused before any process starts.

- rope_scaling and rope_parameters together: transformers takes rope_scaling wholesale (its own
  rope_theta, else the top-level one) and ignores rope_parameters; corelaunch reads the same, and
  refuses the config when the two blocks disagree.
- yarn / longrope options (attention_factor, beta_fast, beta_slow, mscale, mscale_all_dim, truncate,
  the longrope factor lists) are checked here: unchecked, they failed in every worker after loading.
- partial_rotary_factor below 1 with scaled rope is refused (transformers' model cannot run it; the
  workers rotate whole heads); with default rope it is ignored, as transformers' families ignore it.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from shardlib.demo_model import PACKAGED_CONFIG
from shardlib.model_config import ModelConfig, load_model_config
from workers.rope import RotaryTables

DEMO = json.loads(PACKAGED_CONFIG.read_text())  # SmolLM2-135M: head_dim 64, rope_theta 100000
HALF_HEAD = 32  # longrope factors: one per rotated pair
BOTH_BLOCKS = dict(rope_scaling={"rope_type": "linear", "factor": 2.0},
                   rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 5000})


def demo(**changes) -> dict:
    """The demo config.json with `changes` (a value of ... deletes the field)."""
    raw = {**DEMO, **changes}
    return {k: v for k, v in raw.items() if v is not ...}


def scaled(block: str, scaling: dict, **changes) -> dict:
    """The demo config with `scaling` as its one rope block (its rope_theta, 100000, beside it)."""
    if block == "rope_scaling":
        return demo(rope_parameters=..., rope_theta=100000.0, rope_scaling=scaling, **changes)
    return demo(rope_parameters={"rope_theta": 100000.0, **scaling}, **changes)


def refusal(raw: dict) -> str:
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dict(raw)
    message = str(err.value)
    assert "\n" not in message, message
    return message


def transformers_rope(raw: dict, tmp_path) -> tuple[float, str, float | None]:
    """(rope_theta, rope_type, factor) transformers' AutoConfig reads from `raw` saved as config.json."""
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps(raw))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        params = AutoConfig.from_pretrained(tmp_path).rope_parameters
    return float(params["rope_theta"]), params["rope_type"], params.get("factor")


def corelaunch_rope(tmp_path) -> tuple[float, str, float | None]:
    """The same three as corelaunch reads them from the config.json in tmp_path."""
    config = load_model_config(tmp_path / "config.json")
    scaling = config.rope_scaling or {}
    return config.rope_theta, scaling.get("rope_type", scaling.get("type", "default")), scaling.get("factor")


# ---- rope_scaling beside rope_parameters ----------------------------------------------------------
@pytest.mark.parametrize("changes", [
    # rope_scaling's own rope_theta is the base (corelaunch took the top-level one)
    dict(rope_parameters=..., rope_theta=20000,
         rope_scaling={"rope_type": "linear", "factor": 2.0, "rope_theta": 5000}),
    dict(rope_parameters=..., rope_scaling={"rope_type": "linear", "factor": 2.0, "rope_theta": 5000}),
    # both blocks, describing the same rotation, or rope_scaling adding scaling to the same base
    dict(rope_theta=100000, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    dict(rope_theta=100000, rope_scaling={"rope_type": "linear", "factor": 2.0},
         rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 100000}),
    dict(rope_scaling={"type": "linear", "factor": 2.0}, rope_parameters={"rope_type": "linear", "factor": 2.0}),
    dict(rope_scaling={"rope_type": "linear", "factor": 2.0, "rope_theta": 100000}),
    dict(rope_theta=..., rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 5000}),
])
def test_the_rope_transformers_reads_is_the_rope_corelaunch_reads(changes, tmp_path):
    raw = demo(**changes)
    expected = transformers_rope(raw, tmp_path)
    assert corelaunch_rope(tmp_path) == expected


def test_transformers_ignores_rope_parameters_beside_rope_scaling(tmp_path):
    """The reference behaviour the refusal below rests on: rope_scaling wins, theta included."""
    assert transformers_rope(demo(rope_theta=..., **BOTH_BLOCKS), tmp_path) == (10000.0, "linear", 2.0)


@pytest.mark.parametrize("changes, transformers_runs", [
    (dict(rope_theta=..., **BOTH_BLOCKS), "rope_type linear with rope_theta 10000.0"),
    # a transformers 5 config (base in rope_parameters) given a rope_scaling, as 4.x model cards say
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type yarn with rope_theta 10000.0"),
    (dict(BOTH_BLOCKS, rope_theta=20000), "rope_type linear with rope_theta 20000"),
    # the same scaling, but a base transformers would not use
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0},
          rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5000}),
     "rope_type linear with rope_theta 10000.0"),
    (dict(rope_scaling={"rope_type": "default", "rope_theta": 5000},
          rope_parameters={"rope_type": "linear", "factor": 2.0}), "rope_type default with rope_theta 5000"),
])
def test_disagreeing_rope_blocks_are_refused_naming_which_to_remove(changes, transformers_runs):
    message = refusal(demo(**changes))
    assert message.startswith("config.json field rope_parameters="), message
    assert "transformers reads rope_scaling alone and ignores rope_parameters" in message
    assert transformers_runs in message
    assert ("move rope_scaling's settings into rope_parameters and remove rope_scaling, or remove "
            "rope_parameters to run what transformers runs") in message


# ---- yarn and longrope options -------------------------------------------------------------------
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
LONGROPE = {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 2048,
            "short_factor": [1.0] * HALF_HEAD, "long_factor": [2.0] * HALF_HEAD}


@pytest.mark.parametrize("block", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("base, key, value, rule", [
    (YARN, "attention_factor", "x", "must be a finite number > 0"),
    (YARN, "attention_factor", 0, "must be a finite number > 0"),
    (YARN, "attention_factor", float("nan"), "must be a finite number > 0"),
    (YARN, "beta_fast", "32", "must be a finite number > 0"),
    (YARN, "beta_fast", True, "must be a finite number > 0"),
    (YARN, "beta_slow", "1", "must be a finite number > 0"),
    (YARN, "beta_slow", -1, "must be a finite number > 0"),
    (YARN, "mscale", "1", "must be a finite number >= 0"),
    (YARN, "mscale", -0.5, "must be a finite number >= 0"),
    (YARN, "mscale_all_dim", [1.0], "must be a finite number >= 0"),
    (YARN, "mscale_all_dim", float("inf"), "must be a finite number >= 0"),
    (YARN, "truncate", "false", "must be true or false"),
    (YARN, "truncate", 0, "must be true or false"),
    (YARN, "truncate", None, "must be true or false"),  # transformers reads null as false, not the default
    (LONGROPE, "attention_factor", "x", "must be a finite number > 0"),
    (LONGROPE, "short_factor", [1.0] * (HALF_HEAD - 1) + ["1"], "must be a list of finite positive numbers"),
    (LONGROPE, "long_factor", [1.0] * (HALF_HEAD - 1) + [float("inf")], "must be a list of finite positive numbers"),
])
def test_bad_yarn_and_longrope_options_are_refused_naming_key_value_and_fix(block, base, key, value, rule):
    message = refusal(scaled(block, {**base, key: value}))
    assert f"config.json field {block}.{key}=" in message, message
    assert rule in message, message
    assert "; write a bare JSON" in message or "; copy it from the checkpoint's config" in message, message


def test_a_longrope_list_of_the_wrong_length_names_the_length_it_needs():
    message = refusal(demo(rope_parameters={**LONGROPE, "long_factor": [2.0] * (HALF_HEAD + 1)}))
    assert "rope_scaling.long_factor='<33 numbers>' must hold head_dim / 2 = 32 numbers" in message, message


@pytest.mark.parametrize("scaling", [
    {**YARN, "attention_factor": 0.8, "beta_fast": 16, "beta_slow": 2.0, "mscale": 0, "mscale_all_dim": 1,
     "truncate": False},
    {**YARN, "attention_factor": None, "beta_fast": None, "mscale": 1.0, "mscale_all_dim": 0.5},
    {**LONGROPE, "attention_factor": 1.2},
])
def test_good_yarn_and_longrope_options_are_accepted_and_build_the_workers_tables(scaling):
    config = ModelConfig.from_dict(scaled("rope_scaling", scaling))
    tables = RotaryTables(config.head_dim, 8, config.rope_theta, config.rope_scaling,
                          max_position_embeddings=config.max_position_embeddings)
    assert torch.isfinite(tables.cos).all() and tables.cos.shape == (8, config.head_dim)


# ---- partial_rotary_factor -----------------------------------------------------------------------
SCALINGS = [{"rope_type": "linear", "factor": 2.0}, {"rope_type": "dynamic", "factor": 2.0}, YARN, LONGROPE,
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 2048}]


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: s["rope_type"])
@pytest.mark.parametrize("where", ["top level", "rope_scaling", "rope_parameters"])
def test_partial_rotary_with_scaled_rope_is_refused(scaling, where):
    if where == "top level":
        raw, name = scaled("rope_scaling", scaling, partial_rotary_factor=0.5), "partial_rotary_factor"
    else:
        raw, name = scaled(where, {**scaling, "partial_rotary_factor": 0.5}), f"{where}.partial_rotary_factor"
    message = refusal(raw)
    assert message.startswith(f"config.json field {name}=0.5 is not supported with {scaling['rope_type']} "), message
    assert "transformers' model cannot run it either" in message
    assert "remove partial_rotary_factor (or set it to 1.0)" in message


@pytest.mark.parametrize("changes", [
    dict(partial_rotary_factor=0.5),
    dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    dict(rope_parameters=..., rope_scaling={"rope_type": "linear", "factor": 2.0}, partial_rotary_factor=1.0),
    # transformers takes the block's own factor over the top-level one
    dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 1.0},
         partial_rotary_factor=0.5),
])
def test_partial_rotary_that_changes_nothing_is_accepted(changes):
    config = ModelConfig.from_dict(demo(**changes))
    assert config.head_dim == 64


def test_transformers_cannot_run_partial_rotary_with_scaled_rope():
    """The claim the refusal makes, on a tiny Llama (shape error in apply_rotary_pos_emb)."""
    from tests.model_factory import build_random_model

    model = build_random_model("llama", rope_scaling={"rope_type": "linear", "factor": 2.0},
                               partial_rotary_factor=0.5)
    with pytest.raises(RuntimeError, match="must match the size"):
        model(torch.tensor([[5, 6, 7, 8]]))
