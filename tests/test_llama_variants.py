"""Llama checkpoints with the options transformers defines for them: biases on o_proj and the MLP
(attention_bias, mlp_bias) and rope scaling linear, dynamic, yarn and longrope. Greedy tokens must
equal transformers' at TP 1 and TP 2 (ranks as threads, tests/tp_harness.py).

The prompt plus its new tokens runs past the original context of every scaling (8 positions), so
longrope switches to its long factors, as transformers does step by step. Dynamic scaling changes
nothing until a sequence passes max_position_embeddings, which the engine never allows
(workers/engine.py's cache_length); its growth is checked by a greedy loop over the model's own
forward instead.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from shardlib.buckets import Buckets
from shardlib.model_config import ModelConfig
from shardlib.serving_shapes import ServingShapes
from tests.model_factory import build_random_model
from tests.serving_driver import collect, request, run_loops, stop
from tests.test_model_tp import hf_greedy
from tests.tp_harness import Case, Request, build_rank_model, hf_state_dict, run_tp_in_process, token_ids
from workers.collectives import SingleRank
from workers.engine import generate
from workers.rope import RotaryTables
from workers.sampling import SamplingParams
from workers.serving.loop import ServingConfig, ServingLoop

PROMPTS = [[5, 9, 33, 17, 80, 3], [7, 100, 21, 4, 66, 8, 120, 3, 44, 12]]
NEW_TOKENS, EOS, CONTEXT = 10, 2, 8
HALF = 8  # head_dim 16 / 2: one longrope factor per rotated pair

SPECS = {
    "biases": dict(attention_bias=True, mlp_bias=True, intermediate_size=100),  # 100: padded at TP 3
    "linear": dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "dynamic": dict(rope_scaling={"rope_type": "dynamic", "factor": 4.0}, max_position_embeddings=4 * CONTEXT),
    "yarn": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": CONTEXT},
                 max_position_embeddings=4 * CONTEXT),
    "longrope": dict(rope_scaling={"rope_type": "longrope", "original_max_position_embeddings": CONTEXT,
                                   "short_factor": [1.0 + i / 4 for i in range(HALF)],
                                   "long_factor": [2.0 + i for i in range(HALF)]},
                     max_position_embeddings=4 * CONTEXT),
}


@functools.lru_cache(maxsize=None)
def hf_model(name: str):
    return build_random_model(hidden_size=64, num_heads=4, num_kv_heads=2, **SPECS[name])


@functools.lru_cache(maxsize=None)
def reference(name: str):
    model = hf_model(name)
    config = ModelConfig.from_dict(model.config.to_dict())
    with torch.inference_mode():
        refs = [hf_greedy(model, prompt, NEW_TOKENS) for prompt in PROMPTS]
    return config, hf_state_dict(model), refs


def requests() -> list[Request]:
    return [Request([prompt], NEW_TOKENS, [EOS]) for prompt in PROMPTS]


@pytest.mark.parametrize("name", list(SPECS))
def test_tp1_equals_transformers(name):
    config, state, refs = reference(name)
    assert config.executor_gaps() == []
    model = build_rank_model(config, state, 0, 1, SingleRank())
    got = [generate(model, r.prompts, r.sampling(), r.max_new_tokens, r.stop_token_ids)[0].token_ids
           for r in requests()]
    assert got == refs
    # The scaling must matter, or this test would not test it (dynamic: only past the context).
    if name not in ("biases", "dynamic"):
        plain = build_rank_model(dataclasses.replace(config, rope_scaling=None), state, 0, 1, SingleRank())
        assert [generate(plain, r.prompts, r.sampling(), r.max_new_tokens, r.stop_token_ids)[0].token_ids
                for r in requests()] != refs


def test_tp2_equals_transformers():
    cases = [Case(name, *reference(name)[:2], requests()) for name in SPECS]
    results = run_tp_in_process(2, cases)
    for name in SPECS:
        assert [token_ids(out)[0] for out in results[0][name]] == reference(name)[2], name


def longrope_model():
    config, state, refs = reference("longrope")
    return build_rank_model(config, state, 0, 1, SingleRank()), refs


@pytest.mark.parametrize("name", ["longrope", "dynamic"])
def test_each_row_of_a_lookup_scales_by_its_own_largest_position(name):
    """A row's cos/sin do not depend on the other rows of its step, even past the original context
    (longrope) or max_position_embeddings (dynamic, 32 here)."""
    config = reference(name)[0]
    tables = RotaryTables(config.head_dim, 64, config.rope_theta, config.rope_scaling,
                          max_position_embeddings=config.max_position_embeddings)
    short, long = torch.tensor([[0, 0, 1, 2, 3, 3]]), torch.tensor([[38, 39, 40, 41, 42, 43]])
    cos, sin = tables.lookup(torch.cat((short, long)), torch.float32)
    for i, row in enumerate((short, long)):
        alone = tables.lookup(row, torch.float32)
        assert torch.equal(cos[i], alone[0][0]) and torch.equal(sin[i], alone[1][0])
    assert not torch.equal(cos[1], tables.cos[long[0]])  # the long row's scaling mattered


def test_longrope_rows_of_one_static_batch_choose_their_own_factors():
    """The 6-token prompt (within the original context of 8 for its prefill and first two decode
    steps) and the 10-token one (past it) in one left-padded batch: each gets transformers' tokens
    for it alone."""
    model, refs = longrope_model()
    outs = generate(model, PROMPTS, [SamplingParams()] * len(PROMPTS), NEW_TOKENS, [EOS])
    assert [out.token_ids for out in outs] == refs


def test_longrope_context_bucket_padding_keeps_the_short_factors():
    """A 6-token prompt prefilled in a context bucket of 16 columns: the padding columns must not
    carry positions past the prompt, which would pass the original context (8) and switch the prompt
    to the long factors that transformers does not use for it."""
    model, refs = longrope_model()
    buckets = Buckets.build(context=(16, 32), token=(32,))
    [out] = generate(model, [PROMPTS[0]], [SamplingParams()], NEW_TOKENS, [EOS], buckets=buckets,
                     return_logits=True)
    with torch.inference_mode():
        expected = hf_model("longrope")(torch.tensor([PROMPTS[0]])).logits[0, -1]
    torch.testing.assert_close(out.logits[0], expected, atol=1e-4, rtol=1e-4)
    assert out.token_ids == refs[0]


def serve(model, prompts: list[list[int]], config: ServingConfig) -> list[list[int]]:
    loop = ServingLoop(model, config)
    threads = run_loops([loop])
    loop.submit([request(f"r{i}", prompt, NEW_TOKENS, stop_token_ids=(EOS,)) for i, prompt in enumerate(prompts)])
    got = collect(loop, {f"r{i}" for i in range(len(prompts))})
    stop([loop], threads)
    return [got.tokens[f"r{i}"] for i in range(len(prompts))]


def test_longrope_serving_chunk_padding_keeps_the_short_factors():
    """Serving shapes pad each prompt's single prefill chunk to 16 columns; one request at a time."""
    model, refs = longrope_model()
    shapes = ServingShapes.build(Buckets.build(max_seq_len=32, context=(16,), token=(32,)), max_num_seqs=1,
                                 max_prefill_tokens=16)
    assert shapes.chunk_buckets == (16,)
    assert serve(model, PROMPTS, ServingConfig(1, 16, 32, shapes)) == refs


