"""Edges of the prompt a chat or an echoed completion is made of, in-process (no server, a scripted
engine over SmolLM2's real tokenizer): an echoed text prompt's offsets on a tokenizer that adds a
BOS, how a message's text parts are joined, a chat its template renders to nothing, an assistant
message with nothing in it, a tokenizer's dict of named templates, and a content of the wrong type."""

from __future__ import annotations

import copy

import pytest
from tokenizers.processors import TemplateProcessing

from launcher.serving.echoed_prompt import echoed_prompt
from launcher.serving.openai_protocol import ChatCompletionRequest, ProtocolError, parse_request
from launcher.serving.openai_render import CompletionRender
from launcher.serving.stream_types import StreamDelta
from launcher.serving.token_pieces import TokenPieces
from tests.test_tokenize_routes import answer, refusal_of, scripted_server
from workers.serving.requests import TokenLogprob

MODEL = "smollm2-135m-instruct"
HI = [{"role": "user", "content": "hi"}]
RENDERS_NOTHING = "{% for m in messages %}{% endfor %}"


@pytest.fixture
def bos_tokenizer(smollm2_tokenizer):
    """SmolLM2's tokenizer made to add a BOS before a text, as Llama's, Mistral's and Gemma's do (its
    own post-processor, not a stand-in)."""
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    bos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    assert tokenizer("hi there")["input_ids"][0] == bos
    return tokenizer


def chat(messages) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, {"model": MODEL, "messages": messages})


def refused(messages) -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        chat(messages).chat_messages()
    assert caught.value.status == 400
    return caught.value


# ---- echo: offsets into the text as sent ------------------------------------------------------
def test_an_echoed_text_prompt_s_offsets_point_into_the_sent_text_past_an_added_bos(bos_tokenizer):
    ids = bos_tokenizer("hi there")["input_ids"]
    echo = echoed_prompt(TokenPieces(bos_tokenizer), "hi there", ids, with_logprobs=True)
    assert echo.text == "hi there"
    assert echo.offsets == (0, 0, 2)  # the BOS stands before the text; it was (0, 13, 15)


def test_an_echoed_completion_s_offsets_all_point_into_its_text_on_a_bos_tokenizer(bos_tokenizer):
    pieces = TokenPieces(bos_tokenizer)
    ids = bos_tokenizer("hi there")["input_ids"]
    (friend,) = bos_tokenizer(" friend", add_special_tokens=False)["input_ids"]
    render = CompletionRender(pieces, logprobs=True,
                              echo=echoed_prompt(pieces, "hi there", ids, with_logprobs=True))
    scored = [TokenLogprob(t, -1.0, [(t, -1.0)]) for t in ids[1:]]  # the engine scores all but the first
    render.collect(StreamDelta("r", " friend", [friend], "length", len(ids), 1, [TokenLogprob(friend, -0.5, [])],
                               prompt_logprobs=scored))
    choice = render.choice("length")
    logprobs = choice["logprobs"]
    assert choice["text"] == "hi there friend"
    assert logprobs["tokens"] == ["<|endoftext|>", "hi", " there", " friend"]
    assert logprobs["text_offset"] == [0, 0, 2, 8]  # in order, the completion's right after the prompt
    for token, offset in zip(logprobs["tokens"][1:], logprobs["text_offset"][1:]):
        assert choice["text"][offset:offset + len(token)] == token


