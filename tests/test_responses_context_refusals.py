"""Refusals of /v1/responses requests that do not fit, in terms the client can act on: a continued
conversation too long for the context names what the kept conversation takes and what the new input
does, and the way out (a new conversation of the turns to keep: truncation "auto" is not
supported); min_tokens past the limit names max_output_tokens and input, not the chat's fields.
The route runs in-process over SmolLM2's tokenizer and the scripted engine, with a 512-token
context (tests/test_tokenize_routes.py); the token counts are the tokenizer's own, rendered here."""

from __future__ import annotations

from tests.test_kept_responses import keeping
from tests.test_responses_route import asked, refusal, respond, tokenizer

__all__ = ["tokenizer"]  # the module-scoped fixture, taken from the route's tests

START_ANEW = "start a new conversation: send in input only the turns to keep, without previous_response_id"


def tokens(tokenizer, messages: list[dict], opening: bool) -> int:
    return len(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=opening,
                                             return_dict=False))


def answer_text(response: dict) -> str:
    return response["output"][0]["content"][0]["text"]


def test_a_conversation_too_long_names_the_kept_turns_and_the_new_input(tokenizer):
    server = keeping(tokenizer, "Hello there friend.")
    first_input, new_input = "word " * 250, "more " * 250
    first = respond(server, asked(input=first_input))
    kept = [{"role": "user", "content": first_input}, {"role": "assistant", "content": answer_text(first)}]
    kept_tokens = tokens(tokenizer, kept, False)
    whole = tokens(tokenizer, [*kept, {"role": "user", "content": new_input}], True)
    assert kept_tokens < 511 < whole  # each part fits, the two together do not
    refused = refusal(server, asked(input=new_input, previous_response_id=first["id"]))
    assert refused.status == 400 and refused.code == "context_length_exceeded" and refused.param == "input"
    assert f"the prompt has {whole} tokens" in refused.message and "at most 511 tokens" in refused.message
    assert f"continues takes {kept_tokens} of them and this request's input the other {whole - kept_tokens}" \
        in refused.message
    assert START_ANEW in refused.message and 'truncation "auto" is not supported' in refused.message
    assert "shorten the prompt" not in refused.message  # the client never sends most of it
    # an input far too long to count whole: the room it had is named
    endless = refusal(server, asked(input="more " * 20000, previous_response_id=first["id"]))
    assert endless.param == "input" and endless.code == "context_length_exceeded"
    assert f"continues takes {kept_tokens} of them and this request's input more than the {511 - kept_tokens} " \
           f"left" in endless.message


def test_a_kept_conversation_that_fills_the_context_alone_is_named(tokenizer):
    server = keeping(tokenizer, "Hello there friend.")
    first_input = "word " * 503  # a 510-token prompt: the answer's first token or two fill the context
    first = respond(server, asked(input=first_input))
    kept = [{"role": "user", "content": first_input}, {"role": "assistant", "content": answer_text(first)}]
    kept_tokens = tokens(tokenizer, kept, False)
    assert kept_tokens >= 511
    refused = refusal(server, asked(input="Go on.", previous_response_id=first["id"]))
    assert refused.status == 400 and refused.code == "context_length_exceeded"
    assert refused.param == "previous_response_id"
    assert f"continues takes {kept_tokens} tokens" in refused.message and "no room is left" in refused.message
    assert START_ANEW in refused.message


def test_a_token_limit_past_the_context_of_a_continued_conversation_says_what_to_shorten(tokenizer):
    server = keeping(tokenizer, "Hello there friend.")
    first = respond(server, asked(input="word " * 100))
    refused = refusal(server, asked(input="Go on.", previous_response_id=first["id"], max_output_tokens=500))
    assert refused.code == "context_length_exceeded" and refused.param == "max_output_tokens"
    assert "lower max_output_tokens" in refused.message and START_ANEW in refused.message
    assert "shorten the prompt" not in refused.message


def test_min_tokens_past_the_limit_is_told_in_the_routes_names(tokenizer):
    server = keeping(tokenizer, "Hello.")
    sent = refusal(server, asked(max_output_tokens=2, min_tokens=5))
    assert sent.param == "min_tokens" and sent.message == ("min_tokens (5) must be at most max_output_tokens (2); "
                                                           "lower min_tokens or raise max_output_tokens")
    unsent = refusal(server, asked(min_tokens=10 ** 6))
    assert unsent.param == "min_tokens" and "(no max_output_tokens was sent)" in unsent.message
    assert unsent.message.endswith("lower min_tokens or shorten the input")
    for chat_name in ("max_completion_tokens", "max_tokens ", "messages"):
        assert chat_name not in sent.message + unsent.message


THINKING_OF_THE_LAST_TURNS = (  # Qwen3's rule: thinking is rendered only after the last user message
    "{% set ns = namespace(last_user=-1) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    # and an empty user turn refused, as some templates do (the count's stand-ins were empty turns)
    "{% for m in messages %}{% if m.role == 'user' and not m.content %}{{ raise_exception('empty') }}{% endif %}"
    "<{{ m.role }}>{% if m.reasoning and loop.index0 > ns.last_user %}[{{ m.reasoning }}]"
    "{% endif %}{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


def test_a_kept_turns_thinking_the_template_drops_is_not_counted_as_kept_nor_its_answer_as_new(tokenizer):
    import copy

    dropping = copy.deepcopy(tokenizer)
    dropping.chat_template = THINKING_OF_THE_LAST_TURNS
    server = keeping(dropping, "Hello there friend.")
    thought, first_input, kept_answer, new_input = "long thought " * 40, "word " * 20, "Blue. " * 150, "more " * 200
    first = respond(server, asked(input=[
        {"role": "user", "content": first_input},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": thought}]},
        {"role": "assistant", "content": kept_answer}]))
    kept = [{"role": "user", "content": first_input},
            {"role": "assistant", "content": kept_answer, "reasoning": thought},
            {"role": "assistant", "content": answer_text(first)}]
    alone = dropping.apply_chat_template(kept, tokenize=True, add_generation_prompt=False, return_dict=False)
    prompt = dropping.apply_chat_template([*kept, {"role": "user", "content": new_input}], tokenize=True,
                                          add_generation_prompt=True, return_dict=False)
    without_thinking = tokens(dropping, [{**message, "reasoning": None} for message in kept], False)
    # alone, its thinking is rendered (it follows the last user message); in the prompt it is not
    assert without_thinking < len(alone) < 511 < len(prompt)
    refused = refusal(server, asked(input=new_input, previous_response_id=first["id"]))
    assert refused.param == "input" and f"the prompt has {len(prompt)} tokens" in refused.message
    counted_kept = int(refused.message.split("continues takes ")[1].split(" ")[0])
    counted_new = int(refused.message.split("this request's input the other ")[1].split(";")[0])
    assert counted_kept + counted_new == len(prompt)
    # the new input is the new user turn (its text, and the few tokens that open and close the turns
    # around it): the kept answer after the dropped thinking is the kept conversation's
    new_text = len(dropping(new_input, add_special_tokens=False).input_ids)
    new_turn = len(prompt) - without_thinking
    assert new_text <= counted_new <= new_turn and new_turn - new_text < 10
    # an input far too long to render is split the same way (its text stood in for by a short one)
    endless = refusal(server, asked(input="more " * 20000, previous_response_id=first["id"]))
    assert endless.param == "input" and f"continues takes {counted_kept} of them and this request's input more " \
                                        f"than the {511 - counted_kept} left" in endless.message
