"""The OpenAI-compatible server: its wire format in-process (fast), then the official `openai` client
against a real `corelaunch serve` on loopback with the built-in SmolLM2 model (slow).

One server serves every slow test but the proxy one (which starts its own with --ingress proxy):
direct ingress (the default for one replica), --max-restarts 0 (the last test fails its TP group
for good and watches Serve replace the replica), --max-num-seqs 4 --max-queued-requests 12 (16 requests fit; the
503 test sends more), --api-key set (the 401 test; every client sends the key), --no-compile (the
HTTP layer is the subject: compiling SmolLM2's prefill and decode graphs at each batch bucket the
requests reach took most of this module's time; the serving loop's compiled graphs are
tests/test_serving_loop.py's and, through Ray, tests/test_compiled.py's).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher.serving import openai_protocol as proto
from launcher.serving.openai_protocol import ChatCompletionRequest, CompletionRequest, ProtocolError, parse_request

REPO = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
API_KEY = "test-key-123"


# ---- fast: the protocol, no server -----------------------------------------------------------
def completion(**fields):
    return parse_request(CompletionRequest, {"model": MODEL, "prompt": "hi", **fields})


def chat(**fields):
    return parse_request(ChatCompletionRequest,
                         {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields})


def refusal(parse, **fields) -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        parse(**fields)
    assert caught.value.status == 400
    body = caught.value.body()["error"]
    assert body["type"] == "invalid_request_error" and body["code"] is None and body["message"]
    return caught.value


@pytest.mark.parametrize("field, value, words", [
    ("temperature", 1e39, ["temperature (1e+39)", "[0, 3.402823e+38]"]),  # above 2 is taken: float32's bound
    ("temperature", -1, ["temperature (-1)", "[0, 3.402823e+38]"]),
    ("temperature", "hot", ["temperature ('hot')", "[0, 3.402823e+38]"]),
    ("top_p", -0.1, ["top_p (-0.1)", "[0, 1]"]),
    ("top_p", 1.5, ["top_p (1.5)", "[0, 1]"]),
    ("top_k", -2, ["top_k (-2)", ">= 0"]),
    ("min_p", 1.5, ["min_p (1.5)", "[0, 1]"]),
    ("min_tokens", -1, ["min_tokens (-1)", "an integer >= 0, at most max_tokens"]),
    ("min_tokens", 2.0, ["min_tokens (2.0)", "an integer >= 0"]),
    ("min_p", -0.1, ["min_p (-0.1)", "[0, 1]"]),
    ("seed", -2**63 - 1, ["seed (-9223372036854775809)", "[-2**63, 2**63 - 1]"]),
    ("max_tokens", 0, ["max_tokens (0)", ">= 1"]),
    ("logprobs", 21, ["logprobs (21)", "[0, 20]"]),
    ("n", 129, ["n (129)", "[1, 128]"]),
    ("n", 0, ["n (0)", "[1, 128]"]),
    ("presence_penalty", 2.5, ["presence_penalty (2.5)", "[-2, 2]"]),
    ("frequency_penalty", -2.01, ["frequency_penalty (-2.01)", "[-2, 2]"]),
    ("repetition_penalty", 0, ["repetition_penalty (0)", "a number > 0 in float32's normal range"]),
    ("repetition_penalty", float("inf"), ["repetition_penalty (Infinity)", "[1.175494e-38, 3.402823e+38]"]),
    ("repetition_penalty", float("nan"), ["repetition_penalty (NaN)", "[1.175494e-38, 3.402823e+38]"]),
    ("repetition_penalty", 1e39, ["repetition_penalty (1e+39)", "float32's normal range"]),
    ("repetition_penalty", "1.2", ["repetition_penalty ('1.2')", "a number > 0"]),
    ("stop", ["a", "b", "c", "d", "e"], ["stop has 5 strings", "at most 4"]),
    ("stop", [""], ["stop[0] is empty", "stop strings must not be empty"]),
    ("stop", ["a", ""], ["stop[1] is empty"]),  # which one of the list (it did not say)
    ("stop", "", ["stop is empty"]),
    ("prompt", [[]], ["its token-id list is empty"]),
    ("prompt", [[1, 2], []], ["prompt[1] must be a string", "its token-id list is empty"]),  # which of several
    ("prompt", [[1, 2], [3, -1]], ["prompt[1]: token ids must be integers >= 0"]),
    ("prompt", [], ["prompt must be a string", "it is an empty list"]),  # was "a list of 0 strings"
    ("prompt", [[4, -1]], ["token ids must be integers >= 0"]),
    ("prompt", [1, -5], ["prompt: token ids must be integers >= 0"]),
    ("stream_options", {"include_usage": True}, ["only allowed with stream: true"]),
    ("stop_token_ids", [-3], ["stop_token_ids", "integers >= 0"]),
    # millions of ids took seconds of the event loop to check, and the refusal quoted them all
    ("stop_token_ids", [7] * 1025, ["stop_token_ids has 1025 ids; at most 1024"]),
    ("stop_token_ids", [-1] * 1000, ["stop_token_ids ([-1, -1, -1", "...) must be"]),
    # values of the wrong JSON type are refused, not converted
    ("max_tokens", "2", ["max_tokens ('2')", ">= 1"]),
    ("max_tokens", 2.0, ["max_tokens (2.0)", ">= 1"]),
    ("max_tokens", True, ["max_tokens (true)", ">= 1"]),
    ("seed", 1.0, ["seed (1.0)", "2**63 - 1"]),
    ("logprobs", True, ["logprobs (true)", "[0, 20]"]),
    ("stream", "yes", ["stream ('yes')", "true or false"]),
    ("prompt", [True, False], ["prompt ([true, false])", "token ids"]),
])
def test_completion_refusals_name_the_field_and_its_range(field, value, words):
    err = refusal(completion, **{field: value})
    assert err.param == field
    for word in words:
        assert word in err.message, err.message


def test_null_parameters_take_their_defaults():
    req = completion(temperature=None, top_p=None, top_k=None, n=None, stream=None, ignore_eos=None, seed=None,
                     stop=None, stop_token_ids=None, presence_penalty=None, frequency_penalty=None, max_tokens=None)
    assert (req.temperature, req.top_p, req.top_k, req.n, req.stream, req.ignore_eos) == (1.0, 1.0, 0, 1, False, False)
    assert req.stop_token_ids == [] and req.seed is None and req.max_tokens is None
    assert chat(logprobs=None, top_logprobs=None).logprobs is False
    assert refusal(completion, model=None).param == "model"  # a required field stays required


def test_a_number_field_takes_an_integer():
    assert completion(temperature=1, top_p=1).temperature == 1.0


def test_top_p_zero_keeps_only_the_most_likely_token():
    """OpenAI allows top_p 0 (it was refused): the limit of a shrinking nucleus, the top token alone.
    It was top_k 1, which keeps every token tied at the top and drew among them (bfloat16 logits
    tie often); now greedy, which takes the first of them as greedy requests do."""
    import torch

    from workers.sampling import sample

    sampling = completion(temperature=0.8, top_p=0, seed=5).sampling()
    assert sampling.temperature == 0.0 and sampling.seed == 5
    tied = torch.tensor([[3.0, 3.0, 1.0, 0.0]])
    drawn = {int(sample(tied, [sampling], [torch.Generator().manual_seed(seed)])[0]) for seed in range(12)}
    assert drawn == {0}
    plain = chat(temperature=0.8, top_p=0.9, top_k=-1).sampling()
    assert (plain.top_k, plain.top_p) == (0, 0.9)  # -1 is vLLM's "off"


@pytest.mark.parametrize("bias, words", [
    ({"abc": 1}, "logit_bias key 'abc' is not a token id"),
    ({"-3": 1}, "logit_bias key '-3' is not a token id"),
    ({" 7": 1}, "logit_bias key ' 7' is not a token id"),
    ({"\u00b2": 1}, "is not a token id"),  # a digit to str.isdigit, not to int()
    ({"9" * 5000: 1}, "is not a token id"),  # was Python's own "Exceeds the limit (4300 digits)", param prompt
    ({"5": 1, "05": -100}, "logit_bias names token 5 twice (as '5' and '05')"),  # was the last one, silently
    ({"7": float("inf")}, "logit_bias[\"7\"] (Infinity) must be a finite number"),  # 100.5 is taken as 100
    ({"7": float("nan")}, "logit_bias[\"7\"] (NaN) must be a finite number"),
    ({"7": "1"}, "logit_bias ('1') must be an object of at most 1024 token ids"),
    ({str(i): 1 for i in range(1025)}, "logit_bias has 1025 entries; at most 1024"),
    ([1, 2], "logit_bias ([1, 2]) must be an object"),
])
def test_logit_bias_refusals_name_the_key_and_the_rule(bias, words):
    err = refusal(completion, logit_bias=bias)
    assert err.param == "logit_bias" and words in err.message, err.message


@pytest.mark.parametrize("parse", [completion, chat], ids=["completions", "chat"])
@pytest.mark.parametrize("ids, words", [
    ([], "allowed_token_ids ([]) must be a non-empty list of at most 262144 token ids (integers >= 0, in the "
         "model's vocabulary; vLLM's extension: only these tokens are generated): an empty list leaves no token"),
    ([5, -1], "allowed_token_ids ([5, -1]) must be a non-empty list"),
    ([5, 1.5], "allowed_token_ids (1.5) must be a non-empty list"),
    ([True], "allowed_token_ids (true) must be a non-empty list"),
    (["5"], "allowed_token_ids ('5') must be a non-empty list"),
    (5, "allowed_token_ids (5) must be a non-empty list"),
    (list(range(262145)), "allowed_token_ids has 262145 ids; at most 262144 are allowed"),
], ids=["empty", "negative", "float", "bool", "string", "not-a-list", "too-many"])
def test_allowed_token_ids_refusals_name_the_field_and_the_rule(parse, ids, words):
    err = refusal(parse, allowed_token_ids=ids)
    assert err.param == "allowed_token_ids" and words in err.message, err.message


def test_allowed_token_ids_reach_the_engines_sampling_params_on_both_routes():
    assert completion(allowed_token_ids=[9, 2, 9], temperature=0).sampling().allowed_token_ids == (2, 9)
    assert chat(allowed_token_ids=[7], top_p=0).sampling().allowed_token_ids == (7,)
    assert completion(allowed_token_ids=None).sampling().allowed_token_ids is None
    assert chat().sampling().allowed_token_ids is None


def test_allowed_token_ids_outside_the_vocabulary_are_a_400_naming_the_field():
    """The driver refuses them (launcher/api.py, as it refuses logit_bias's): the refusal names the
    field, not the prompt."""
    from shardlib.request_checks import check_request
    from shardlib.sampling_params import SamplingParams

    with pytest.raises(ValueError) as driver:
        check_request([[1, 2]], [SamplingParams(allowed_token_ids=[5, 49152])], 8, 49152)
    message = str(driver.value)
    start, rejected = _starting_server(None, message)
    with pytest.raises(ProtocolError) as caught:
        start(completion(allowed_token_ids=[5, 49152]), [1, 2], 8)
    assert (caught.value.status, caught.value.param, caught.value.message) == (400, "allowed_token_ids", message)
    assert rejected == [400]


def test_penalties_and_min_p_reach_the_engines_sampling_params():
    """presence_penalty and frequency_penalty were refused unless 0; now they and vLLM's
    repetition_penalty are the request's, greedy ones included (top_p 0 and temperature 0)."""
    sampling = completion(temperature=0, presence_penalty=0.5, frequency_penalty=-1.5, repetition_penalty=1.3).sampling()
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty) == (0.5, -1.5, 1.3)
    assert sampling.is_greedy and sampling.has_penalties
    nucleus_zero = chat(top_p=0, frequency_penalty=2, repetition_penalty=0.9).sampling()
    assert nucleus_zero.is_greedy and (nucleus_zero.frequency_penalty, nucleus_zero.repetition_penalty) == (2, 0.9)
    assert not completion(presence_penalty=None, repetition_penalty=None).sampling().has_penalties
    assert chat(min_p=0.2).sampling().min_p == 0.2 and completion(min_p=None).sampling().min_p == 0.0
    assert completion(logit_bias={"50256": -100, "7": 2}).sampling().logit_bias == ((7, 2.0), (50256, -100.0))


def test_min_tokens_past_the_limit_names_the_limit_the_request_has():
    """A chat request without max_tokens was told to raise a max_tokens it never sent (the limit was
    what the context leaves), which past the context is refused in turn."""
    from launcher.serving.openai_app import _min_tokens_past_the_limit

    said = _min_tokens_past_the_limit(chat(min_tokens=5000), 986, 38)
    assert said == ("min_tokens (5000) must be at most the 986 tokens the context leaves after the 38-token prompt "
                    "(no max_tokens was sent); lower min_tokens or shorten the messages")
    assert _min_tokens_past_the_limit(chat(min_tokens=9, max_completion_tokens=8), 8, 38) == (
        "min_tokens (9) must be at most max_completion_tokens (8); lower min_tokens or raise max_completion_tokens")
    assert _min_tokens_past_the_limit(completion(min_tokens=20), 16, 5) == (
        "min_tokens (20) must be at most max_tokens, 16 when not sent (OpenAI's default for completions); send "
        "max_tokens of at least 20")
    assert _min_tokens_past_the_limit(completion(min_tokens=5, max_tokens=4), 4, 5).endswith("raise max_tokens")


def test_chat_logprobs_must_be_true_or_false():
    err = refusal(chat, logprobs=1)
    assert err.param == "logprobs" and "true or false on /v1/chat/completions" in err.message


def test_an_unknown_key_inside_stream_options_is_named_with_its_path():
    err = refusal(completion, stream=True, stream_options={"include_usage": True, "include_usages": True})
    assert err.param == "stream_options.include_usages"
    assert "unknown parameter 'stream_options.include_usages'" in err.message
    assert "{include_usage: bool, continuous_usage_stats: bool}" in err.message
    err = refusal(completion, stream=True, stream_options={"include_usage": "yes"})  # named the object before
    assert err.param == "stream_options.include_usage"
    assert err.message == "stream_options.include_usage ('yes') must be true or false"