# ---- text parts: joined as vLLM joins them ------------------------------------------------------
def test_a_message_s_text_parts_reach_the_model_joined_by_a_newline(smollm2_tokenizer):
    parts = [{"type": "text", "text": "Question:"}, {"type": "text", "text": "What is 2+2?"}]
    server = scripted_server(smollm2_tokenizer, "4")
    answer(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": parts}]})
    assert "<|im_start|>user\nQuestion:\nWhat is 2+2?<|im_end|>" in server.prompts[0], server.prompts[0]


# ---- a chat its template renders to nothing -----------------------------------------------------
def test_a_chat_the_request_s_template_renders_to_nothing_is_refused_naming_that_template(smollm2_tokenizer):
    server = scripted_server(smollm2_tokenizer, "Hello")
    server.trust_request_chat_template = True
    for stream in (False, True):
        err = refusal_of(server, "/v1/chat/completions", {"model": MODEL, "messages": HI, "stream": stream,
                                                          "chat_template": RENDERS_NOTHING})
        assert err.status == 400 and err.param == "messages", err.param
        assert "the request's own chat_template rendered the messages to no tokens" in err.message, err.message
    assert server.prompts == []  # the engine was never asked
    # /tokenize counts it (vLLM's too): 0 tokens is an answer there, not a prompt to complete
    assert answer(server, "/tokenize", {"model": MODEL, "messages": HI, "chat_template": RENDERS_NOTHING})["count"] == 0


def test_a_chat_the_server_s_template_renders_to_nothing_is_refused_naming_the_server_s(smollm2_tokenizer):
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = RENDERS_NOTHING
    server = scripted_server(tokenizer, "Hello")
    server.server_template = True  # as `corelaunch serve --chat-template` sets it
    err = refusal_of(server, "/v1/chat/completions", {"model": MODEL, "messages": HI})
    assert err.status == 400 and err.param == "messages"
    assert "the server's chat template (--chat-template) rendered the messages to no tokens" in err.message
    assert server.prompts == []


# ---- an assistant message with nothing in it ----------------------------------------------------
@pytest.mark.parametrize("message", [{"role": "assistant"}, {"role": "assistant", "content": None},
                                     {"role": "assistant", "tool_calls": []}])
def test_an_assistant_message_with_neither_content_nor_tool_calls_is_refused(message):
    err = refused([*HI, message, *HI])
    assert err.param == "messages.1.content", err.param
    assert "an assistant message needs content or tool_calls" in err.message, err.message


def test_an_assistant_message_with_tool_calls_or_only_its_thinking_is_taken():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    taken = chat([*HI, {"role": "assistant", "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "c1", "content": "r"}]).chat_messages()
    assert taken[1]["content"] == "" and taken[1]["tool_calls"][0]["function"]["name"] == "f"
    for field in ("reasoning", "reasoning_content"):  # a turn cut while it thought: its thinking is the turn
        taken = chat([*HI, {"role": "assistant", field: "let me see"}, *HI]).chat_messages()
        assert taken[1]["reasoning"] == "let me see" and taken[1]["content"] == ""


# ---- a tokenizer's dict of named templates ---------------------------------------------------
# Both kinds of quote, so that str() of the dict escapes the single ones (\'developer\')
KNOWS_DEVELOPER = ("{% for m in messages %}{% if m.role == 'developer' %}DEV{% else %}{{ m.role }}{% endif %}"
                   "{{ \":\" + m.content + \"\\n\" }}{% endfor %}")


def test_the_developer_role_is_kept_for_a_template_from_a_dict_of_named_templates(smollm2_tokenizer):
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = {"default": KNOWS_DEVELOPER, "tool_use": "{{ messages }}"}
    server = scripted_server(tokenizer, "ok")
    answer(server, "/v1/chat/completions", {"model": MODEL,
                                            "messages": [{"role": "developer", "content": "be terse"}, *HI]})
    assert server.prompts[0] == "DEV:be terse\nuser:hi\n", server.prompts[0]  # was "system:be terse..."


# ---- a content or a message of the wrong type ---------------------------------------------------
@pytest.mark.parametrize("content, shown", [(5, "not 5"), ({"type": "text", "text": "a"}, 'not {"type": "text"')])
def test_a_content_that_is_neither_a_string_nor_a_list_is_refused_saying_what_it_may_be(content, shown):
    with pytest.raises(ProtocolError) as caught:
        chat([{"role": "user", "content": content}])
    assert caught.value.param == "messages.0.content"
    assert caught.value.message.startswith("messages.0.content: must be a string or a list of text parts"), \
        caught.value.message  # was pydantic's "Input should be a valid string"
    assert shown in caught.value.message, caught.value.message


def test_a_message_that_is_not_an_object_is_refused_listing_every_role():
    with pytest.raises(ProtocolError) as caught:
        chat(["hi"])
    assert caught.value.param == "messages.0"
    assert "role: system|user|assistant|tool|developer" in caught.value.message, caught.value.message
