"""Sampling fields as clients written for vLLM's OpenAI server send them: seed -1 (no seed), a logit
bias past +-100 (taken at the bound), a temperature above OpenAI's 2, top_k written 5.0, and
spaces_between_special_tokens (accepted; the text's decoder never spaces special tokens apart)."""

from __future__ import annotations

import pytest

from launcher.serving.openai_protocol import ChatCompletionRequest, ProtocolError, parse_request
from tests.test_openai_server import MODEL, chat, completion


def responses(**fields) -> ChatCompletionRequest:
    """A /v1/responses body as the chat request it becomes (the route parses it so)."""
    from launcher.serving.responses.request import chat_body

    body, _ = chat_body({"model": MODEL, "input": "hi", **fields})
    return parse_request(ChatCompletionRequest, body)


def refused(parse, **fields) -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        parse(**fields)
    assert caught.value.status == 400
    return caught.value


# ---- seed -1 ------------------------------------------------------------------------------------
@pytest.mark.parametrize("parse", [completion, chat, responses], ids=["completions", "chat", "responses"])
def test_seed_minus_one_is_no_seed_on_every_route(parse):
    """-1 was a fixed seed: every request sending it drew the same tokens."""
    request = parse(seed=-1, temperature=0.8)
    assert request.seed is None
    assert request.sampling().seed is None


def test_seed_minus_one_leaves_every_choice_unseeded_and_other_seeds_stay_fixed():
    request = completion(seed=-1, n=3, temperature=1.0)
    assert [request.choice_sampling(i).seed for i in range(3)] == [None, None, None]
    seeded = completion(seed=-2, n=2, temperature=1.0)
    assert [seeded.choice_sampling(i).seed for i in range(2)] == [-2, -1]  # a derived -1 is still a seed
    assert completion(seed=7).sampling().seed == 7
    assert completion(seed=0).sampling().seed == 0


def test_two_unseeded_requests_get_different_generator_seeds():
    """The engine gives a sequence without a seed a random one of its own
    (workers/serving/token_choice.request_generator); -1 reached it as the seed both requests used."""
    from types import SimpleNamespace

    import torch

    from workers.serving.token_choice import request_generator

    seeds = []
    for _ in range(2):
        sequence = SimpleNamespace(request=SimpleNamespace(sampling=chat(seed=-1, temperature=1.0).sampling()),
                                   seed=None)
        assert request_generator(sequence, torch.device("cpu")) is not None
        seeds.append(sequence.seed)
    # two draws of randrange(2**62) agree with probability 2**-62
    assert seeds[0] != seeds[1]


def test_the_driver_apis_seed_minus_1_is_no_seed_too():
    """SamplingParams(seed=-1), as code ported from vLLM writes "no seed", was a fixed seed there."""
    from shardlib.sampling_params import SamplingParams

    assert SamplingParams(temperature=1.0, seed=-1).seed is None
    assert SamplingParams(temperature=1.0, seed=-2).seed == -2


# ---- logit_bias past +-100 ----------------------------------------------------------------------
@pytest.mark.parametrize("parse", [completion, chat], ids=["completions", "chat"])
def test_a_logit_bias_past_the_bound_is_taken_at_the_bound(parse):
    sampling = parse(logit_bias={"7": 150, "8": -1e9, "9": 100.0, "10": -2.5}).sampling()
    assert sampling.logit_bias == ((7, 100.0), (8, -100.0), (9, 100.0), (10, -2.5))


@pytest.mark.parametrize("value, shown", [(float("nan"), "NaN"), (float("inf"), "Infinity"),
                                          (float("-inf"), "-Infinity")])
def test_a_logit_bias_that_is_no_finite_number_is_still_refused(value, shown):
    err = refused(completion, logit_bias={"7": value})
    assert err.param == "logit_bias"
    assert err.message.startswith(f"logit_bias[\"7\"] ({shown}) must be a finite number (one past [-100, 100] is "
                                  f"taken as -100 or 100)"), err.message


def test_the_driver_apis_sampling_params_still_refuse_a_bias_past_the_bound_naming_the_range():
    from shardlib.sampling_params import SamplingParams

    with pytest.raises(ValueError, match=r"^logit_bias\[7\]=150 must be a number in \[-100, 100\]$"):
        SamplingParams(logit_bias={7: 150})


# ---- temperature ---------------------------------------------------------------------------------
@pytest.mark.parametrize("parse", [completion, chat, responses], ids=["completions", "chat", "responses"])
def test_a_temperature_above_two_is_taken(parse):
    assert parse(temperature=3.0).sampling().temperature == 3.0
    assert parse(temperature=1e6).sampling().temperature == 1e6


@pytest.mark.parametrize("value, shown", [(-0.5, "-0.5"), (float("inf"), "Infinity"), (float("nan"), "NaN"),
                                          (1e39, "1e+39"), ("hot", "'hot'")])
def test_a_temperature_that_is_negative_or_not_finite_is_refused_with_the_range(value, shown):
    err = refused(chat, temperature=value)
    assert err.param == "temperature"
    assert err.message.startswith(f"temperature ({shown}) must be a number in [0, 3.402823e+38] (0 is greedy"), \
        err.message


# ---- top_k written as a float --------------------------------------------------------------------
@pytest.mark.parametrize("parse", [completion, chat, responses], ids=["completions", "chat", "responses"])
def test_top_k_written_as_a_whole_float_is_its_integer(parse):
    assert parse(top_k=5.0).sampling().top_k == 5
    assert parse(top_k=-1.0).sampling().top_k == 0  # -1: off, as the integer
    assert parse(top_k=5).sampling().top_k == 5


@pytest.mark.parametrize("value, shown", [(5.5, "5.5"), (-2.0, "-2"), (True, "true"), ("5", "'5'"),
                                          (float("inf"), "Infinity")])
def test_top_k_that_is_no_whole_number_is_refused_by_name(value, shown):
    err = refused(completion, top_k=value)
    assert err.param == "top_k"
    assert err.message.startswith(f"top_k ({shown}) must be an integer >= 0, or -1"), err.message


# ---- spaces_between_special_tokens --------------------------------------------------------------
@pytest.mark.parametrize("parse", [completion, chat], ids=["completions", "chat"])
def test_spaces_between_special_tokens_is_accepted(parse):
    assert parse(spaces_between_special_tokens=False).spaces_between_special_tokens is False
    assert parse().spaces_between_special_tokens is True
    assert refused(parse, spaces_between_special_tokens="no").param == "spaces_between_special_tokens"


def test_special_tokens_kept_in_the_text_are_never_spaced_apart(smollm2_tokenizer):
    """Why the field can be ignored: the stream's decoder writes adjacent special tokens side by side,
    which is what the field's false asks (and what vLLM's fast detokenizer writes for either value)."""
    from launcher.serving.text_stream import TextStream
    from workers.serving.requests import TokenEvent

    ids = smollm2_tokenizer.encode("Hi<|im_end|><|im_start|><|endoftext|>", add_special_tokens=False)
    stream = TextStream("r", smollm2_tokenizer, (), 1, skip_special_tokens=False)
    text = "".join(stream.delta(TokenEvent("r", [token], "length" if i == len(ids) - 1 else None)).text
                   for i, token in enumerate(ids))
    assert text == "Hi<|im_end|><|im_start|><|endoftext|>"