@pytest.mark.parametrize("parse", [completion, chat], ids=["completions", "chat"])
def test_continuous_usage_stats_is_a_bool_that_counts_only_with_include_usage(parse):
    """vLLM's stream_options.continuous_usage_stats: with include_usage, every chunk carries the usage
    so far; alone it is accepted and does nothing, as vLLM's should_include_usage has it."""
    both = parse(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert both.include_usage() and both.continuous_usage()
    alone = parse(stream=True, stream_options={"continuous_usage_stats": True})
    assert not alone.include_usage() and not alone.continuous_usage()
    assert not parse(stream=True, stream_options={"include_usage": True}).continuous_usage()
    assert not parse(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": None}
                     ).continuous_usage()  # null: the default
    for bad in ("yes", 1):
        err = refusal(parse, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": bad})
        assert err.param == "stream_options.continuous_usage_stats"
        assert err.message.startswith(f"stream_options.continuous_usage_stats ({bad!r}) must be true or false")
    err = refusal(parse, stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert err.param == "stream_options" and "only allowed with stream: true" in err.message


def test_null_inside_stream_options_means_its_default():
    request = completion(stream=True, stream_options={"include_usage": None})
    assert request.stream_options is not None and request.include_usage() is False
    assert completion(stream=True, stream_options={"include_usage": True}).include_usage() is True


def test_unknown_and_missing_fields_are_refused_by_name():
    err = refusal(completion, guided_json={})
    assert err.param == "guided_json" and "unknown parameter 'guided_json'" in err.message and "max_tokens" in err.message
    with pytest.raises(ProtocolError) as caught:
        parse_request(CompletionRequest, {"prompt": "hi"})
    assert caught.value.param == "model" and "'model' is required" in caught.value.message
    with pytest.raises(ProtocolError, match="must be a JSON object, not an array"):
        parse_request(CompletionRequest, [1, 2])
    with pytest.raises(ProtocolError, match="^a key of the request body is not valid UTF-8 text") as caught:  # a key that is not valid text
        parse_request(CompletionRequest, {"model": MODEL, "prompt": "hi", "\ud800": 1})
    assert caught.value.param is None and not caught.value.message.startswith("None")  # was "None: Input ..."


def test_unsupported_parameters_are_taken_at_the_value_that_asks_for_nothing():
    """Clients that send every parameter send these at their defaults: each was an unknown parameter."""
    completion(best_of=1, echo=False, suffix="", logit_bias={})
    completion(best_of=None, echo=None, suffix=None, logit_bias=None)
    chat(logit_bias={}, response_format={"type": "text"})
    for parse, field, value, words in (
            (completion, "best_of", 2, "best_of (2) must be 1 (best_of is not supported"),
            (completion, "suffix", "end", "suffix ('end') must be an empty string (suffix is not supported)"),
            (completion, "echo", 0, "echo (0) must be true or false"),  # a number is no boolean (0 was taken)
            (chat, "response_format.type", {"type": "xml"},
             "response_format.type ('xml') must be \"text\", \"json_object\" or \"json_schema\"")):
        err = refusal(parse, **{field.split(".")[0]: value})
        assert err.param == field and words in err.message, err.message


def test_openai_sdk_fields_that_ask_for_nothing_here_are_taken():
    """Fields OpenAI's SDK sends (its prompt cache routing key, safety identifier, service tier,
    output modalities, verbosity, stream obfuscation) were "unknown parameter" 400s; each is taken at
    the values that ask for nothing this server does not do, and named where it asks for more."""
    for parse in (completion, chat):
        parse(prompt_cache_key="conversation-7", safety_identifier="user-hash", service_tier="auto", stream=True,
              stream_options={"include_usage": True, "include_obfuscation": False})
        parse(service_tier="default", prompt_cache_key=None, safety_identifier=None)
    chat(modalities=["text"], verbosity="medium")
    for parse, field, value, words in (
            (chat, "service_tier", "flex", "service_tier ('flex') must be \"auto\" or \"default\""),
            (completion, "prompt_cache_key", 5, "prompt_cache_key (5) must be a string"),
            (chat, "modalities", ["text", "audio"], "must be [\"text\"] (this server writes text only)"),
            (chat, "verbosity", "high", "verbosity ('high') must be \"medium\""),
            (completion, "modalities", ["text"], "unknown parameter 'modalities'")):  # chat's alone
        err = refusal(parse, **{field: value})
        assert err.param == field and words in err.message, (field, err.message)
    err = refusal(chat, messages=[{"role": "assistant", "content": "x", "function_call": {}},
                                  {"role": "user", "content": "y"}])  # an empty one was dropped without a word
    assert err.param == "messages.0.function_call" and "the deprecated function_call is not supported" in err.message


def test_structured_output_fields_take_only_their_wire_names_and_name_a_missing_one():
    schema = {"type": "object"}
    err = refusal(chat, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema_": schema}})
    assert err.param == "response_format.json_schema.schema_" and "unknown parameter" in err.message
    err = refusal(completion, structured_outputs={"json_": schema})
    assert err.param == "structured_outputs.json_" and "unknown parameter" in err.message
    err = refusal(chat, response_format={"type": "json_schema", "json_schema": {"schema": schema}})
    assert err.param == "response_format.json_schema.name"
    assert err.message.startswith("response_format.json_schema.name is required: a string of 1 to 64"), err.message
    assert chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}).sampling() \
        .structured_output.json == '{"type": "object"}'


def test_function_calling_and_stored_completion_fields_are_taken_when_they_ask_for_nothing():
    """OpenAI's chat parameters this server does not implement were "unknown parameter" errors, even
    at the values clients send when they want none of it. (Tools are taken: tests/test_tool_calls.py;
    an empty tools list is refused, as vLLM and OpenAI refuse it.)"""
    chat(functions=[], tool_choice="none", function_call="auto", parallel_tool_calls=False, store=False,
         metadata={})
    chat(tools=None, tool_choice=None, store=None, metadata=None)
    for field, value, words in (
            ("tools", [], "tools must not be an empty list"),
            ("functions", [{"name": "f"}], "must be an empty list (the deprecated functions are not supported"),
            ("tool_choice", "required", "needs tools"),
            ("tool_choice", {"type": "function", "function": {"name": "f"}}, "needs tools"),
            ("function_call", {"name": "f"}, "the deprecated function_call is not supported"),
            ("parallel_tool_calls", "no", "must be true or false"),
            ("store", True, "store (true) must be false (stored completions are not supported)"),
            ("metadata", {"k": "v"}, "must be an empty object (metadata tags stored completions")):
        err = refusal(chat, **{field: value})
        assert err.param == field and words in err.message, (field, err.message)
    err = refusal(chat, tools=[{"type": "function", "function": {"name": "f"}}])  # tool_choice "auto" by default
    assert err.param == "tool_choice" and "\"auto\" (the default with tools) is not supported" in err.message


def test_a_stop_string_that_is_not_valid_text_is_refused():
    """A lone surrogate can never match the generated text: it was accepted and never stopped anything."""
    for stop in ("\ud800", ["fine", "x\udfff"]):
        err = refusal(completion, stop=stop)
        assert err.param == "stop" and "stop is not valid UTF-8 text" in err.message


def test_a_request_past_the_request_timeout_is_a_504_naming_both_ways_out():
    """A chat request without max_tokens may generate the rest of the context, which on a slow host
    outlasts the default --request-timeout: it was a 500, "generation failed", naming the timeout only."""
    from launcher.cluster.replica_pool import _overdue
    from launcher.serving.openai_app import _generation_failure
    from launcher.serving.openai_app import _overdue as told_overdue

    handle = SimpleNamespace(request_id="5f0c9e", timeout_s=600, delivered=[1] * 3067,
                             request=SimpleNamespace(max_tokens=4064))
    said = told_overdue("chatcmpl-1", 600, [3067], [None])
    status, body, headers = _generation_failure(_overdue(handle, "it was cancelled"), overdue=said)
    error = body["error"]
    assert status == 504 and (error["type"], error["code"]) == ("server_error", "generation_timeout")
    assert not _openai_client_retries(status, headers)  # it did, twice: the generation ran three times
    assert error["message"].startswith("response chatcmpl-1 did not finish within the request timeout (600 s); it "
                                       "had delivered 3067 tokens; ")
    assert "5f0c9e" not in error["message"]  # the engine's request id means nothing to the client
    assert "--request-timeout" in error["message"] and "max_tokens (max_completion_tokens)" in error["message"]
    # /v1/responses refuses max_tokens: its timeout names its own field
    status, body, _ = _generation_failure(_overdue(handle, "it was cancelled"), "max_output_tokens", said)
    assert status == 504 and "fewer tokens with max_output_tokens:" in body["error"]["message"]
    assert "max_tokens (" not in body["error"]["message"]
    status, body, headers = _generation_failure(RuntimeError("boom"))
    assert status == 500 and body["error"]["message"] == "generation failed: boom"
    assert not _openai_client_retries(status, headers)


def _openai_client_retries(status: int, headers: dict) -> bool:
    """Whether the official openai client would retry a response of this status and these headers
    (its own rule: every 5xx, unless x-should-retry says otherwise)."""
    import openai
    from openai._base_client import httpx2 as http_client  # the HTTP library this openai release uses

    client = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="x")
    return client._should_retry(http_client.Response(status, headers=headers))


def test_a_request_whose_replica_failed_for_good_is_a_503_that_names_no_node_or_process():
    """The error's own message, written for the driver API's user, reached any HTTP client: the
    Launcher's replica index (0 in every Serve replica), `max_restarts=0`, and the failed rank's
    node address and pid. Now a 503 like a new request there gets; the cause goes to Serve's log."""
    import logging

    from launcher.errors import LaunchError, NoReplicaAvailable, RequestTimeout, RestartLimitExceeded
    from launcher.serving.openai_app import SERVER_LOG, UNAVAILABLE_RETRY_S, _generation_failure

    logged = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: logged.append(record.getMessage())
    SERVER_LOG.addHandler(handler)  # Serve's logger does not propagate to pytest's capture
    cause = ("replica 0 failed and is given up: restarts are disabled (max_restarts=0; raise --max-restarts to "
             "restart failed groups). Last failure: rank 0 (node 192.0.2.2, pid 3434) died")
    try:
        failures = [_generation_failure(err) for err in (RestartLimitExceeded(cause), NoReplicaAvailable(cause),
                                                         RestartLimitExceeded(cause + " again"))]
    finally:
        SERVER_LOG.removeHandler(handler)
    for status, body, headers in failures:
        error = body["error"]
        assert (status, error["code"], headers) == (503, "model_unavailable", {"Retry-After": str(UNAVAILABLE_RETRY_S)})
        assert "failed and could not be restarted" in error["message"]
        assert not any(word in error["message"] for word in ("192.0.2.2", "pid", "max_restarts", "replica 0")), error
    # each cause logged once: another request failed by the same error adds nothing
    assert logged == [f"corelaunch: the model is not serving: {cause}",
                      f"corelaunch: the model is not serving: {cause} again"]
    status, body, _ = _generation_failure(LaunchError("the launcher was shut down while this request was streaming"))
    assert status == 503 and "is not serving (it is stopping)" in body["error"]["message"]
    # counted as `unavailable` (503), as at admission: they were `error`, which the metric keeps for 500 and 504
    from launcher.serving.openai_app import failure_reason

    assert {failure_reason(s) for s, _, _ in failures} == {"unavailable"} and failure_reason(status) == "unavailable"
    assert failure_reason(_generation_failure(RequestTimeout("slow"))[0]) == "error"
    assert failure_reason(_generation_failure(RuntimeError("bug"))[0]) == "error"


def test_the_server_class_uses_no_module_name_defined_after_it():
    """Serve's ingress pickles the class's methods when the class is decorated, with the module's
    globals as they are then: a helper defined below the class was missing in every replica
    (NameError on each failed generation: a cut stream, a plain-text 500), while importing it
    here worked."""
    import ast

    from launcher.serving import openai_app

    tree = ast.parse(Path(openai_app.__file__).read_text())
    [server] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "OpenAIServer"]
    later = set()
    for node in tree.body[tree.body.index(server) + 1:]:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            later.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            later |= {t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                      if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            later |= {(a.asname or a.name).split(".")[0] for a in node.names}
    used = {n.id for n in ast.walk(server) if isinstance(n, ast.Name)}
    assert later and not (used & later), sorted(used & later)


def _starting_server(longest_prompt, refusal: str | None = None):
    """The server's _start over a stub launcher whose astream refuses with `refusal` (or streams)."""
    from launcher.serving.openai_app import OpenAIServer

    ours = next(c for c in OpenAIServer.func_or_class.__mro__[1:] if c.__module__ == "launcher.serving.openai_app")

    def astream(*args, **kwargs):
        if refusal is not None:
            raise ValueError(refusal)
        return "a stream"

    rejected = []
    server = SimpleNamespace(context_tokens=256, longest_prompt=longest_prompt,
                             launcher=SimpleNamespace(astream=astream),
                             metrics=SimpleNamespace(rejected=lambda status, **kw: rejected.append(status),
                                                     prompt_tokens=SimpleNamespace(inc=lambda n: None)))
    return (lambda req, prompt, max_tokens: ours._start(server, req, prompt, max_tokens, None, "prompt",
                                                        req.sampling())), rejected


def test_a_prompt_past_the_longest_prefill_shape_is_context_length_exceeded():
    """A compiled directory's largest context bucket (128) below its context (256): a 129-token
    prompt got a 400 without a code, numbered "prompt 0:", whose fix was an operator's ("use larger
    context-encoding buckets"); a client learnt neither the limit's kind nor that trimming helps."""
    start, rejected = _starting_server(longest_prompt=128)
    with pytest.raises(ProtocolError) as caught:
        start(completion(), list(range(129)), 8)
    error = caught.value.body()["error"]
    assert (caught.value.status, error["code"], error["param"]) == (400, "context_length_exceeded", "prompt")
    assert error["message"] == ("the prompt has 129 tokens and this server takes prompts of at most 128 (its "
                                "longest prefill shape; the context holds 256); shorten the prompt")
    assert rejected == [400]
    assert start(completion(), list(range(128)), 8) == "a stream"  # at the bucket: taken


def test_an_engine_refusal_speaks_of_the_one_prompt_a_request_has():
    """The driver API numbers its prompts: "prompt 0 holds token ids [999999] outside the vocabulary"
    reached HTTP clients, who sent one prompt."""
    start, _ = _starting_server(None, "prompt 0 holds token ids [999999] outside the vocabulary [0, 49152); "
                                      "were they tokenized for another model?")
    with pytest.raises(ProtocolError) as caught:
        start(completion(), [999999], 8)
    assert caught.value.message.startswith("the prompt holds token ids [999999] outside the vocabulary")
    assert caught.value.param == "prompt"


def test_malformed_bodies_are_named_in_json_terms_with_a_fix_a_client_can_apply():
    """Each message was about Python rather than the request: "not NoneType", "use
    sys.set_int_max_str_digits()", a list of parts blamed for not being a string, "content part type
    None", and a lone surrogate in a key as "Input should be a valid string"."""
    import json

    from launcher.serving.openai_app import parse_json_body

    def refused(raw: bytes) -> ProtocolError:
        with pytest.raises(ProtocolError) as caught:
            parse_request(ChatCompletionRequest, parse_json_body(raw))
        return caught.value

    def message_with(content) -> bytes:
        return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}]}).encode()

    for raw, kind in ((b"null", "null"), (b"[]", "an array"), (b"5", "a number"), (b'"x"', "a string"),
                      (b"true", "a boolean")):
        assert refused(raw).message == f"the request body must be a JSON object, not {kind}"
    err = refused(b'{"seed": ' + b"9" * 5000 + b"}")
    assert "an integer of more than 4300 digits" in err.message and "sys." not in err.message
    err = refused(message_with([{"type": "text", "text": "a"}, "b"]))
    assert (err.param, err.message) == ("messages.0.content.1", """messages.0.content.1 ('b') must be a content """
                                        """part, {"type": "text", "text": ...}""")
    err = refused(message_with([{"text": "a"}]))
    assert err.param == "messages.0.content.0.type" and 'has no "type"' in err.message and "None" not in err.message
    err = refused(b'{"model": "m", "\\ud800": 1, "messages": [{"role": "user", "content": "x"}]}')
    assert err.message.startswith("a key of the request body is not valid UTF-8 text")
    assert refused(message_with(5)).param == "messages.0.content"  # not a list: the string's rule, as before


def test_a_failed_replicas_health_check_names_the_failure():
    """Serve's log showed only "every TP group of this replica has failed": the cause reached the
    HTTP clients' 503 bodies alone."""
    from launcher.serving.openai_app import OpenAIServer

    ours = next(c for c in OpenAIServer.func_or_class.__mro__[1:] if c.__module__ == "launcher.serving.openai_app")
    status = [{"index": 0, "state": "failed", "failure": "restart limit: rank 1 (pid 7) died 4 times in 600 s"}]
    server = SimpleNamespace(launcher=SimpleNamespace(replica_status=lambda: status))
    server._serving = lambda: ours._serving(server)
    with pytest.raises(RuntimeError, match=r"every TP group of this replica has failed \(group 0: restart limit: "
                                           r"rank 1 \(pid 7\) died 4 times in 600 s\); Serve will replace"):
        ours.check_health(server)
    status[0]["state"] = "restarting"
    ours.check_health(server)  # a group still restarting is healthy


def test_a_replica_stopped_while_it_loads_passes_its_first_health_check():
    """Ctrl-C during the model's load: Serve calls the replica's __del__ as its constructor returns,
    then makes the first health check, which found every group shut down and logged a traceback
    saying they had all failed."""
    from launcher.serving.openai_app import OpenAIServer

    ours = next(c for c in OpenAIServer.func_or_class.__mro__[1:] if c.__module__ == "launcher.serving.openai_app")
    status = [{"index": 0, "state": "serving"}]
    server = object.__new__(ours)
    server.board = None
    server.launcher = SimpleNamespace(replica_status=lambda: status, shutdown=status.clear)
    ours.check_health(server)
    ours.__del__(server)
    assert status == []  # shut down: a health check of a replica not asked to stop would fail now
    ours.check_health(server)


def test_a_tokenizer_without_a_length_bound_still_gets_a_body_limit():
    """longest_token_chars is None for a tokenizer that can fold text into unknown tokens: the body
    limit multiplied it, and every replica of such a model failed to start (TypeError)."""
    from launcher.serving.openai_app import REQUEST_BYTES_FLOOR, UNBOUNDED_TOKEN_CHARS, request_bytes_limit
    from launcher.serving.prompt_probe import longest_token_chars
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    assert longest_token_chars(words) is None
    assert request_bytes_limit(4096, None) == REQUEST_BYTES_FLOOR + 12 * 4096 * UNBOUNDED_TOKEN_CHARS
    assert request_bytes_limit(4096, 81) == REQUEST_BYTES_FLOOR + 12 * 4096 * 81


def test_chat_refusals():
    assert refusal(chat, logprobs=True, top_logprobs=21).param == "top_logprobs"
    assert "needs logprobs: true" in refusal(chat, top_logprobs=2).message
    # 0 asks for nothing: clients that send every default send it without logprobs (vLLM takes it)
    assert chat(logprobs=False, top_logprobs=0).logprobs is False
    with pytest.raises(ProtocolError) as caught:
        parse_request(ChatCompletionRequest, {"model": MODEL, "messages": []})
    assert caught.value.param == "messages"
    with pytest.raises(ProtocolError) as caught:
        parse_request(ChatCompletionRequest, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]})
    assert caught.value.param == "messages.0.role" and "('wizard') must be one of 'system', 'user'" in caught.value.message
    with pytest.raises(ProtocolError) as caught:  # pydantic's union branch leaked: "messages.0.content.str"
        parse_request(ChatCompletionRequest, {"model": MODEL, "messages": [{"role": "user", "content": {"a": 1}}]})
    assert caught.value.param == "messages.0.content" and caught.value.message.startswith("messages.0.content: ")
    with pytest.raises(ProtocolError, match="'image_url' is not supported") as caught:
        parse_request(ChatCompletionRequest, {"model": MODEL, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert caught.value.param == "messages.0.content.0"
    # each was taken before: a text part without text ("is not supported", param "messages"), a
    # user message without content (answered as an empty one), an assistant's tool calls (dropped;
    # now they are taken, and a malformed one is refused: tests/test_tool_calls.py)
    for messages, param, words in (
            ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages.0.content.0.text",
             "messages.0.content.0.text (5) must be a string"),
            ([{"role": "system", "content": "x"}, {"role": "user"}], "messages.1.content",
             "messages.1.content is required in a user message"),
            ([{"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
              {"role": "user", "content": "x"}], "messages.0.tool_calls.0.function",
             "messages.0.tool_calls.0.function is required"),
            ([{"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
              {"role": "user", "content": "x"}], "messages.0.function_call",
             "the deprecated function_call is not supported"),
            # a tool message answers a tool call: it must say which
            ([{"role": "user", "content": "x"}, {"role": "tool", "content": "42"}],
             "messages.1.tool_call_id", "messages.1.tool_call_id is required in a tool message"),
            ([{"role": "user", "content": []}], "messages.0.content", "messages.0.content is an empty list")):
        with pytest.raises(ProtocolError) as caught:
            parse_request(ChatCompletionRequest, {"model": MODEL, "messages": messages})
        assert caught.value.param == param and words in caught.value.message
    assert chat(messages=[{"role": "assistant", "reasoning": "hm"}, {"role": "user", "content": "x"}]).chat_messages()[0] \
        == {"role": "assistant", "content": "", "reasoning": "hm", "reasoning_content": "hm"}  # an assistant's content
    # may be left out where it has its thinking or tool calls (one with neither: tests/test_chat_prompt_edges.py)


@pytest.mark.parametrize("message, param, words", [
    # a misspelt content: the assistant turn went to the template empty (51 prompt tokens, not 59)
    ({"role": "assistant", "contnet": "Nice to meet you."}, "messages.1.contnet", "unknown key 'contnet' in messages.1"),
    ({"role": "user", "content": "x", "refusal": "I will not."}, "messages.1.refusal",
     "refusal belongs to an assistant message (its refusal to answer), and a user message has none"),
    ({"role": "assistant", "content": "x", "audio": {"id": "a1"}}, "messages.1.audio", "unknown key 'audio'"),
    ({"role": "user", "content": "x", "tool_call_id": "c1"}, "messages.1.tool_call_id",
     "tool_call_id belongs to a tool message, and a user message has none"),
    ({"role": "user", "content": [{"type": "text", "text": "Hi", "image_url": {"url": "x"}}]},
     "messages.1.content.0.image_url", "unknown key 'image_url' in text part messages.1.content.0"),
    ({"role": "assistant", "content": "x", "annotations": [{"type": "url_citation"}]}, "messages.1.annotations",
     "citations are not supported"),
], ids=["misspelt-content", "refusal", "audio", "tool-call-id", "text-part-extra", "annotations"])
def test_a_key_a_message_does_not_take_is_refused_by_name(message, param, words):
    """Messages ignored unknown keys: each of these was answered as if the key were not there."""
    with pytest.raises(ProtocolError) as caught:
        parse_request(ChatCompletionRequest, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}, message]})
    assert caught.value.param == param and words in caught.value.message, caught.value.message


def test_an_assistants_refusal_is_its_text_where_it_has_no_content():
    """OpenAI's answers carry `refusal`, which a replayed conversation sends back: a 400 before."""
    def assistant(**fields) -> dict:
        request = chat(messages=[{"role": "user", "content": "x"}, {"role": "assistant", **fields},
                                 {"role": "user", "content": "y"}])
        return request.chat_messages()[1]

    assert assistant(content=None, refusal="I can't help with that.") == {"role": "assistant",
                                                                          "content": "I can't help with that."}
    assert assistant(refusal="No.")["content"] == assistant(content="", refusal="No.")["content"] == "No."
    # both set: the content wins (the answer the client kept)
    assert assistant(content="Sure.", refusal="No.")["content"] == "Sure."
    assert assistant(content=[{"type": "text", "text": "Sure."}], refusal="No.")["content"] == "Sure."
    assert refusal(chat, messages=[{"role": "assistant", "refusal": "\ud800"}]).param == "messages.0.refusal"
    # an empty refusal and no content is the empty turn the check refuses (it went through as "")
    assert refusal(chat, messages=[{"role": "assistant", "content": None, "refusal": ""}]).param == "messages.0.content"


def test_an_assistants_refusal_part_is_its_text_as_on_the_responses_route():
    """OpenAI's assistant message takes {"type": "refusal", "refusal": ...} parts; chat refused them
    ("content part type 'refusal' is not supported") while /v1/responses took them."""
    request = chat(messages=[{"role": "user", "content": "x"},
                             {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."},
                                                               {"type": "text", "text": "Ask me another."}]},
                             {"role": "user", "content": "y"}])
    assert request.chat_messages()[1]["content"] == "I can't.\nAsk me another."
    err = refusal(chat, messages=[{"role": "user", "content": [{"type": "refusal", "refusal": "No."}]}])
    assert err.param == "messages.0.content.0" and "an assistant's refusal parts" in err.message
    err = refusal(chat, messages=[{"role": "assistant", "content": [{"type": "refusal", "refusal": 5}]}])
    assert err.param == "messages.0.content.0.refusal" and "(5) must be a string" in err.message


