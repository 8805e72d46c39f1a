"""vLLM's --stream-interval on the OpenAI server: the server's setting (builder argument
stream_interval, `corelaunch serve --stream-interval N`), the request body's stream_interval on
/v1/completions and /v1/chat/completions, and the interval the routes hand the engine: the server's,
raised by the body's for a stream (vLLM's clamp), the server's alone for a whole answer and for
/v1/responses (whose body, as vLLM's ResponsesRequest, has no such field). The routes run in-process
over SmolLM2's tokenizer and a scripted engine (tests/test_tokenize_routes.py's), here gathering its
tokens into deltas as the engine's leader does. Last, benchmarks/serving.py's --stream-interval,
handed to the server it starts. The engine's own gathering: its tests."""

from __future__ import annotations

import asyncio
import inspect
import json

import pytest

from launcher.serving.openai_protocol import ChatCompletionRequest, CompletionRequest, parse_request
from launcher.serving.server_settings import settings_from_args
from tests.test_chat_template_flag import flags, serve_settings
from tests.test_tokenize_routes import post, refusal_of, route_of, scripted_server, streamed_text_of

MODEL = "smollm2-135m-instruct"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
SCRIPT = "The capital of France is Paris, a city on the Seine."


# ---- the server's setting ----------------------------------------------------------------------
def test_the_servers_interval_from_builder_arguments_and_the_command_line():
    assert settings_from_args({}).stream_interval == 1
    assert settings_from_args({"stream_interval": "4"}).stream_interval == 4  # `serve run` passes text
    assert settings_from_args({"stream_interval": 8}).stream_interval == 8  # a config file's args: typed
    assert settings_from_args({"stream_interval": "null"}).stream_interval == 1  # null: the default
    assert serve_settings("--stream-interval", "4").stream_interval == 4
    assert serve_settings().stream_interval == 1


@pytest.mark.parametrize("value, shown", [(0, "0"), (-2, "-2"), ("two", "'two'"), ("true", "True"), (1.5, "1.5")])
def test_a_bad_servers_interval_is_refused_naming_the_argument_or_the_flag(value, shown):
    rule = r"must be an integer >= 1 \(tokens a stream sends per chunk; 1: every token as it comes\)"
    with pytest.raises(ValueError, match=rf"^stream_interval \({shown}\) {rule}$"):
        settings_from_args({"stream_interval": value})
    if isinstance(value, int):  # a command line's value reaches the settings typed
        with pytest.raises(ValueError, match=rf"^--stream-interval \({shown}\) {rule}$"):
            settings_from_args({"stream_interval": value}, flags())


@pytest.mark.parametrize("text, words", [("0", "--stream-interval (0) must be at least 1"),
                                         ("four", "--stream-interval must be an integer, not 'four'")])
def test_a_bad_stream_interval_flag_is_refused_by_the_parser(capsys, text, words):
    from launcher.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--stream-interval", text])
    assert words in capsys.readouterr().err


# ---- the request's field -----------------------------------------------------------------------
def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "The capital of France is", **fields}


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": CHAT, **fields}


@pytest.mark.parametrize("model, body", [(CompletionRequest, completion), (ChatCompletionRequest, chat)],
                         ids=["completions", "chat"])
def test_the_field_is_an_integer_of_at_least_one_or_null(model, body):
    assert parse_request(model, body(stream=True, stream_interval=3)).stream_interval == 3
    assert parse_request(model, body(stream=True, stream_interval=None)).stream_interval is None
    assert parse_request(model, body()).stream_interval is None


@pytest.mark.parametrize("route, body", [("/v1/completions", completion), ("/v1/chat/completions", chat)],
                         ids=["completions", "chat"])