def test_longrope_requests_served_in_one_step_choose_their_own_factors():
    """The 6-token and the 10-token request prefilled in one call (the short one padded to 10
    columns) and decoded in the same steps: the short one's tokens do not depend on the long one."""
    model, refs = longrope_model()
    assert serve(model, PROMPTS, ServingConfig(2, 64, 32)) == refs


def greedy_past_the_context(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Prefill then one token per step through ShardedCausalLM.forward (no engine length limit)."""
    cache = model.new_cache(1, len(prompt) + new_tokens)
    ids, out = torch.tensor([prompt]), []
    with torch.inference_mode():
        logits = model(ids, torch.arange(len(prompt))[None], cache, torch.arange(len(prompt)))
        for step in range(new_tokens):
            out.append(int(logits.argmax(-1)))
            position = len(prompt) + step
            logits = model(torch.tensor([[out[-1]]]), torch.tensor([[position]]), cache, torch.tensor([position]))
    return out


def test_dynamic_scaling_grows_its_base_past_the_context():
    model = build_random_model(hidden_size=64, num_heads=4, num_kv_heads=2, max_position_embeddings=CONTEXT,
                               rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    config = ModelConfig.from_dict(model.config.to_dict())
    long_prompt = PROMPTS[1]  # 10 tokens: already past the context of 8 in the prefill
    with torch.inference_mode():
        ids = torch.tensor([long_prompt])
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                                  pad_token_id=0)[0, len(long_prompt):].tolist()
    ours = build_rank_model(config, hf_state_dict(model), 0, 1, SingleRank())
    assert greedy_past_the_context(ours, long_prompt, NEW_TOKENS) == expected
    plain = build_rank_model(dataclasses.replace(config, rope_scaling=None), hf_state_dict(model), 0, 1, SingleRank())
    assert greedy_past_the_context(plain, long_prompt, NEW_TOKENS) != expected  # the scaling mattered


def test_bias_and_scaling_facts_are_read():
    biases = reference("biases")[0]
    assert biases.attention_bias and biases.output_bias and biases.mlp_bias
    assert reference("yarn")[0].rope_scaling["rope_type"] == "yarn"