def test_a_conversation_with_a_refusal_is_answered_and_the_refusal_is_the_assistants_turn(smollm2_tokenizer):
    from tests.test_stream_interval_server import run_route
    from tests.test_tokenize_routes import scripted_server

    server = scripted_server(smollm2_tokenizer, "Fine.")
    messages = [{"role": "user", "content": "Pick a lock."},
                {"role": "assistant", "content": None, "refusal": "I can't help with that.", "annotations": []},
                {"role": "user", "content": "A bike lock, mine."}]
    answer = run_route(server, "/v1/chat/completions", {"model": MODEL, "messages": messages})
    assert answer["choices"][0]["message"]["content"] == "Fine."
    assert "assistant\nI can't help with that.<|im_end|>" in server.prompts[0]


@pytest.mark.parametrize("role", ["bot", "", "USER"])
def test_a_role_outside_the_set_is_quoted_with_the_roles_it_may_be(role):
    err = refusal(chat, messages=[{"role": role, "content": "x"}])
    assert err.param == "messages.0.role"
    assert err.message == (f"messages.0.role ({role!r}) must be one of 'system', 'user', 'assistant', 'tool' or "
                           f"'developer'")


@pytest.mark.parametrize("message", [1, "hi", None, []], ids=["number", "string", "null", "array"])
def test_a_message_that_is_no_object_is_named_without_the_servers_class_names(message):
    """pydantic's words named the server's own class ("instance of ChatMessage")."""
    with pytest.raises(ProtocolError) as caught:
        parse_request(ChatCompletionRequest, {"model": MODEL, "messages": [message]})
    assert caught.value.param == "messages.0" and "must be a message, an object {role:" in caught.value.message
    assert "ChatMessage" not in caught.value.message and "instance" not in caught.value.message


def test_a_message_key_sent_as_null_is_left_out():
    """Clients that serialise every field of a message send OpenAI's optional ones as null."""
    request = parse_request(ChatCompletionRequest, {"model": MODEL, "messages": [
        {"role": "user", "content": "x", "name": None, "refusal": None, "audio": None, "tool_call_id": None},
        {"role": "user", "content": [{"type": "text", "text": "y", "image_url": None}]}]})
    assert [m.text() for m in request.messages] == ["x", "y"]
    # OpenAI's own answers carry an empty annotations list: a conversation recorded there is sent back
    replayed = parse_request(ChatCompletionRequest, {"model": MODEL, "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": "yo", "annotations": [], "refusal": None},
        {"role": "user", "content": "z"}]})
    replayed.messages[1].check(1)
    assert replayed.messages[1].template_form(1, "assistant") == {"role": "assistant", "content": "yo"}


def test_developer_messages_are_system_messages_unless_the_template_knows_the_role():
    """OpenAI: developer messages replace system messages. Passed on as "developer", SmolLM2's
    template added its own default system turn, then a developer turn the model never saw."""
    req = chat(messages=[{"role": "developer", "content": "be a pirate"}, {"role": "user", "content": "hi"}])
    smollm2_like = "{% for m in messages %}<|im_start|>{{ m['role'] }}{% endfor %}{% if messages[0]['role'] != 'system' %}"
    assert req.chat_messages(smollm2_like)[0] == {"role": "system", "content": "be a pirate"}
    assert req.chat_messages("{% if m['role'] == 'developer' %}")[0]["role"] == "developer"  # the template's own role


def test_a_participant_name_reaches_the_template():
    req = chat(messages=[{"role": "user", "content": "hi", "name": "alice"}, {"role": "user", "content": "yo"}])
    assert req.chat_messages() == [{"role": "user", "content": "hi", "name": "alice"}, {"role": "user", "content": "yo"}]
    refusal(chat, messages=[{"role": "user", "content": "hi", "name": 5}])


def test_a_lone_surrogate_in_a_text_part_is_named_by_its_part():
    """It was reported against the joined content (messages.0.content, at its position there)."""
    with pytest.raises(ProtocolError) as caught:
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": "fine"},
                                                    {"type": "text", "text": "bad \ud800"}]}]).chat_messages()
    assert caught.value.param == "messages.0.content.1.text", caught.value.param
    assert "messages.0.content.1.text is not valid UTF-8 text" in caught.value.message
    assert "position 4" in caught.value.message, caught.value.message


def test_accepted_requests_and_their_engine_arguments():
    req = completion(prompt=["only one"], temperature=0, top_k=-1, stop="\n", stop_token_ids=[7], ignore_eos=True,
                     stream=True, stream_options={"include_usage": True}, seed=-3, logprobs=2, user="u")
    assert req.prompt_inputs() == ["only one"] and req.stop_strings() == ["\n"] and req.include_usage()
    assert completion(prompt=[1, 2, 3]).prompt_inputs() == [[1, 2, 3]]
    assert completion(prompt=[[1, 2, 3]]).prompt_inputs() == [[1, 2, 3]]  # one prompt, as ["text"] is (was a 400)
    assert completion(prompt=["a", "b"]).prompt_inputs() == ["a", "b"]
    assert completion(prompt=[[1], [2, 3]]).prompt_inputs() == [[1], [2, 3]]
    assert completion(stop=None).stop_strings() == [] and completion().temperature == 1.0
    req = chat(messages=[{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
               logprobs=True, top_logprobs=3, max_completion_tokens=5, max_tokens=9)
    assert req.chat_messages() == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"}]
    assert req.logprobs_count() == 3 and chat(logprobs=True).logprobs_count() == 0 and chat().logprobs_count() is None
    assert proto.max_new_tokens(req, prompt_tokens=10, context_tokens=100) == 5  # max_completion_tokens wins
    assert proto.max_new_tokens(chat(), prompt_tokens=10, context_tokens=100) == 90  # the rest of the context
    assert proto.max_new_tokens(chat(), prompt_tokens=150, context_tokens=100) == 1  # the engine refuses it
    assert proto.max_new_tokens(completion(), 10, 100) == proto.DEFAULT_COMPLETION_MAX_TOKENS
    assert proto.max_new_tokens(completion(max_tokens=7), 10, 100) == 7


def test_response_objects_and_server_sent_events():
    meta = proto.ResponseMeta(id="cmpl-1", created=5, model=MODEL)
    usage = proto.usage(3, 4)
    assert usage == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                     "prompt_tokens_details": {"cached_tokens": 0}}
    assert proto.usage(3, 4, cached_tokens=2)["prompt_tokens_details"] == {"cached_tokens": 2}
    body = proto.completion_response(meta, " Paris", "length", usage)
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == " Paris" and body["usage"] == usage
    body = proto.chat_response(meta, "Hi", "stop", usage)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hi"}
    chunk = proto.chat_chunk(meta, {"content": "Hi"})
    assert chunk["object"] == "chat.completion.chunk" and chunk["choices"][0]["finish_reason"] is None
    assert proto.usage_chunk(meta, "chat.completion.chunk", usage)["choices"] == []
    assert proto.sse_event({"a": "x\ny"}) == 'data: {"a":"x\\ny"}\n\n'  # one line per event
    assert proto.SSE_DONE == "data: [DONE]\n\n"
    assert proto.error_body("bad", "temperature") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "temperature", "code": None}}
    assert proto.models_list(MODEL, 5, 2048)["data"] == [{"id": MODEL, "object": "model", "created": 5,
                                                          "owned_by": "corelaunch", "root": MODEL, "parent": None,
                                                          "max_model_len": 2048}]


def test_continuous_usage_stats_put_each_choices_counts_so_far_in_every_chunk():
    """stream_options.continuous_usage_stats, as vLLM's: every chunk with a choice carries that
    choice's prompt's tokens and its completion tokens so far (a chat's role chunks 0); the last
    chunk still has the request's usage (each prompt once, every choice's tokens)."""
    import asyncio
    import json

    from launcher.serving.choice_streams import ChoiceStreams
    from launcher.serving.metrics import ServerMetrics, TokenTimer
    from launcher.serving.openai_app import OpenAIServer
    from launcher.serving.openai_render import ChatRender, CompletionRender
    from launcher.serving.stream_types import StreamDelta
    from launcher.serving.token_pieces import TokenPieces

    words = {1: "Hel", 2: "lo", 3: "!"}
    pieces = TokenPieces(SimpleNamespace(decode=lambda ids, skip_special_tokens=False, **options:
                                         "".join(words[i] for i in ids)))
    ours = next(c for c in OpenAIServer.func_or_class.__mro__[1:] if c.__module__ == "launcher.serving.openai_app")
    metrics = ServerMetrics(lambda: {})

    def choice_deltas(*parts):  # (text, token id, finish_reason): one engine stream of one choice
        return [StreamDelta("r", text, [token], finish, completion_tokens=n)
                for n, (text, token, finish) in enumerate(parts, 1)]

    async def engine(deltas):
        for delta in deltas:
            yield delta

    def sent(renders, choices, prompt_lengths, per_prompt, continuous=True):
        stream = ChoiceStreams([engine(d) for d in choices], prompt_lengths, per_prompt)
        timers = [TokenTimer(metrics, 0.0) for _ in renders]

        async def run():
            meta = proto.ResponseMeta("x", 1, MODEL)
            return [e async for e in ours._events(object.__new__(ours), stream, renders, meta, timers, True, {},
                                                  continuous)]

        events = asyncio.run(run())
        assert events[-1] == proto.SSE_DONE
        return [json.loads(event[len("data: "):]) for event in events[:-1]]

    def counts(chunks, index):
        return [c["usage"]["completion_tokens"] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]

    # completions, two prompts (4 and 7 tokens) of one choice each; choice 0's second token is held back
    first = choice_deltas(("Hel", 1, None), ("", 2, None), ("lo!", 3, "stop"))
    second = choice_deltas(("lo", 2, None), ("!", 3, "length"))
    chunks = sent([CompletionRender(pieces, False, i) for i in range(2)], [first, second], [4, 7], 1)
    for chunk in chunks[:-1]:
        index, usage = chunk["choices"][0]["index"], chunk["usage"]
        assert usage["prompt_tokens"] == [4, 7][index]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert counts(chunks, 0) == [1, 3] and counts(chunks, 1) == [1, 2]  # per choice, as vLLM counts them
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == proto.usage(11, 5)
    # chat, n=2 of one 6-token prompt: the role chunks carry 0 completion tokens
    chunks = sent([ChatRender(pieces, False, i) for i in range(2)], [first, second], [6], 2)
    assert [c["usage"] for c in chunks[:2]] == [proto.chunk_usage(6, 0)] * 2
    assert counts(chunks, 0) == [0, 1, 3] and counts(chunks, 1) == [0, 1, 2]
    assert all(c["usage"]["prompt_tokens"] == 6 for c in chunks) and chunks[-1]["usage"] == proto.usage(6, 5)
    # include_usage alone: null on every chunk but the last, as before
    chunks = sent([ChatRender(pieces, False)], [second], [6], 1, continuous=False)
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["usage"] == proto.usage(6, 2)


