"""Logit bias and repetition, frequency and presence penalties: the formula row by row, and greedy
generation with them equal to transformers' (its own sequence bias and repetition penalty;
frequency and presence through a logits processor written here from OpenAI's definition), in the
static engine and in the serving loop, alone, batched and resumed after a fault."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from tests.serving_driver import collect, request, run_loops, stop
from tests.test_engine import PROMPTS, fresh_model, hf_model
from workers.engine import generate
from workers.penalties import penalized
from workers.sampling import SamplingParams
from workers.serving.loop import ServingConfig, ServingLoop

NEW = 12


def reference_row(logits: list[float], params: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    """The definitions, one token at a time: the bias first, as vLLM and transformers apply it."""
    out = list(logits)
    for token, bias in params.logit_bias:
        out[token] += bias
    for token in range(len(out)):
        if token in prompt or token in output:
            r = params.repetition_penalty
            out[token] = out[token] / r if out[token] > 0 else out[token] * r
        count = output.count(token)
        out[token] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    return out


def test_penalties_follow_their_definitions_row_by_row():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0)) * 4  # both signs
    params = [SamplingParams(repetition_penalty=1.7, frequency_penalty=0.4, presence_penalty=-0.6,
                             logit_bias={8: 3.0, 30: -1.5}),
              SamplingParams(),  # no penalty: left as it is
              SamplingParams(temperature=0.9, repetition_penalty=0.5, presence_penalty=2.0),
              SamplingParams(logit_bias={0: 100, 39: -100})]  # a bias alone
    prompts = [[3, 3, 8, 20], [1, 2], [39, 0, 5], [4]]
    outputs = [[8, 8, 8, 11, 3], [1, 1], [12, 5, 12], [0]]
    logits = torch.cat((logits, logits[:1]))
    before = logits.clone()
    got = penalized(logits, params, prompts, outputs)
    assert torch.equal(logits, before)  # the caller's logits (log-probabilities come from them) untouched
    for i in range(4):
        want = torch.tensor(reference_row(logits[i].tolist(), params[i], prompts[i], outputs[i]))
        torch.testing.assert_close(got[i], want, rtol=1e-6, atol=1e-6)
    assert not torch.equal(got[0], logits[0]) and torch.equal(got[1], logits[1])
    assert penalized(logits, [SamplingParams()] * 4, prompts, outputs) is logits  # nothing asked: no copy


def test_frequency_and_presence_count_generated_tokens_never_the_prompt():
    logits = torch.zeros(1, 10)
    got = penalized(logits, [SamplingParams(frequency_penalty=1.0, presence_penalty=0.5)], [[4, 4, 4]], [[7, 7]])
    assert got[0, 4] == 0 and got[0, 7] == -2.5  # 2 x 1.0 + 0.5


def test_a_penalty_never_makes_a_finite_logit_infinite_and_keeps_a_broken_one_broken():
    """A tiny repetition penalty divides a large logit past float32's range, a large one multiplies a
    negative one past it: an infinite logit failed the request's token choice. A NaN or inf the
    model produced stays, for the choice to report as a broken forward."""
    logits = torch.tensor([[3e38, -3e38, 1.0, 0.0]])
    small = penalized(logits, [SamplingParams(repetition_penalty=1e-3)], [[0, 2]], [[]])
    large = penalized(logits, [SamplingParams(repetition_penalty=1e3)], [[1]], [[]])
    assert small.isfinite().all() and large.isfinite().all()
    assert small[0, 0] == torch.finfo(torch.float32).max and large[0, 1] == -torch.finfo(torch.float32).max
    for extreme in (1.1754943508222875e-38, 3.4028234663852886e38):  # the range's ends, applied to a logit of 0
        edge = penalized(torch.tensor([[0.0, 1.0, -1.0]]), [SamplingParams(repetition_penalty=extreme)], [[0, 1, 2]],
                         [[]])
        assert edge.isfinite().all() and edge[0, 0] == 0
    broken = torch.tensor([[float("nan"), 1.0, float("inf")]])
    kept = penalized(broken, [SamplingParams(repetition_penalty=2.0)], [[0, 1, 2]], [[]])
    assert kept[0, 0].isnan() and kept[0, 2] == float("inf") and kept[0, 1] == 0.5


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's frequency and presence penalties over the tokens generated after `prompt_length`."""

    def __init__(self, prompt_length: int, frequency: float, presence: float):
        self.prompt_length, self.frequency, self.presence = prompt_length, frequency, presence

    def __call__(self, input_ids, scores):
        for row, ids in enumerate(input_ids):
            counts = torch.bincount(ids[self.prompt_length:], minlength=scores.shape[-1]).to(scores.dtype)
            scores[row] -= self.frequency * counts + self.presence * (counts > 0).to(scores.dtype)
        return scores