@pytest.mark.parametrize("value, shown", [(True, "true"), (0, "0"), (-1, "-1"), ("2", "'2'"), (2.0, "2.0")])
def test_a_bad_field_is_a_400_naming_it_and_its_range(smollm2_tokenizer, route, body, value, shown):
    """A bool (pydantic would read true as 1), 0, a string or a float: refused, not converted."""
    server = scripted_server(smollm2_tokenizer, SCRIPT)
    refused = refusal_of(server, route, body(stream=True, stream_interval=value))
    assert (refused.status, refused.param) == (400, "stream_interval")
    assert refused.message.startswith(f"stream_interval ({shown}) must be an integer >= 1, or null (vLLM's "
                                      f"extension: a stream's tokens per chunk, raising the server's "
                                      f"--stream-interval for this request;")
    assert server.prompts == []  # refused before the engine was asked


def test_the_responses_route_refuses_the_field_as_vllms_responses_request_has_none(smollm2_tokenizer):
    server = scripted_server(smollm2_tokenizer, SCRIPT)
    refused = refusal_of(server, "/v1/responses", {"model": MODEL, "input": "Hi", "stream": True,
                                                   "stream_interval": 4})
    assert (refused.status, refused.param) == (400, "stream_interval")
    assert refused.message.startswith("unknown parameter 'stream_interval'")


# ---- what the routes hand the engine -----------------------------------------------------------
def gathering_server(tokenizer, server_interval: int):
    """scripted_server at --stream-interval server_interval, its engine taking stream_interval as the
    Launcher's astream does (a keyword the server must pass) and gathering the scripted one-token
    deltas as the leader does: the first alone, then every stream_interval tokens, the rest at the
    end. server.intervals: the interval each engine stream was given."""
    from launcher.serving.stream_types import StreamDelta

    server = scripted_server(tokenizer, SCRIPT)
    server.stream_interval, server.intervals = server_interval, []
    scripted = server.launcher.astream

    def astream(prompt, sampling, max_new_tokens, logprobs=None, *, stream_interval, **options):
        server.intervals.append(stream_interval)
        single = scripted(prompt, sampling, max_new_tokens, logprobs, **options)

        async def gathered():
            held = []
            async for delta in single:
                held.append(delta)
                if len(held) == 1 and delta.completion_tokens == 1 or len(held) == stream_interval \
                        or delta.finish_reason is not None:
                    yield StreamDelta(
                        delta.request_id, "".join(d.text for d in held), [t for d in held for t in d.token_ids],
                        delta.finish_reason, prompt_tokens=delta.prompt_tokens,
                        completion_tokens=delta.completion_tokens, cached_tokens=held[0].cached_tokens,
                        logprobs=None if logprobs is None else [entry for d in held for entry in d.logprobs])
                    held = []

        return gathered()

    server.launcher.astream = astream
    return server


def test_the_stand_in_takes_the_keyword_the_launchers_astream_takes():
    """The stand-in above is only as good as its signature: the engine's keyword is stream_interval."""
    from launcher.api import Launcher

    for method in (Launcher.astream, Launcher.stream):
        assert inspect.signature(method).parameters["stream_interval"].default == 1, method


def run_route(server, route: str, body: dict):
    """(the whole answer's JSON, or the stream's data objects before [DONE])."""
    async def run():
        response = await route_of(server, route)(post(route, body))
        assert response.status_code == 200
        if not body.get("stream"):
            return json.loads(response.body)
        text = await streamed_text_of(response)
        if route == "/v1/responses":
            return [json.loads(block.split("\n")[1][len("data: "):]) for block in text.split("\n\n")[:-1]]
        blocks = [block[len("data: "):] for block in text.split("\n\n") if block]
        assert blocks[-1] == "[DONE]"
        return [json.loads(block) for block in blocks[:-1]]

    return asyncio.run(run())


@pytest.mark.parametrize("server_interval, asked, given", [(1, None, 1), (4, None, 4), (4, 2, 4), (4, 4, 4),
                                                           (4, 6, 6), (1, 3, 3)])