def test_renderers_turn_deltas_into_chunks_and_responses():
    from launcher.serving.openai_render import ChatRender, CompletionRender
    from launcher.serving.stream_types import StreamDelta
    from launcher.serving.token_pieces import TokenPieces
    from workers.serving.requests import TokenLogprob

    words = {1: "Hel", 2: "lo", 3: "!"}
    tokenizer = TokenPieces(SimpleNamespace(decode=lambda ids, skip_special_tokens=False, **options: "".join(words[i] for i in ids)))
    deltas = [StreamDelta("r", "Hel", [1], None, 2, 1, [TokenLogprob(1, -0.1, [(1, -0.1), (2, -2.0)])]),
              StreamDelta("r", "", [2], None, 2, 2, [TokenLogprob(2, -0.2, [])]),  # text held back
              StreamDelta("r", "lo!", [3], "stop", 2, 3, [TokenLogprob(3, -0.3, [])])]
    meta = proto.ResponseMeta("x", 1, MODEL)
    render = CompletionRender(tokenizer, logprobs=True)
    chunks = [render.chunk(meta, d) for d in deltas]
    assert chunks[1] is None  # "lo"'s log-probability waits for its text (tests/test_logprob_alignment.py)
    assert [c["choices"][0]["text"] for c in (chunks[0], chunks[2])] == ["Hel", "lo!"]
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in (chunks[0], chunks[2])] == [[0], [3, 5]]
    assert chunks[0]["choices"][0]["logprobs"]["top_logprobs"] == [{"Hel": -0.1, "lo": -2.0}]
    # OpenAI's completions always list the chosen token as well (logprobs 0 included): it was left out
    assert chunks[2]["choices"][0]["logprobs"]["top_logprobs"] == [{"lo": -0.2}, {"!": -0.3}]
    render = CompletionRender(tokenizer, logprobs=False)
    assert render.chunk(meta, deltas[1]) is None  # nothing to say yet
    for d in deltas:
        render.collect(d)
    body = render.response(meta, "stop", proto.usage(2, 3))
    assert body["choices"][0]["text"] == "Hello!" and body["choices"][0]["logprobs"] is None
    render = ChatRender(tokenizer, logprobs=True)
    assert render.opening(meta)[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = render.chunk(meta, deltas[2])
    assert last["choices"][0]["delta"] == {"content": "lo!"} and last["choices"][0]["finish_reason"] == "stop"
    for d in deltas:
        render.collect(d)
    body = render.response(meta, "stop", proto.usage(2, 3))
    content = body["choices"][0]["logprobs"]["content"]
    assert body["choices"][0]["message"]["content"] == "Hello!" and [c["token"] for c in content] == ["Hel", "lo", "!"]
    assert content[0]["top_logprobs"][1] == {"token": "lo", "logprob": -2.0, "bytes": [108, 111]}


def test_every_request_outcome_is_exported_at_zero_before_its_first_request():
    """A review: each outcome's series appeared at 1 with its first request, which Prometheus' rate()
    and increase() cannot see, so an alert on the first 504 or 503 of a replica never fired."""
    from launcher.serving.metrics import OUTCOMES, ServerMetrics

    text = ServerMetrics(lambda: {}).render().decode()
    for finish_reason, status in OUTCOMES:
        assert f'corelaunch_requests_total{{finish_reason="{finish_reason}",status="{status}"}} 0.0' in text
    assert ("error", 504) in OUTCOMES and ("rejected", 503) in OUTCOMES and ("abort", 499) in OUTCOMES


def test_metrics_render_every_name_from_a_private_registry():
    from launcher.serving.metrics import ServerMetrics, TokenTimer

    metrics = ServerMetrics(lambda: {"running": 2, "waiting": 5})
    timer = TokenTimer(metrics, start=0.0)
    timer.tokens(1, now=0.5)
    timer.tokens(2, now=0.7)
    metrics.finished("length")
    metrics.rejected(503)
    text = metrics.render().decode()
    assert "corelaunch_requests_running 2.0" in text and "corelaunch_requests_waiting 5.0" in text
    assert "corelaunch_time_to_first_token_seconds_count 1.0" in text
    assert "corelaunch_inter_token_latency_seconds_count 2.0" in text
    assert "corelaunch_generated_tokens_total 3.0" in text
    assert 'corelaunch_requests_total{finish_reason="rejected",status="503"} 1.0' in text
    assert "python_gc" not in text  # the process-wide collectors are not in the private registry
    assert "_created" not in text  # one more gauge per series in Prometheus, saying only when it began
    burst = TokenTimer(metrics, start=1.0)  # a first delta carrying three tokens, then one more
    burst.tokens(3, now=1.5)
    burst.tokens(1, now=1.6)
    text = metrics.render().decode()
    assert "corelaunch_inter_token_latency_seconds_count 5.0" in text  # 2 + (3 + 1 - 1): one gap a token
    assert re.search(r"corelaunch_inter_token_latency_seconds_sum 0\.3000", text)  # 0.2 + 0 + 0 + 0.1


def test_a_compiled_directory_is_served_under_its_own_name(tmp_path):
    """Not under the hidden version folder its link points to (.c1.v-HOST-PID-RANDOM), which
    clients would have had to send, and which changes at every compile."""
    from launcher.serving.server_settings import settings_from_args
    from tests.model_factory import save_random_model
    from tests.test_compile_cli import fake_compiled_dir

    model = Path(save_random_model(tmp_path / "model"))
    version = fake_compiled_dir(tmp_path / ".c1.v-host-1-abcd1234", model)
    (tmp_path / "c1").symlink_to(version.name)
    settings = settings_from_args({"compiled_dir": str(tmp_path / "c1")})
    assert settings.served_model_name == "c1"
    assert settings_from_args({"compiled_dir": f"{tmp_path}/c1/"}).served_model_name == "c1"
    # and every replica, those Serve starts later included, loads the version the link named then
    assert settings.launch["compiled_dir"] == str(version)


def test_a_folder_reached_through_a_link_is_served_under_the_links_name(tmp_path, monkeypatch):
    """`cd c1 && corelaunch serve --compiled .` served under the hidden version's name (the process
    sees its working directory resolved), and `--model models/llama`, a link to a dated folder, under
    the dated folder's: clients sending "c1" or "llama" got 404."""
    from launcher.serving.server_settings import settings_from_args
    from tests.model_factory import save_random_model
    from tests.test_compile_cli import fake_compiled_dir

    model = Path(save_random_model(tmp_path / "llama-2024-07-23"))
    (tmp_path / "llama").symlink_to(model.name)
    assert settings_from_args({"model": str(tmp_path / "llama")}).served_model_name == "llama"
    version = fake_compiled_dir(tmp_path / ".c1.v-host-1-abcd1234", model)
    (tmp_path / "c1").symlink_to(version.name)
    monkeypatch.chdir(tmp_path / "c1")  # as a shell's `cd c1`: the process's own cwd is the version
    monkeypatch.setenv("PWD", str(tmp_path / "c1"))  # what the shell tells it
    assert settings_from_args({"compiled_dir": "."}).served_model_name == "c1"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PWD", "/elsewhere")  # not where the process is: its own view is taken
    assert settings_from_args({"model": "llama/"}).served_model_name == "llama"


@pytest.mark.parametrize("name", ["a\nb", "a\tb", "model\x1b[2J", "a\u2028b"], ids=["newline", "tab", "escape", "line-separator"])
def test_a_served_model_name_with_control_characters_is_refused(name):
    """Taken before, and the start-up line ("serving a<newline>b") printed it broken."""
    from launcher.serving.server_settings import settings_from_args

    with pytest.raises(ValueError, match=r"served_model_name \(.*\) must hold no control characters or line breaks"):
        settings_from_args({"served_model_name": name})
    for taken in ("Smöl org/model 1", "モデル\u3000v1", "a\u00a0b"):  # other scripts' spaces are no control
        assert settings_from_args({"served_model_name": taken}).served_model_name == taken


def test_null_on_serve_run_is_the_default_for_text_arguments_too(monkeypatch):
    """`serve run ... kv_strategy=null` was refused as 'null' "must be one of ..., or None", and
    api_key=null made the key the text "null", while the README says null is every argument's default."""
    from launcher.serving.openai_app import builder_settings

    monkeypatch.setenv("CORELAUNCH_API_KEY", "envkey")
    settings = builder_settings({"api_key": "null", "served_model_name": "null", "kv_strategy": "null",
                                 "instance": "null", "backend": "~", "dtype": "NULL", "tp": "null"})
    assert settings.api_key == "envkey" and settings.served_model_name == MODEL
    assert all(key not in settings.launch or settings.launch[key] is None
               for key in ("kv_strategy", "instance", "backend", "dtype"))
    assert builder_settings({"served_model_name": "./null"}).served_model_name == "./null"  # the way to say it


def test_server_settings_from_builder_arguments():
    from launcher.serving.server_settings import settings_from_args

    settings = settings_from_args({"tp": "1", "dtype": "float32", "replicas": "2"})  # `serve run` passes text
    assert settings.launch["tp"] == 1 and settings.launch["replicas"] == 1 and settings.launch["progress"] is False
    assert settings.num_replicas == 2 and settings.autoscaling is None and settings.served_model_name == MODEL
    settings = settings_from_args({"min_replicas": 1, "max_replicas": 3, "served_model_name": "m", "api_key": "k"})
    assert settings.autoscaling == {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 2.0}
    assert settings.most_replicas == 3 and settings.api_key == "k" and settings.served_model_name == "m"
    with pytest.raises(ValueError, match="give one or the other"):
        settings_from_args({"replicas": 2, "max_replicas": 3})
    # null is the argument's default for every argument (tp=null was refused, seq_len=null taken)
    defaults = settings_from_args({})
    for nulled in ({"tp": "null", "seq_len": "null", "replicas": "null"}, {"tp": None, "max_num_seqs": None}):
        assert settings_from_args(nulled) == defaults, nulled
    with pytest.raises(ValueError, match=r"max_replicas \(1\) must be an integer >= 2"):
        settings_from_args({"min_replicas": 2, "max_replicas": 1})
    with pytest.raises(ValueError, match=r"target_ongoing_requests \(inf\) must be a finite positive number"):
        settings_from_args({"min_replicas": 1, "target_ongoing_requests": float("inf")})  # was taken
    # a target alone (or a minimum alone) autoscaled from 1 to 1, or from 3 to 3: nothing ever scaled
    for alone, given, low in (({"target_ongoing_requests": 3}, "target_ongoing_requests", 1),
                              ({"min_replicas": 3}, "min_replicas", 3),
                              ({"min_replicas": 2, "max_replicas": 2}, "max_replicas, min_replicas", 2)):
        with pytest.raises(ValueError, match=rf"autoscaling from min_replicas {low} to max_replicas {low} \(given: "
                                             rf"{given}\) has nothing to scale between: give max_replicas above "
                                             rf"{low} to autoscale, or replicas {low} for a fixed count"):
            settings_from_args(alone)
    with pytest.raises(ValueError, match="unknown argument.*modle"):
        settings_from_args({"modle": "x"})
    with pytest.raises(ValueError, match=r"tp \('two'\)"):
        settings_from_args({"tp": "two"})
    with pytest.raises(ValueError, match="api_key must be a non-empty string"):
        settings_from_args({"api_key": "a b"})
    assert settings_from_args({"burst_wait_s": "0.02"}).launch["burst_wait_s"] == 0.02
    with pytest.raises(ValueError, match=r"burst_wait_s \(-1\) must be between 0 and 1 seconds"):
        settings_from_args({"burst_wait_s": "-1"})
    # `serve run` text as `corelaunch serve` writes it: "128" was iterated as buckets 1, 2 and 8
    for text, buckets in (("128", (128,)), ("128,256", (128, 256)), ("[64, 128]", (64, 128))):
        assert settings_from_args({"token_buckets": text}).launch["token_buckets"] == list(buckets)
    for null in ("null", "~", ""):  # still the automatic buckets
        assert settings_from_args({"context_buckets": null}).launch.get("context_buckets") is None
    with pytest.raises(ValueError, match=r"token_buckets: bucket list 'a,b' must be comma-separated integers"):
        settings_from_args({"token_buckets": "a,b"})
    with pytest.raises(ValueError, match=r"compile \('nope'\) must be True or False"):  # was compile on
        settings_from_args({"compile": "nope"})
    assert settings_from_args({"presharded_cache": True, "presharded_cache_dir": "2024"}).launch[
        "presharded_cache_dir"] == "2024"  # was int
    with pytest.raises(ValueError, match=r"ray_address \('10.0.0.1:6379'\) does not apply to a server"):
        settings_from_args({"ray_address": "10.0.0.1:6379"})  # was ignored: a replica is inside Serve's Ray
    with pytest.raises(ValueError, match="printable ASCII"):  # a header cannot carry it: every request got 401
        settings_from_args({"api_key": "clé"})
    with pytest.raises(ValueError, match=r"replicas \('None'\) fixes"):  # the text, quoted
        settings_from_args({"replicas": "None", "max_replicas": "2"})
    # tool_call_parser: a server argument (tool_choice "auto"), checked before any replica starts
    assert settings_from_args({"tool_call_parser": "hermes"}).tool_call_parser == "hermes"
    assert settings_from_args({}).tool_call_parser is None and "tool_call_parser" not in defaults.launch
    with pytest.raises(ValueError, match=r"tool_call_parser \('granite'\) must be one of hermes"):
        settings_from_args({"tool_call_parser": "granite"})


def test_the_api_key_from_the_environment_is_checked_and_an_empty_flag_refused(monkeypatch, capsys, ray_tripwire):
    from launcher.cli import build_parser, main
    from launcher.cli.serve_command import server_args
    from launcher.serving.server_settings import api_key_from_environment

    monkeypatch.setenv("CORELAUNCH_API_KEY", "")
    assert api_key_from_environment() is None  # empty: no key
    assert "api_key" not in server_args(build_parser().parse_args(["serve"]))
    monkeypatch.setenv("CORELAUNCH_API_KEY", "env-key")
    assert server_args(build_parser().parse_args(["serve"]))["api_key"] == "env-key"
    assert server_args(build_parser().parse_args(["serve", "--api-key", "flag-key"]))["api_key"] == "flag-key"
    assert main(["serve", "--api-key", ""]) == 2  # "--api-key $KEY" with KEY unset served with no key
    assert "--api-key must be a non-empty string" in capsys.readouterr().err
    monkeypatch.setenv("CORELAUNCH_API_KEY", "a b")  # read by each Serve replica of `serve run`, unchecked
    with pytest.raises(ValueError, match="CORELAUNCH_API_KEY must be a non-empty string"):
        api_key_from_environment()


def test_a_null_word_is_a_key_on_the_command_line_and_never_no_key(monkeypatch):
    """`corelaunch serve --api-key null` (or ~, NULL, Null; or CORELAUNCH_API_KEY=null) started a server
    with no key at all: the command line's text went through `serve run`'s YAML null rule (which
    stays `serve run`'s: api_key=null is the argument left out, each replica then reading its own
    environment, as a runtime_env may hold the key)."""
    from launcher.cli import build_parser
    from launcher.cli.serve_command import server_args
    from launcher.serving.openai_app import builder_settings
    from launcher.serving.server_settings import SERVER_ARGS, YAML_NULLS, settings_from_args

    flags = {k: "--" + k.replace("_", "-") for k in SERVER_ARGS}
    serve = lambda *argv: settings_from_args(server_args(build_parser().parse_args(["serve", *argv])), flags)
    monkeypatch.delenv("CORELAUNCH_API_KEY", raising=False)
    for word in YAML_NULLS:
        assert serve("--api-key", word).api_key == word
        assert serve("--served-model-name", word).served_model_name == word
    monkeypatch.setenv("CORELAUNCH_API_KEY", "null")
    assert serve().api_key == "null"
    assert builder_settings({}).api_key == "null"  # the environment's text is a key there too
    monkeypatch.delenv("CORELAUNCH_API_KEY")
    assert all(builder_settings({"api_key": word}).api_key is None for word in YAML_NULLS)  # as left out


def test_a_replica_checks_its_environments_api_key_before_loading_the_model(monkeypatch, ray_tripwire):
    """A `serve run` replica reads CORELAUNCH_API_KEY itself: a bad one fails it before its TP group
    starts (it was checked, a first time, after the whole model load)."""
    from launcher.serving import port_rebind
    from launcher.serving.openai_app import OpenAIServer
    from launcher.serving.server_settings import settings_from_args

    monkeypatch.setattr(port_rebind, "allow_port_rebinding", lambda: True)  # Serve's sockets: not this test's
    monkeypatch.setenv("CORELAUNCH_API_KEY", "a b")
    wrapper = OpenAIServer.func_or_class  # Serve's ingress subclass, whose __init__ is a coroutine
    ours = next(c for c in wrapper.__mro__[1:] if c.__module__ == "launcher.serving.openai_app")
    server = object.__new__(wrapper)
    with pytest.raises(ValueError, match="CORELAUNCH_API_KEY must be a non-empty string"):
        ours.__init__(server, settings_from_args({}))
    assert getattr(server, "launcher", None) is None


def test_chat_with_a_model_without_a_chat_template_says_so():
    """Its refusal blamed the client's messages ("the model's chat template refused them: Cannot use
    chat template functions because tokenizer.chat_template is not set")."""
    from launcher.serving.openai_app import OpenAIServer

    wrapper = OpenAIServer.func_or_class
    ours = next(c for c in wrapper.__mro__[1:] if c.__module__ == "launcher.serving.openai_app")
    server = SimpleNamespace(tokenizer=SimpleNamespace(chat_template=None), name="plain")
    with pytest.raises(ProtocolError) as caught:
        ours._apply_chat_template(server, [{"role": "user", "content": "hi"}])
    assert caught.value.status == 400 and caught.value.param == "messages"
    assert caught.value.message.startswith("model 'plain' has no chat template") and "/v1/completions" in caught.value.message


def test_a_replicas_in_flight_cap_follows_the_engines_own_defaults():
    from launcher.api import MAX_QUEUED_REQUESTS, LaunchConfig
    from launcher.serving.server_settings import ROUTE_HEADROOM, settings_from_args

    engine = LaunchConfig()  # what `serve run` / `serve deploy` get for arguments left out
    assert engine.max_queued_requests is None  # no limit: the engine queues all, so Serve holds none back
    assert settings_from_args({"tp": "1"}).max_ongoing_requests == \
        engine.max_num_seqs + MAX_QUEUED_REQUESTS + ROUTE_HEADROOM < 2**31
    assert settings_from_args({"max_num_seqs": 4, "max_queued_requests": 3}).max_ongoing_requests == 7 + ROUTE_HEADROOM


def test_the_burst_wait_help_names_the_loops_cap(capsys):
    from launcher.cli import main
    from workers.serving.burst import BURST_WAIT_CAP

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"at most {BURST_WAIT_CAP}x in all" in help_text


def test_wait_healthy_asks_at_least_once_and_names_the_ready_timeout():
    import http.server
    import socket

    from launcher.cli.serve_command import wait_healthy

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:  # no time left of --ready-timeout, but a server that is up is still found up
        assert wait_healthy("127.0.0.1", server.server_address[1], threading.Event(), time.monotonic(), 900.0) is None
    finally:
        server.shutdown()
        server.server_close()
    with socket.socket() as nobody:  # bound, not listening: connections are refused
        nobody.bind(("127.0.0.1", 0))
        message = wait_healthy("127.0.0.1", nobody.getsockname()[1], threading.Event(), time.monotonic(), 900.0)
    assert "within --ready-timeout 900 s" in message and "raise --ready-timeout" in message


_PROXY_PORT_TAKEN = """
import dataclasses, socket, sys
from launcher.cli import run, serve_command
held = socket.socket()
held.bind(("127.0.0.1", 0))
held.listen()
planned = serve_command.ingress_plan
serve_command.ingress_plan = lambda args, mode: dataclasses.replace(planned(args, mode),
                                                                    proxy_port=held.getsockname()[1])
sys.argv = ["corelaunch", "serve", "--port", sys.argv[1], "--quiet"]
run()
"""
# run(), the `corelaunch` command's own exit, not sys.exit(main()): after serve had stopped its private
# Ray, the interpreter's exit ran Ray's exit hook, which waited on the stopped GCS (13.6 s from the
# message to the exit, against 1.5 s), a wait the command itself never has (it ends with os._exit)


@pytest.mark.slow
def test_serve_that_cannot_start_its_proxy_says_so_in_one_line():
    """The idle proxy's port taken between its choice and Serve's start (a race with Ray's start-up):
    one line naming the address and the bind failure, exit code 1, not the proxy actor's traceback."""
    from workers.net import free_port_for_a_late_bind

    run = subprocess.run([sys.executable, "-c", _PROXY_PORT_TAKEN, str(free_port_for_a_late_bind())],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stderr[-3000:]
    assert re.search(r"corelaunch serve: Ray Serve did not start \(its proxy on 127\.0\.0\.1:\d+\): RuntimeError: "
                     r"Failed to bind to address", run.stderr), run.stderr[-3000:]
    assert "Traceback" not in run.stderr


def test_serve_cli_refuses_bad_options_before_starting_ray(capsys, tmp_path, ray_tripwire):
    import socket

    from launcher.cli import main
    from workers.net import free_port

    free = ["--port", str(free_port())]  # refusals after the port check: not the default 8000, which may be taken
    assert main(["serve", "--replicas", "2", "--min-replicas", "1"]) == 2
    assert "--replicas (2) fixes the Serve replica count, while --min-replicas ask" in capsys.readouterr().err
    assert main(["serve", "--min-replicas", "3", "--max-replicas", "2"]) == 2  # named as the builder's keys
    assert "--max-replicas (2) must be an integer >= 3 (--min-replicas is 3)" in capsys.readouterr().err
    assert main(["serve", "--target-ongoing-requests", "2"]) == 2  # autoscaled from 1 to 1, through the proxy
    assert "from --min-replicas 1 to --max-replicas 1 (given: --target-ongoing-requests) has nothing to scale " \
           "between: give --max-replicas above 1" in capsys.readouterr().err
    assert main(["serve", "--ingress", "direct", "--max-replicas", "2"]) == 2  # said "may run 1"
    assert "but this server autoscales (--min-replicas, --max-replicas or --target-ongoing-requests" in \
        capsys.readouterr().err
    assert main(["serve", "--replicas", "2", "--ingress", "direct"]) == 2
    assert "use --ingress proxy" in capsys.readouterr().err
    assert main(["serve", *free, "--model", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["serve", *free, "--model", str(tmp_path / "replicas" / "api_key")]) == 2  # a path is not a flag
    assert f"model path {tmp_path / 'replicas' / 'api_key'} does not exist" in capsys.readouterr().err
    # the Ray serve starts is private, this host alone: the plan counted 2 hosts' RAM (and no replica check)
    assert main(["serve", *free, "--nodes", "2", "--replicas", "40"]) == 2
    assert ("--nodes (2): corelaunch serve starts a private Ray of this host alone, one node, whose memory the plan "
            "would count 2 times; to serve over several nodes, deploy the application") in capsys.readouterr().err
    # a model without a tokenizer started Ray and its ranks, then failed in the replica (AttributeError)
    from tests.model_factory import save_random_model

    bare = save_random_model(tmp_path / "bare", "llama", num_heads=4, num_kv_heads=2)
    assert main(["serve", *free, "--model", str(bare), "--tp", "1"]) == 2
    assert (f"{bare} has no tokenizer files (tokenizer.json, tokenizer_config.json or tokenizer.model): the server "
            f"reads prompts and chat messages as text; copy the model's tokenizer into it") in capsys.readouterr().err
    # a broken tokenizer file (cut short) failed every replica's start after Ray and Serve had started,
    # the command's last line Serve's "Failed to update the deployments ['OpenAIServer']"
    from shardlib.demo_model import ensure_demo_model

    (bare / "tokenizer.json").write_bytes((Path(ensure_demo_model()) / "tokenizer.json").read_bytes()[:1000])
    assert main(["serve", *free, "--model", str(bare), "--tp", "1"]) == 2
    err = capsys.readouterr().err
    assert f"the tokenizer in {bare} cannot be loaded (JSONDecodeError: " in err
    assert "(the server reads prompts as text)" in err and "token-id lists" not in err, err
    # every Serve replica is a TP group in this host's RAM (the Ray serve starts is private)
    assert main(["serve", *free, "--replicas", "500", "--ingress", "proxy"]) == 2
    assert "--replicas (500): 500 TP groups of 1 rank(s) need" in capsys.readouterr().err
    assert main(["serve", *free, "--min-replicas", "1", "--max-replicas", "500"]) == 2
    assert "--max-replicas (500): 500 TP groups" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert main(["serve", "--port", str(busy.getsockname()[1])]) == 2
    assert "pass a free --port" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--port", "70000"])
    assert "--port (70000) must be at most 65535" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # bound every interface, as 0.0.0.0 does, without saying so
        main(["serve", "--host", ""])
    assert "--host ('') is empty; pass 127.0.0.1" in capsys.readouterr().err
    for host in ("192.0.2.1", "no-such-host.invalid"):  # TEST-NET-1: no machine's own address
        assert main(["serve", "--host", host]) == 2
        err = capsys.readouterr().err
        assert f"cannot listen on {host}:" in err and "pass a --host this machine has" in err and "--port" not in err
    assert main(["serve", "--host", "::1"]) == 2  # was "not this machine's", though it is
    assert "--host ::1 is an IPv6 address, which corelaunch serve does not bind" in capsys.readouterr().err
    for timeout in ("0", "-5", "nan", "inf", "soon"):
        with pytest.raises(SystemExit):
            main(["serve", "--ready-timeout", timeout])
        err = capsys.readouterr().err
        assert f"--ready-timeout ({timeout}" in err or f"--ready-timeout ('{timeout}'" in err, err
    from launcher.cli import build_parser
    from launcher.cli.serve_command import server_args

    assert server_args(build_parser().parse_args(["serve", "--burst-wait-ms", "25"]))["burst_wait_s"] == 0.025
    with pytest.raises(SystemExit):
        main(["serve", "--burst-wait-ms", "5000"])
    assert "--burst-wait-ms (5000) must be between 0 and 1000" in capsys.readouterr().err


def test_serve_config_example_is_a_valid_serve_config():
    import yaml
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(yaml.safe_load((REPO / "cluster_configs/serve_smollm2.yaml").read_text()))
    [app] = config.applications
    assert app.import_path == "launcher.serving.openai_app:build_app" and app.route_prefix == "/"
    assert config.http_options.host == "127.0.0.1" and config.http_options.port == 8000
    from launcher.serving.server_settings import settings_from_args

    settings_from_args(app.args)  # the example's arguments are ones the builder takes


def test_serve_run_takes_the_api_key_from_the_shell_that_builds_the_app(monkeypatch):
    """`CORELAUNCH_API_KEY=... serve run launcher.serving.openai_app:build_app` was silently ignored:
    only the replicas' environments (inherited from `ray start`) were read, and the server ran open."""
    from launcher.serving.openai_app import builder_settings

    monkeypatch.setenv("CORELAUNCH_API_KEY", "from-the-shell")
    assert builder_settings({"tp": 1}).api_key == "from-the-shell"
    assert builder_settings({"tp": 1, "api_key": "in-args"}).api_key == "in-args"  # args win
    monkeypatch.delenv("CORELAUNCH_API_KEY")
    assert builder_settings({"tp": 1}).api_key is None  # each replica then reads its own environment
    monkeypatch.setenv("CORELAUNCH_API_KEY", "a b")
    with pytest.raises(ValueError, match="CORELAUNCH_API_KEY must be a non-empty string"):
        builder_settings({"tp": 1})


def test_a_device_backends_serve_replica_leaves_the_cpu_share_out(ray_tripwire):
    """A Serve replica sized every rank's CPU share whatever the backend, and a device backend
    refuses cpus_per_rank (it ignored it before): every neuron or cuda replica failed to start."""
    from launcher.api import LaunchConfig
    from launcher.launch_plan import plan_launch
    from launcher.progress import Progress
    from launcher.serving import openai_app

    launch = dict(backend="neuron", instance="trn1.32xlarge", progress=False, compile=False)  # neuron runs eager
    assert openai_app._cpus_per_rank(launch, 2) is None  # before any Ray call: no node list needed
    # the replica's launch then plans (Launcher.prepare would also start loading the tokenizer on
    # a thread, which outlived the test and raced the next one's transformers imports)
    assert plan_launch(LaunchConfig(**launch, cpus_per_rank=None), Progress(False)).backend == "neuron"


# ---- slow: a real server ---------------------------------------------------------------------
@contextlib.contextmanager
def running_server(log: Path, *options: str, stop_group: bool = False):
    """`corelaunch serve --tp 1 --no-compile OPTIONS` in a subprocess on a free loopback port, until
    GET /health answers 200; yields its base URL and pid, then stops it with SIGTERM and checks it
    exits 0. stop_group: the SIGTERM goes to its whole process group (as systemd stopping a unit, or
    `kill -- -PGID`, sends it), its private Ray's processes included."""
    import requests

    from workers.net import free_port_for_a_late_bind

    port = free_port_for_a_late_bind()  # Serve binds it tens of seconds later
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "launcher", "serve", "--tp", "1", "--port", str(port), "--no-compile", *options],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "CORELAUNCH_API_KEY": ""},
            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 540
        while True:
            assert proc.poll() is None, f"corelaunch serve exited ({proc.returncode}):\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"no /health within 540 s:\n{log.read_text()[-4000:]}"
            try:
                if requests.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:  # not listening yet: the replica (or proxy) is still starting
                pass
            time.sleep(1)
        yield SimpleNamespace(url=url, pid=proc.pid)
    finally:
        stopping = time.monotonic()
        (os.killpg if stop_group else os.kill)(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        stopped_in = time.monotonic() - stopping
    assert proc.returncode == 0, log.read_text()[-4000:]
    # Serve's graceful shutdown waited 30 s for a controller the group's signal had taken.
    assert not stop_group or stopped_in < 28, f"stopped {stopped_in:.0f} s after the group's SIGTERM"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The module's server (direct ingress, the default for one replica); yields its URL and log."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    # --max-restarts 0: the module's last test fails the TP group for good (nothing else kills a rank)
    # --tool-call-parser: tool_choice "auto" taken (only requests with tools and "auto" see it)
    # --responses-store: /v1/responses keeps what it answers (kept in the one replica's process)
    with running_server(log, "--max-num-seqs", "4", "--max-queued-requests", "12", "--api-key", API_KEY,
                        "--max-restarts", "0", "--tool-call-parser", "hermes", "--responses-store", "8") as running:
        yield SimpleNamespace(url=running.url, pid=running.pid, log=log)


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, timeout=300, max_retries=0)


@pytest.fixture(scope="module")
def hf():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardlib.demo_model import ensure_demo_model

    model_dir = ensure_demo_model()
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def greedy(ids: list[int], max_new_tokens: int) -> str:
        ids_t = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(ids_t, attention_mask=torch.ones_like(ids_t), max_new_tokens=max_new_tokens,
                                 do_sample=False)
        return tok.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)

    return SimpleNamespace(tok=tok, greedy=greedy, config=model.config, model=model)


PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.slow
def test_completion_greedy_matches_transformers(client, hf):
    expected = hf.greedy(hf.tok(PROMPT)["input_ids"], 8)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert out.choices[0].text == expected and "Paris" in expected
    assert out.usage.prompt_tokens == len(hf.tok(PROMPT)["input_ids"]) and out.usage.completion_tokens == 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8 and out.choices[0].finish_reason == "length"
    by_ids = client.completions.create(model=MODEL, prompt=hf.tok(PROMPT)["input_ids"], max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == expected
    nested = client.completions.create(model=MODEL, prompt=[hf.tok(PROMPT)["input_ids"]], max_tokens=8, temperature=0)
    assert nested.choices[0].text == expected  # one token-id list in a list: one prompt
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    # with include_usage, OpenAI's other chunks carry "usage": null (the key was missing)
    assert all("usage" in c.model_fields_set and c.usage is None for c in chunks[:-1])


@pytest.mark.slow
def test_chat_greedy_matches_transformers(client, hf):
    ids = hf.tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    expected = hf.greedy(list(ids), 12)
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    assert out.choices[0].message.content == expected and out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=12, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


@pytest.mark.slow
def test_a_stream_interval_sends_the_same_answer_in_fewer_chunks(client, hf):
    """The body's stream_interval (vLLM's) on a server at --stream-interval 1: the first token alone,
    then chunks of n tokens and what is left at the end, the text, usage and log-probabilities those
    of the whole answer."""
    ids = hf.tok(PROMPT)["input_ids"]
    expected = hf.greedy(ids, 10)
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                       logprobs=1, stream_options={"include_usage": True},
                                       extra_body={"stream_interval": 4, "ignore_eos": True})
    chunks = [c for c in stream]
    texts = [c.choices[0] for c in chunks if c.choices]
    assert [len(c.logprobs.tokens) for c in texts] == [1, 4, 4, 1]
    assert "".join(c.text for c in texts) == expected and chunks[-1].usage.completion_tokens == 10
    chat_ids = hf.tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    answer = hf.greedy(list(chat_ids), 12)
    chat = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stream=True,
                                               logprobs=True, extra_body={"stream_interval": 5}))
    content = [c.choices[0] for c in chat if c.choices and c.choices[0].delta.content]
    assert "".join(c.delta.content for c in content) == answer
    assert max(len(c.logprobs.content) for c in content) > 1  # gathered: several tokens a chunk

    def choices(interval: int) -> list:
        stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=80, temperature=0, stream=True,
                                           logprobs=1, extra_body={"stream_interval": interval, "ignore_eos": True})
        return [c.choices[0] for c in stream if c.choices]

    def text_and_tokens(chunks: list) -> tuple:
        return "".join(c.text for c in chunks), [t for c in chunks for t in c.logprobs.tokens]

    one_at_a_time = text_and_tokens(choices(1))  # (a token without text yet goes with the next: not a chunk each)
    # past the 64 a leader holds (held_per_event): 66 held 33 at a time (a divisor), a chunk two whole
    # events; 71 (a prime) 64 at a time, its chunk the first event and 7 tokens of the second, which
    # the replica splits: it gathers exactly the interval a chunk, and the rest of the 79 at the end.
    # (Each chunk ends on a token with text of its own: 67's would not, and it moved to the next.)
    for interval, sizes in ((66, [1, 66, 13]), (71, [1, 71, 8])):
        gathered = choices(interval)
        assert [len(c.logprobs.tokens) for c in gathered] == sizes
        assert text_and_tokens(gathered) == one_at_a_time


@pytest.mark.slow
def test_continuous_usage_stats_count_each_chunks_tokens_so_far(client, hf):
    """vLLM's stream_options.continuous_usage_stats: every chunk with a choice carries usage, its
    completion_tokens growing to the final count (a chat's role chunk 0); the last chunk, no
    choices, still has the request's usage."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    chat_ids = hf.tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    asked = dict(model=MODEL, temperature=0, stream=True, stream_options=options, extra_body={"ignore_eos": True})
    streams = {  # one at a time: each request starts when its turn comes
        "completions": (lambda: client.completions.create(prompt=PROMPT, max_tokens=8, **asked),
                        len(hf.tok(PROMPT)["input_ids"]), 8),
        "chat": (lambda: client.chat.completions.create(messages=CHAT, max_tokens=6, **asked), len(chat_ids), 6)}
    for name, (start, prompt_tokens, new_tokens) in streams.items():
        chunks = list(start())
        with_choice = [c for c in chunks if c.choices]
        assert with_choice and all(c.usage is not None and c.usage.prompt_tokens == prompt_tokens and
                                   c.usage.total_tokens == prompt_tokens + c.usage.completion_tokens
                                   for c in with_choice), name
        grown = [c.usage.completion_tokens for c in with_choice]
        if name == "chat":
            assert with_choice[0].choices[0].delta.role == "assistant" and grown.pop(0) == 0
        assert grown == sorted(set(grown)) and grown[0] >= 1 and grown[-1] == new_tokens, (name, grown)
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == new_tokens, name
        assert chunks[-1].usage.prompt_tokens == prompt_tokens and chunks[-1].usage.prompt_tokens_details is not None


@pytest.mark.slow
def test_a_stop_string_ends_the_text_before_it(client, hf):
    full = hf.greedy(hf.tok(PROMPT)["input_ids"], 16)
    stop = full[len(full) // 2:][:4]  # four characters from the middle of the greedy text
    cut = full[:full.find(stop)]
    assert stop.strip() and len(cut) < len(full) // 2 + 1
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop, "@@@"],
                                    logprobs=1)
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 16  # generation ended at the stop, not at max_tokens
    # log-probabilities for the returned text's tokens only: the stop string's are left out (the
    # last token may run past the cut, but starts before it), while usage counts every token
    logprobs = out.choices[0].logprobs
    assert "".join(logprobs.tokens).startswith(cut) and logprobs.text_offset[-1] < len(cut)
    assert len(logprobs.tokens) <= out.usage.completion_tokens
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop,
                                       stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == cut and chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_include_stop_str_in_output_ends_the_text_with_the_stop_string(client, hf):
    """vLLM's include_stop_str_in_output: the text is the one without it plus the stop string, nothing
    after it, streamed or not, in every choice, on both routes; the tokens counted are the same."""
    full = hf.greedy(hf.tok(PROMPT)["input_ids"], 16)
    stop = full[len(full) // 2:][:4]  # four characters from the middle of the greedy text
    cut = full[:full.find(stop)]
    assert stop.strip() and len(cut) < len(full) // 2 + 1
    asked = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop, "@@@"])
    plain = client.completions.create(**asked)
    kept = client.completions.create(**asked, n=2, extra_body={"include_stop_str_in_output": True})
    assert plain.choices[0].text == cut and [c.text for c in kept.choices] == [cut + stop] * 2
    assert all(c.finish_reason == "stop" for c in [*plain.choices, *kept.choices])
    assert kept.usage.completion_tokens == 2 * plain.usage.completion_tokens < 32
    for flag, expected in ((False, cut), (True, cut + stop)):
        streamed = {0: "", 1: ""}
        for chunk in client.completions.create(**asked, n=2, stream=True,
                                               extra_body={"include_stop_str_in_output": flag}):
            for choice in chunk.choices:
                streamed[choice.index] += choice.text
        assert streamed == {0: expected, 1: expected}, flag
    ids = hf.tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    answer = hf.greedy(list(ids), 12)
    chat_stop = answer[len(answer) // 2:][:3]
    assert chat_stop.strip() and answer.find(chat_stop) > 0
    chat_asked = dict(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stop=[chat_stop],
                      extra_body={"include_stop_str_in_output": True})
    out = client.chat.completions.create(**chat_asked)
    expected = answer[:answer.find(chat_stop) + len(chat_stop)]
    assert out.choices[0].message.content == expected and out.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(**chat_asked, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected


@pytest.mark.slow
def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client, server, hf):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens are what the model reads (the same
    greedy text as sending only them), what usage counts and what echo gives back, streamed or not,
    on both routes; a text longer than the context is taken once truncated (refused whole)."""
    import openai
    import requests

    long_text = " ".join(f"item {i} of the list," for i in range(60)) + " " + PROMPT
    ids = hf.tok(long_text)["input_ids"]
    k = 24
    assert len(ids) > 4 * k
    tail = client.completions.create(model=MODEL, prompt=ids[-k:], max_tokens=6, temperature=0)
    asked = dict(model=MODEL, max_tokens=6, temperature=0, extra_body={"truncate_prompt_tokens": k})
    for prompt in (long_text, ids):
        out = client.completions.create(prompt=prompt, **asked)
        assert out.choices[0].text == tail.choices[0].text and out.usage.prompt_tokens == k
    assert tail.choices[0].text == hf.greedy(ids[-k:], 6)
    chunks = list(client.completions.create(prompt=long_text, stream=True, stream_options={"include_usage": True},
                                            **asked))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == tail.choices[0].text
    assert chunks[-1].usage.prompt_tokens == k
    echoed = client.completions.create(prompt=long_text, echo=True, logprobs=0, **asked)
    kept = hf.tok.decode(ids[-k:])
    assert echoed.choices[0].text == kept + tail.choices[0].text and echoed.usage.prompt_tokens == k
    assert len(echoed.choices[0].logprobs.tokens) == k + echoed.usage.completion_tokens  # the kept tokens scored
    # chat: the rendered chat prompt's last tokens
    chat_ids = list(hf.tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False))
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                          extra_body={"truncate_prompt_tokens": 8})
    assert chat.usage.prompt_tokens == 8 < len(chat_ids)
    assert chat.choices[0].message.content == hf.greedy(chat_ids[-8:], 6)
    # a text longer than the whole context: refused as it is, served once truncated
    auth = {"Authorization": f"Bearer {API_KEY}"}
    context = requests.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": "x"}, headers=auth,
                            timeout=60).json()["max_model_len"]
    overlong = " hello" * (context + 50)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=overlong, max_tokens=2, temperature=0)
    assert refused.value.body["code"] == "context_length_exceeded"
    served = client.completions.create(prompt=overlong, **{**asked, "max_tokens": 2})
    assert served.usage.prompt_tokens == k
    with pytest.raises(openai.BadRequestError) as past:
        client.completions.create(prompt=PROMPT, **{**asked, "extra_body": {"truncate_prompt_tokens": context + 1}})
    assert past.value.body["param"] == "truncate_prompt_tokens"


@pytest.mark.slow
def test_penalties_logit_bias_and_min_p_over_http(client, hf):
    """OpenAI's frequency_penalty and presence_penalty, and vLLM's repetition_penalty (extra_body),
    greedy, streamed and not: the text of transformers' greedy generation with the same penalties;
    likewise OpenAI's logit_bias, and vLLM's min_tokens (transformers' min_new_tokens). vLLM's min_p
    reaches the sampler."""
    import openai
    import torch
    from transformers import LogitsProcessorList

    from tests.test_penalties import OpenAIPenalties

    prompt = "one two one two one two one two"
    ids = hf.tok(prompt)["input_ids"]
    with torch.no_grad():
        out = hf.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=16, do_sample=False, repetition_penalty=1.3,
                                logits_processor=LogitsProcessorList([OpenAIPenalties(len(ids), 0.8, 0.4)]))
    expected = hf.tok.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)
    assert expected != hf.greedy(ids, 16)  # the penalties change this text: the comparison means something
    asked = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, frequency_penalty=0.8, presence_penalty=0.4,
                 extra_body={"repetition_penalty": 1.3})
    assert client.completions.create(**asked).choices[0].text == expected
    assert "".join(c.choices[0].text for c in client.completions.create(**asked, stream=True)) == expected
    # a logit bias of -100 on the greedy text's first token: transformers' text with the same bias
    first = hf.tok(hf.greedy(ids, 1))["input_ids"][0]
    with torch.no_grad():
        out = hf.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=8, do_sample=False, sequence_bias={(first,): -100.0})
    banned = hf.tok.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)
    assert banned != hf.greedy(ids, 8)
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                    logit_bias={str(first): -100})
    assert got.choices[0].text == banned
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, logit_bias={str(hf.config.vocab_size): 1})
    assert refused.value.body["param"] == "logit_bias" and "outside the vocabulary" in refused.value.body["message"]
    # min_tokens holds stop tokens back as transformers' min_new_tokens does (the greedy text's second
    # token made a stop token: without it the text ends there)
    prompt_ids = hf.tok(PROMPT)["input_ids"]
    with torch.no_grad():
        greedy_ids = hf.model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                                       max_new_tokens=2, do_sample=False)[0, len(prompt_ids):].tolist()
    ending = greedy_ids[1]
    eos = hf.config.eos_token_id if isinstance(hf.config.eos_token_id, list) else [hf.config.eos_token_id]
    with torch.no_grad():
        out = hf.model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                                max_new_tokens=10, do_sample=False, min_new_tokens=6, eos_token_id=[ending, *eos])
    held = out[0, len(prompt_ids):].tolist()
    assert len(held) >= 6
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0,
                                    extra_body={"stop_token_ids": [ending], "min_tokens": 6})
    # a stop token that ends the request leaves its text out, as vLLM's does
    shown = held[:-1] if held[-1] in (ending, *eos) else held
    assert got.usage.completion_tokens == len(held) and got.choices[0].text == hf.tok.decode(shown)
    short = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0,
                                      extra_body={"stop_token_ids": [ending]})
    assert short.usage.completion_tokens == 2
    # and stop strings too, as vLLM's does: the greedy text's first token's text is looked for only
    # in the text of the tokens after the first min_tokens
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    first_text = hf.tok.decode(greedy_ids[:1])
    assert plain.choices[0].text.count(first_text) == 1  # nowhere later: with min_tokens no stop at all
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=[first_text])
    assert stopped.choices[0].text == "" and stopped.choices[0].finish_reason == "stop"
    held_back = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=[first_text],
                                          extra_body={"min_tokens": 1})
    assert held_back.choices[0].text == plain.choices[0].text and held_back.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"min_tokens": 5})
    assert refused.value.body["param"] == "min_tokens" and "at most max_tokens (4)" in refused.value.body["message"]
    # min_p 1 keeps only the most likely token (and its equals): sampled, it is the greedy text
    hot = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.5, seed=3,
                                    extra_body={"min_p": 1.0})
    assert hot.choices[0].text == hf.greedy(hf.tok(PROMPT)["input_ids"], 8)


@pytest.mark.slow
def test_n_choices_each_equal_their_own_request(client, hf):
    """n choices, streamed and not: choice i is what one request seeded with choice_seed(seed, i)
    gets (choice 0 with the seed itself), usage counts every choice's tokens once and the prompt
    once; greedy choices are all the greedy text; more choices than sequence slots is a 400."""
    import openai

    from launcher.serving.openai_protocol import choice_seed

    asked = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    alone = [client.completions.create(**{**asked, "seed": choice_seed(11, i)}).choices[0].text for i in range(3)]
    assert len(set(alone)) > 1  # the choices differ: each has a seed of its own
    out = client.completions.create(**asked, n=3)
    assert [c.index for c in out.choices] == [0, 1, 2] and [c.text for c in out.choices] == alone
    assert out.usage.completion_tokens == 24 and out.usage.prompt_tokens == len(hf.tok(PROMPT)["input_ids"])
    streamed, usage = {0: "", 1: "", 2: ""}, None
    for chunk in client.completions.create(**asked, n=3, stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
        usage = chunk.usage or usage
    assert [streamed[i] for i in range(3)] == alone and usage.completion_tokens == 24
    ids = hf.tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    greedy = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, n=2)
    assert [c.message.content for c in greedy.choices] == [hf.greedy(list(ids), 6)] * 2
    roles = {}
    for chunk in client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, n=2,
                                                stream=True):
        for choice in chunk.choices:
            roles.setdefault(choice.index, choice.delta.role)  # each choice opens with the assistant's role
    assert roles == {0: "assistant", 1: "assistant"}
    with pytest.raises(openai.BadRequestError) as refused:  # the module's server runs --max-num-seqs 4
        client.completions.create(**asked, n=5)
    assert refused.value.body["param"] == "n" and "max_num_seqs 4" in refused.value.body["message"]