PENALTIES = {
    "repetition": SamplingParams(repetition_penalty=1.8),
    "frequency_presence": SamplingParams(frequency_penalty=1.5, presence_penalty=0.7),
    "all_three": SamplingParams(repetition_penalty=1.3, frequency_penalty=0.9, presence_penalty=1.1),
    "logit_bias": SamplingParams(logit_bias={5: 6.0, 17: 4.5, 61: -100.0}),
    "bias_and_penalties": SamplingParams(logit_bias={5: 6.0, 17: 4.5}, repetition_penalty=1.5, frequency_penalty=1.0),
}


def transformers_greedy(prompt: list[int], params: SamplingParams) -> list[int]:
    ids = torch.tensor([prompt])
    processors = LogitsProcessorList([OpenAIPenalties(len(prompt), params.frequency_penalty, params.presence_penalty)])
    with torch.inference_mode():
        out = hf_model().generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                                  eos_token_id=None, pad_token_id=0, repetition_penalty=params.repetition_penalty,
                                  sequence_bias={(token,): bias for token, bias in params.logit_bias} or None,
                                  logits_processor=processors)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", list(PENALTIES))
def test_greedy_with_penalties_equals_transformers_in_both_engines(name):
    params = PENALTIES[name]
    want = [transformers_greedy(p, params) for p in PROMPTS]
    plain = [transformers_greedy(p, SamplingParams()) for p in PROMPTS]
    assert want != plain  # the penalties change what this model generates: the comparison means something
    static, served, companion = generated_in_both_engines(params)
    assert static == want and served == want
    assert companion == plain[0]  # a companion without penalties is not penalised


def generated_in_both_engines(params: SamplingParams) -> tuple[list, list, list]:
    """Greedy tokens of PROMPTS with `params` from the static engine and from continuous batching
    (chunked prefill, two rows for the prompts and a companion without params: each row with its own
    history), and the companion's tokens (PROMPTS[0] with default params)."""
    static = generate(fresh_model(), PROMPTS, [params] * len(PROMPTS), NEW, [])
    loop = ServingLoop(fresh_model(), ServingConfig(2, 4, 64))
    threads = run_loops([loop])
    loop.submit([request(f"r{i}", p, NEW, sampling=params) for i, p in enumerate(PROMPTS)]
                + [request("plain", PROMPTS[0], NEW)])
    got = collect(loop, {f"r{i}" for i in range(len(PROMPTS))} | {"plain"})
    stop([loop], threads)
    return [o.token_ids for o in static], [got.tokens[f"r{i}"] for i in range(len(PROMPTS))], got.tokens["plain"]


def test_a_resumed_request_counts_the_tokens_it_already_delivered_as_output():
    """A resume after a fault submits the prompt plus the delivered tokens (draws_before of them):
    frequency and presence penalties go on counting those as generated, so the rest of the stream
    is what it would have been without the fault."""
    params = SamplingParams(frequency_penalty=2.0, presence_penalty=1.0)
    loop = ServingLoop(fresh_model(), ServingConfig(2, 32, 64))
    threads = run_loops([loop])
    loop.submit([request("whole", PROMPTS[0], NEW, sampling=params)])
    whole = collect(loop, {"whole"}).tokens["whole"]
    loop.submit([request("rest", tuple(PROMPTS[0]) + tuple(whole[:5]), NEW - 5, sampling=params, draws_before=5)])
    rest = collect(loop, {"rest"}).tokens["rest"]
    stop([loop], threads)
    assert whole == transformers_greedy(PROMPTS[0], params)
    assert rest == whole[5:]
    # counted as prompt instead, the same tokens are penalised differently from here on
    as_prompt = transformers_greedy(PROMPTS[0] + whole[:5], params)[:NEW - 5]
    assert as_prompt != whole[5:]


