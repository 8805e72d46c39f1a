"""Prompt log-probabilities through the driver API, the groups in-process (TP 2): generate's and
stream's equal transformers' log-softmax over each prompt, come once (on the first delta), survive a
group fault without coming twice, and bad values are refused before anything runs."""

from __future__ import annotations

import asyncio

import pytest
import torch

from launcher.api import Launcher
from launcher.cluster.stream_handle import StreamHandle
from launcher.errors import WorkerDied
from tests.in_process_cluster import TokenGate
from tests.test_replicas import EAGER, NEW_TOKENS, PROMPTS, model_and_expected  # noqa: F401 - fixture
from workers.sampling import SamplingParams
from workers.serving.requests import StreamRequest, TokenEvent, TokenLogprob


def hf_table(model_dir: str, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def assert_matches(entries, table: torch.Tensor, prompt: list[int], top_n: int) -> None:
    assert [e.token_id for e in entries] == prompt[1:]
    for j, e in enumerate(entries):
        assert e.logprob == pytest.approx(float(table[j, prompt[j + 1]]), abs=1e-4)
        assert [t for t, _ in e.top] == table[j].topk(top_n).indices.tolist()


def test_generate_and_stream_give_each_prompts_logprobs_once(model_and_expected, in_process_cluster):
    model_dir, expected = model_and_expected
    tables = [hf_table(model_dir, p) for p in PROMPTS]
    with Launcher(model=model_dir, tp=2, max_num_seqs=2, max_prefill_tokens=4, progress=False, **EAGER) as llm:
        results = llm.generate(PROMPTS, max_new_tokens=NEW_TOKENS, prompt_logprobs=2)
        plain = llm.generate(PROMPTS[:1], max_new_tokens=NEW_TOKENS)
        deltas = list(llm.stream(PROMPTS[0], max_new_tokens=NEW_TOKENS, prompt_logprobs=1))

        async def scored():
            [result] = await llm.agenerate(PROMPTS[3:4], max_new_tokens=2, prompt_logprobs=0)
            return result
        async_result = asyncio.run(scored())
    assert [r.token_ids for r in results] == expected  # scoring changes no generated token
    for result, prompt, table in zip(results, PROMPTS, tables):
        assert_matches(result.prompt_logprobs, table, prompt, 2)
    assert plain[0].prompt_logprobs is None and plain[0].to_dict()["prompt_logprobs"] is None
    assert results[0].to_dict()["prompt_logprobs"][0]["token_id"] == PROMPTS[0][1]
    assert [d.prompt_logprobs is not None for d in deltas] == [True] + [False] * (len(deltas) - 1)
    assert_matches(deltas[0].prompt_logprobs, tables[0], PROMPTS[0], 1)
    assert_matches(async_result.prompt_logprobs, tables[3], PROMPTS[3], 0)


def test_a_fault_before_the_first_token_scores_again_and_after_it_does_not(model_and_expected,
                                                                         in_process_cluster, monkeypatch):
    model_dir, expected = model_and_expected
    gate = TokenGate(monkeypatch)  # the first stream is still running when the fault is set
    with Launcher(model=model_dir, tp=2, max_num_seqs=1, progress=False, **EAGER) as llm:
        streams = [llm.stream(p, max_new_tokens=NEW_TOKENS, prompt_logprobs=1) for p in PROMPTS[:3]]
        first = next(streams[0])  # one row: the first streams, the others wait unscored
        llm._group.fail_next(WorkerDied("rank 1 (in-process) died while serving"))
        gate.release()
        rest = [list(s) for s in streams]
    got = [[first] + rest[0]] + rest[1:]
    for deltas, want in zip(got, expected):
        assert [t for d in deltas for t in d.token_ids] == want[:NEW_TOKENS]
        assert sum(d.prompt_logprobs is not None for d in deltas) == 1  # once, whichever attempt sent it
        assert deltas[0].prompt_logprobs is not None
    assert streams[0].handle.attempts == 2


def test_a_resumed_request_asks_for_prompt_logprobs_only_while_none_came():
    request = StreamRequest("r", (1, 2, 3), SamplingParams(), 5, prompt_logprobs=2)
    handle = StreamHandle(request, lambda item: None, 60)
    assert handle.resumed().prompt_logprobs == 2  # nothing delivered: they never came
    handle.deliver(TokenEvent("r", [9], prompt_logprobs=[TokenLogprob(2, -1.0), TokenLogprob(3, -2.0)]))
    again = handle.resumed()
    assert again.prompt_logprobs is None and again.prompt_token_ids == (1, 2, 3, 9)


def test_bad_prompt_logprobs_are_refused_before_anything_runs(model_and_expected, in_process_cluster):
    model_dir, _ = model_and_expected
    with Launcher(model=model_dir, tp=1, progress=False, **EAGER) as llm:
        for bad in (21, -1, True, "1", 1.0):
            with pytest.raises(ValueError, match=r"prompt_logprobs \(.*\) must be an integer from 0 to 20"):
                llm.generate(PROMPTS[:1], prompt_logprobs=bad)
            with pytest.raises(ValueError, match=r"prompt_logprobs \(.*\) must be an integer from 0 to 20"):
                llm.stream(PROMPTS[0], prompt_logprobs=bad)
        with pytest.raises(ValueError, match=r"prompt_logprobs \(1\) needs batching='continuous'"):
            llm.generate(PROMPTS[:1], prompt_logprobs=1, batching="static")
        assert llm.load() == {"running": 0, "waiting": 0}


def test_a_fault_while_a_long_prompt_is_scored_scores_it_again_once(model_and_expected, in_process_cluster,
                                                                    monkeypatch):
    """The group fails while a scored prompt is still being prefilled in chunks: the restarted group
    scores it again, and its log-probabilities come once, equal to transformers'. The fault strikes
    rank 0's loop at its third step (of 15 chunks), whatever the host's speed: injected from the
    driver, it landed at the driver's next poll, up to 50 ms later, by when a fast host under load
    had sometimes finished the whole request (`.ci/run`, machine R)."""
    from workers.serving.loop import ServingLoop

    model_dir, _ = model_and_expected
    prompt = [(7 * i + 3) % 120 + 1 for i in range(60)]
    table = hf_table(model_dir, prompt)
    steps = {"rank 0": 0}
    forwards = ServingLoop._forwards

    def dies_at_the_third_step(loop, plan):
        if loop.is_leader:
            steps["rank 0"] += 1
            if steps["rank 0"] == 3:
                raise RuntimeError("rank 0 (in-process) died while scoring")
        return forwards(loop, plan)

    monkeypatch.setattr(ServingLoop, "_forwards", dies_at_the_third_step)
    with Launcher(model=model_dir, tp=2, max_num_seqs=1, max_prefill_tokens=4, progress=False, **EAGER) as llm:
        stream = llm.stream(prompt, max_new_tokens=3, prompt_logprobs=1)
        deltas = list(stream)
    assert stream.handle.attempts == 2
    assert [d.prompt_logprobs is not None for d in deltas] == [True] + [False] * (len(deltas) - 1)
    assert_matches(deltas[0].prompt_logprobs, table, prompt, 1)