@pytest.mark.slow
def test_models_health_and_metrics(client, server):
    import requests

    import openai

    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL  # GET /v1/models/{id} was a 404
    # vLLM's max_model_len, which clients read to size their context: /tokenize's own
    counted = requests.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": "Hi"}, timeout=10,
                            headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert client.models.list().data[0].max_model_len == counted["max_model_len"] > 0
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    health = requests.get(f"{server.url}/health", timeout=10)  # open without the key
    assert (health.status_code, health.json()) == (200, {"status": "ok"})  # the model named only behind the key
    # SageMaker's routes: /ping as /health, /invocations answered by the route its body names
    assert [requests.request(method, f"{server.url}/ping", timeout=10).status_code for method in ("GET", "POST")] == [
        200, 200]
    keyed = {"Authorization": f"Bearer {API_KEY}"}
    invoked = requests.post(f"{server.url}/invocations", headers=keyed, timeout=60,
                            json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert invoked.status_code == 200 and invoked.json()["object"] == "text_completion"
    assert requests.post(f"{server.url}/invocations", json={"model": MODEL, "prompt": "Hi"}, timeout=10).status_code == 401
    assert requests.head(f"{server.url}/health", timeout=10).status_code == 200  # probes by HEAD got 405
    text = requests.get(f"{server.url}/metrics", timeout=10).text
    for name in ("corelaunch_requests_running", "corelaunch_requests_waiting",
                 "corelaunch_time_to_first_token_seconds_bucket", "corelaunch_inter_token_latency_seconds_bucket",
                 "corelaunch_generated_tokens_total", "corelaunch_requests_total",
                 "corelaunch_prefix_cache_hit_tokens_total"):
        assert name in text, name


@pytest.mark.slow
def test_tokenize_and_detokenize_answer_as_the_tokenizer_and_chat_completions_do(client, server, hf):
    """vLLM's /tokenize and /detokenize (404 before they existed): a text's ids are the tokenizer's, a
    chat's are the prompt /v1/chat/completions counts, ids read back as the text, and max_model_len
    is the context /v1/completions holds prompts against. Refusals as on the other routes, and none
    of it counted in corelaunch_requests_total (generation requests only)."""
    import requests

    auth = {"Authorization": f"Bearer {API_KEY}"}

    def post(route: str, body: dict, headers: dict = auth) -> requests.Response:
        return requests.post(f"{server.url}{route}", json=body, headers=headers, timeout=30)

    counted = _metric_sum(server, "corelaunch_requests_total")
    reply = post("/tokenize", {"model": MODEL, "prompt": PROMPT, "return_token_strs": True})
    assert reply.status_code == 200, reply.text
    ids = hf.tok(PROMPT)["input_ids"]
    context = reply.json()["max_model_len"]
    assert reply.json() == {"count": len(ids), "max_model_len": context, "tokens": ids,
                            "token_strs": hf.tok.convert_ids_to_tokens(ids)}
    full = post("/v1/completions", {"model": MODEL, "prompt": [7] * context, "max_tokens": 1})  # refused, not run
    assert full.status_code == 400 and f"the context holds {context}," in full.json()["error"]["message"]
    counted += 1  # that refusal is a generation request's
    chat = post("/tokenize", {"model": MODEL, "messages": CHAT}).json()
    assert chat["tokens"] == hf.tok.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    assert post("/detokenize", {"model": MODEL, "tokens": ids}).json() == {"prompt": PROMPT}

    vocab = hf.config.vocab_size
    reply = post("/detokenize", {"model": MODEL, "tokens": [ids[0], vocab]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tokens"
    assert f"[{vocab}] outside the vocabulary [0, {vocab})" in reply.json()["error"]["message"]
    reply = post("/tokenize", {"model": MODEL, "prompt": ["a"]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"
    for route, body in (("/tokenize", {"prompt": PROMPT}), ("/detokenize", {"tokens": ids})):
        reply = post(route, {"model": "gpt-4", **body})
        assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"
        reply = post(route, {"model": MODEL, **body}, headers={})
        assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
        # a wrong method: 405 only with the key, as under /v1/
        assert requests.get(f"{server.url}{route}", timeout=10).status_code == 401
        assert requests.get(f"{server.url}{route}", headers=auth, timeout=10).status_code == 405
    assert _metric_sum(server, "corelaunch_requests_total") == counted

    usage = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, temperature=0).usage
    assert chat["count"] == len(chat["tokens"]) == usage.prompt_tokens


@pytest.mark.slow
def test_http_errors(client, server, hf):
    import openai
    import requests

    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=PROMPT, temperature=-1)  # above 2 is taken
    assert caught.value.body["param"] == "temperature" and "[0, 3.402823e+38]" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=CHAT, n=129)
    assert caught.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-4", prompt=PROMPT)
    assert caught.value.body["param"] == "model" and MODEL in caught.value.body["message"]
    long_prompt = "hello " * 9000
    prompt_tokens = len(hf.tok(long_prompt)["input_ids"])
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=4)
    message = caught.value.body["message"]
    assert str(prompt_tokens) in message and any(str(n) in message for n in (hf.config.max_position_embeddings, 4096))
    assert caught.value.body["code"] == "context_length_exceeded"  # OpenAI's: clients trim and retry on it
    with pytest.raises(openai.BadRequestError) as caught:  # no max_tokens sent: named as "max_tokens 1"
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long_prompt}])
    message = caught.value.body["message"]
    assert "leaving no room for a generated token" in message and "max_tokens" not in message
    assert caught.value.body["param"] == "messages" and caught.value.body["code"] == "context_length_exceeded"
    # 315 000 characters of dense text: refused from its head alone (under the length bound, 2 x 81
    # characters per context token, at a context of 4096 or more); 3 MB of spaces, too sparse for
    # its head to tell: refused by its length, untokenized (launcher/serving/prompt_probe.py)
    huge = "The quick brown fox jumps over the lazy dog. " * 7_000
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=huge, max_tokens=4)
    assert caught.value.body["param"] == "prompt" and "characters alone have" in caught.value.body["message"]
    assert caught.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": huge}])
    assert caught.value.body["param"] == "messages" and "chat prompt (the messages in the model's chat template) " \
        "cannot fit" in caught.value.body["message"]
    sparse = "a" + " " * 3_000_000 + "b"  # inside the text: no template trims it (a chat prompt adds the template's)
    for call, param in ((lambda: client.completions.create(model=MODEL, prompt=sparse, max_tokens=4), "prompt"),
                        (lambda: client.chat.completions.create(
                            model=MODEL, messages=[{"role": "user", "content": sparse}]), "messages")):
        with pytest.raises(openai.BadRequestError) as caught:
            call()
        assert caught.value.body["param"] == param
        assert re.search(r"it has 300\d{4} characters, no token", caught.value.body["message"])
        assert caught.value.body["code"] == "context_length_exceeded"
    auth = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    reply = requests.post(f"{server.url}/v1/chat/completions", headers=auth, timeout=30,
                          data=f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi \\ud800"}}]}}')
    assert reply.status_code == 400, reply.text  # the chat template's internal TypeError was the message
    assert reply.json()["error"]["param"] == "messages.0.content" and "not valid UTF-8" in reply.json()["error"]["message"]
    reply = requests.post(f"{server.url}/v1/chat/completions", headers=auth, timeout=30,  # a name reaches the template
                          data=f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi", "name": "\\ud800"}}]}}')
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "messages.0.name" and "not valid UTF-8" in reply.json()["error"]["message"]
    rejected = 'corelaunch_requests_total{finish_reason="rejected",status="400"}'
    before = _metric(server, rejected)
    assert requests.post(f"{server.url}/v1/completions", headers=auth, data="{bad", timeout=10).status_code == 400
    assert _metric(server, rejected) == before + 1  # a body that is not JSON was not counted
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        reply = requests.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x"},
                              headers=headers, timeout=10)
        assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
        assert reply.headers["www-authenticate"] == "Bearer"
        # names the key's every source: the CLI's flag, the Serve app's argument, the environment
        assert all(source in reply.json()["error"]["message"] for source in ("--api-key", "`api_key`", "CORELAUNCH_API_KEY"))
    assert requests.get(f"{server.url}/v1/models", timeout=10).status_code == 401
    for send, route in ((requests.post, "/v1/embeddings"), (requests.get, "/v1/completions"),
                        (requests.post, "/v1/completions/"), (requests.get, "/v1/chat/completions/")):
        # a route or method that does not exist: 401 without the key (404 and 405 told what exists,
        # and so did a 307 from a route with a trailing slash to the route without)
        assert send(f"{server.url}{route}", timeout=10, allow_redirects=False).status_code == 401
        assert send(f"{server.url}{route}", headers=auth, timeout=10, allow_redirects=False).status_code in (404, 405)
    assert requests.get(f"{server.url}/openapi.json", timeout=10).status_code == 404  # answered without the key
    # Bodies past the server's limit: 413 by the declared length, or as a chunked body arrives
    # (both were read whole and parsed first); counted as rejected
    too_large = 'corelaunch_requests_total{finish_reason="rejected",status="413"}'
    limit = 2 ** 20 + 12 * 4096 * 81  # 1 MiB + 12 bytes x the context (4096) x SmolLM2's longest piece
    body = b'{"model": "%s", "prompt": "%s"}' % (MODEL.encode(), b"a" * 2 * limit)
    before = _metric(server, too_large) if too_large in requests.get(f"{server.url}/metrics", timeout=10).text else 0
    for data in (body, iter([body[i:i + 2 ** 20] for i in range(0, len(body), 2 ** 20)])):
        reply = requests.post(f"{server.url}/v1/completions", headers=auth, data=data, timeout=60)
        assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large", reply.text
    assert _metric(server, too_large) == before + 2


@pytest.mark.slow
def test_edge_values_neither_crash_the_group_nor_escape_as_500s(client, server, hf):
    """Found by an adversarial run: a top_k past float32's range and a temperature of 1e-40 are in
    range but used to fail the leader's step (its group restarted on the replayed request until the
    replica was given up); JSON nested thousands deep or a 5000-digit number answered a plain 500;
    too large a max_tokens was blamed on the prompt, by the engine's name for it."""
    import openai
    import requests

    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
    tiny = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1e-40, seed=1)
    assert tiny.choices[0].text == greedy  # below 1e-5 a temperature is greedy
    huge_k = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1, seed=3,
                                       extra_body={"top_k": 10**39})
    no_k = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1, seed=3)
    assert huge_k.choices[0].text == no_k.choices[0].text  # a k past the vocabulary keeps every token
    # OpenAI's seeds are signed 64-bit: a negative one is accepted and is a seed of its own
    negative = [client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1, seed=-2**63)
                .choices[0].text for _ in range(2)]
    assert negative[0] == negative[1]
    assert requests.get(f"{server.url}/health", timeout=10).status_code == 200
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    for body, words in (("[" * 100000 + "]" * 100000, "not valid JSON"),
                        ('{"model": "%s", "prompt": "a", "max_tokens": %s}' % (MODEL, "9" * 5000),
                         "an integer of more than 4300 digits")):
        reply = requests.post(f"{server.url}/v1/completions", data=body, headers=headers, timeout=30)
        assert reply.status_code == 400 and words in reply.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=[28] * 10, max_tokens=10**6)
    assert caught.value.body["param"] == "max_tokens" and caught.value.body["code"] == "context_length_exceeded"
    assert "max_tokens 1000000" in caught.value.body["message"] and "max_new_tokens" not in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=10**6)
    assert caught.value.body["param"] == "max_completion_tokens"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="")
    assert caught.value.body["param"] == "prompt" and "prompt is empty" in caught.value.body["message"]


@pytest.mark.slow
def test_allowed_token_ids_over_http(client, hf):
    """vLLM's allowed_token_ids (extra_body), greedy: the text of transformers' greedy generation
    restricted to the same ids; without EOS among them the request runs to max_tokens, on chat too,
    whose every token is one of them. Ids outside the vocabulary are a 400 naming the field."""
    import openai
    import torch

    allowed = hf.tok(" one two three Paris the")["input_ids"]
    words = {hf.tok.decode([t]) for t in allowed}
    assert len(allowed) == 5 and words == {" one", " two", " three", " Paris", " the"}
    ids = hf.tok(PROMPT)["input_ids"]
    with torch.no_grad():
        out = hf.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=8, do_sample=False, prefix_allowed_tokens_fn=lambda b, s: allowed)
    restricted = out[0, len(ids):].tolist()
    assert set(restricted) <= set(allowed) and hf.tok.decode(restricted) != hf.greedy(ids, 8)
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"allowed_token_ids": allowed})
    assert got.choices[0].text == hf.tok.decode(restricted)
    assert got.choices[0].finish_reason == "length" and got.usage.completion_tokens == 8  # no EOS allowed
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                          extra_body={"allowed_token_ids": allowed})
    assert chat.choices[0].finish_reason == "length" and len(chat.choices[0].logprobs.content) == 6
    assert {entry.token for entry in chat.choices[0].logprobs.content} <= words
    with pytest.raises(openai.BadRequestError) as outside:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                       extra_body={"allowed_token_ids": [5, hf.config.vocab_size]})
    body = outside.value.body
    assert body["param"] == "allowed_token_ids"
    assert f"[{hf.config.vocab_size}] outside the vocabulary" in body["message"]
    with pytest.raises(openai.BadRequestError) as empty:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"allowed_token_ids": []})
    assert empty.value.body["param"] == "allowed_token_ids"


@pytest.mark.slow
def test_logprobs_of_tokens_inside_characters(client):
    """SmolLM2 spells an emoji as several tokens of one or two bytes: each gets a text of its own
    (`bytes:\\xNN`), its own top_logprobs key, and offsets count the characters before it."""
    out = client.completions.create(model=MODEL, prompt="Reply using only emojis: 😀🎉🔥 ->", max_tokens=12,
                                    temperature=0, logprobs=5)
    text, logprobs = out.choices[0].text, out.choices[0].logprobs
    assert any(t.startswith("bytes:") for t in logprobs.tokens), logprobs.tokens  # the greedy text has emoji
    assert all(len(top) == 5 for top in logprobs.top_logprobs)
    for token, offset in zip(logprobs.tokens, logprobs.text_offset):
        if not token.startswith("bytes:"):
            assert text[offset:offset + len(token)] == token
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Reply with 🎉🔥"}],
                                          max_tokens=12, temperature=0, logprobs=True)
    content = chat.choices[0].logprobs.content
    joined = b"".join(bytes(entry.bytes) for entry in content)
    assert joined.decode("utf-8", errors="replace").rstrip("\ufffd") == chat.choices[0].message.content.rstrip("\ufffd")


@pytest.mark.slow
def test_several_prompts_in_one_request_number_their_choices_prompt_by_prompt(client, hf):
    prompts = [PROMPT, "Hello, my name is"]
    ids = [hf.tok(p)["input_ids"] for p in prompts]
    expected = [hf.greedy(i, 6) for i in ids]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [expected[0], expected[0], expected[1], expected[1]]
    assert out.usage.prompt_tokens == len(ids[0]) + len(ids[1]) and out.usage.completion_tokens == 4 * 6
    chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, stream=True,
                                            echo=True))
    texts = {}
    for chunk in chunks:
        texts[chunk.choices[0].index] = texts.get(chunk.choices[0].index, "") + chunk.choices[0].text
    assert texts == {0: prompts[0] + expected[0], 1: prompts[1] + expected[1]}
    with pytest.raises(Exception) as caught:  # 3 prompts x 2 choices: more than the server's 4 rows
        client.completions.create(model=MODEL, prompt=prompts + ["x"], max_tokens=2, n=2)
    assert caught.value.status_code == 400 and "3 prompts of n (2) choices each are 6 sequences" in str(caught.value)
    with pytest.raises(Exception) as caught:
        client.completions.create(model=MODEL, prompt=[PROMPT, ""], max_tokens=2)
    assert caught.value.status_code == 400 and "prompt[1]: prompt is empty" in str(caught.value)
    with pytest.raises(Exception) as caught:  # an option of the whole request names no prompt
        client.completions.create(model=MODEL, prompt=prompts, max_tokens=2, logit_bias={"999999": 1})
    assert caught.value.status_code == 400 and "400 - logit_bias names token ids [999999]" in str(caught.value)
    with pytest.raises(Exception) as caught:  # decoded for the echo, an id of 2**32 overflowed (a 500)
        client.completions.create(model=MODEL, prompt=[ids[0], [504, 2**32]], max_tokens=2, echo=True)
    assert caught.value.status_code == 400 and "prompt[1]: prompt holds token ids [4294967296] outside the " \
        "vocabulary" in str(caught.value)


@pytest.mark.slow
def test_vllm_prompt_logprobs_score_chat_and_completion_prompts(client, hf):
    import torch

    ids = list(hf.tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False))
    with torch.no_grad():
        table = torch.log_softmax(hf.model(torch.tensor([ids])).logits[0].float(), dim=-1)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0,
                                          extra_body={"prompt_logprobs": 2})
    listed = chat.model_extra["prompt_logprobs"]
    assert len(listed) == len(ids) and listed[0] is None
    for j in range(1, len(ids)):
        mine = listed[j][str(ids[j])]
        assert mine["logprob"] == pytest.approx(float(table[j - 1, ids[j]]), abs=2e-3)
        assert mine["rank"] == int((table[j - 1] > table[j - 1, ids[j]] + 1e-4).sum()) + 1 or \
            abs(float(table[j - 1].sort(descending=True).values[mine["rank"] - 1] - table[j - 1, ids[j]])) < 1e-3
        assert mine["decoded_token"] == hf.tok.decode([ids[j]]) or mine["decoded_token"].startswith("bytes:")
        top = table[j - 1].topk(2).indices.tolist()
        assert set(listed[j]) == {str(ids[j])} | {str(t) for t in top}
    out = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=1, temperature=0, n=2,
                                    extra_body={"prompt_logprobs": 0})
    lengths = [len(hf.tok(PROMPT)["input_ids"])] * 2 + [len(hf.tok("Hello")["input_ids"])] * 2
    assert [len(c.model_extra["prompt_logprobs"]) for c in out.choices] == lengths
    ids = hf.tok(PROMPT)["input_ids"]
    with torch.no_grad():
        table = torch.log_softmax(hf.model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for j, listed in enumerate(out.choices[1].model_extra["prompt_logprobs"][1:], 1):
        assert listed[str(ids[j])]["logprob"] == pytest.approx(float(table[j - 1, ids[j]]), abs=2e-3)
    with pytest.raises(Exception) as caught:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, stream=True,
                                  extra_body={"prompt_logprobs": 0})
    assert caught.value.status_code == 400 and "not available with stream: true" in str(caught.value)


