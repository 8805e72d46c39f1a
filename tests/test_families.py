"""Qwen3, Gemma 3 and sliding windows (Mistral, Qwen2) against transformers: identical greedy tokens.

Every case runs at TP 1. Qwen3 and Gemma 3 also run at TP 2 and TP 4 (KV heads replicated rather
than split), Mistral's window at TP 2 and Qwen2's at TP 4; the soft-capped Gemma 3 runs at TP 1 only.
Every rank is a thread of this process (tests/tp_harness.py), one group per degree. Every case runs each prompt
alone and both as one left-padded batch; the first prompt alone is more than twice
the sliding window, so a window applied wrongly (or not at all) changes the tokens, which
test_the_window_changes_the_tokens checks. The serving engine (chunked prefill, one cache row per
sequence) and the compiled graphs must give the same tokens as the eager static batch.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from shardlib.buckets import Buckets
from shardlib.model_config import ModelConfig
from shardlib.sharding import KVStrategy, ShardLayout
from tests.model_factory import build_random_model
from tests.test_model_tp import hf_greedy
from tests.tp_harness import Case, Request, build_rank_model, hf_state_dict, run_tp_in_process, token_ids
from workers.collectives import SingleRank
from workers.engine import generate
from workers.sampling import SamplingParams

PROMPTS = [[5, 9, 33, 17, 80, 3, 44, 12, 61, 7, 8, 90, 10, 11], [7, 100, 21]]
NEW_TOKENS, EOS, WINDOW = 10, 2, 4
TWO_KINDS = ["sliding_attention", "full_attention"]

SPECS = {
    "qwen3": dict(model_type="qwen3", head_dim=32),  # head_dim is not hidden_size / heads
    "gemma3": dict(model_type="gemma3_text", head_dim=16, sliding_window=WINDOW, layer_types=TWO_KINDS,
                   query_pre_attn_scalar=24),
    "gemma3_softcap": dict(model_type="gemma3_text", head_dim=16, sliding_window=WINDOW + 1, layer_types=TWO_KINDS,
                           attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                           seed=2),
    "mistral_window": dict(model_type="mistral", sliding_window=WINDOW, seed=1),
    "qwen2_window": dict(model_type="qwen2", sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1),
    # transformers' other name for SiLU: it was refused as not implemented
    "llama_swish": dict(model_type="llama", hidden_act="swish"),
}
WINDOWED = ("gemma3", "gemma3_softcap", "mistral_window", "qwen2_window")


@functools.lru_cache(maxsize=None)
def reference(name: str):
    """(ModelConfig, full state_dict, transformers' greedy tokens per prompt)."""
    model = build_random_model(**SPECS[name])
    config = ModelConfig.from_dict(model.config.to_dict())
    with torch.inference_mode():
        refs = [hf_greedy(model, prompt, NEW_TOKENS) for prompt in PROMPTS]
    return config, hf_state_dict(model), refs


def requests() -> list[Request]:
    return [Request([prompt], NEW_TOKENS, [EOS]) for prompt in PROMPTS] + [Request(PROMPTS, NEW_TOKENS, [EOS])]


def check(name: str, outputs: list[list]) -> None:
    refs = reference(name)[2]
    alone = [token_ids(out)[0] for out in outputs[:2]]
    assert alone == refs, name
    assert token_ids(outputs[2]) == refs, f"{name}: the left-padded batch"


def tp1_outputs(name: str, config: ModelConfig | None = None) -> list[list]:
    base, state, _ = reference(name)
    model = build_rank_model(config or base, state, 0, 1, SingleRank())
    return [generate(model, r.prompts, r.sampling(), r.max_new_tokens, r.stop_token_ids) for r in requests()]


@pytest.mark.parametrize("name", list(SPECS))
def test_tp1_equals_transformers(name):
    check(name, tp1_outputs(name))


@pytest.mark.parametrize("tp, strategy", [(2, KVStrategy.SHARD), (4, KVStrategy.REPLICATE_TO_TP)])
def test_tp_degrees_equal_transformers(tp, strategy):
    names = ["qwen3", "gemma3", "mistral_window"] if tp == 2 else ["qwen3", "gemma3", "qwen2_window"]
    cases = []
    for name in names:
        config, state, _ = reference(name)
        assert ShardLayout.for_model(config, tp).kv_strategy is strategy
        cases.append(Case(name, config, state, requests()))
    results = run_tp_in_process(tp, cases)
    for name in names:
        check(name, results[0][name])
        for rank in range(1, tp):
            assert [token_ids(o) for o in results[rank][name]] == [token_ids(o) for o in results[0][name]]


@pytest.mark.parametrize("name", WINDOWED)
def test_the_window_changes_the_tokens(name):
    """Without its window the model gives other tokens for the long prompt: the tests above do test it."""
    config = reference(name)[0]
    assert config.sliding_window is not None and len(PROMPTS[0]) > 2 * config.sliding_window
    unwindowed = dataclasses.replace(config, sliding_window=None, layer_types=None)
    outputs = tp1_outputs(name, unwindowed)
    assert token_ids(outputs[0])[0] != reference(name)[2][0]


def last_logits(config: ModelConfig, state: dict, prompt: list[int]) -> torch.Tensor:
    model = build_rank_model(config, state, 0, 1, SingleRank())
    ids = torch.tensor([prompt])
    cache = model.new_cache(1, len(prompt))
    with torch.inference_mode():
        return model(ids, torch.arange(len(prompt))[None], cache, torch.arange(len(prompt)))[0]


def test_soft_capped_logits_equal_transformers():
    """The final cap keeps the logits' order, so greedy tokens cannot see it: the logits themselves
    are compared, and must move when the cap is dropped. (attn_logit_softcapping is in the config
    too: transformers' Gemma 3 ignores it, and so does corelaunch, which this comparison checks.)"""
    config, state, _ = reference("gemma3_softcap")
    hf = build_random_model(**SPECS["gemma3_softcap"])
    with torch.inference_mode():
        expected = hf(torch.tensor([PROMPTS[0]])).logits[0, -1]
    got = last_logits(config, state, PROMPTS[0])
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
    assert got.abs().max() <= config.final_logit_softcapping
    uncapped = last_logits(dataclasses.replace(config, final_logit_softcapping=None), state, PROMPTS[0])
    assert (uncapped - expected).abs().max() > 1e-3


def test_swish_is_read_as_silu_by_every_family_reader():
    assert reference("llama_swish")[0].hidden_act == "silu"
    for model_type, field in (("mixtral", "hidden_act"), ("gemma3_text", "hidden_activation")):
        raw = build_random_model(model_type).config.to_dict()
        assert ModelConfig.from_dict({**raw, field: "swish"}).hidden_act == "silu", model_type


def test_config_facts_of_each_family():
    qwen3, gemma, mistral, qwen2 = (reference(n)[0] for n in ("qwen3", "gemma3", "mistral_window", "qwen2_window"))
    assert qwen3.head_dim == 32 and qwen3.sliding_window is None and qwen3.layer_types is None
    assert gemma.layer_types == tuple(TWO_KINDS) and gemma.window_of(0) == WINDOW and gemma.window_of(1) is None
    assert (gemma.rope_theta, gemma.local_rope_theta) == (1_000_000.0, 10_000.0)
    assert gemma.query_pre_attn_scalar == 24 and gemma.hidden_act == "gelu_pytorch_tanh"
    assert mistral.layer_types == ("sliding_attention",) * 2
    assert qwen2.layer_types == ("full_attention", "sliding_attention")  # from max_window_layers


def test_serving_engine_applies_the_window():
    """Chunked prefill into per-sequence cache rows gives the static batch's tokens."""
    from tests.serving_driver import collect, request, run_loops, stop
    from workers.serving.loop import ServingConfig, ServingLoop

    config, state, refs = reference("gemma3_softcap")
    loop = ServingLoop(build_rank_model(config, state, 0, 1, SingleRank()), ServingConfig(2, 4, 64))
    threads = run_loops([loop])
    loop.submit([request(f"r{i}", p, NEW_TOKENS, stop_token_ids=[EOS]) for i, p in enumerate(PROMPTS)])
    got = collect(loop, {"r0", "r1"})
    stop([loop], threads)
    assert [got.tokens["r0"], got.tokens["r1"]] == refs


@pytest.mark.slow  # torch.compile: about a minute on the shared development machine
def test_compiled_graphs_apply_windows_rope_bases_and_caps():
    from workers.compiled import CompiledCausalLM

    config, state, refs = reference("gemma3_softcap")
    compiled = CompiledCausalLM(build_rank_model(config, state, 0, 1, SingleRank()),
                                Buckets.build(context=[16], token=[32], batch=[2]), announce=lambda line: None)
    outs = generate(compiled, PROMPTS, [SamplingParams()] * 2, NEW_TOKENS, [EOS])
    assert [o.token_ids for o in outs] == refs


def test_gemma3_runs_hidden_activation_alone_as_transformers_does():
    """transformers' Gemma 3 reads hidden_activation only: a config with hidden_act "silu" (older
    Gemma configs write hidden_act) ran SiLU here, logits 0.32 away from transformers'; "gelu" was
    refused as not implemented, where transformers runs its default."""
    spec = dict(model_type="gemma3_text", head_dim=16, sliding_window=WINDOW, layer_types=TWO_KINDS, hidden_act="silu")
    hf = build_random_model(**spec)
    raw = {k: v for k, v in hf.config.to_dict().items() if k != "hidden_activation"}  # as such a config.json
    assert raw.get("hidden_act") == "silu"
    config = ModelConfig.from_dict(raw)
    assert config.hidden_act == "gelu_pytorch_tanh"
    with torch.inference_mode():
        expected = hf(torch.tensor([PROMPTS[0]])).logits[0, -1]
    got = last_logits(config, hf_state_dict(hf), PROMPTS[0])
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
    assert ModelConfig.from_dict({**raw, "hidden_act": "gelu"}).hidden_act == "gelu_pytorch_tanh"
    with pytest.raises(ValueError, match=r"field hidden_activation='gelu' is not implemented"):  # its own field named
        ModelConfig.from_dict({**raw, "hidden_activation": "gelu"})


@pytest.mark.parametrize("spec", [dict(model_type="llama", sliding_window=0),
                                  dict(model_type="qwen2", sliding_window=0, use_sliding_window=False),
                                  dict(model_type="qwen3", sliding_window=2**40, use_sliding_window=False)])
def test_a_window_the_family_never_applies_is_not_checked(spec):
    """transformers runs these (Llama has no window; Qwen reads it only with use_sliding_window):
    they were refused as "sliding_window=0 must be a positive integer"."""
    raw = build_random_model(model_type=spec["model_type"]).config.to_dict()
    config = ModelConfig.from_dict({**raw, **spec})
    assert config.sliding_window is None and config.layer_types is None
    with pytest.raises(ValueError, match=r"sliding_window"):  # where it does apply, still checked
        ModelConfig.from_dict({**raw, **spec, "model_type": "mistral"})


@pytest.mark.parametrize("layout", ["4.x", "5.x"])
def test_gemma3_partial_rotary_with_scaled_rope_is_refused_as_for_the_other_families(layout):
    """transformers' model fails with a shape error on it; corelaunch rotated every dimension."""
    plain = build_random_model(model_type="gemma3_text", head_dim=16, sliding_window=WINDOW,
                               layer_types=TWO_KINDS).config.to_dict()
    raw, linear = plain, {"rope_type": "linear", "factor": 8.0}
    if layout == "4.x":
        raw = {**{k: v for k, v in raw.items() if k != "rope_parameters"}, "rope_scaling": linear}
        where = "partial_rotary_factor"
    else:
        raw = {**raw, "rope_scaling": None, "rope_parameters": {
            "full_attention": {**linear, "rope_theta": 1e6, "partial_rotary_factor": 0.5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
        where = r"rope_parameters\.full_attention\.partial_rotary_factor"
    with pytest.raises(ValueError, match=rf"{where}.*not supported with linear rope scaling"):
        ModelConfig.from_dict({**raw, "partial_rotary_factor": 0.5})
    assert ModelConfig.from_dict({**plain, "partial_rotary_factor": 0.5}).rope_scaling is None  # default rope: read as before


def test_a_reused_prefix_longer_than_the_window_gives_transformers_tokens():
    """Prefix caching with a window: the second request is seated on the first one's row (its prompt
    and generated tokens) and prefilled from where they part, past the window (its reused slots hold
    keys the window has left behind by then), in chunks of 3."""
    from tests.serving_driver import collect, request, run_loops, stop
    from workers.serving.loop import ServingConfig, ServingLoop

    from workers.serving.prefix_reuse import MIN_SHARED_TOKENS

    name = "gemma3_softcap"  # window 5: local and global layers
    config, state, refs = reference(name)
    held = PROMPTS[0] + refs[0][:-1]  # what the first request's row holds once it ends
    assert len(held) >= MIN_SHARED_TOKENS + 2
    second = held[:MIN_SHARED_TOKENS + 2] + [3, 7]
    with torch.inference_mode():
        expected = hf_greedy(build_random_model(**SPECS[name]), second, NEW_TOKENS)
    loop = ServingLoop(build_rank_model(config, state, 0, 1, SingleRank()),
                       ServingConfig(1, 3, 64, prefix_caching=True))
    threads = run_loops([loop])
    try:
        loop.submit([request("first", PROMPTS[0], NEW_TOKENS, stop_token_ids=[EOS])])
        first = collect(loop, {"first"})
        loop.submit([request("second", second, NEW_TOKENS, stop_token_ids=[EOS])])
        got = collect(loop, {"second"})
    finally:
        stop([loop], threads)
    assert first.tokens["first"] == refs[0]
    cached = [e.cached_tokens for e in got.events if e.cached_tokens is not None]
    assert cached and cached[0] > config.sliding_window, cached  # the reuse really spans the window
    assert got.tokens["second"] == expected
