"""Prompt log-probabilities in the serving loop, in-process: every prompt token's log-probability and
its most likely alternatives equal transformers' log-softmax over the prompt, whether the prompt is
prefilled in one chunk or several, beside other requests, at TP 1 and TP 2, eager and compiled;
they come once, with the first token, and the generated tokens are those of the prompt alone."""

from __future__ import annotations

import pytest
import torch

from shardlib.buckets import Buckets
from shardlib.serving_shapes import ServingShapes
from tests.serving_driver import collect, count_prefill_calls, request, run_loops, stop
from tests.test_engine import PROMPTS, alone, fresh_model, hf_model
from tests.test_serving_loop import MORE_PROMPTS, tp2_loops
from workers.serving.loop import ServingConfig, ServingLoop
from workers.serving.prompt_scoring import SCORE_BLOCK, prompt_targets
from workers.serving.step_plan import PrefillChunk

LONG = tuple((7 * i + 3) % 120 + 1 for i in range(40))


def hf_prompt_table(prompt) -> torch.Tensor:
    """transformers' log-softmax at every prompt position: row j scores the token after column j."""
    with torch.no_grad():
        logits = hf_model()(torch.tensor([list(prompt)])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def check_entries(entries, prompt, top_n: int) -> None:
    table = hf_prompt_table(prompt)
    assert [e.token_id for e in entries] == list(prompt[1:])
    for j, entry in enumerate(entries):
        assert entry.logprob == pytest.approx(float(table[j, prompt[j + 1]]), abs=1e-4)
        assert entry.rank == int((table[j] > table[j, prompt[j + 1]] + 1e-5).sum()) + 1
        assert len(entry.top) == top_n
        want = table[j].topk(top_n)
        assert [t for t, _ in entry.top] == want.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(want.values.tolist(), abs=1e-4)


def prompt_entries(got, rid):
    carried = [e.prompt_logprobs for e in got.events if e.request_id == rid and e.prompt_logprobs is not None]
    assert len(carried) == 1, f"{rid}: prompt logprobs came {len(carried)} times"
    first = next(e for e in got.events if e.request_id == rid and e.token_ids)
    assert first.prompt_logprobs is carried[0]  # with the first token
    return carried[0]


@pytest.mark.parametrize("budget", [64, 6], ids=["one-chunk", "chunks-of-6"])
def test_prompt_logprobs_equal_transformers_in_one_chunk_or_several(budget):
    loop = ServingLoop(fresh_model(), ServingConfig(3, budget, 64))
    threads = run_loops([loop])
    loop.submit([request("scored", LONG, 5, prompt_logprobs=3), request("plain", PROMPTS[0], 5),
                 request("zero", PROMPTS[2], 5, prompt_logprobs=0, logprobs=1)])
    got = collect(loop, {"scored", "plain", "zero"})
    stop([loop], threads)
    check_entries(prompt_entries(got, "scored"), LONG, 3)
    check_entries(prompt_entries(got, "zero"), PROMPTS[2], 0)
    assert not any(e.prompt_logprobs for e in got.events if e.request_id == "plain")
    for rid, prompt in (("scored", LONG), ("plain", PROMPTS[0]), ("zero", PROMPTS[2])):
        assert got.tokens[rid] == alone(tuple(prompt), 5)


def test_a_one_token_prompt_has_no_prompt_logprobs_and_blocks_split_long_chunks(monkeypatch):
    import workers.serving.prompt_scoring as scoring

    monkeypatch.setattr(scoring, "SCORE_BLOCK", 4)  # 40 columns in blocks of 4, the last block partial
    assert SCORE_BLOCK > 4
    loop = ServingLoop(fresh_model(), ServingConfig(2, 64, 64))
    threads = run_loops([loop])
    loop.submit([request("one", [11], 3, prompt_logprobs=2), request("long", LONG[:39], 3, prompt_logprobs=1)])
    got = collect(loop, {"one", "long"})
    stop([loop], threads)
    assert prompt_entries(got, "one") == []
    check_entries(prompt_entries(got, "long"), LONG[:39], 1)
    assert got.tokens["one"] == alone((11,), 3) and got.tokens["long"] == alone(LONG[:39], 3)


def test_targets_are_the_tokens_after_each_column():
    prompt = (10, 11, 12, 13, 14)
    assert prompt_targets(prompt, PrefillChunk(0, 0, (10, 11))) == (11, 12)
    assert prompt_targets(prompt, PrefillChunk(0, 2, (12, 13, 14))) == (13, 14)  # the last predicts no prompt token


def test_tp2_prompt_logprobs_equal_transformers():
    loops = tp2_loops(max_num_seqs=2, max_prefill_tokens=7)
    threads = run_loops(loops)
    loops[0].submit([request("scored", LONG, 4, prompt_logprobs=2), request("plain", MORE_PROMPTS[3], 4)])
    got = collect(loops[0], {"scored", "plain"})
    stop(loops, threads)
    check_entries(prompt_entries(got, "scored"), LONG, 2)
    assert got.tokens["scored"] == alone(LONG, 4) and got.tokens["plain"] == alone(tuple(MORE_PROMPTS[3]), 4)


def test_compiled_loop_scores_prompts_eagerly_without_building_a_graph():
    from torch._dynamo.utils import counters

    from workers.compiled import CompiledCausalLM

    torch._dynamo.reset()
    buckets = Buckets.build(max_seq_len=64, context=(8,), token=(64,))
    shapes = ServingShapes.build(buckets, max_num_seqs=2, max_prefill_tokens=8)
    model = CompiledCausalLM(fresh_model(), buckets, announce=lambda line: None)
    loop = ServingLoop(model, ServingConfig(2, 8, 64, shapes))
    with model.warming_up():
        loop.warm_up(shapes.shapes())
    graphs = counters["stats"]["unique_graphs"]
    threads = run_loops([loop])
    loop.submit([request("scored", LONG[:20], 4, prompt_logprobs=1), request("plain", PROMPTS[0], 4)])
    got = collect(loop, {"scored", "plain"})
    stop([loop], threads)
    assert counters["stats"]["unique_graphs"] == graphs
    check_entries(prompt_entries(got, "scored"), LONG[:20], 1)
    assert got.tokens["plain"] == alone(tuple(PROMPTS[0]), 4)
    assert got.tokens["scored"] == alone(LONG[:20], 4)


def test_a_backend_without_a_scoring_step_fails_the_request_alone():
    class NoScoring:
        def __init__(self, model):
            self._model = model

        def __getattr__(self, name):
            if name in ("score_step", "column_logits"):
                raise AttributeError(name)
            return getattr(self._model, name)

    loop = ServingLoop(NoScoring(fresh_model()), ServingConfig(2, 64, 64))
    threads = run_loops([loop])
    loop.submit([request("scored", PROMPTS[0], 3, prompt_logprobs=1), request("plain", PROMPTS[1], 3)])
    got = collect(loop, {"scored", "plain"})
    stop([loop], threads)
    assert got.finish["scored"] == "error" and got.tokens["scored"] == []
    [error] = [e.error for e in got.events if e.request_id == "scored"]
    assert "prompt log-probabilities are not available" in error
    assert got.tokens["plain"] == alone(tuple(PROMPTS[1]), 3)


def test_a_compiled_loop_prefills_a_call_that_would_be_mostly_padding_eagerly():
    """Four 5-token prompts in a 128-token chunk bucket would prefill 4 x 128 tokens for 20 real
    ones: the call runs eagerly at its exact shape (no prefill graph), with the tokens the eager
    model gives; a 100-token prompt, which its bucket barely pads, keeps its compiled graph."""
    from workers.compiled import CompiledCausalLM

    torch._dynamo.reset()
    buckets = Buckets.build(max_seq_len=256, context=(128,), token=(256,))
    shapes = ServingShapes.build(buckets, max_num_seqs=4, max_prefill_tokens=512)
    model = CompiledCausalLM(fresh_model(), buckets, announce=lambda line: None)
    calls = count_prefill_calls(model)
    loop = ServingLoop(model, ServingConfig(4, 512, 256, shapes))
    threads = run_loops([loop])
    short = [tuple(p[:5]) for p in PROMPTS[:3]] + [tuple(LONG[:5])]
    loop.submit([request(f"s{i}", p, 3) for i, p in enumerate(short)])
    got = collect(loop, {f"s{i}" for i in range(4)})
    assert calls == {"eager": 1, "graph": 0}
    loop.submit([request("long", LONG * 3, 3)])  # 120 tokens in the 128 bucket: compiled
    got_long = collect(loop, {"long"})
    stop([loop], threads)
    assert calls == {"eager": 1, "graph": 1}
    assert [got.tokens[f"s{i}"] for i in range(4)] == [alone(p, 3) for p in short]
    assert got_long.tokens["long"] == alone(LONG * 3, 3)