@pytest.mark.slow
def test_structured_output_over_http(client, smollm2_tokenizer):
    """OpenAI's response_format (json_schema through the client's own parse(), json_object) and vLLM's
    structured_outputs (choice, regex), streamed and not; a schema llguidance cannot compile is a 400
    naming the field."""
    import json

    import jsonschema
    from pydantic import BaseModel

    class Capital(BaseModel):
        country: str
        capital: str

    asked = [{"role": "user", "content": "What is the capital of France? Reply in JSON with country and capital."}]
    parsed = client.chat.completions.parse(model=MODEL, messages=asked, response_format=Capital, max_tokens=40,
                                           temperature=0)
    choice = parsed.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Capital), choice.message.content
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                               "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
              "required": ["answer", "confidence"], "additionalProperties": False}
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is Paris in France?"}], max_tokens=40, temperature=0.8,
        seed=3, stream=True, response_format={"type": "json_schema", "json_schema": {"name": "verdict",
                                                                                     "schema": schema}})
    chunks = list(stream)
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks)), schema)
    assert chunks[-1].choices[0].finish_reason == "stop"
    obj = client.chat.completions.create(model=MODEL, messages=asked, max_tokens=60, temperature=0,
                                         response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":  # a whole object; cut by max_tokens it is a prefix of one
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:
        assert obj.choices[0].message.content.startswith("{")
    picked = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=10, n=2,
                                       temperature=1.0, extra_body={"structured_outputs": {"choice": ["Paris",
                                                                                                     "Lyon"]}})
    assert {c.text for c in picked.choices} <= {"Paris", "Lyon"} and {c.finish_reason for c in picked.choices} == {"stop"}
    dated = client.completions.create(model=MODEL, prompt="The year France became a republic:", max_tokens=10,
                                      temperature=0, extra_body={"structured_outputs": {"regex": "1[0-9]{3}"}})
    assert re.fullmatch("1[0-9]{3}", dated.choices[0].text) and dated.choices[0].finish_reason == "stop"
    with pytest.raises(Exception) as caught:
        client.chat.completions.create(model=MODEL, messages=asked, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}})
    assert caught.value.status_code == 400 and caught.value.body["param"] == "response_format.json_schema.schema"
    assert "Invalid type: nonsense" in caught.value.body["message"]
    with pytest.raises(Exception) as caught:  # compiles, and no text matches it: refused before it runs
        client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=5,
                                  extra_body={"structured_outputs": {"regex": "[^\\s\\S]"}})
    assert caught.value.status_code == 400 and caught.value.body["param"] == "structured_outputs"
    assert caught.value.body["message"].startswith("structured_output (regex") and "no output can match" in \
        caught.value.body["message"]  # about the request as a whole: no prompt[0] before it
    looping = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    with pytest.raises(Exception) as caught:  # compiles, and cannot go on past its first token
        client.chat.completions.create(model=MODEL, messages=asked, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "loop", "schema": looping}})
    assert caught.value.status_code == 400 and caught.value.body["param"] == "response_format.json_schema.schema"
    assert "its matcher fails after its first token" in caught.value.body["message"]
    letter = smollm2_tokenizer.convert_tokens_to_ids("a")
    with pytest.raises(Exception) as caught:  # the request's own ids leave nothing the first step allows
        client.completions.create(model=MODEL, prompt="Year:", max_tokens=5, extra_body={
            "structured_outputs": {"regex": "[0-9]+"}, "allowed_token_ids": [letter]})
    assert caught.value.status_code == 400 and caught.value.body["param"] == "allowed_token_ids"
    assert caught.value.body["message"].startswith(f"allowed_token_ids ([{letter}]) hold no token the structured")
    many = client.completions.create(model=MODEL, prompt="Pick one:", max_tokens=10, temperature=0,
                                     extra_body={"structured_outputs": {"choice": [f"n{i}" for i in range(2500)]}})
    assert many.choices[0].text in {f"n{i}" for i in range(2500)} and many.choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(client, server, hf):
    """What lm-evaluation-harness's local-completions sends to score a continuation (echo, logprobs 1,
    max_tokens 1) and how it reads the answer: the continuation's summed log-probability and whether
    each of its tokens was the most likely."""
    import torch

    text = PROMPT + " Paris"
    ids = hf.tok(text)["input_ids"]
    context = len(hf.tok(PROMPT)["input_ids"])
    with torch.no_grad():
        table = torch.log_softmax(hf.model(torch.tensor([ids])).logits[0].float(), dim=-1)
    asked = dict(model=MODEL, prompt=text, max_tokens=1, temperature=0, logprobs=1, echo=True)
    choice = client.completions.create(**asked).choices[0]
    lp = choice.logprobs
    assert choice.text == text + hf.greedy(ids, 1)
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for j in range(1, len(ids)):
        assert lp.token_logprobs[j] == pytest.approx(float(table[j - 1, ids[j]]), abs=2e-3)
        assert choice.text[lp.text_offset[j]:].startswith(lp.tokens[j])
    continuation = lp.token_logprobs[context:-1]
    assert sum(continuation) == pytest.approx(float(sum(table[j - 1, ids[j]] for j in range(context, len(ids)))),
                                              abs=5e-3)
    greedy = all(value == max(top.values()) for value, top in zip(continuation, lp.top_logprobs[context:-1]))
    assert greedy == all(int(table[j - 1].argmax()) == ids[j] for j in range(context, len(ids)))
    streamed = list(client.completions.create(**asked, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    assert streamed[0].choices[0].text.startswith(text)  # the prompt comes with the first chunk
    assert [v for c in streamed if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs] == \
        lp.token_logprobs
    by_ids = client.completions.create(**{**asked, "prompt": ids, "logprobs": None}).choices[0]
    assert by_ids.text == choice.text and by_ids.logprobs is None  # token ids echo as their decoding
    # max_tokens 0 (what older harnesses send): the prompt alone, scored, nothing generated
    generated = _metric(server, "corelaunch_generated_tokens_total")
    only = client.completions.create(**{**asked, "max_tokens": 0})
    assert _metric(server, "corelaunch_generated_tokens_total") == generated  # the dropped token uncounted
    assert only.choices[0].text == text and only.choices[0].finish_reason == "length"
    assert only.choices[0].logprobs.token_logprobs == lp.token_logprobs[:-1]
    assert only.usage.completion_tokens == 0 and only.usage.prompt_tokens == len(ids)
    lengths, stops = ('corelaunch_requests_total{finish_reason="%s",status="200"}' % r for r in ("length", "stop"))
    ahead = _metric(server, lengths, missing=0)
    streamed = list(client.completions.create(**{**asked, "max_tokens": 0}, stream=True,
                                              stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text
    assert streamed[-1].usage.completion_tokens == 0
    # a stream is counted once its body is sent, after the client has read [DONE]: a scrape at once
    # could miss it, and the count below would then take its "length" for the next request's
    deadline = time.monotonic() + 10
    while _metric(server, lengths, missing=0) < ahead + 1:
        assert time.monotonic() < deadline, "the streamed request never counted"
        time.sleep(0.05)
    # the dropped token was EOS (forced): the client and the metrics both say "length"
    before = _metric(server, lengths, missing=0), _metric(server, stops, missing=0)
    eos = client.completions.create(**{**asked, "max_tokens": 0, "logit_bias": {str(hf.config.eos_token_id): 100}})
    assert eos.choices[0].finish_reason == "length"
    assert (_metric(server, lengths, missing=0), _metric(server, stops, missing=0)) == (before[0] + 1, before[1])
    with pytest.raises(Exception) as caught:  # a prompt that fills the context: max_tokens 0 says why it counts
        client.completions.create(**{**asked, "max_tokens": 0, "prompt": [504] * 4096})
    assert caught.value.status_code == 400 and "max_tokens 0 still needs one position" in str(caught.value)


def _metric(server, name: str, missing: float | None = None) -> float:
    """missing: the value of a series not (yet) in /metrics (a labelled counter's pair outside
    metrics.OUTCOMES appears at its first count); None: a missing series fails the test."""
    import requests

    for line in requests.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    if missing is not None:
        return missing
    raise AssertionError(f"{name} not in /metrics")


def _metric_sum(server, name: str) -> float:
    """The sum of a metric's samples over every label set (every replica's)."""
    import requests

    lines = requests.get(f"{server.url}/metrics", timeout=10).text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name + "{") or line.startswith(name + " "))


def _metric_by_replica(server, name: str) -> dict[str, float]:
    """A metric's value for each replica label it has a series for."""
    import re

    import requests

    text = requests.get(f"{server.url}/metrics", timeout=10).text
    found = re.findall(rf'^{name}{{[^}}]*replica="([^"]+)"[^}}]*}} (\S+)$', text, flags=re.M)
    return {replica: float(value) for replica, value in found}


def _holds_streams(server, streams: int, per_replica_running: int) -> bool:
    """True when the replicas together hold `streams` requests, and every replica holding any runs
    exactly min(what it holds, per_replica_running) of them and queues the rest."""
    running = _metric_by_replica(server, "corelaunch_requests_running")
    waiting = _metric_by_replica(server, "corelaunch_requests_waiting")
    held = {r: running.get(r, 0) + waiting.get(r, 0) for r in set(running) | set(waiting)}
    return (sum(held.values()) == streams
            and all(running.get(r, 0) == min(n, per_replica_running) for r, n in held.items()))


def _replicas_in(server, name: str) -> set[str]:
    import re

    import requests

    text = requests.get(f"{server.url}/metrics", timeout=10).text
    return set(re.findall(rf'^{name}{{[^}}]*replica="([^"]+)"', text, flags=re.M))


def _wait_idle(server, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while _metric(server, "corelaunch_requests_running") or _metric(server, "corelaunch_requests_waiting"):
        assert time.monotonic() < deadline, "requests still running or waiting after the clients finished"
        time.sleep(0.5)


@pytest.mark.slow
def test_full_queue_answers_503_with_retry_after(client, server):
    import openai

    # 16 streams that cannot end meanwhile: 4 running, 12 queued (--max-num-seqs 4 --max-queued-requests 12)
    streams = [client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2000, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True}) for _ in range(16)]
    try:
        deadline = time.monotonic() + 60
        while (_metric(server, "corelaunch_requests_running"), _metric(server, "corelaunch_requests_waiting")) != (4, 12):
            assert time.monotonic() < deadline, "the 16 streams never filled the rows and the queue"
            time.sleep(0.2)
        for stream in (False, True):
            with pytest.raises(openai.APIStatusError) as refused:
                client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, stream=stream)
            error = refused.value
            assert error.status_code == 503 and error.body.get("code") == "queue_full", (stream, error.body)
            retry = int(error.response.headers["retry-after"])  # the pace of the module's earlier requests
            assert 1 <= retry <= 60
            assert error.body["message"] == ("the server is at capacity: all 4 sequence slots are busy and its queue "
                                             f"of 12 is full; retry after {retry} s"), error.body
        # room for two of three choices: the third refused, the two admitted are cancelled, and the
        # prompt is not counted (it was, once the first choice was admitted)
        for stream in streams[-2:]:
            stream.close()
        while _metric(server, "corelaunch_requests_waiting") != 10:
            assert time.monotonic() < deadline + 60, "two closed streams never left the queue"
            time.sleep(0.2)
        prompts_before = _metric(server, "corelaunch_prompt_tokens_total")
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=3)
        assert refused.value.status_code == 503 and refused.value.body.get("code") == "queue_full"
        # the pool counts the two admitted choices until their group answers the cancel, which a
        # loaded machine can take longer than any fixed wait for; a choice never cancelled keeps 12
        deadline = time.monotonic() + 30
        while (waiting := _metric(server, "corelaunch_requests_waiting")) != 10:
            assert time.monotonic() < deadline, f"the refused request's admitted choices stay queued: {waiting}"
            time.sleep(0.2)
        assert _metric(server, "corelaunch_prompt_tokens_total") == prompts_before
    finally:
        for stream in streams:
            stream.close()  # each client goes away: its request is cancelled
    _wait_idle(server)


@pytest.mark.slow
def test_client_that_disconnects_frees_its_slot(client, server):
    import requests

    prompt_tokens, aborts = "corelaunch_prompt_tokens_total", 'corelaunch_requests_total{finish_reason="abort",status="499"}'
    generated = "corelaunch_generated_tokens_total"
    aborts_before, generated_before = _metric(server, aborts, missing=0.0), _metric(server, generated)
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2000, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    next(chunks)
    stream.close()  # the client goes away mid-generation
    _wait_idle(server)  # the engine dropped the request rather than generating 2000 tokens
    deadline = time.monotonic() + 30
    while _metric(server, aborts) != aborts_before + 1:  # an abort, not a request that ran to its end
        assert time.monotonic() < deadline, "the streamed request's abort was never counted"
        time.sleep(0.2)
    assert _metric(server, generated) - generated_before < 1000
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason == "length"

    # A client that leaves a request it did not stream: an abort, and its prompt's tokens counted
    # (they were counted only for requests that finished)
    before = _metric(server, prompt_tokens), _metric(server, aborts)
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(f"{server.url}/v1/completions", timeout=(10, 1.0),
                      headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": MODEL, "prompt": [28] * 5, "max_tokens": 2000, "ignore_eos": True})
    _wait_idle(server)
    deadline = time.monotonic() + 30
    while _metric(server, aborts) != before[1] + 1:  # counted once the replica saw the disconnect
        assert time.monotonic() < deadline, "the abort was never counted"
        time.sleep(0.2)
    assert _metric(server, prompt_tokens) == before[0] + 5


@pytest.mark.slow
def test_a_second_chat_turn_reuses_the_first_turns_cache_row(client, server, hf):
    """Prefix caching over HTTP: the second turn's prompt starts with the first's prompt and answer,
    which the first turn's cache row still holds; usage counts them as cached and the server's
    counter adds them, and the second turn's greedy text is transformers' for its whole prompt."""
    first_ids = hf.tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    before = _metric(server, "corelaunch_prefix_cache_hit_tokens_total", missing=0)
    first = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    second_messages = CHAT + [{"role": "assistant", "content": first.choices[0].message.content},
                              {"role": "user", "content": "And of Italy?"}]
    second_ids = hf.tok.apply_chat_template(second_messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
    second = client.chat.completions.create(model=MODEL, messages=second_messages, max_tokens=12, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert len(first_ids) <= cached < len(second_ids), (len(first_ids), cached, len(second_ids))
    assert second.usage.prompt_tokens == len(second_ids)
    assert second.choices[0].message.content == hf.greedy(list(second_ids), 12)
    assert _metric(server, "corelaunch_prefix_cache_hit_tokens_total") - before == (
        first.usage.prompt_tokens_details.cached_tokens + cached)


@pytest.mark.slow
def test_a_repeated_prompt_is_cached_only_under_the_cache_salt_it_came_with(client):
    """vLLM's cache_salt over HTTP: the same prompt again reports its cached tokens under the salt
    it was first sent with and none under another; an empty salt is a 400 naming the field."""
    import uuid

    import openai

    salt = uuid.uuid4().hex  # a salt (and a prompt) no earlier test of the module's server sent
    prompt = f"{salt}: the quick brown fox jumps over the lazy dog, and the dog sleeps on."

    def cached(salt: str) -> int:
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                        extra_body={"cache_salt": salt})
        return got.usage.prompt_tokens_details.cached_tokens

    assert cached(salt) == 0
    assert cached(salt) > 16  # all but the prompt's last token
    assert cached(salt + "-other") == 0
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, extra_body={"cache_salt": ""})
    assert refused.value.body["param"] == "cache_salt" and "non-empty string" in refused.value.body["message"]


@pytest.mark.slow
def test_concurrent_greedy_requests_equal_each_run_alone(client, server):
    prompts = ["The capital of France is", "Once upon a time, in a small village,", "2 + 2 =",
               "The largest planet in the solar system is"]
    alone = {p: client.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0).choices[0].text
             for p in prompts}
    results, lock = [], threading.Lock()
    rng = random.Random(0)
    delays = [rng.uniform(0, 1.5) for _ in range(16)]

    def request(i: int):
        time.sleep(delays[i])  # arrivals spread out: requests join a batch that is already running
        prompt = prompts[i % len(prompts)]
        text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0).choices[0].text
        with lock:
            results.append((prompt, text))

    threads = [threading.Thread(target=request, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert len(results) == 16
    for prompt, text in results:
        assert text == alone[prompt], (prompt, text, alone[prompt])


@pytest.mark.slow
def test_direct_ingress_is_the_replicas_own_server(server):
    owner = _listener(server.url)
    assert owner is not None and "ServeRepli" in owner.name(), (server.url, owner)
    # Serve's "Application ... is ready at <its idle proxy>" is left out (a user took it for the
    # server's address); its other lines are not (with the proxy on --port it is kept: below)
    log = server.log.read_text()
    assert "Started Serve" in log and " is ready at " not in log and f"at {server.url}/v1" in log, log[-3000:]
    import requests
    from importlib.metadata import version

    answer = requests.get(f"{server.url}/version", timeout=30)  # no key, as /health
    assert answer.status_code == 200 and answer.json() == {"version": version("corelaunch")}


def _read_to_the_end(client, got: dict, started: threading.Event) -> None:
    """One greedy stream of 40 tokens read to its end into `got` (tokens and finish, or the error);
    `started` is set at its third chunk (or when it ends sooner)."""
    try:
        stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks, finish, usage = 0, None, None
        for chunk in stream:
            usage = chunk.usage or usage
            if chunk.choices:
                chunks += 1
                finish = chunk.choices[0].finish_reason or finish
                if chunks == 3:
                    started.set()
        got.update(tokens=usage.completion_tokens if usage else None, finish=finish)
    except Exception as err:  # noqa: BLE001 - the outcome the test reports
        got.update(error=f"{type(err).__name__}: {err}")
    finally:
        started.set()


@pytest.mark.slow
def test_proxy_ingress_serves_the_same_stream_and_a_stop_lets_its_streams_finish(tmp_path, hf):
    """--ingress proxy (what several replicas use), with two replicas: Serve's proxy on --port streams
    the same greedy text as transformers, the replicas' own servers are not what answers, a kept
    response is found by either replica (one store deployment they share), and
    /metrics shows both replicas' series, whichever replica answers it.
    Then SIGTERM (or Ctrl-C) with a stream in flight: serve.shutdown() alone stopped the proxy at
    once, cutting every stream (a connection error 0.2-1.4 s after the signal, with a replica
    traceback per stream on stderr), where the README promised Serve's graceful wait. The
    application is now deleted first, its replicas finishing their requests while the proxy still
    runs. (One server for both: each start of one costs tens of seconds of the suite.)"""
    import openai

    import requests

    expected = hf.greedy(hf.tok(PROMPT)["input_ids"], 8)
    got: dict = {}
    started = threading.Event()
    with running_server(tmp_path / "serve.log", "--ingress", "proxy", "--max-num-seqs", "1", "--replicas", "2",
                        "--responses-store", "4") as running:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", timeout=300, max_retries=0)
        stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected
        # the replicas share one store: whichever replica Serve's router picks finds the kept turn
        first = client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=2, temperature=0)
        for _ in range(6):
            assert client.responses.retrieve(first.id).id == first.id
            # raises (400 previous_response_not_found) where this replica cannot find the turn
            client.responses.create(model=MODEL, input="Go on.", previous_response_id=first.id, max_output_tokens=2,
                                    temperature=0, store=False)
        owner = _listener(running.url)
        owner_name = owner.name() if owner is not None else "nothing"
        # No queue limit (the default): 20 streams, more than 5 x --max-num-seqs + 8 (Serve's cap on
        # a replica before), all reach the engines, and /health and /metrics still answer at once.
        opened, release = [], threading.Event()

        def hold():
            held = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=400, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
            opened.append(held)
            release.wait(120)
            held.close()

        holders = [threading.Thread(target=hold, daemon=True) for _ in range(20)]
        for holder in holders:
            holder.start()
        try:
            deadline = time.monotonic() + 60
            while len(opened) < 20:
                assert time.monotonic() < deadline, f"{len(opened)} of 20 streams reached the engine"
                time.sleep(0.2)
            assert requests.get(f"{running.url}/health", timeout=10).status_code == 200
            assert requests.get(f"{running.url}/metrics", timeout=10).status_code == 200
            # Which replica takes each stream is Serve's router's choice (it once sent all 20 to one
            # replica), so the check is per replica: each runs at most --max-num-seqs 1 stream and
            # queues the rest, and together they hold all 20.
            deadline = time.monotonic() + 30  # another replica's gauges are up to 2 s old
            while not _holds_streams(running, 20, per_replica_running=1):
                assert time.monotonic() < deadline, requests.get(f"{running.url}/metrics", timeout=10).text
                time.sleep(0.5)
            # whichever replica answers, both replicas' series are there: four scrapes in a row (a
            # replica whose pushes a loaded machine delays past 6 s drops out for a moment; the bug,
            # each scrape showing its own replica's alone, never gives four)
            deadline, in_a_row, seen = time.monotonic() + 30, 0, set()
            while in_a_row < 4:
                seen = _replicas_in(running, "corelaunch_requests_running")
                in_a_row = in_a_row + 1 if len(seen) == 2 else 0
                assert time.monotonic() < deadline, f"not 4 scrapes in a row with both replicas' series: {seen}"
                if not in_a_row:
                    time.sleep(0.5)
        finally:
            release.set()
            for holder in holders:
                holder.join(30)
        deadline = time.monotonic() + 60
        while _metric_sum(running, "corelaunch_requests_running") + _metric_sum(running, "corelaunch_requests_waiting"):
            assert time.monotonic() < deadline, "the closed streams were never dropped"
            time.sleep(0.5)
        reader = threading.Thread(target=_read_to_the_end, args=(client, got, started), daemon=True)
        reader.start()
        assert started.wait(300), "the stream never began"
    # running_server sent SIGTERM to the command (alone) and saw it exit 0
    assert "Proxy" in owner_name, owner_name
    reader.join(60)
    assert "error" not in got, got
    assert got == {"tokens": 40, "finish": "length"}, got  # every token, then the end of the stream
    log = (tmp_path / "serve.log").read_text()
    # and no "(raylet) Task ServeController.graceful_shutdown failed", which serve.shutdown() printed at every stop
    assert "Traceback" not in log and "graceful_shutdown" not in log, log[-3000:]
    assert f"is ready at {running.url}/" in log  # the proxy is on --port: Serve's line says so rightly


@pytest.mark.slow
def test_a_port_taken_while_the_server_starts_is_named(tmp_path):
    """--port was free at the check before Ray started; another process (a second server started at
    the same time) bound it before this server's replica could: the command exited 1 after ~20 s
    with Serve's "Failed to update the deployments", naming no port (the bind error was only in a
    replica's log under /tmp/ray)."""
    import socket

    from workers.net import free_port_for_a_late_bind

    port = free_port_for_a_late_bind()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "launcher", "serve", "--tp", "1", "--port", str(port),
                                 "--no-compile", "--seq-len", "64"], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "CORELAUNCH_API_KEY": ""}, start_new_session=True)
    other = socket.socket()
    try:
        deadline = time.monotonic() + 120
        while "Started Serve" not in log.read_text():  # past the check; the replica binds much later
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", port))
        other.listen()
        proc.wait(timeout=180)
    finally:
        other.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    text = log.read_text()
    assert proc.returncode == 2, text[-3000:]
    assert (f"corelaunch serve: cannot listen on 127.0.0.1:{port} (Address already in use); pass a free --port, or "
            f"stop what holds it (it was free when this server started") in text, text[-3000:]