def test_penalty_values_are_checked_when_the_params_are_built():
    for kwargs, words in (({"presence_penalty": 2.5}, "presence_penalty=2.5 must be a number in [-2, 2]"),
                          ({"frequency_penalty": float("nan")}, "frequency_penalty=nan must be a number in [-2, 2]"),
                          ({"repetition_penalty": 0}, "repetition_penalty=0 must be a finite number > 0"),
                          ({"repetition_penalty": float("inf")}, "repetition_penalty=inf must be a finite"),
                          # float32 makes 1e39 infinite and 1e-46 zero: a logit of 0 became NaN, which failed
                          # the request as if the model's forward were broken
                          ({"repetition_penalty": 1e39}, "repetition_penalty=1e+39 must be in [1.175494e-38, "
                                                         "3.402823e+38] (float32's normal range"),
                          ({"repetition_penalty": 1e-46}, "repetition_penalty=1e-46 must be in [1.175494e-38"),
                          ({"presence_penalty": True}, "presence_penalty=True must be a number"),
                          ({"logit_bias": {3: 100.5}}, "logit_bias[3]=100.5 must be a number in [-100, 100]"),
                          ({"logit_bias": {-1: 1.0}}, "logit_bias names -1, which is not a token id"),
                          ({"logit_bias": {"3": 1.0}}, "logit_bias names '3', which is not a token id"),
                          ({"logit_bias": [(3, 1.0), (3, 2.0)]}, "logit_bias names token 3 twice"),
                          ({"logit_bias": 5}, "logit_bias=5 must be a mapping {token_id: bias}")):
        with pytest.raises(ValueError) as caught:
            SamplingParams(**kwargs)
        assert words in str(caught.value)
    import numpy as np

    numpy_valued = SamplingParams(repetition_penalty=np.float32(1.25), frequency_penalty=np.float64(-0.5),
                                  logit_bias={np.int64(9): np.float32(-2.5), 4: 1})
    assert type(numpy_valued.repetition_penalty) is float and numpy_valued.frequency_penalty == -0.5
    assert numpy_valued.logit_bias == ((4, 1.0), (9, -2.5)) and hash(numpy_valued)  # plain, ordered, hashable


def test_a_logit_bias_outside_the_vocabulary_is_refused_with_the_request():
    """Checked with the prompts (the params do not know the model): indexing the logits with such an
    id would fail the leader's step."""
    from shardlib.request_checks import check_request

    check_request([[1, 2]], [SamplingParams(logit_bias={127: 1.0})], 4, vocab_size=128)
    with pytest.raises(ValueError, match=r"^logit_bias names token ids \[128, 500\] outside the vocabulary "
                                         r"\[0, 128\)"):
        check_request([[1, 2]], [SamplingParams(logit_bias={500: 1.0, 128: -1.0, 3: 2.0})], 4, vocab_size=128)


def test_generate_flags_build_the_penalties_and_name_themselves_when_refused():
    import argparse

    from launcher.cli import generate_command

    parser = argparse.ArgumentParser()
    generate_command.add_parser(parser.add_subparsers())

    def sampling(*flags: str) -> SamplingParams:
        return generate_command._sampling(parser.parse_args(["generate", *flags, "hi"]))

    got = sampling("--presence-penalty", "0.5", "--frequency-penalty", "-1", "--repetition-penalty", "1.2")
    assert (got.presence_penalty, got.frequency_penalty, got.repetition_penalty) == (0.5, -1.0, 1.2)
    assert got.is_greedy  # penalties alone do not sample
    assert not sampling().has_penalties
    with pytest.raises(ValueError, match=r"^--frequency-penalty 3.0 must be a number in \[-2, 2\]"):
        sampling("--frequency-penalty", "3")
    with pytest.raises(ValueError, match=r"^--temperature -1.0 must be a finite number >= 0"):
        sampling("--temperature", "-1")
    assert sampling("--min-p", "0.1").min_p == 0.1 and sampling("--min-p", "0.1").temperature == 1.0
    with pytest.raises(ValueError, match=r"^--min-p 2.0 must be a number in \[0, 1\]"):
        sampling("--min-p", "2")
    assert sampling("--min-tokens", "5").min_tokens == 5 and sampling("--min-tokens", "5").is_greedy
    with pytest.raises(ValueError, match=r"^--min-tokens \(40\) must be at most --max-new-tokens \(32\)$"):
        sampling("--min-tokens", "40")  # the default --max-new-tokens is 32
    with pytest.raises(ValueError, match=r"^--min-tokens -1 must be an integer >= 0"):
        sampling("--min-tokens", "-1")
    got = sampling("--logit-bias", "5=-100", "--logit-bias", "7=2.5")
    assert got.logit_bias == ((5, -100.0), (7, 2.5)) and got.is_greedy
    with pytest.raises(ValueError, match=r"^--logit-bias 5=200.0 must be a number in \[-100, 100\]"):
        sampling("--logit-bias", "5=200")
    for bad in ("5", "x=1", "5=y", "=1", "-5=1"):
        with pytest.raises(ValueError, match=rf"^--logit-bias '{bad}' must be ID=BIAS, a token id \(an integer >= 0\)"):
            sampling(f"--logit-bias={bad}")  # with "=": argparse takes "-5=1" after a space for an option
    with pytest.raises(ValueError, match=r"^--logit-bias names token 5 twice \(1 and 2\)"):
        sampling("--logit-bias", "5=1", "--logit-bias", "5=2")


