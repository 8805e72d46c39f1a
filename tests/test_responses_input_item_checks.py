"""Input items' fields that a kept turn lists back (launcher/serving/responses/request.py,
listed_items.py): an item's id must be a string and its status OpenAI's, refused with a 400 naming
the field whether or not the server keeps responses (a list as id was an uncaught 500 on a server
keeping them; an integer was listed back as the id); a null type with a role is a message; an
assistant's refusal part (history exported from OpenAI) is taken as its text and listed back as a
refusal part. Through the route, over the scripted engine of tests/test_tokenize_routes.py."""

from __future__ import annotations

import pytest

from tests.test_kept_responses import keeping, listing
from tests.test_responses_route import asked, check_with_the_clients_types, refusal, respond, server_over, tokenizer

__all__ = ["tokenizer"]  # the module-scoped fixture, taken from the route's tests


@pytest.mark.parametrize("keeps", [True, False])
@pytest.mark.parametrize("field, value", [("id", ["x"]), ("id", {"a": 1}), ("id", 5), ("status", 7),
                                          ("status", "done")])
def test_an_items_id_and_status_of_the_wrong_kind_are_named(tokenizer, keeps, field, value):
    server = keeping(tokenizer, ["A."]) if keeps else server_over(tokenizer, "A.")
    sent = [{"role": "user", "content": "hi"}, {"role": "user", "content": "yo", field: value}]
    refused = refusal(server, asked(input=sent))
    assert refused.status == 400 and refused.param == f"input[1].{field}"
    assert server.prompts == []


def test_an_items_string_id_and_status_are_listed_back(tokenizer):
    server = keeping(tokenizer, ["A."])
    answer = respond(server, asked(input=[{"type": "message", "role": "user", "content": "hi", "id": "msg_mine",
                                           "status": "incomplete"}]))
    [item] = listing(server, answer["id"])["data"]
    assert item["id"] == "msg_mine" and item["status"] == "incomplete"


def test_a_null_type_with_a_role_is_a_message_and_is_listed_as_one(tokenizer):
    server = keeping(tokenizer, ["A."])
    answer = respond(server, asked(input=[{"type": None, "role": "user", "content": "hi"}]))
    assert "<user>hi" in server.prompts[0]
    [item] = listing(server, answer["id"])["data"]
    assert item["type"] == "message" and item["id"].startswith("msg_")
    # with no role either it is still refused, the type named
    assert refusal(server, asked(input=[{"type": None, "content": "hi"}])).param == "input[0].type"


def test_an_assistants_refusal_part_is_taken_as_its_text_and_listed_back_as_a_refusal(tokenizer):
    from openai.types.responses import ResponseItemList

    server = keeping(tokenizer, ["Fine.", "More."])
    sent = [{"role": "user", "content": "q"},
            {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
            {"role": "user", "content": "q2"}]
    answer = respond(server, asked(input=sent))
    check_with_the_clients_types(answer)
    assert "<assistant>no" in server.prompts[0]
    items = listing(server, answer["id"], b"order=asc")
    ResponseItemList.model_validate(items)
    assert items["data"][1]["content"] == [{"type": "refusal", "refusal": "no"}]
    # the kept turn comes back as history as it was sent
    respond(server, asked(input="More?", previous_response_id=answer["id"]))
    assert "<assistant>no" in server.prompts[1]


def test_a_refusal_part_is_an_assistants_only_and_must_hold_text(tokenizer):
    server = server_over(tokenizer, "A.")
    refused = refusal(server, asked(input=[{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]))
    assert refused.param == "input[0].content[0].type"
    for part, param in (({"type": "refusal"}, "input[0].content[0].refusal"),
                        ({"type": "refusal", "refusal": 3}, "input[0].content[0].refusal"),
                        ({"type": "refusal", "refusal": "no", "text": "x"}, "input[0].content[0].text")):
        assert refusal(server, asked(input=[{"role": "assistant", "content": [part]}])).param == param