@pytest.mark.slow
def test_a_replica_whose_group_failed_is_replaced_on_the_same_port(client, server, hf):
    """The module's last use of its server: with --max-restarts 0 a SIGKILLed rank fails the TP
    group for good, /health answers 503 and so does a completion (OpenAI's error object, not a
    plain-text 500), Serve's health check replaces the replica, and the new replica's own server
    (direct ingress) answers on the same --port."""
    import psutil
    import requests

    before = _listener(server.url)

    def named_rank(process) -> bool:  # Ray starts and ends idle workers: one may be gone by now
        try:
            return "RayRankWor" in process.name()
        except psutil.NoSuchProcess:
            return False

    [rank] = [p for p in psutil.Process(server.pid).children(recursive=True) if named_rank(p)]
    rank.kill()
    statuses, refused = [], None
    deadline = time.monotonic() + 300
    while not (503 in statuses and statuses[-1] == 200):
        assert time.monotonic() < deadline, f"health answers {statuses[-5:]}:\n{server.log.read_text()[-3000:]}"
        try:
            statuses.append(requests.get(f"{server.url}/health", timeout=10).status_code)
            if statuses[-1] == 503 and refused is None:  # the failed replica, before Serve replaces it
                refused = requests.post(f"{server.url}/v1/completions", timeout=30,
                                        headers={"Authorization": f"Bearer {API_KEY}"},
                                        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
        except requests.RequestException:  # between the old replica's end and the new one's server
            statuses.append(None)
        time.sleep(1)
    assert refused is not None and refused.status_code == 503, (refused, refused and refused.text)
    error = refused.json()["error"]
    assert error["code"] == "model_unavailable" and "cannot take requests now" in error["message"], error
    assert "pid" not in error["message"] and "max_restarts" not in error["message"], error  # the log's, not a client's
    assert refused.headers["Retry-After"] == "10", refused.headers
    after = _listener(server.url)
    assert after is not None and "ServeRepli" in after.name() and after.pid != before.pid, (before, after)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert out.choices[0].text == hf.greedy(hf.tok(PROMPT)["input_ids"], 8)


def _listener(url: str):
    """The process listening on the URL's port (psutil), or None."""
    import psutil

    port = int(url.rsplit(":", 1)[1])
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            try:
                process = psutil.Process(conn.pid)
                process.name()  # read now: a process gone since the scan is skipped
                return process
            except psutil.NoSuchProcess:
                continue
    return None


def test_metrics_of_every_replica_merge_into_one_exposition_labelled_by_replica():
    """With several Serve replicas each scrape showed one replica's counters, the next another's:
    Prometheus read every switch as a counter reset."""
    from prometheus_client.parser import text_string_to_metric_families

    from launcher.serving.metrics import ServerMetrics
    from launcher.serving.metrics_board import STALE_AFTER_S, MetricsBoard, merged_exposition

    replicas = {"a1": ServerMetrics(lambda: {"running": 1, "waiting": 0}),
                "b2": ServerMetrics(lambda: {"running": 3, "waiting": 2})}
    replicas["a1"].finished("length")
    replicas["b2"].finished("stop")
    replicas["b2"].finished("stop")
    board = MetricsBoard()
    board.put("a1", replicas["a1"].render(), 0)
    texts = board.gather("b2", replicas["b2"].render(), 0)
    assert sorted(texts) == ["a1", "b2"]
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(merged_exposition(texts).decode())
               for s in family.samples}
    assert samples[("corelaunch_requests_running", (("replica", "a1"),))] == 1
    assert samples[("corelaunch_requests_waiting", (("replica", "b2"),))] == 2
    assert samples[("corelaunch_requests_total", (("finish_reason", "stop"), ("replica", "b2"), ("status", "200")))] == 2
    assert samples[("corelaunch_requests_total", (("finish_reason", "length"), ("replica", "a1"), ("status", "200")))] == 1
    assert ("corelaunch_time_to_first_token_seconds_count", (("replica", "a1"),)) in samples  # histograms too
    # a replica that stopped posting drops out
    board._texts["a1"] = (board._texts["a1"][0] - STALE_AFTER_S - 1, *board._texts["a1"][1:])
    assert sorted(board.gather("b2", replicas["b2"].render(), 1)) == ["b2"]


def test_a_render_arriving_after_a_later_one_leaves_the_later_on_the_board():
    """A replica's periodic post, rendered before a scrape's render but reaching the board after
    it, replaced the newer text: the next scrape showed the replica's counter lower than the one
    before, a counter reset to Prometheus."""
    from launcher.serving.metrics import ServerMetrics
    from launcher.serving.metrics_board import BoardPoster, MetricsBoard

    metrics = ServerMetrics(lambda: {"running": 0, "waiting": 0})
    poster = BoardPoster(None, "a1", metrics.render)  # no board to post to: its renders alone
    try:
        periodic, periodic_number = poster.render()
        metrics.finished("stop")
        scraped, scraped_number = poster.render()
    finally:
        poster.close()
    assert periodic_number < scraped_number and periodic != scraped
    board = MetricsBoard()
    assert board.gather("a1", scraped, scraped_number) == {"a1": scraped}
    board.put("a1", periodic, periodic_number)  # the periodic post arrives last
    assert board.gather("b2", b"", 0)["a1"] == scraped
    board.put("a1", scraped + b"# later\n", scraped_number + 1)
    assert board.gather("b2", b"", 1)["a1"] == scraped + b"# later\n"
    # a1 stops: a periodic post it rendered before its drop, arriving after, does not bring it back
    board.drop("a1")
    board.put("a1", scraped, scraped_number + 2)
    assert sorted(board.gather("b2", b"", 2)) == ["b2"]



def test_a_value_nested_just_under_the_parsers_depth_limit_is_a_400():
    """A body the JSON parser just took (nested a frame short of its limit) failed a field's check,
    and quoting the value in the message encoded it again, one frame deeper: RecursionError, a
    plain-text 500, where one level more or less got the 400."""
    import sys

    from launcher.serving.openai_app import parse_json_body
    from launcher.serving.openai_protocol import CompletionRequest, ProtocolError, parse_request

    limit = sys.getrecursionlimit()
    statuses = set()
    for depth in range(limit - 200, limit + 20):
        raw = ('{"model": "m", "prompt": "hi", "user": ' + "[" * depth + "]" * depth + "}").encode()
        with pytest.raises(ProtocolError) as refused:
            parse_request(CompletionRequest, parse_json_body(raw))
        statuses.add(refused.value.status)
    assert statuses == {400}


def test_serve_quiet_still_says_the_model_has_no_chat_template(tmp_path, smollm2_tokenizer, monkeypatch, capsys):
    """The replica says so at start, in its output, which --quiet hides: a server refusing every
    chat request started without a word. The driver's look at the files agrees with the tokenizer."""
    import json
    import shutil
    import socket

    from launcher.cli.serve_command import has_chat_template
    from shardlib.demo_model import ensure_demo_model
    from transformers import AutoTokenizer

    demo = Path(ensure_demo_model())
    assert has_chat_template(demo) and smollm2_tokenizer.chat_template is not None
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (demo / name).exists():
            shutil.copy(demo / name, bare / name)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in ("chat_template.jinja", "chat_template.json"):
        (bare / extra).unlink(missing_ok=True)
    assert not has_chat_template(bare) and AutoTokenizer.from_pretrained(bare).chat_template is None
    # `serve --quiet` of such a model (planned, then stopped before Ray) says so on its own stderr
    from launcher.cli import main, serve_command
    from tests.model_factory import build_random_model, save_model

    model_dir = save_model(build_random_model("llama"), tmp_path / "m")
    for name in bare.iterdir():
        shutil.copy(name, model_dir / name.name)
    monkeypatch.setattr(serve_command, "_serve", lambda *args: 0)
    for quiet, said in ((["--quiet"], True), ([], False)):  # without --quiet the replica's own line shows
        capsys.readouterr()
        with socket.socket() as probe:  # a free port: the command checks it before planning
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        assert main(["serve", "--model", str(model_dir), "--port", str(port), *quiet]) == 0
        err = capsys.readouterr().err
        assert ("has no chat template: /v1/chat/completions refuses every request" in err) == said, err
    # a legacy chat_template.json (the tokenizer does not read it), and templates only named ones
    # (a dict with no default: apply_chat_template refuses every conversation) are none either
    (bare / "chat_template.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    assert not has_chat_template(bare)
    (bare / "additional_chat_templates").mkdir()
    (bare / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages[0]['content'] }}")
    assert not has_chat_template(bare)
    (bare / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert has_chat_template(bare) and AutoTokenizer.from_pretrained(bare).chat_template is not None


def test_a_serve_replica_refuses_a_model_without_a_tokenizer_before_its_ranks_start(tmp_path, monkeypatch):
    """`serve run launcher.serving.openai_app:build_app model=DIR` plans nothing in the driver: the
    replica itself refuses, after planning and before Ray or any rank starts."""
    from launcher.serving import openai_app
    from launcher.serving.openai_app import OpenAIServer, builder_settings
    from tests.model_factory import save_random_model

    from launcher.api import Launcher

    monkeypatch.setattr(openai_app, "_key_check", openai_app._key_check)  # the constructor installs its own
    monkeypatch.setattr(Launcher, "start", lambda self: pytest.fail("the replica started its Launcher"))
    bare = save_random_model(tmp_path / "bare", "llama", num_heads=4, num_kv_heads=2)
    wrapper = OpenAIServer.func_or_class
    ours = next(c for c in wrapper.__mro__[1:] if c.__module__ == "launcher.serving.openai_app")
    server = object.__new__(ours)
    with pytest.raises(ValueError, match=r"has no tokenizer files .* the server reads prompts and chat messages"):
        ours.__init__(server, builder_settings({"model": str(bare), "tp": 1, "backend": "cpu", "compile": False,
                                                       "cpus_per_rank": 1}))
    assert server.launcher._pool is None and server.launcher.plan is not None  # planned, then refused


def test_a_queue_full_answer_speaks_to_the_client_not_the_operator():
    """It quoted the engine's message: the operator's flags to raise, "retry later" before "retry after
    1 s", and "0 requests already wait" for a server that queues none."""
    from launcher.errors import QueueFull
    from launcher.serving.openai_app import _at_capacity

    assert _at_capacity(QueueFull("x", slots=4, queue_limit=12), 1) == (
        "the server is at capacity: all 4 sequence slots are busy and its queue of 12 is full; retry after 1 s")
    assert _at_capacity(QueueFull("x", slots=2, queue_limit=0), 3) == (
        "the server is at capacity: all 2 sequence slots are busy and it queues no requests; retry after 3 s")
    assert _at_capacity(QueueFull("--max-num-seqs"), 1) == "the server is at capacity; retry after 1 s"
    # several Serve replicas: the counts were one replica's, read as the whole server's
    assert _at_capacity(QueueFull("x", slots=4, queue_limit=12), 1, one_of_several=True) == (
        "the server is at capacity: all 4 sequence slots of the replica that took this request are busy and "
        "its queue of 12 is full; retry after 1 s")


def test_builder_refusals_say_where_a_serve_option_goes_and_what_a_misspelling_meant(tmp_path):
    """A review by hand: `port` (a `corelaunch serve` flag) was answered with forty field names and
    no word of Serve's http_options; `max_num_seq` got the same list; and a model folder without a
    config.json passed the builder and failed in every replica Serve placed, 13 s later."""
    from launcher.serving.server_settings import settings_from_args

    with pytest.raises(ValueError, match=r"unknown argument\(s\) port \(port: Serve's HTTP proxy listens where "
                                         r"the Serve config's http_options say \(host, port\)\); the server takes"):
        settings_from_args({"port": "8001"})
    with pytest.raises(ValueError, match=r"unknown argument\(s\) max_num_seq \(max_num_seq: did you mean "
                                         r"max_num_seqs\?\); the server takes"):
        settings_from_args({"max_num_seq": "8"})
    with pytest.raises(ValueError, match=r"unknown argument\(s\) zzz; the server takes"):  # no hint to give
        settings_from_args({"zzz": "1"})
    empty = tmp_path / "nomodel"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=f"no Hugging Face config at {empty}/config.json"):
        settings_from_args({"model": str(empty)})


@pytest.mark.slow
def test_tool_calls_through_the_official_client(client):
    """The openai client's tools and tool_choice against the real server: a named call's arguments
    are JSON text matching the function's schema (whole, and reassembled from the stream's pieces),
    "required" answers with calls of the tools and finish_reason "tool_calls" (streamed, its arguments
    as they are written), a conversation
    carrying the call and its result goes on in text with tool_choice "none", and "auto" (the default
    with tools, taken by this server's --tool-call-parser hermes) gives SmolLM2's text as content, the
    model writing no <tool_call> block; a hermes block the output is forced to write comes back as
    a call, streamed with its arguments piece by piece."""
    import json

    weather = {"type": "function", "function": {"name": "weather", "description": "Today's weather in a city",
                                                "parameters": {"type": "object", "properties": {
                                                    "city": {"type": "string", "enum": ["Paris", "Rome"]}},
                                                    "required": ["city"], "additionalProperties": False}}}
    asked = dict(model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                 tools=[weather], max_tokens=40, temperature=0)
    named = client.chat.completions.create(**asked, tool_choice={"type": "function", "function": {"name": "weather"}})
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "weather" and call.id.startswith("chatcmpl-tool-")
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    assert named.choices[0].finish_reason == "stop" and named.choices[0].message.content is None  # only calls
    pieces, names = [], set()
    for chunk in client.chat.completions.create(**asked, tool_choice={"type": "function", "function": {"name": "weather"}},
                                                stream=True):
        for delta_call in chunk.choices[0].delta.tool_calls or ():
            names.add(delta_call.function.name)
            pieces.append(delta_call.function.arguments or "")
    assert "".join(pieces) == call.function.arguments and names - {None} == {"weather"}
    required = client.chat.completions.create(**asked, tool_choice="required", parallel_tool_calls=False)
    assert required.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in required.choices[0].message.tool_calls] == ["weather"]
    pieces = [delta_call for chunk in client.chat.completions.create(**asked, tool_choice="required",
                                                                     parallel_tool_calls=False, stream=True)
              for delta_call in chunk.choices[0].delta.tool_calls or ()]
    assert [p.function.name for p in pieces if p.function.name] == ["weather"] and len(pieces) > 1  # as written
    assert json.loads("".join(p.function.arguments or "" for p in pieces)) == json.loads(
        required.choices[0].message.tool_calls[0].function.arguments)
    answered = client.chat.completions.create(
        model=MODEL, tools=[weather], tool_choice="none", max_tokens=8, temperature=0,
        messages=[*asked["messages"],
                  {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
                  {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}])
    assert answered.choices[0].message.content and not answered.choices[0].message.tool_calls
    auto = client.chat.completions.create(**asked)  # "auto", the default with tools
    assert auto.choices[0].message.content and not auto.choices[0].message.tool_calls
    assert auto.choices[0].finish_reason in ("stop", "length")
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(**asked, stream=True)
                       if chunk.choices)
    assert streamed == auto.choices[0].message.content
    import re

    block = 'Sure.<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "note": "a long one"}}\n</tool_call>'
    forced = dict(asked, max_tokens=60, extra_body={"structured_outputs": {"regex": re.escape(block)}})
    whole = client.chat.completions.create(**forced).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Sure."
    [whole_call] = whole.message.tool_calls
    pieces, content = [], ""
    for chunk in client.chat.completions.create(**forced, stream=True):
        [choice] = chunk.choices
        content += choice.delta.content or ""
        pieces += choice.delta.tool_calls or []
    assert content == "Sure." and len(pieces) > 3  # the arguments as the model writes them, token by token
    assert [p.function.name for p in pieces if p.function.name] == ["weather"] and pieces[0].id
    assert json.loads("".join(p.function.arguments or "" for p in pieces)) == json.loads(
        whole_call.function.arguments) == {"city": "Paris", "note": "a long one"}


@pytest.mark.slow
def test_responses_through_the_official_client(client):
    """The openai client's Responses API (POST /v1/responses) against the real server: the greedy
    answer is the chat route's for the same messages (text, finish and token counts), whole and as
    the stream's deltas; instructions are a system message; a forced function call is a
    function_call item; a kept response is continued by previous_response_id as the same
    conversation sent whole, read back, its input items listed, and deleted."""
    import json

    import openai

    question = "What is the capital of France?"
    asked = dict(model=MODEL, input=question, max_output_tokens=12, temperature=0)
    whole = client.responses.create(**asked)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                          max_tokens=12, temperature=0)
    assert whole.output_text == chat.choices[0].message.content and whole.output_text
    assert (whole.status == "incomplete") == (chat.choices[0].finish_reason == "length")
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                     chat.usage.completion_tokens)
    events = list(client.responses.create(**asked, stream=True))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    brief = client.responses.create(**asked, instructions="Answer in one word.")
    chat = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Answer in one word."}, {"role": "user", "content": question}])
    assert brief.output_text == chat.choices[0].message.content
    weather = {"type": "function", "name": "weather", "description": "Today's weather in a city",
               "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                              "required": ["city"], "additionalProperties": False}}
    forced = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[weather],
                                     tool_choice={"type": "function", "name": "weather"}, max_output_tokens=40,
                                     temperature=0)
    [call] = forced.output
    assert call.type == "function_call" and call.name == "weather"
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    # the server keeps responses (--responses-store 8): a follow-up by previous_response_id is the same
    # as the conversation sent whole
    follow = dict(model=MODEL, max_output_tokens=12, temperature=0)
    continued = client.responses.create(**follow, input="And of Italy?", previous_response_id=whole.id)
    sent_whole = client.responses.create(**follow, store=False, input=[
        {"role": "user", "content": question}, {"role": "assistant", "content": whole.output_text},
        {"role": "user", "content": "And of Italy?"}])
    assert continued.output_text == sent_whole.output_text and continued.previous_response_id == whole.id
    assert continued.usage.input_tokens == sent_whole.usage.input_tokens
    assert client.responses.retrieve(whole.id).output_text == whole.output_text
    scored = client.responses.create(**asked, include=["message.output_text.logprobs"], top_logprobs=2)
    logprobs = scored.output[0].content[0].logprobs
    assert scored.output_text == whole.output_text and scored.output[0].status == "completed"
    # the text's tokens: the end token that finished it is counted, and left out as its text is
    assert "".join(entry.token for entry in logprobs) == whole.output_text
    assert len(logprobs) == scored.usage.output_tokens - 1
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in logprobs)
    [sent] = client.responses.input_items.list(whole.id).data
    assert sent.type == "message" and sent.role == "user" and sent.content[0].text == question
    client.responses.delete(whole.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(whole.id)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**asked, previous_response_id=whole.id)
    assert refused.value.body["param"] == "previous_response_id"
    assert refused.value.body["code"] == "previous_response_not_found"
