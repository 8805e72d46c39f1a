"""A request past the request timeout is a 504 told in the client's terms: the response id a stream
gave it (chatcmpl-..., resp_...; none where the answer was not streamed, whose id never reached the
client), not the engine's own request id that the timeout's error names, and with several choices
each unfinished one and the tokens it had delivered (the error counted one choice's). In-process over
SmolLM2's tokenizer and a scripted engine (tests/test_tokenize_routes.py) whose last choice times out
after one token, raising the replica pool's own timeout error."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from launcher.cluster.replica_pool import _overdue
from launcher.serving.stream_types import StreamDelta
from tests.test_tokenize_routes import MODEL, post, route_of, scripted_server, streamed_text_of

ENGINE_ID = "8d3f1c0e5b7a4e2f9c6d1a0b3e5f7a9c"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a story."}], "max_tokens": 400}


def timing_out_server(tokenizer, choices: int, given_s: float = 6.0):
    """Choices 0 .. choices-2 stream two tokens and stop; the last streams one token and, once the others
    have ended, fails as the replica pool fails a request past its timeout: the server's 6 s, or
    `given_s` where waves of rows queued before it gave it more."""
    server = scripted_server(tokenizer, "unused")
    server.launcher.config.request_timeout_s = 6.0
    started, others_ended = [], asyncio.Event()
    token = tokenizer.encode(" a", add_special_tokens=False)[0]

    def astream(prompt, sampling, max_new_tokens, **options):
        index = len(started)
        started.append(index)

        async def deltas():
            if index < choices - 1:
                yield StreamDelta("r", " a", [token], None, prompt_tokens=len(prompt), completion_tokens=1)
                yield StreamDelta("r", " a", [token], "stop", prompt_tokens=len(prompt), completion_tokens=2)
                if index == choices - 2:
                    others_ended.set()  # asked for more: the server has read its ending
                return
            yield StreamDelta("r", " a", [token], None, prompt_tokens=len(prompt), completion_tokens=1)
            if choices > 1:
                await others_ended.wait()
            handle = SimpleNamespace(request_id=ENGINE_ID, timeout_s=given_s, delivered=[token],
                                     request=SimpleNamespace(max_tokens=max_new_tokens))
            raise _overdue(handle, "it was cancelled")

        return deltas()

    server.launcher.astream = astream
    return server


def failed(tokenizer, route: str, body: dict, choices: int = 1, given_s: float = 6.0):
    """(status, error body) of a request answered whole; (ids its chunks carried, the error) of a stream."""
    async def run():
        response = await route_of(timing_out_server(tokenizer, choices, given_s), route)(post(route, body))
        if not body.get("stream"):
            return response.status_code, json.loads(response.body)["error"]
        events = [json.loads(line[len("data: "):]) for line in (await streamed_text_of(response)).split("\n")
                  if line.startswith("data: ") and line != "data: [DONE]"]
        ids = {event.get("id") or (event.get("response") or {}).get("id") for event in events} - {None}
        # a chat stream's error chunk holds OpenAI's error object; the Responses stream's error event is one
        return ids, next(event.get("error") or event for event in events
                         if event.get("error") or event.get("type") == "error")

    return asyncio.run(run())


def test_a_whole_answer_of_several_choices_names_each_unfinished_one(smollm2_tokenizer):
    status, error = failed(smollm2_tokenizer, "/v1/chat/completions", {**CHAT, "n": 3}, choices=3)
    assert (status, error["code"]) == (504, "generation_timeout")
    # a whole answer delivers nothing before its end, and gathers a choice's tokens into one piece:
    # its count read "1 token" however far the choice had come, so none is given
    assert error["message"].startswith("the request did not finish within the request timeout (6 s); of its 3 "
                                       "choices, choice 2 had not ended; ask for fewer tokens "
                                       "with max_tokens (max_completion_tokens)"), error["message"]
    assert ENGINE_ID not in error["message"]


def test_a_stream_names_the_id_its_chunks_carried(smollm2_tokenizer):
    ids, error = failed(smollm2_tokenizer, "/v1/chat/completions", {**CHAT, "stream": True})
    [response_id] = ids
    assert response_id.startswith("chatcmpl-") and error["code"] == "generation_timeout"
    assert error["message"].startswith(f"response {response_id} did not finish within the request timeout (6 s); "
                                       f"it had delivered 1 token; "), error["message"]
    assert ENGINE_ID not in error["message"]


def test_a_responses_stream_names_its_response_and_its_own_token_field(smollm2_tokenizer):
    ids, error = failed(smollm2_tokenizer, "/v1/responses", {"model": MODEL, "input": "Tell a story.",
                                                             "max_output_tokens": 400, "stream": True})
    [response_id] = ids
    assert response_id.startswith("resp_") and error["code"] == "generation_timeout"
    assert error["message"].startswith(f"response {response_id} did not finish within the request timeout (6 s); "
                                       f"it had delivered 1 token; ask for fewer tokens with max_output_tokens"), \
        error["message"]
    assert ENGINE_ID not in error["message"]


def test_the_time_told_is_the_time_the_request_was_given(smollm2_tokenizer):
    """Queued behind a wave of rows, a request is given two timeouts: the message said the server's one."""
    status, error = failed(smollm2_tokenizer, "/v1/chat/completions", CHAT, given_s=12.0)
    assert (status, error["code"]) == (504, "generation_timeout")
    assert error["message"].startswith("the request did not finish within the request timeout (12 s); ask "
                                       "for fewer tokens"), error["message"]


def test_a_timeout_not_of_the_request_itself_keeps_its_own_words():
    """A hung group's RequestTimeout is no request's own: it says what happened, not "did not finish"."""
    from launcher.errors import RequestTimeout
    from launcher.serving.openai_app import _generation_failure

    hung = RequestTimeout("replica 0's group made no step in 30 s (the request timeout) with requests in flight")
    status, body, _ = _generation_failure(hung)
    assert status == 504
    assert body["error"]["message"].startswith("replica 0's group made no step in 30 s"), body["error"]["message"]
