"""Kept responses through the server's routes (`--responses-store N`): POST /v1/responses keeps what
it answers (whole, or the stream's final response) unless store is false; previous_response_id
continues a kept conversation (its turns reach the chat template after this request's instructions,
the earlier instructions not carried over, a function call's output sent back after its call);
GET and DELETE /v1/responses/{id}; what is not kept, or no longer, named; a server that keeps none;
where the replicas keep them (their own process, or one store deployment they share). The routes
run in-process over SmolLM2's tokenizer and an engine that streams scripted texts
(tests/test_tokenize_routes.py)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from launcher.serving.openai_protocol import ProtocolError
from launcher.serving.response_store_server import LocalResponses, SharedResponses, StoreUnavailable
from tests.test_responses_route import (TOOLS, WEATHER_CALL, asked, check_with_the_clients_types, refusal, respond,
                                        server_over, streamed_text, tokenizer)

__all__ = ["tokenizer"]  # the module-scoped fixture, taken from the route's tests


def keeping(tokenizer, scripts, capacity: int = 8, **parsers):
    """The scripted server keeping `capacity` responses in its own process (as one replica does)."""
    server = server_over(tokenizer, scripts, **parsers)
    server.responses_kept = LocalResponses(capacity)
    return server


def request_to(method: str, path: str, query: bytes = b""):
    from starlette.requests import Request

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    return Request({"type": "http", "method": method, "path": path, "headers": [], "query_string": query}, receive)


def read_back(server, response_id: str, query: bytes = b"") -> dict:
    return asyncio.run(server.retrieve_response(response_id, request_to("GET", f"/v1/responses/{response_id}", query)))


def deleted(server, response_id: str) -> dict:
    return asyncio.run(server.delete_response(response_id, request_to("DELETE", f"/v1/responses/{response_id}")))


def listing(server, response_id: str, query: bytes = b"") -> dict:
    path = f"/v1/responses/{response_id}/input_items"
    return asyncio.run(server.response_input_items(response_id, request_to("GET", path, query)))


def refusal_by(call, *args) -> ProtocolError:
    with pytest.raises(ProtocolError) as err:
        call(*args)
    return err.value


def test_a_kept_response_is_read_back_and_continued(tokenizer):
    server = keeping(tokenizer, ["Hello there.", "Paris.", "Rome."])
    first = respond(server, asked(instructions="Be brief.", input="Hi"))
    assert first["store"] is True and first["previous_response_id"] is None
    assert read_back(server, first["id"]) == first
    second = respond(server, asked(instructions="Answer in one word.", input="Capital of France?",
                                   previous_response_id=first["id"]))
    check_with_the_clients_types(second)
    assert second["previous_response_id"] == first["id"] and second["store"] is True
    prompt = server.prompts[1]
    # this request's instructions, then the kept turn (its own instructions not carried over), then the input
    assert "Be brief." not in prompt
    assert prompt.index("<system>Answer in one word.") < prompt.index("<user>Hi") < \
        prompt.index("<assistant>Hello there.") < prompt.index("<user>Capital of France?")
    third = respond(server, asked(input="And Italy?", previous_response_id=second["id"]))
    assert server.prompts[2].index("<user>Hi") < server.prompts[2].index("<assistant>Paris.") < \
        server.prompts[2].index("<user>And Italy?")
    assert read_back(server, third["id"])["output"] == third["output"]


def test_a_streamed_response_is_kept_as_its_final_event_tells_it(tokenizer):
    server = keeping(tokenizer, ["The sky is blue.", "Yes."])
    events = respond(server, asked(stream=True))
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and final["store"] is True
    assert read_back(server, final["id"]) == final and streamed_text(events) == "The sky is blue."
    respond(server, asked(input="Always?", previous_response_id=final["id"], stream=True))
    assert "<assistant>The sky is blue." in server.prompts[1]


def test_store_false_keeps_nothing(tokenizer):
    server = keeping(tokenizer, "Hello.")
    answer = respond(server, asked(store=False))
    assert answer["store"] is False
    missing = refusal_by(read_back, server, answer["id"])
    assert missing.status == 404 and missing.code == "response_not_found" and "store: false" in missing.message
    lost = refusal(server, asked(previous_response_id=answer["id"]))
    assert lost.status == 400 and lost.param == "previous_response_id" and lost.code == "previous_response_not_found"
    assert answer["id"] in lost.message and "send the conversation's turns in input" in lost.message


def test_a_function_calls_output_continues_the_kept_call(tokenizer):
    server = keeping(tokenizer, [WEATHER_CALL, "It is 21 C in Paris."], tool_call_parser="hermes")
    first = respond(server, asked(input="Weather in Paris?", tools=TOOLS))
    [call] = first["output"]
    assert call["type"] == "function_call"
    second = respond(server, asked(input=[{"type": "function_call_output", "call_id": call["call_id"],
                                           "output": "21 C"}], tools=TOOLS, previous_response_id=first["id"]))
    prompt = server.prompts[1]
    assert prompt.index("<user>Weather in Paris?") < prompt.index(f"(call {call['call_id']} weather)") < \
        prompt.index(f"<tool>21 C(for {call['call_id']})")
    assert second["output"][0]["content"][0]["text"] == "It is 21 C in Paris."


def test_a_turn_cut_while_thinking_keeps_its_own_turn(tokenizer):
    """A kept answer that is all thinking (max_output_tokens cut it inside its reasoning) still takes
    the assistant's turn in the next prompt, with its thinking: two user turns in a row would be
    refused by templates that want them alternating, and the client cannot mend a kept turn."""
    server = keeping(tokenizer, ["The sky scatters blue light", "Blue.", "Yes."], reasoning_parser="deepseek_r1")
    cut = respond(server, asked(input="Colour?", max_output_tokens=3))
    assert cut["status"] == "incomplete" and [item["type"] for item in cut["output"]] == ["reasoning"]
    respond(server, asked(input="Well?", previous_response_id=cut["id"]))
    prompt = server.prompts[1]
    assert prompt.index("<user>Colour?") < prompt.index("<assistant>[The sky") < prompt.index("<user>Well?")
    # an input that opens with the assistant's own message takes the thinking itself: no empty turn
    respond(server, asked(input=[{"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Sure?"}],
                          previous_response_id=cut["id"]))
    assert "<user>Colour?<assistant>Blue.[The sky" in server.prompts[2] and server.prompts[2].count("<assistant>") == 2


def test_two_turns_may_continue_the_same_response(tokenizer):
    server = keeping(tokenizer, ["Hello.", "Paris.", "Rome."])
    first = respond(server, asked(input="Hi"))
    france = respond(server, asked(input="France?", previous_response_id=first["id"]))
    italy = respond(server, asked(input="Italy?", previous_response_id=first["id"]))
    assert "France?" not in server.prompts[2] and "<assistant>Hello." in server.prompts[2]
    assert read_back(server, france["id"])["output"] != read_back(server, italy["id"])["output"]


def test_a_conversation_longer_than_the_store_loses_its_first_turn(tokenizer):
    """N bounds the turns of every conversation together (each kept response is one turn): a chain of
    N + 1 responses can no longer be continued from its last (README)."""
    server = keeping(tokenizer, "Fine.", capacity=3)
    turn = respond(server, asked(input="Turn 0?"))
    first = turn
    for i in range(1, 3):
        turn = respond(server, asked(input=f"Turn {i}?", previous_response_id=turn["id"]))
    assert "<user>Turn 0?" in server.prompts[-1]
    turn = respond(server, asked(input="Turn 3?", previous_response_id=turn["id"]))  # the fourth kept: turn 0 goes
    lost = refusal(server, asked(input="Turn 4?", previous_response_id=turn["id"]))
    assert lost.code == "previous_response_not_found" and f"it continued {first['id']!r}" in lost.message


class FailingStore(LocalResponses):
    """A store whose every call fails as a shared store that does not answer does."""

    async def put(self, *args):
        raise StoreUnavailable("the response store did not answer within 10 s")

    history = get = input_items = delete = put


def test_a_store_that_fails_costs_the_keeping_not_the_answer(tokenizer, caplog):
    server = server_over(tokenizer, "Hello.")
    server.responses_kept = FailingStore(4)
    whole = respond(server, asked())
    assert whole["store"] is False and whole["output"][0]["content"][0]["text"] == "Hello."
    assert f"response {whole['id']} was answered but not kept" in caplog.text
    events = respond(server, asked(stream=True))
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["store"] is False
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    for call in (read_back, deleted):
        busy = refusal_by(call, server, "resp_1")
        assert busy.status == 503 and busy.code == "response_store_unavailable" and "retry later" in busy.message
        assert busy.headers["Retry-After"]
    busy = refusal(server, asked(previous_response_id="resp_1"))
    assert busy.status == 503 and busy.code == "response_store_unavailable"
    counted = {labels: server.metrics.registry.get_sample_value("corelaunch_requests_total", dict(zip(
        ("finish_reason", "status"), labels))) for labels in (("unavailable", "503"), ("rejected", "503"))}
    assert counted == {("unavailable", "503"): 1.0, ("rejected", "503"): 0.0}  # not a full queue


def test_a_shared_store_that_does_not_answer_is_named(monkeypatch):
    from launcher.serving import response_store_server

    class Handle:  # a store replica that never answers, then one that fails
        def __getattr__(self, method):
            return SimpleNamespace(remote=lambda *args: asyncio.sleep(3600))

    class Broken:
        def __getattr__(self, method):
            async def fail(*args):
                raise RuntimeError("replica died")
            return SimpleNamespace(remote=fail)

    monkeypatch.setattr(response_store_server, "STORE_WAIT_S", 0.05)
    with pytest.raises(StoreUnavailable, match="did not answer within 0.05 s"):
        asyncio.run(SharedResponses(Handle()).history("resp_1"))
    with pytest.raises(StoreUnavailable, match="the response store failed: RuntimeError: replica died"):
        asyncio.run(SharedResponses(Broken()).put({"id": "resp_1", "output": []}, [], None))


def test_a_deleted_response_is_gone_and_named_by_the_turns_after_it(tokenizer):
    server = keeping(tokenizer, ["One.", "Two.", "Three."])
    first = respond(server, asked())
    second = respond(server, asked(input="Next?", previous_response_id=first["id"]))
    assert deleted(server, first["id"]) == {"id": first["id"], "object": "response", "deleted": True}
    assert refusal_by(read_back, server, first["id"]).status == 404
    assert refusal_by(deleted, server, first["id"]).status == 404
    assert read_back(server, second["id"]) == second  # still there to read back
    broken = refusal(server, asked(input="Then?", previous_response_id=second["id"]))
    assert broken.code == "previous_response_not_found" and f"it continued {first['id']!r}" in broken.message


def test_a_full_store_lets_the_least_recently_used_go(tokenizer):
    server = keeping(tokenizer, "Fine.", capacity=2)
    old, kept, new = (respond(server, asked(input=f"Question {i}?")) for i in range(3))
    assert refusal(server, asked(previous_response_id=old["id"])).code == "previous_response_not_found"
    assert read_back(server, kept["id"]) == kept and read_back(server, new["id"]) == new


def test_a_server_that_keeps_nothing_says_how_to_keep(tokenizer):
    server = server_over(tokenizer, "Hello.")
    answer = respond(server, asked())
    assert answer["store"] is False
    for call in (read_back, deleted):
        missing = refusal_by(call, server, answer["id"])
        assert missing.status == 404 and "--responses-store N" in missing.message
    continued = refusal(server, asked(previous_response_id=answer["id"]))
    assert continued.status == 400 and "--responses-store N" in continued.message


def test_bad_previous_ids_and_replays_are_refused(tokenizer):
    server = keeping(tokenizer, "Hello.")
    for bad in (5, "", ["resp_1"]):
        wrong = refusal(server, asked(previous_response_id=bad))
        assert wrong.status == 400 and wrong.param == "previous_response_id" and "resp_" in wrong.message
    answer = respond(server, asked())
    replay = refusal_by(read_back, server, answer["id"], b"stream=true")
    assert replay.status == 400 and replay.param == "stream" and "no events to replay" in replay.message
    assert read_back(server, answer["id"], b"stream=false") == answer == read_back(server, answer["id"], b"stream=0")
    replay = refusal_by(read_back, server, answer["id"], b"stream=false&starting_after=3")
    assert replay.status == 400 and replay.param == "starting_after"


def test_the_routes_need_the_api_key(tokenizer):
    server = keeping(tokenizer, "Hello.")
    answer = respond(server, asked())
    server.api_key = "secret"
    for call in (read_back, listing, deleted):
        assert refusal_by(call, server, answer["id"]).status == 401


def test_the_store_deployment_refuses_to_be_two_stores():
    from launcher.serving.response_store_server import refuse_several_stores
    from launcher.serving.serve_deployment import DeploymentFacts

    refuse_several_stores(None)  # outside a replica, or an unknown Serve: as deployed
    refuse_several_stores(DeploymentFacts(most_replicas=1, drain_s=20.0))
    with pytest.raises(ValueError, match=r"ResponseStoreServer runs 2 replicas .* leave its num_replicas at 1"):
        refuse_several_stores(DeploymentFacts(most_replicas=2, drain_s=20.0))


def test_several_replicas_share_one_store_deployment():
    from launcher.serving.openai_app import _kept_responses, application
    from launcher.serving.server_settings import settings_from_args

    shared = application(settings_from_args({"replicas": 2, "responses_store": 4}))._bound_deployment
    [store] = shared.init_args[1:]
    assert store._bound_deployment.name == "ResponseStoreServer" and store._bound_deployment.init_args == (4,)
    alone = application(settings_from_args({"responses_store": 4}))._bound_deployment
    assert alone.init_args[1:] == ()  # one replica keeps them in its own process
    assert application(settings_from_args({"replicas": 2}))._bound_deployment.init_args[1:] == ()
    one = settings_from_args({"responses_store": 4})
    assert isinstance(_kept_responses(one, object(), 2), SharedResponses)
    assert isinstance(_kept_responses(one, None, 1), LocalResponses)
    assert _kept_responses(settings_from_args({}), None, 1) is None
    # a config file's deployments: entry raised the count past the builder's: refused, saying what to set
    with pytest.raises(ValueError, match=r"responses_store \(4\) keeps responses in the replica's own process .* "
                                         r"set replicas \(or max_replicas\) to 3"):
        _kept_responses(one, None, 3)


@pytest.mark.parametrize("value, message", [(-1, "responses_store (-1) must be an integer >= 0"),
                                            ("many", "responses_store ('many') must be an integer >= 0"),
                                            (10 ** 7, "responses_store (10000000) must be at most 1000000")])
def test_the_builders_argument_is_checked(value, message):
    from launcher.serving.server_settings import settings_from_args

    with pytest.raises(ValueError) as err:
        settings_from_args({"responses_store": value})
    assert message in str(err.value)
    assert settings_from_args({"responses_store": "3"}).responses_store == 3  # `serve run` passes text


def test_the_command_line_option(capsys):
    from launcher.cli import main

    with pytest.raises(SystemExit) as refused_by_argparse:
        main(["serve", "--responses-store", "-1"])
    assert refused_by_argparse.value.code == 2
    assert "--responses-store (-1) must be at least 0" in capsys.readouterr().err
    assert main(["serve", "--responses-store", "10000000"]) == 2  # refused before Ray starts
    assert "--responses-store (10000000) must be at most 1000000" in capsys.readouterr().err


def test_a_kept_responses_input_items_are_listed_in_pages(tokenizer):
    from openai.types.responses import ResponseItemList

    server = keeping(tokenizer, "Fine.")
    sent = [{"role": "user", "content": "First?"}, {"type": "message", "role": "assistant", "content": "Yes."},
            {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
            {"role": "user", "content": [{"type": "input_text", "text": "Then?"}]}]
    answer = respond(server, asked(input=sent, tools=TOOLS, tool_choice="none"))
    whole = listing(server, answer["id"], b"limit=100")
    ResponseItemList.model_validate(whole)  # the official client's type
    assert [item["type"] for item in whole["data"]] == ["message", "function_call_output", "function_call",
                                                      "message", "message"]  # latest first by default
    assert whole["data"][0]["content"] == [{"type": "input_text", "text": "Then?"}]
    assert whole["data"][3]["content"] == [{"type": "output_text", "text": "Yes.", "annotations": []}]
    assert whole["data"][4]["content"] == [{"type": "input_text", "text": "First?"}]
    assert all(item["id"] and item["status"] == "completed" for item in whole["data"])
    assert listing(server, answer["id"], b"limit=100") == whole  # the same ids every time
    first = listing(server, answer["id"], b"order=asc&limit=2")
    assert first["data"] == whole["data"][::-1][:2] and first["has_more"] is True
    rest = listing(server, answer["id"], f"order=asc&after={first['last_id']}".encode())
    assert rest["data"] == whole["data"][::-1][2:] and rest["has_more"] is False
    assert rest["first_id"] == rest["data"][0]["id"] and rest["last_id"] == rest["data"][-1]["id"]
    assert "First?" not in json.dumps(listing(server, respond(server, asked(
        input="Next?", previous_response_id=answer["id"]))["id"]))  # a turn lists its own input only
    for query, param in ((b"limit=0", "limit"), (b"limit=101", "limit"), (b"limit=x", "limit"),
                         (b"order=up", "order"), (b"after=msg_nothing", "after")):
        bad = refusal_by(listing, server, answer["id"], query)
        assert bad.status == 400 and bad.param == param
    assert refusal_by(listing, server, "resp_unknown").status == 404
    assert refusal_by(listing, server_over(tokenizer, "x"), answer["id"]).status == 404


def test_every_input_item_shape_is_listed_in_the_clients_types_and_comes_back_as_history(tokenizer):
    """Shapes chat_body takes that the listed shape must mend: a user's output_text part and an
    assistant's input_text part (each role's own part type), an assistant message with no content
    (one empty part: an empty list would be refused when the turn comes back), a reasoning item's
    null summary, an id sent twice (a new one the second time: `after` stays unambiguous)."""
    from openai.types.responses import ResponseItemList

    server = keeping(tokenizer, ["Fine.", "More."])
    sent = [{"role": "system", "content": "Be brief."},
            {"role": "developer", "content": [{"type": "text", "text": "Be kind."}]},
            {"role": "user", "content": [{"type": "output_text", "text": "Quoted."}]},
            {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Thinking."}], "summary": None},
            {"role": "assistant"},
            {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{}", "id": "dup"},
            {"type": "function_call_output", "call_id": "call_1", "id": "dup",
             "output": [{"type": "input_text", "text": "21 C"}]},
            {"role": "assistant", "content": [{"type": "input_text", "text": "Noted."}]},
            {"role": "user", "content": "Then?"}]
    answer = respond(server, asked(input=sent, tools=TOOLS, tool_choice="none"))
    items = listing(server, answer["id"], b"order=asc")
    ResponseItemList.model_validate(items)
    ids = [item["id"] for item in items["data"]]
    assert len(set(ids)) == len(ids) == len(sent) and ids[5] == "dup" != ids[6]
    assert [item["content"] for item in items["data"][:2]] == [[{"type": "input_text", "text": "Be brief."}],
                                                               [{"type": "input_text", "text": "Be kind."}]]
    respond(server, asked(input="More?", previous_response_id=answer["id"], tools=TOOLS, tool_choice="none"))
    prompt = server.prompts[1]
    # (the chat route gives a developer message the system role)
    for said in ("<system>Be brief.", "<system>Be kind.", "<user>Quoted.", "[Thinking.]", "(call call_1 weather)",
                 "<tool>21 C(for call_1)", "<assistant>Noted.", "<user>Then?", "<assistant>Fine.", "<user>More?"):
        assert said in prompt, said
    # the kept turn gives the chat template what the same items sent whole give it
    whole = server_over(tokenizer, "x")
    respond(whole, asked(input=[*sent, *answer["output"], {"role": "user", "content": "More?"}], tools=TOOLS,
                         tool_choice="none"))
    assert whole.prompts == [prompt]
