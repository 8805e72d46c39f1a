"""config.json validation: every field the planner or the workers read is type- and range-checked
up front (one-line ValueError naming the field, the value and the fix), checked by hand for the
known bad inputs and by hypothesis on random mutations of the demo model's config; and planning time
does not grow with the head count."""

from __future__ import annotations

import dataclasses
import json
import math
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from launcher.cli import main
from shardlib.demo_model import PACKAGED_CONFIG
from shardlib.instances import gpu_node
from shardlib.model_config import ModelConfig, load_model_config
from shardlib.planner import plan

DEMO = json.loads(PACKAGED_CONFIG.read_text())  # SmolLM2-135M: 9 heads, 3 KV heads, head_dim 64


def demo(**changes) -> dict:
    """The demo config.json with `changes` (a value of ... deletes the field)."""
    raw = {**DEMO, **changes}
    return {k: v for k, v in raw.items() if v is not ...}


def refusal(raw) -> str:
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dict(raw)
    message = str(err.value)
    assert "\n" not in message, message
    return message


def test_the_demo_config_is_valid():
    cfg = ModelConfig.from_dict(demo())
    assert plan(cfg).valid and (cfg.head_dim, cfg.rope_theta, cfg.rope_scaling) == (64, 100000.0, None)


# ---- the known bad inputs, each refused naming the field, the value and the fix -----------------
@pytest.mark.parametrize("changes, names", [
    (dict(max_position_embeddings="4096"), "max_position_embeddings='4096'"),
    (dict(max_position_embeddings=0), "max_position_embeddings=0"),
    (dict(max_position_embeddings=1), "max_position_embeddings=1 must be an integer >= 2"),  # planned as valid
    (dict(max_position_embeddings=-5), "max_position_embeddings=-5"),
    (dict(max_position_embeddings=4096.0), "max_position_embeddings=4096.0"),
    (dict(max_position_embeddings=2**40), f"max_position_embeddings={2**40}"),
    (dict(num_key_value_heads=0), "num_key_value_heads=0"),
    (dict(num_key_value_heads=2), "num_key_value_heads=2"),  # 9 heads: not a GQA grouping
    (dict(num_attention_heads=True), "num_attention_heads=True"),
    (dict(num_attention_heads="9"), "num_attention_heads='9'"),
    (dict(hidden_size=[576]), "hidden_size=[576]"),
    (dict(intermediate_size=-1), "intermediate_size=-1"),
    (dict(num_hidden_layers=0), "num_hidden_layers=0"),
    # 2**31 - 1 layers filled 24 GiB building per-layer tuples before any check answered
    (dict(num_hidden_layers=2**31 - 1), f"num_hidden_layers={2**31 - 1} must be a positive integer (at most 100000)"),
    (dict(vocab_size=None), "vocab_size=None"),
    (dict(head_dim=0), "head_dim=0"),
    (dict(head_dim=63), "head_dim=63"),  # rotary embeddings need an even head_dim
    (dict(head_dim=..., hidden_size=577), "hidden_size=577"),  # not divisible by 9 heads, no head_dim
    (dict(rms_norm_eps="tiny"), "rms_norm_eps='tiny'"),
    (dict(rms_norm_eps=0), "rms_norm_eps=0"),
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps=nan"),
    (dict(rms_norm_eps=True), "rms_norm_eps=True"),
    (dict(rope_scaling="linear"), "rope_scaling='linear'"),
    (dict(rope_scaling={"factor": 8.0}), "rope_scaling={'factor': 8.0}"),  # no rope_type
    (dict(rope_scaling={"rope_type": "linear", "factor": "x"}), "rope_scaling.factor='x'"),
    (dict(rope_scaling={"rope_type": 3}), "rope_scaling.rope_type=3"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope_scaling={'rope_type': 'llama3'"),
    (dict(rope_parameters=["rope_theta", 10000.0]), "rope_parameters=['rope_theta', 10000.0]"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": -1}), "rope_parameters.rope_theta=-1"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}), "rope_parameters.high_freq_factor=4.0"),
    (dict(rope_parameters={"rope_type": "yarn", "original_max_position_embeddings": 0}),
     "rope_parameters.original_max_position_embeddings=0"),
    (dict(rope_parameters=..., rope_theta=float("inf")), "rope_theta=inf"),
    (dict(tie_word_embeddings="true"), "tie_word_embeddings='true'"),
    (dict(tie_word_embeddings=1), "tie_word_embeddings=1"),
    (dict(attention_bias="no"), "attention_bias='no'"),
    (dict(mlp_bias=0), "mlp_bias=0"),
    (dict(dtype=32), "dtype=32"),
    (dict(dtype=..., torch_dtype="complex64"), "torch_dtype='complex64'"),  # float64 runs in float32
    (dict(model_type="mistral", sliding_window=-4096), "sliding_window=-4096"),
    (dict(model_type="qwen2", use_sliding_window="yes"), "use_sliding_window='yes'"),
    (dict(model_type="mixtral", num_local_experts="8"), "num_local_experts='8'"),
    (dict(model_type="mixtral", num_local_experts=8, num_experts_per_tok=9), "num_experts_per_tok=9"),
    (dict(eos_token_id="</s>"), "eos_token_id='</s>'"),
    (dict(eos_token_id=[2, None]), "eos_token_id=[2, None]"),
    (dict(bos_token_id=1.0), "bos_token_id=1.0"),
    (dict(model_type=["llama"]), "model_type=['llama']"),
    (dict(rope_scaling={"rope_type": "linear"}), "rope_scaling={'rope_type': 'linear'}"),  # no factor
    (dict(rope_parameters=..., rope_scaling={"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}),
     "rope_scaling.short_factor='<1 numbers>'"),  # one per rotated pair
    (dict(rope_scaling={"rope_type": "longrope", "short_factor": "x", "long_factor": [1.0]}),
     "rope_scaling.short_factor='x'"),
    (dict(model_type="qwen3", use_sliding_window=True, sliding_window=4, layer_types=["local"]),
     "layer_types=['local']"),
    (dict(model_type="gemma3_text", hidden_activation="relu"), "hidden_activation='relu'"),
    (dict(model_type="gemma3_text", query_pre_attn_scalar=0), "query_pre_attn_scalar=0"),
    # its sliding layers take the local rope base even without a window: not global layers
    (dict(model_type="gemma3_text", sliding_window=None), "sliding_window=None leaves Gemma 3's sliding_attention"),
    (dict(model_type="gemma3_text", rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": -1}}),
     "rope_theta=-1"),
])
def test_bad_fields_are_refused_naming_field_and_value(changes, names):
    message = refusal(demo(**changes))
    assert names in message, message
    assert "; " in message  # the rule, then the fix


def test_messages_say_the_fix():
    assert "write a bare JSON integer such as 8192" in refusal(demo(max_position_embeddings="4096"))
    assert "must be a finite number > 0" in refusal(demo(rms_norm_eps="tiny"))
    assert "must be a JSON object or null" in refusal(demo(rope_scaling="linear"))
    assert "use a divisor of 9" in refusal(demo(num_key_value_heads=2))
    assert "add head_dim" in refusal(demo(head_dim=..., hidden_size=577))
    assert "lacks low_freq_factor, high_freq_factor, original_max_position_embeddings" in refusal(
        demo(rope_scaling={"rope_type": "llama3", "factor": 8.0}))


def test_null_optional_fields_take_their_defaults():
    cfg = ModelConfig.from_dict(demo(num_key_value_heads=None, head_dim=None, rms_norm_eps=None,
                                     max_position_embeddings=None, rope_parameters=None, rope_theta=None,
                                     tie_word_embeddings=None, dtype=None, eos_token_id=None))
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps, cfg.max_position_embeddings) == (9, 64, 1e-6, 2048)
    assert (cfg.rope_theta, cfg.tie_word_embeddings, cfg.torch_dtype, cfg.eos_token_id) == (10000.0, False, "float32", ())


def test_direct_construction_is_checked_too():
    base = ModelConfig.from_dict(demo())
    for field, value in (("max_position_embeddings", -5), ("rms_norm_eps", "tiny"), ("tie_word_embeddings", None),
                         ("rope_scaling", "linear"), ("torch_dtype", "bf16"), ("eos_token_id", [2])):
        with pytest.raises(ValueError, match=field):
            dataclasses.replace(base, **{field: value})


def test_unreadable_json_is_a_value_error(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[" * 100_000)
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_model_config(path)
    path.write_text('{"model_type": "llama", "hidden_size": ' + "9" * 5000 + "}")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_model_config(path)


def test_a_config_json_that_is_not_a_file_is_refused_by_name(tmp_path, capsys):
    """A directory gave IsADirectoryError tracebacks in generate/check/bench/compile; a FIFO blocked
    `plan` forever on its read."""
    import os

    for name, make in (("dir", lambda p: p.mkdir()), ("fifo", os.mkfifo)):
        model = tmp_path / name
        model.mkdir()
        make(model / "config.json")
        with pytest.raises(ValueError, match=f"{model}/config.json is not a regular file"):
            load_model_config(model)
        for command in (["plan", "--model", str(model)], ["quantize", "--model", str(model), "--dtype", "int8",
                                                          "--out", str(tmp_path / f"q-{name}")]):
            capsys.readouterr()
            assert main(command) == 2
            assert "config.json is not a regular file" in capsys.readouterr().err


@pytest.mark.parametrize("changes, names", [
    (dict(max_position_embeddings="4096"), "max_position_embeddings='4096'"),
    (dict(rope_scaling="linear"), "rope_scaling='linear'"),
    (dict(rope_parameters=[1, 2]), "rope_parameters=[1, 2]"),
    (dict(num_attention_heads=True), "num_attention_heads=True"),
    (dict(rms_norm_eps="tiny"), "rms_norm_eps='tiny'"),
])
def test_cli_refuses_bad_config_in_one_line_with_exit_2(tmp_path, capsys, changes, names):
    (tmp_path / "config.json").write_text(json.dumps(demo(**changes)))
    capsys.readouterr()
    code = main(["plan", "--model", str(tmp_path)])
    out = capsys.readouterr()
    assert code == 2 and out.out == ""
    [line] = out.err.strip().splitlines()
    assert line.startswith("corelaunch plan: config.json field ") and names in line, line


# ---- planning time does not grow with the head count -------------------------------------------
def test_planning_10_to_the_8_heads_enumerates_divisors_quickly():
    heads = 10**8
    cfg = ModelConfig.from_dict(demo(num_attention_heads=heads, num_key_value_heads=heads, head_dim=...,
                                     hidden_size=2 * heads, num_hidden_layers=1, vocab_size=32,
                                     intermediate_size=64))
    assert cfg.head_dim == 2
    roomy = gpu_node(10**20)  # per-rank memory no model can exhaust: only the head rule decides
    start = time.perf_counter()
    p = plan(cfg, instance=roomy)
    elapsed = time.perf_counter() - start
    divisors = sorted(2**a * 5**b for a in range(9) for b in range(9))
    assert p.valid and p.tp_degree == 1 and list(p.valid_tp_degrees) == divisors
    assert plan(cfg, instance=roomy, tp=3).error_codes == ("heads_not_divisible",)
    # on this host nothing fits: the refusal (with its ways out over 8 node counts) is quick too
    refused = plan(cfg)
    assert not refused.valid and "no_valid_tp_degree" in refused.error_codes
    assert elapsed < 5, elapsed  # a loose guard: the old loop over every degree took minutes


def test_a_large_prime_head_count_plans_at_tp_1_and_itself():
    prime = 2_147_483_647  # 2**31 - 1, the largest accepted
    cfg = ModelConfig.from_dict(demo(num_attention_heads=prime, num_key_value_heads=1, head_dim=2,
                                     hidden_size=2, num_hidden_layers=1, vocab_size=32, intermediate_size=2))
    assert plan(cfg, instance=gpu_node(10**20)).valid_tp_degrees == (1, prime)


# ---- property: any mutation of a config.json plans or is refused with a ValueError --------------
_LEAVES = (st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
           | st.integers(min_value=-3, max_value=130) | st.floats() | st.text(max_size=8)
           | st.sampled_from(["4096", "linear", "tiny", "llama3", "default", "bfloat16", "fp16", "torch.float16"]))
JSON_VALUES = st.recursive(_LEAVES, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
_SMALL = st.integers(min_value=1, max_value=64)
_ROPE = st.fixed_dictionaries({}, optional={
    "rope_type": st.sampled_from(["default", "llama3", "linear", "yarn"]) | JSON_VALUES,
    "type": st.sampled_from(["linear", "dynamic"]) | JSON_VALUES,
    "rope_theta": st.floats() | JSON_VALUES,
    "factor": st.floats() | JSON_VALUES, "low_freq_factor": st.floats() | JSON_VALUES,
    "high_freq_factor": st.floats() | JSON_VALUES,
    "original_max_position_embeddings": st.integers(-2, 10_000) | JSON_VALUES,
})
# Fields the code reads (and some it does not), each set to a random JSON value, a rope object, a
# small count (so that valid configs other than the demo's come up), or deleted.
FIELDS = sorted(set(DEMO) | {"num_key_value_heads", "head_dim", "rope_scaling", "rope_parameters", "rope_theta",
                             "sliding_window", "use_sliding_window", "torch_dtype", "dtype",
                             "num_local_experts", "num_experts_per_tok",
                             # the mixture-of-experts dialects (shardlib/moe_configs.py)
                             "num_experts", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers",
                             "decoder_sparse_step", "hidden_act", "d_model", "n_heads", "n_layers", "max_seq_len",
                             "attn_config", "ffn_config"})
MUTATIONS = st.dictionaries(
    st.sampled_from(FIELDS) | st.text(max_size=6),
    JSON_VALUES | _ROPE | _SMALL | st.just(...)
    | st.sampled_from(["llama", "mistral", "qwen2", "mixtral", "qwen3_moe", "dbrx"]),
    min_size=1, max_size=6)


def _plan_or_refuse(mutation: dict) -> None:
    raw = demo(**mutation)
    try:
        cfg = ModelConfig.from_dict(raw)
    except ValueError as err:
        assert str(err) and "\n" not in str(err), str(err)
        return
    for instance in ("cpu", "trn1.32xlarge", gpu_node(80 * 2**30)):
        p = plan(cfg, instance=instance)  # a validated config always plans (valid or not)
        assert p.memory.kv_cache_bytes_per_rank > 0 and p.memory.weight_bytes_per_rank > 0
        assert p.valid == (p.errors == ()) and all(t >= 1 for t in p.valid_tp_degrees)
        json.dumps(p.to_dict(), allow_nan=False)
    assert math.isfinite(cfg.rms_norm_eps) and cfg.rms_norm_eps > 0 and cfg.rope_theta > 0
    cfg.executor_gaps(4096)
    cfg.config_hash()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(MUTATIONS)
def test_mutated_configs_plan_or_raise_value_error(mutation):
    _plan_or_refuse(mutation)


@pytest.mark.slow
@pytest.mark.timeout(600)
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(MUTATIONS)
def test_mutated_configs_plan_or_raise_value_error_500_examples(mutation):
    _plan_or_refuse(mutation)


def test_a_compiled_or_presharded_directory_given_as_the_model_is_named_as_such(tmp_path):
    """It said only that config.json was missing, which the directory's model/ folder does hold."""
    from shardlib.model_config import load_model_config

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"is a corelaunch compiled or pre-sharded directory \(it holds "
                                                r"manifest\.json\), not a Hugging Face model: pass the model it was "
                                                r"made from as --model"):
        load_model_config(tmp_path)


def test_launch_config_numbers_of_numpy_and_torch_are_read_as_pythons():
    """tp=np.int64(2) was refused with "must be a positive integer or 'auto'", a rule the value met
    (the request counts took them); so was request_timeout_s=np.float32(5)."""
    import numpy as np
    import torch

    from launcher.api import LaunchConfig

    config = LaunchConfig(tp=np.int64(2), seq_len=np.int32(64), max_num_seqs=torch.tensor(3),
                          request_timeout_s=np.float32(5), device_memory_gib=torch.tensor(2.5))
    assert (config.tp, config.seq_len, config.max_num_seqs, config.request_timeout_s, config.device_memory_gib) == \
        (2, 64, 3, 5.0, 2.5)
    assert all(type(v) in (int, float) for v in (config.tp, config.seq_len, config.max_num_seqs,
                                                 config.request_timeout_s, config.device_memory_gib))
    for bad, words in ((dict(tp=np.bool_(True)), "tp"), (dict(seq_len=np.float32(2.5)), "seq_len"),
                       (dict(max_num_seqs=torch.tensor([1, 2])), "max_num_seqs")):
        with pytest.raises(ValueError, match=words):
            LaunchConfig(**bad)


def test_an_eager_launch_refuses_a_seq_len_past_the_models_positions(tmp_path):
    """Only a compiled launch refused it; an eager one held cache slots no request may reach."""
    from launcher.api import LaunchConfig
    from launcher.errors import PlanRejected
    from launcher.launch_plan import plan_launch
    from launcher.progress import Progress
    from tests.model_factory import save_random_model

    model = str(save_random_model(tmp_path, "llama", num_heads=4, num_kv_heads=2))
    limit = load_model_config(model).max_position_embeddings
    with pytest.raises(PlanRejected, match=rf"\[seq_len_too_long\] seq_len \({limit + 1}\) exceeds"):
        plan_launch(LaunchConfig(model=model, tp=1, compile=False, seq_len=limit + 1), Progress(False))
    # token buckets set seq_len: named as the option given (it said seq_len, which nobody passed)
    with pytest.raises(ValueError, match=rf"token_buckets \(64,{limit + 1}\): token-generation bucket {limit + 1} exceeds the model's "
                                         rf"max_position_embeddings \({limit}\); drop it or lower it to {limit}"):
        plan_launch(LaunchConfig(model=model, tp=1, token_buckets=(64, limit + 1)), Progress(False))


def test_nodes_on_a_private_cluster_are_refused_before_anything_starts(tmp_path, monkeypatch):
    """A private Ray is this host alone: --nodes 2 planned two hosts' RAM (RAM / ceil(TP / 2) per rank)
    for ranks that all land here, and skipped the replicas' check against this host's RAM."""
    import ray

    from launcher.api import LaunchConfig
    from launcher.launch_plan import plan_launch
    from launcher.progress import Progress
    from tests.model_factory import save_random_model

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh `corelaunch generate`
    model = str(save_random_model(tmp_path, "llama", num_heads=4, num_kv_heads=2))
    with pytest.raises(ValueError, match=r"nodes \(2\): with no cluster to join, the launch starts a private Ray of "
                                         r"this host alone, one node, whose memory the plan would count 2 times; "
                                         r"join a cluster of 2 or more nodes with --ray-address"):
        plan_launch(LaunchConfig(model=model, tp=2, nodes=2, ray_address="local", compile=False), Progress(False))
    assert plan_launch(LaunchConfig(model=model, tp=2, ray_address="local", compile=False), Progress(False)).plan.valid
    # a second launch of a program whose first runs on the private Ray it started: the same host
    # alone (it was taken for the calling program's own session, joined wherever it is)
    from launcher.cluster import ray_cluster

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setitem(ray_cluster._OWN_SESSION, "users", 1)
    monkeypatch.setitem(ray_cluster._OWN_SESSION, "started_here", True)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray_cluster, "recorded_cluster", lambda: None)
    for address in ("local", None):
        with pytest.raises(ValueError, match=r"nodes \(2\): with no cluster to join, the launch starts a private Ray"):
            plan_launch(LaunchConfig(model=model, tp=2, nodes=2, ray_address=address, compile=False), Progress(False))