def transformers_min_new_tokens(prompt: list[int], stop: int, min_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf_model().generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                                  eos_token_id=stop, pad_token_id=0, min_new_tokens=min_new_tokens)
    return out[0, len(prompt):].tolist()


def test_min_tokens_holds_the_stop_tokens_back_as_transformers_min_new_tokens():
    """In the static engine, the serving loop and a stream resumed after a fault: the stop token
    greedy generation would end on at its second token is held back until min_tokens."""
    prompt = PROMPTS[0]
    ending = transformers_greedy(prompt, SamplingParams())[1]
    want = transformers_min_new_tokens(prompt, ending, 6)
    assert len(want) > 6 and ending not in want[:6]  # without min_tokens it ends after 2 tokens
    held = SamplingParams(min_tokens=6)
    [plain] = generate(fresh_model(), [prompt], [SamplingParams()], NEW, [ending])
    assert len(plain.token_ids) == 2 and plain.finish_reason == "stop"
    [static] = generate(fresh_model(), [prompt], [held], NEW, [ending])
    assert static.token_ids == want
    loop = ServingLoop(fresh_model(), ServingConfig(2, 4, 64))
    threads = run_loops([loop])
    loop.submit([request("held", prompt, NEW, sampling=held, stop_token_ids=(ending,)),
                 request("plain", prompt, NEW, stop_token_ids=(ending,)),
                 request("resumed", tuple(prompt) + tuple(want[:3]), NEW - 3, sampling=held,
                         stop_token_ids=(ending,), draws_before=3)])
    got = collect(loop, {"held", "plain", "resumed"})
    stop([loop], threads)
    assert got.tokens["held"] == want and got.tokens["plain"] == plain.token_ids
    assert want[:3] + got.tokens["resumed"] == want  # the 3 delivered tokens count towards min_tokens


def test_min_tokens_is_checked_against_max_new_tokens():
    from shardlib.request_checks import check_request

    with pytest.raises(ValueError, match=r"^min_tokens=-1 must be an integer >= 0"):
        SamplingParams(min_tokens=-1)
    with pytest.raises(ValueError, match=r"^min_tokens \(9\) must be at most max_new_tokens \(8\)"):
        check_request([[1, 2]], [SamplingParams(min_tokens=9)], 8, vocab_size=128)
    check_request([[1, 2]], [SamplingParams(min_tokens=8)], 8, vocab_size=128)


def test_an_ending_id_past_the_vocabulary_is_not_held_back_nor_fails_the_request():
    """An end-of-sequence id outside the logits' width (a checkpoint's files may name one the
    embedding lacks) with min_tokens raised an IndexError: the request failed, and a static batch's
    error ended the serving loop. Such an id can never be chosen: nothing to hold back."""
    logits = torch.zeros(2, 8)
    out = penalized(logits, [SamplingParams(min_tokens=2), SamplingParams(min_tokens=2)], [[1], [1]], [[], []],
                    [{3, 500}, {-1, 600}])
    assert out[0, 3] == float("-inf") and torch.isfinite(out[0, [0, 1, 2, 4, 5, 6, 7]]).all()
    assert torch.isfinite(out[1]).all()  # -1 no longer held the last column back
    [static] = generate(fresh_model(), [PROMPTS[0]], [SamplingParams(min_tokens=1)], 4, [2, 500])
    assert len(static.token_ids) == 4  # this model never picks 2 here: the row runs to its limit


def test_the_launchers_ending_ids_leave_out_ids_past_the_vocabulary(tmp_path):
    """config.json's and generation_config.json's end-of-sequence ids are checked as integers only:
    one past the vocabulary reached every request's stop ids."""
    import json

    from launcher.api import Launcher
    from tests.model_factory import build_random_model, save_model

    model = build_random_model("llama", num_heads=4, num_kv_heads=2)
    model_dir = save_model(model, tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    vocab = config["vocab_size"]
    config["eos_token_id"] = [2, vocab + 5]
    (model_dir / "config.json").write_text(json.dumps(config))
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [vocab, 3]}))
    launcher = Launcher(model=str(model_dir), tp=1, compile=False, progress=False).prepare()
    assert sorted(set(launcher._eos_ids())) == [2, 3]