def test_a_stream_gets_the_larger_of_the_servers_interval_and_its_own(smollm2_tokenizer, server_interval, asked,
                                                                      given):
    tokens = len(smollm2_tokenizer.encode(SCRIPT, add_special_tokens=False))
    for route, body, text_of in (("/v1/completions", completion, lambda c: c["choices"][0]["text"]),
                                 ("/v1/chat/completions", chat,
                                  lambda c: c["choices"][0]["delta"].get("content") or "")):
        server = gathering_server(smollm2_tokenizer, server_interval)
        chunks = run_route(server, route, body(stream=True, stream_interval=asked, max_tokens=64,
                                               stream_options={"include_usage": True}))
        assert server.intervals == [given], route
        texts = [text_of(chunk) for chunk in chunks if chunk["choices"]]
        assert "".join(texts) == SCRIPT, route
        # the first token alone, then `given` at a time: the chunks that carry text are that many
        assert len([t for t in texts if t]) == 1 + -(-(tokens - 1) // given), (route, texts)
        assert chunks[-1]["usage"]["completion_tokens"] == tokens, route


def test_every_choice_of_a_stream_gets_the_requests_interval(smollm2_tokenizer):
    server = gathering_server(smollm2_tokenizer, 2)
    run_route(server, "/v1/completions", completion(stream=True, stream_interval=5, n=2,
                                                    prompt=["Paris is", "Rome is"]))
    assert server.intervals == [5, 5, 5, 5]


@pytest.mark.parametrize("route, body", [("/v1/completions", completion), ("/v1/chat/completions", chat)],
                         ids=["completions", "chat"])
def test_a_whole_answer_gathers_its_tokens_whatever_it_asks(smollm2_tokenizer, route, body):
    """vLLM ignores the field without stream: true; a whole answer, read at its end, has the engine
    gather its tokens after the first up to WHOLE_ANSWER_INTERVAL at a time (at most its max_tokens,
    at least the server's interval); the answer is the same text either way."""
    from launcher.serving.openai_protocol import WHOLE_ANSWER_INTERVAL

    server = gathering_server(smollm2_tokenizer, 3)
    for max_tokens in (40, 400):
        run_route(server, route, body(stream_interval=7, max_tokens=max_tokens))
    server.stream_interval = WHOLE_ANSWER_INTERVAL + 6
    run_route(server, route, body(max_tokens=400))
    assert server.intervals == [40, WHOLE_ANSWER_INTERVAL, WHOLE_ANSWER_INTERVAL + 6]
    server = gathering_server(smollm2_tokenizer, 3)
    whole = run_route(server, route, body(stream_interval=7, max_tokens=64, logprobs=True if body is chat else 2))
    assert server.intervals == [64]
    choice = whole["choices"][0]
    assert (choice.get("text") or choice.get("message", {}).get("content")) == SCRIPT
    tokens = len(smollm2_tokenizer.encode(SCRIPT, add_special_tokens=False))
    logprobs = choice["logprobs"]
    assert len(logprobs["content"] if body is chat else logprobs["tokens"]) == tokens  # every gathered token's


def test_the_responses_route_streams_at_the_servers_interval(smollm2_tokenizer):
    server = gathering_server(smollm2_tokenizer, 4)
    events = run_route(server, "/v1/responses", {"model": MODEL, "input": "Hi", "stream": True})
    assert server.intervals == [4]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == SCRIPT


# ---- the serving benchmark ---------------------------------------------------------------------
def test_the_benchmark_passes_its_interval_to_the_server_it_starts_only(capsys):
    from benchmarks.serving import parse_args, serve_arguments
    from launcher.cli import build_parser

    served = build_parser().parse_args(["serve", *serve_arguments("/models/m", parse_args(["--stream-interval", "4"]))])
    assert served.stream_interval == 4
    assert build_parser().parse_args(["serve", *serve_arguments("/models/m", parse_args([]))]).stream_interval is None
    for argv, named in ((["--stream-interval", "4", "--base-url", "http://h:1/v1"], "--stream-interval concern the "
                                                                                     "corelaunch server"),
                        (["--stream-interval", "0"], "--stream-interval (0) must be at least 1")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert named in capsys.readouterr().err
