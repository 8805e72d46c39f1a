"""A /v1/responses request turned into the /v1/chat/completions body it asks for, which the chat
parser (openai_protocol.ChatCompletionRequest) then checks; what the Response echoes of it; and the
chat parser's refusals told in the Responses request's terms. Pure: dicts in, dicts out (the
answer side: launcher/serving/responses/output.py).

What is mapped (chat_body):
- input: a string is one user message. A list of items: messages ({role: user|system|developer|
  assistant, content: a string or input_text / output_text / text parts, an assistant's refusal parts
  taken as their text}; a type left out or null is a message where a role is given; an output item
  fed back may keep its id (a string) and status (in_progress, completed, incomplete), and an output
  message the output_text parts' annotations and logprobs, which are dropped);
  function_call items become an assistant message's tool_calls (id = call_id), consecutive ones, and
  ones right after an assistant message, joined into that one message, as a chat turn holds its text
  and calls; function_call_output items become tool messages (an output list's input_text parts
  joined); a reasoning item's text (its reasoning_text content, or its summary's text when it has no
  content, as vLLM reads it) becomes the `reasoning` of the next assistant message, and is dropped
  where a user, system or tool message comes first (the chat template would have no turn to put it in).
- instructions: a first system message (an empty string adds none).
- tools: function tools {type, name, description, parameters, strict} in the chat form; [] is no tools.
- tool_choice: "auto", "none", "required", or {type: "function", name}. "auto" and "none" without
  tools are not handed on (nothing to choose from; the chat route would refuse them).
- max_output_tokens is max_completion_tokens; temperature, top_p, top_k, min_p, presence_penalty,
  frequency_penalty, logit_bias, parallel_tool_calls, skip_special_tokens,
  include_stop_str_in_output, seed, stop, repetition_penalty, ignore_eos (vLLM's Responses request
  takes these four too), min_tokens, chat_template_kwargs and include_reasoning go by their own names
  (the chat parser checks their values).
- text.format: text (nothing), json_object and json_schema are the chat's response_format.
- include "message.output_text.logprobs" is the chat's logprobs, top_logprobs its top_logprobs
  (_logprobs).
- reasoning.effort, where given, is the chat's reasoning_effort (openai_protocol.effort_template_kwargs
  says what the template gets). reasoning.summary is
  accepted and echoed; no summary is made (reasoning items carry the whole thinking as content).

What is refused (ProtocolError 400, param = the Responses field path, e.g. input[2].content[0].type,
the message naming the value and the fix): anything this server cannot do rather than silently not
do it. Non-text input (input_image, input_file, input_audio parts); item types other than message,
function_call, function_call_output and reasoning (built-in tool calls, item references); tools other
than functions (this server runs no built-in tools); tool_choice allowed_tools and built-in kinds;
stored state other than kept responses (conversation, a stored prompt, background: true; and
previous_response_id on a server that keeps no responses: send the earlier turns in input);
truncation "auto" (this server never truncates the input); include entries for built-in tools or
images; encrypted reasoning (never made here);
text.verbosity "low" or "high" (the model's length cannot be steered; "medium", the default, is
taken); max_tool_calls other than null (calls are not counted against a limit here;
parallel_tool_calls: false allows one); unknown keys (named, with close matches). A chat-parser
refusal of the translated body names the chat field; responses_param gives the Responses field
back, message indices included (instructions and joined calls shift them).

What the response echoes (ResponsesEcho): instructions, max_output_tokens, parallel_tool_calls
(true by default), temperature and top_p (as sent, else 1, the value sampling used), tool_choice
("auto" by default, as OpenAI shows it) and tools as sent, text (default {"format": {"type": "text"}}),
metadata (default {}), reasoning (default {"effort": null, "summary": null}), user, prompt_cache_key
and safety_identifier (accepted, unused), store (true where the server keeps responses and the request
did not send false; else false, whatever was sent: a later previous_response_id could not find it;
vLLM without its store ignores store too), truncation "disabled", previous_response_id (as sent),
background false, service_tier "default" (the only tier, whatever was
asked), top_logprobs (as sent, else 0), max_tool_calls null. include "message.output_text.logprobs"
asks for the log-probabilities (_logprobs). include "reasoning.encrypted_content" is accepted
(clients that keep no state send it): the reasoning comes back as plain text in its item's content,
which is what to send back. stream_options.include_obfuscation is accepted; no obfuscation is added.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from launcher.serving.openai_protocol import REASONING_EFFORTS as CHAT_EFFORTS
from launcher.serving.openai_protocol import MAX_LOGPROBS, ProtocolError, _json_kind, _short, check_utf8, clip

# ---- what a request takes ---------------------------------------------------------------------
PASSED_AS_IS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "logit_bias",
                "parallel_tool_calls", "skip_special_tokens", "include_stop_str_in_output",
                # vLLM's /v1/responses takes these four too (its ResponsesRequest's extra parameters)
                "seed", "stop", "repetition_penalty", "ignore_eos",
                # the chat route's own extensions, which say the same here
                "min_tokens", "chat_template_kwargs", "include_reasoning")
"""Fields the chat route takes under the same name and meaning (handed on when present and not null)."""

TAKEN = frozenset({
    "model", "input", "instructions", "stream", "stream_options", "tools", "tool_choice", "max_output_tokens",
    "text", "reasoning", "top_logprobs", "include", "store", "metadata", "user", "service_tier",
    "prompt_cache_key", "safety_identifier", "truncation", "max_tool_calls", "previous_response_id",
    "conversation", "prompt", "background", *PASSED_AS_IS})
"""Every key a /v1/responses body may hold (some only at the value that asks for nothing)."""

_CHAT_NAMES = {
    "messages": "send the conversation as input (a string, or a list of message items)",
    "max_tokens": "send max_output_tokens", "max_completion_tokens": "send max_output_tokens",
    "response_format": "send text: {\"format\": ...}",
    "logprobs": "send include: [\"message.output_text.logprobs\"] (and top_logprobs for alternatives)",
}
"""Chat fields sent to this route by mistake, with the Responses field that says it."""

KEEPS_NONE = "this server keeps no responses (`corelaunch serve --responses-store N` keeps up to N)"
NO_STORE = (f"{KEEPS_NONE}, so no earlier response can be continued; send the earlier turns (their input and "
            f"output items) in input")
"""Why previous_response_id is refused by a server started without a response store."""
NOT_KEPT_WHY = ("it was never kept (store: false, or it failed or was cut off before it finished), was deleted, "
                "was the least recently used when the store was full, or the server (or its response store) "
                "restarted since")
"""Why a server that keeps responses has not got one (kept only in memory: a restart loses them all)."""
STILL_GENERATING = ("it is still being generated (a streamed response is kept once it finishes); send this request "
                    "after its final event (response.completed or response.incomplete)")
"""Why a response in flight cannot be continued yet (responses/store.py: in flight)."""

STORED_STATE = {
    "conversation": "no conversations are kept here (the Conversations API is not served); continue a kept "
                    "response with previous_response_id, or send the turns in input",
    "prompt": "no prompt templates are stored here; send the prompt's text as instructions and input",
}
"""Fields that name state kept by OpenAI's server, which this server never keeps."""

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PART_TYPES = ("input_text", "output_text", "text")
NON_TEXT_PART_TYPES = ("input_image", "input_file", "input_audio")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
ITEM_STATUSES = ("in_progress", "completed", "incomplete")
"""The statuses an output item fed back may carry (OpenAI's)."""
TOOL_CHOICES = ("auto", "none", "required")
REASONING_EFFORTS = tuple(effort for effort in CHAT_EFFORTS if effort != "max")
"""OpenAI's Responses efforts (the chat route also takes vLLM's "max": openai_protocol.REASONING_EFFORTS)."""
REASONING_SUMMARIES = ("auto", "concise", "detailed")
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
"""OpenAI's bounds on metadata."""

_ITEM_KEYS = {
    "message": {"type", "role", "content", "id", "status", "phase"},
    "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
    "function_call_output": {"type", "call_id", "output", "id", "status"},
    "reasoning": {"type", "id", "summary", "content", "encrypted_content", "status"},
}
"""Each item type's keys: the input form's, and the output form's a client feeds back (id, status)."""
_PART_KEYS = {"type", "text", "annotations", "logprobs"}
_REFUSAL_PART_KEYS = {"type", "refusal"}
"""An assistant's refusal part (OpenAI's output may hold one): its text is the refusal."""
_FUNCTION_TOOL_KEYS = ("name", "description", "parameters", "strict")


# ---- the echo ---------------------------------------------------------------------------------
@dataclass
class _MessagePlace:
    """Where one chat message's fields came from in the Responses request, as paths."""

    whole: str
    """The item that made the message (input[3]), or instructions, or input for a string input."""
    content: str | None = None
    """Its content's path: input[3].content, input[4].output (a tool message), instructions, input."""
    calls: list[str] = field(default_factory=list)
    """Each tool call's item, in the message's tool_calls order."""
    reasoning: str | None = None
    """The reasoning item whose text the message carries."""


@dataclass
class ResponsesEcho:
    """What the Response object says back about the request (module docstring: the defaults)."""

    instructions: str | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool = True
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    tool_choice: str | dict = "auto"
    tools: list = field(default_factory=list)
    text: dict = field(default_factory=lambda: {"format": {"type": "text"}})
    metadata: dict = field(default_factory=dict)
    reasoning: dict = field(default_factory=lambda: {"effort": None, "summary": None})
    user: str | None = None
    store: bool = False
    truncation: str = "disabled"
    previous_response_id: str | None = None
    background: bool = False
    service_tier: str = "default"
    top_logprobs: int = 0
    max_tool_calls: None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    _places: list[_MessagePlace] = field(default_factory=list, repr=False, compare=False)
    """Chat message index -> where it came from (responses_param reads it)."""


# ---- the request ------------------------------------------------------------------------------
def chat_body(body: dict, history: list | None = None, keeping: bool = False) -> tuple[dict, ResponsesEcho]:
    """The /v1/chat/completions body a Responses request asks for, and what its response echoes.
    history: the items of the conversation its previous_response_id continues (the response store's
    history), which come after the instructions and before the input; keeping: the server keeps
    responses (the echo's store says whether this one is kept). ProtocolError 400 naming the
    Responses field for anything refused (module docstring)."""
    if not isinstance(body, dict):
        raise ProtocolError(f"the request body must be a JSON object, not {_json_kind(body)}")
    _check_keys(body)
    _refuse_stored_state(body)
    echo = ResponsesEcho()
    echo.previous_response_id = previous_response_id(body, keeping)
    if echo.previous_response_id is not None and history is None:
        raise ValueError("chat_body: previous_response_id was sent and no history was given for it")
    echo.store = keeping and body.get("store") is not False
    chat: dict = {}
    if body.get("model") is not None:
        chat["model"] = body["model"]
    if body.get("stream") is not None:
        chat["stream"] = body["stream"]
    _check_stream_options(body.get("stream_options"))
    chat["messages"] = _messages(body, echo, history or [])
    _tools(body, chat, echo)
    _sampling(body, chat, echo)
    _text_format(body.get("text"), chat, echo)
    _reasoning(body.get("reasoning"), chat, echo)
    _logprobs(body, chat, echo)
    _echoed_only(body, echo)
    return chat, echo


def _check_keys(body: dict) -> None:
    for key in body:
        if key in TAKEN:
            continue
        hint = _CHAT_NAMES.get(key)
        close = difflib.get_close_matches(str(key), sorted(TAKEN), n=3, cutoff=0.7)
        fix = hint or (f"did you mean {' or '.join(repr(c) for c in close)}?" if close else
                       f"/v1/responses takes: {', '.join(sorted(TAKEN))}")
        raise ProtocolError(f"unknown parameter {clip(str(key))!r}; {fix}", param=clip(str(key)))


def previous_response_id(body: dict, keeping: bool) -> str | None:
    """The response a request continues (checked: a string), or None; refused where the server keeps
    no responses (keeping False)."""
    given = body.get("previous_response_id")
    if given is None:
        return None
    if not keeping:
        raise ProtocolError(f"previous_response_id ({_short(given)}) is not supported: {NO_STORE}",
                            param="previous_response_id")
    if not isinstance(given, str) or not given:
        raise ProtocolError(f"previous_response_id ({_short(given)}) must be the id of an earlier response "
                            f"(\"resp_...\")", param="previous_response_id")
    return given


def turn_items(body: dict) -> list:
    """The request's input as items (a string input is one user message), which the store keeps as
    its turn. Call it on a body chat_body took."""
    given = body["input"]
    return [{"type": "message", "role": "user", "content": given}] if isinstance(given, str) else list(given)


def _refuse_stored_state(body: dict) -> None:
    for name, why in STORED_STATE.items():
        if body.get(name) is not None:
            raise ProtocolError(f"{name} ({_short(body[name])}) is not supported: {why}", param=name)
    # `is`, not `in`: 0 == False in Python, and a 0 let through read as a request to keep
    if body.get("background") is not None and body["background"] is not False:
        raise ProtocolError(f"background ({_short(body['background'])}) is not supported: no response runs "
                            f"in the background to poll later; leave it out (or false) and wait for the response, "
                            f"or stream it", param="background")
    if body.get("store") is not None and not isinstance(body["store"], bool):
        raise ProtocolError(f"store ({_short(body['store'])}) must be true or false", param="store")


def _check_stream_options(options) -> None:
    if options is None:
        return
    if not isinstance(options, dict) or any(key != "include_obfuscation" for key in options) or \
            options.get("include_obfuscation") is not None and not isinstance(options["include_obfuscation"], bool):
        raise ProtocolError(f"stream_options ({_short(options)}) must be an object {{\"include_obfuscation\": "
                            f"true or false}} (no obfuscation is added either way)", param="stream_options")


def _text(value, param: str, what: str = "a string") -> None:
    if value is None:
        raise ProtocolError(f"{param} is required: {what}", param=param)
    if not isinstance(value, str):
        raise ProtocolError(f"{param} ({_short(value)}) must be {what}", param=param)


# ---- input -> messages ------------------------------------------------------------------------
class _Conversation:
    """The chat messages being made from input items, with where each came from."""

    def __init__(self, echo: ResponsesEcho):
        self.messages: list[dict] = []
        self.places = echo._places
        self.pending_reasoning: tuple[str, str] | None = None
        """(text, path) of reasoning waiting for the next assistant message."""
        self.last_was_assistant = False
        """Whether the last message is an assistant turn that a function call may join."""
        self.call_ids: set[str] = set()
        """The call_id of every function call so far, which a function_call_output answers."""

    def add(self, message: dict, place: _MessagePlace) -> None:
        if message["role"] == "assistant":
            self._give_reasoning(message, place)
        else:
            self.pending_reasoning = None  # no assistant turn of its own to carry it: dropped
        self.messages.append(message)
        self.places.append(place)
        self.last_was_assistant = message["role"] == "assistant"

    def add_call(self, call: dict, path: str) -> None:
        self.call_ids.add(call["id"])
        if self.last_was_assistant:
            message, place = self.messages[-1], self.places[-1]
            message.setdefault("tool_calls", []).append(call)
            place.calls.append(path)
            self._give_reasoning(message, place)
        else:
            self.add({"role": "assistant", "tool_calls": [call]}, _MessagePlace(path, calls=[path]))

    def add_reasoning(self, text: str, path: str) -> None:
        if self.pending_reasoning is not None:  # two in a row: both are the next turn's thinking
            text = f"{self.pending_reasoning[0]}\n{text}"
            path = self.pending_reasoning[1]
        self.pending_reasoning = (text, path)

    def _give_reasoning(self, message: dict, place: _MessagePlace) -> None:
        if self.pending_reasoning is None:
            return
        text, path = self.pending_reasoning
        message["reasoning"] = f"{message['reasoning']}\n{text}" if message.get("reasoning") else text
        place.reasoning = place.reasoning or path
        self.pending_reasoning = None


def _messages(body: dict, echo: ResponsesEcho, history: list) -> list[dict]:
    conversation = _Conversation(echo)
    instructions = body.get("instructions")
    if instructions is not None:
        _text(instructions, "instructions")
        echo.instructions = instructions
        if instructions:
            conversation.add({"role": "system", "content": instructions},
                             _MessagePlace("instructions", content="instructions"))
    for item in history:  # the kept turns were taken once already; a refusal names where they came from
        _add_item(conversation, item, "previous_response_id")
    given = body.get("input")
    if conversation.pending_reasoning is not None and not _continues_the_assistant(given):
        # a kept turn cut while it thought: its own (empty) assistant turn, not two user turns in a row
        conversation.add({"role": "assistant", "content": ""}, _MessagePlace("previous_response_id"))
    if given is None:
        raise ProtocolError("input is required: a string (the user's message) or a list of items (messages, "
                            "function calls and their outputs)", param="input")
    if isinstance(given, str):
        conversation.add({"role": "user", "content": given}, _MessagePlace("input", content="input"))
        return conversation.messages
    if not isinstance(given, list):
        raise ProtocolError(f"input ({_short(given)}) must be a string or a list of items", param="input")
    if not given:
        raise ProtocolError("input is an empty list; send at least one item (a message {\"role\": \"user\", "
                            "\"content\": ...}), or a string", param="input")
    kept_ids = {item.get("id") for item in history if isinstance(item, dict)} - {None}
    for i, item in enumerate(given):
        _add_item(conversation, item, f"input[{i}]")
        if item.get("id") in kept_ids:
            raise ProtocolError(f"Duplicate item found with id {clip(item['id'])!r}: input[{i}] is already in the "
                                f"conversation previous_response_id continues; send only the new items (the kept "
                                f"ones come first by themselves)", param=f"input[{i}].id")
    return conversation.messages


def _continues_the_assistant(given) -> bool:
    """Whether the input opens with an assistant message or a function call (which take pending
    reasoning themselves)."""
    first = given[0] if isinstance(given, list) and given else None
    return isinstance(first, dict) and (first.get("role") == "assistant" or first.get("type") == "function_call")


def _add_item(conversation: _Conversation, item, path: str) -> None:
    if not isinstance(item, dict):
        raise ProtocolError(f"{path} ({_short(item)}) must be an item, an object such as {{\"role\": \"user\", "
                            f"\"content\": ...}}", param=path)
    kind = item.get("type")
    if kind is None:  # a type left out, or null: a message when it has a role
        kind = "message" if "role" in item else None
    if kind not in ITEM_TYPES:
        what = "has no type (nor a role)" if kind is None else f"type {_short(kind)} is not supported"
        raise ProtocolError(f"{path}.type: the item {what}; this server takes the item types "
                            f"{', '.join(ITEM_TYPES)} (no built-in tools, no item references)",
                            param=f"{path}.type")
    for key in item:
        if key not in _ITEM_KEYS[kind] and item[key] is not None:
            raise ProtocolError(f"unknown key {clip(str(key))!r} in {path}; a {kind} item takes "
                                f"{', '.join(sorted(_ITEM_KEYS[kind]))}", param=f"{path}.{clip(str(key))}")
    _check_id_and_status(item, path)
    if kind == "message":
        _add_message(conversation, item, path)
    elif kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            _text(item.get(key), f"{path}.{key}")
        conversation.add_call({"id": item["call_id"], "type": "function",
                               "function": {"name": item["name"], "arguments": item["arguments"]}}, path)
    elif kind == "function_call_output":
        _text(item.get("call_id"), f"{path}.call_id")
        check_utf8(item["call_id"], f"{path}.call_id")
        output = _output_text(item, path)
        _check_answered_call(conversation, item["call_id"], path)
        conversation.add({"role": "tool", "tool_call_id": item["call_id"], "content": output},
                         _MessagePlace(path, content=f"{path}.output"))
    else:
        conversation.add_reasoning(_reasoning_text(item, path), path)


def _check_answered_call(conversation: _Conversation, call_id: str, path: str) -> None:
    """A function call's output answers a call made before it, in input or in the kept turns
    previous_response_id continues (OpenAI refuses one that answers none). The kept turns are not
    checked again: they were taken once already."""
    if path.startswith("input") and call_id not in conversation.call_ids:
        raise ProtocolError(f"No tool call found for function call output with call_id {clip(call_id)!r}: "
                            f"{path} answers no function_call item before it; send the function_call (with "
                            f"that call_id) before its output, in input or in the response previous_response_id "
                            f"continues", param=f"{path}.call_id")


def _check_id_and_status(item: dict, path: str) -> None:
    """An item fed back keeps its id and status (a kept turn lists them): the id a string (an item
    id, which a listing's `after` names), the status OpenAI's."""
    if item.get("id") is not None and not isinstance(item["id"], str):
        raise ProtocolError(f"{path}.id ({_short(item['id'])}) must be a string, the item's id (\"msg_...\"), "
                            f"or left out", param=f"{path}.id")
    if item.get("id") is not None:  # kept and listed back: JSON must be able to write it
        check_utf8(item["id"], f"{path}.id")
    if item.get("status") is not None and item["status"] not in ITEM_STATUSES:
        raise ProtocolError(f"{path}.status ({_short(item['status'])}) must be one of {', '.join(ITEM_STATUSES)}, "
                            f"or left out", param=f"{path}.status")


def _add_message(conversation: _Conversation, item: dict, path: str) -> None:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise ProtocolError(f"{path}.role ({_short(role)}) must be one of {', '.join(MESSAGE_ROLES)} (a tool's "
                            f"result is a function_call_output item)", param=f"{path}.role")
    message = {"role": role}
    content = item.get("content")
    if isinstance(content, list):
        message["content"] = [_text_part(part, f"{path}.content[{j}]", refusal=role == "assistant")
                              for j, part in enumerate(content)]
    elif content is not None:
        _text(content, f"{path}.content", "a string or a list of text parts")
        message["content"] = content
    conversation.add(message, _MessagePlace(path, content=f"{path}.content"))


def _text_part(part, path: str, refusal: bool = False) -> dict:
    """A content part as the chat's text part ({"type": "text", "text"}); the rest refused.
    refusal: an assistant's part, which may be a refusal (history exported from OpenAI holds them),
    taken as its text."""
    if not isinstance(part, dict):
        raise ProtocolError(f"{path} ({_short(part)}) must be a content part, {{\"type\": \"input_text\", "
                            f"\"text\": ...}}", param=path)
    kind = part.get("type")
    if refusal and kind == "refusal":
        return _refusal_part(part, path)
    if kind in NON_TEXT_PART_TYPES:
        raise ProtocolError(f"{path}.type ({kind!r}) is not supported: this server takes text only; send "
                            f"input_text parts", param=f"{path}.type")
    if kind not in TEXT_PART_TYPES:
        taken = (*TEXT_PART_TYPES, "refusal") if refusal else TEXT_PART_TYPES
        raise ProtocolError(f"{path}.type ({_short(kind)}) is not supported; a part is one of "
                            f"{', '.join(taken)}, {{\"type\": \"input_text\", \"text\": ...}}",
                            param=f"{path}.type")
    _refuse_unknown_keys(part, _PART_KEYS, f"text part {path}", '{"type": "input_text", "text": ...}', path)
    _text(part.get("text"), f"{path}.text")
    return {"type": "text", "text": part["text"]}


def _refusal_part(part: dict, path: str) -> dict:
    _refuse_unknown_keys(part, _REFUSAL_PART_KEYS, f"refusal part {path}", '{"type": "refusal", "refusal": ...}',
                         path)
    _text(part.get("refusal"), f"{path}.refusal")
    return {"type": "text", "text": part["refusal"]}


def _refuse_unknown_keys(part: dict, known, what: str, shape: str, path: str) -> None:
    for key in part:
        if key not in known and part[key] is not None:
            raise ProtocolError(f"unknown key {clip(str(key))!r} in {what}; a {what.split()[0]} part is {shape}",
                                param=f"{path}.{clip(str(key))}")


def _output_text(item: dict, path: str) -> str:
    output = item.get("output")
    if isinstance(output, str):
        return output
    if not isinstance(output, list):
        raise ProtocolError(f"{path}.output ({_short(output)}) must be a string or a list of input_text parts",
                            param=f"{path}.output")
    texts = []
    for j, part in enumerate(output):
        if isinstance(part, dict) and part.get("type") != "input_text":
            raise ProtocolError(f"{path}.output[{j}].type ({_short(part.get('type'))}) is not supported: this "
                                f"server takes text only; send input_text parts", param=f"{path}.output[{j}].type")
        texts.append(_text_part(part, f"{path}.output[{j}]")["text"])
    return "\n".join(texts)  # as a chat tool message's text parts are joined (ChatMessage.text: vLLM's rule)


def _reasoning_text(item: dict, path: str) -> str:
    if item.get("encrypted_content") is not None:
        raise ProtocolError(f"{path}.encrypted_content: encrypted reasoning is not supported (this server never "
                            f"encrypts it); send the reasoning's text as content [{{\"type\": \"reasoning_text\", "
                            f"\"text\": ...}}]", param=f"{path}.encrypted_content")
    texts = {}
    for key, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key) or []
        if not isinstance(parts, list):
            raise ProtocolError(f"{path}.{key} ({_short(parts)}) must be a list of {part_type} parts",
                                param=f"{path}.{key}")
        for j, part in enumerate(parts):
            if not isinstance(part, dict) or part.get("type") != part_type:
                raise ProtocolError(f"{path}.{key}[{j}] ({_short(part)}) must be {{\"type\": \"{part_type}\", "
                                    f"\"text\": ...}}", param=f"{path}.{key}[{j}]")
            _text(part.get("text"), f"{path}.{key}[{j}].text")
        texts[key] = "".join(part["text"] for part in parts)
    return texts["content"] or texts["summary"]  # a summary only where the thinking itself is absent (vLLM's)


# ---- tools ------------------------------------------------------------------------------------
def _tools(body: dict, chat: dict, echo: ResponsesEcho) -> None:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise ProtocolError(f"tools ({_short(tools)}) must be a list of function tools {{\"type\": "
                                f"\"function\", \"name\", \"parameters\"}}", param="tools")
        if tools:
            chat["tools"] = [_chat_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
        echo.tools = tools
    choice = body.get("tool_choice")
    if choice is None:
        return
    echo.tool_choice = choice
    if isinstance(choice, str) and choice in TOOL_CHOICES:
        if choice == "required" or chat.get("tools"):  # "auto"/"none" with no tools: nothing to choose
            chat["tool_choice"] = choice
        return
    if isinstance(choice, dict) and choice.get("type") == "function":
        extra = next((key for key in choice if key not in ("type", "name")), None)
        if extra is not None:
            raise ProtocolError(f"unknown key {clip(str(extra))!r} in tool_choice; a named function is "
                                f"{{\"type\": \"function\", \"name\": ...}}", param=f"tool_choice.{clip(str(extra))}")
        _text(choice.get("name"), "tool_choice.name", "a string, one of the tools' names")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        return
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        raise ProtocolError("tool_choice.type (\"allowed_tools\") is not supported: send only the allowed "
                            "functions as tools, with tool_choice \"auto\" or \"required\"", param="tool_choice.type")
    if isinstance(choice, dict):
        raise ProtocolError(f"tool_choice.type ({_short(choice.get('type'))}) is not supported: only function "
                            f"tools; this server runs no built-in tools. Send \"auto\", \"none\", \"required\" or "
                            f"{{\"type\": \"function\", \"name\": ...}}", param="tool_choice.type")
    raise ProtocolError(f"tool_choice ({_short(choice)}) must be \"auto\", \"none\", \"required\" or "
                        f"{{\"type\": \"function\", \"name\": ...}}", param="tool_choice")


def _chat_tool(tool, path: str) -> dict:
    if not isinstance(tool, dict):
        raise ProtocolError(f"{path} ({_short(tool)}) must be a function tool {{\"type\": \"function\", \"name\", "
                            f"\"parameters\"}}", param=path)
    if tool.get("type") != "function":
        raise ProtocolError(f"{path}.type ({_short(tool.get('type'))}) is not supported: only function tools; this "
                            f"server runs no built-in tools (web search, file search, MCP, code interpreter, "
                            f"computer use...): run them yourself and describe them as functions",
                            param=f"{path}.type")
    for key in tool:
        if key != "type" and key not in _FUNCTION_TOOL_KEYS and tool[key] is not None:
            raise ProtocolError(f"unknown key {clip(str(key))!r} in {path}; a function tool takes type, "
                                f"{', '.join(_FUNCTION_TOOL_KEYS)}", param=f"{path}.{clip(str(key))}")
    return {"type": "function",
            "function": {key: tool[key] for key in _FUNCTION_TOOL_KEYS if tool.get(key) is not None}}


# ---- sampling, format, reasoning --------------------------------------------------------------
def _sampling(body: dict, chat: dict, echo: ResponsesEcho) -> None:
    for name in PASSED_AS_IS:
        if body.get(name) is not None:
            chat[name] = body[name]
    for name in ("temperature", "top_p", "parallel_tool_calls"):
        if body.get(name) is not None:
            setattr(echo, name, body[name])
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = echo.max_output_tokens = body["max_output_tokens"]


def _text_format(text, chat: dict, echo: ResponsesEcho) -> None:
    if text is None:
        return
    if not isinstance(text, dict):
        raise ProtocolError(f"text ({_short(text)}) must be an object {{\"format\": {{\"type\": \"text\"}}}}",
                            param="text")
    extra = next((key for key in text if key not in ("format", "verbosity")), None)
    if extra is not None:
        raise ProtocolError(f"unknown key {clip(str(extra))!r} in text; it takes format and verbosity",
                            param=f"text.{clip(str(extra))}")
    verbosity = text.get("verbosity")
    if verbosity not in (None, "medium"):
        raise ProtocolError(f"text.verbosity ({_short(verbosity)}) is not supported: this server cannot make the "
                            f"model's answers shorter or longer; leave it out (or \"medium\"), and ask for the "
                            f"length in instructions", param="text.verbosity")
    form = text.get("format")
    _check_echoed_text(form, "text.format")
    echo.text = {**text, "format": form if form is not None else {"type": "text"}}
    if form is None:
        return
    if not isinstance(form, dict):
        raise ProtocolError(f"text.format ({_short(form)}) must be an object {{\"type\": \"text\"}}, {{\"type\": "
                            f"\"json_object\"}} or {{\"type\": \"json_schema\", \"name\", \"schema\"}}",
                            param="text.format")
    kind = form.get("type")
    if kind == "json_schema":  # its keys go to the chat's json_schema, whose parser names any bad one
        chat["response_format"] = {"type": "json_schema",
                                   "json_schema": {key: value for key, value in form.items() if key != "type"}}
        return
    if kind not in ("text", "json_object"):
        raise ProtocolError(f"text.format.type ({_short(kind)}) must be \"text\", \"json_object\" or "
                            f"\"json_schema\"", param="text.format.type")
    extra = next((key for key in form if key != "type"), None)
    if extra is not None:
        raise ProtocolError(f"unknown key {clip(str(extra))!r} in text.format; {{\"type\": \"{kind}\"}} takes no "
                            f"other key", param=f"text.format.{clip(str(extra))}")
    if kind == "json_object":
        chat["response_format"] = {"type": "json_object"}


def _check_echoed_text(value, param: str) -> None:
    """Every string of an echoed value (keys too), as check_utf8 checks text: the response echoing
    it could not be written, nor a kept one read back. A bad key is named by the object holding it.
    Walked with a list, not recursion: a schema may nest deeper than Python's stack."""
    left = [(value, param)]
    while left:
        value, param = left.pop()
        if isinstance(value, str):
            check_utf8(value, param)
        elif isinstance(value, dict):
            for key, inner in value.items():
                check_utf8(str(key), param)
                left.append((inner, _deeper(param, f".{clip(str(key))}")))
        elif isinstance(value, list):
            left.extend((inner, _deeper(param, f"[{i}]")) for i, inner in enumerate(value))


def _deeper(param: str, step: str) -> str:
    """param followed by step, up to a few hundred characters (deeper, a path names where it goes
    on: no 40 kB paths for a deeply nested schema)."""
    return param if len(param) > 300 else param + step


def _reasoning(reasoning, chat: dict, echo: ResponsesEcho) -> None:
    if reasoning is None:
        return
    if not isinstance(reasoning, dict):
        raise ProtocolError(f"reasoning ({_short(reasoning)}) must be an object {{\"effort\": ..., \"summary\": "
                            f"...}}", param="reasoning")
    for key in reasoning:
        if key not in ("effort", "summary", "generate_summary"):
            raise ProtocolError(f"unknown key {clip(str(key))!r} in reasoning; it takes effort and summary",
                                param=f"reasoning.{clip(str(key))}")
    effort = reasoning.get("effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise ProtocolError(f"reasoning.effort ({_short(effort)}) must be one of {', '.join(REASONING_EFFORTS)}",
                            param="reasoning.effort")
    for name in ("summary", "generate_summary"):  # generate_summary: its older name, checked alike
        given = reasoning.get(name)
        if given is not None and given not in REASONING_SUMMARIES:
            raise ProtocolError(f"reasoning.{name} ({_short(given)}) must be one of {', '.join(REASONING_SUMMARIES)} "
                                f"(no summary is made: the reasoning item carries the whole thinking)",
                                param=f"reasoning.{name}")
    summary = reasoning["summary"] if reasoning.get("summary") is not None else reasoning.get("generate_summary")
    echo.reasoning = {"effort": effort, "summary": summary}
    if effort is not None:  # the chat's own field, which hands it to the template as vLLM 0.32 does
        chat["reasoning_effort"] = effort


def _logprobs(body: dict, chat: dict, echo: ResponsesEcho) -> None:
    """include "message.output_text.logprobs" asks for the answer's log-probabilities, top_logprobs
    for that many alternatives at each token (the chat's logprobs and top_logprobs, which check the
    bound); top_logprobs alone asks for none (vLLM's rule), and is echoed."""
    top = body.get("top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_LOGPROBS):
        raise ProtocolError(f"top_logprobs ({_short(top)}) must be an integer from 0 to {MAX_LOGPROBS}",
                            param="top_logprobs")
    echo.top_logprobs = top or 0
    include = body.get("include")
    if include is None:
        return
    if not isinstance(include, list):
        raise ProtocolError(f"include ({_short(include)}) must be a list of strings", param="include")
    for i, entry in enumerate(include):
        if entry == "reasoning.encrypted_content":
            continue  # the reasoning is sent in the clear: its content is what to send back
        if entry == "message.output_text.logprobs":
            chat["logprobs"], chat["top_logprobs"] = True, top or 0
            continue
        raise ProtocolError(f"include[{i}] ({_short(entry)}) is not supported: this server has no built-in tools "
                            f"and takes no images; only \"message.output_text.logprobs\" and "
                            f"\"reasoning.encrypted_content\" are taken (the reasoning comes back as plain "
                            f"text)", param=f"include[{i}]")


def _echoed_only(body: dict, echo: ResponsesEcho) -> None:
    """Fields that change nothing in the answer, checked and echoed."""
    for name in ("user", "prompt_cache_key", "safety_identifier"):
        if body.get(name) is not None:
            _text(body[name], name)
            check_utf8(body[name], name)  # echoed: the response could not be written
            setattr(echo, name, body[name])
    tier = body.get("service_tier")
    if tier is not None and tier not in SERVICE_TIERS:
        raise ProtocolError(f"service_tier ({_short(tier)}) must be one of {', '.join(SERVICE_TIERS)} (this server "
                            f"has one tier, \"default\")", param="service_tier")
    if body.get("truncation") not in (None, "disabled"):
        raise ProtocolError(f"truncation ({_short(body['truncation'])}) is not supported: this server never "
                            f"truncates the input; send a shorter one, and leave truncation out (or \"disabled\")",
                            param="truncation")
    if body.get("max_tool_calls") is not None:
        raise ProtocolError(f"max_tool_calls ({_short(body['max_tool_calls'])}) is not supported: calls are not "
                            f"counted against a limit here; leave it out (parallel_tool_calls: false allows one "
                            f"call per response)", param="max_tool_calls")
    echo.metadata = _metadata(body.get("metadata"))


def _metadata(metadata) -> dict:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise ProtocolError(f"metadata ({_short(metadata)}) must be an object of strings", param="metadata")
    if len(metadata) > MAX_METADATA_KEYS:
        raise ProtocolError(f"metadata has {len(metadata)} keys; at most {MAX_METADATA_KEYS} are allowed",
                            param="metadata")
    for key, value in metadata.items():
        check_utf8(key, "metadata")  # named by the field: the key itself cannot be written
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise ProtocolError(f"metadata key {clip(key)!r} is {len(key)} characters long; at most "
                                f"{MAX_METADATA_KEY_CHARS} are allowed", param="metadata")
        if not isinstance(value, str) or len(value) > MAX_METADATA_VALUE_CHARS:
            raise ProtocolError(f"metadata[{clip(key)!r}] ({_short(value)}) must be a string of at most "
                                f"{MAX_METADATA_VALUE_CHARS} characters", param=f"metadata.{clip(key)}")
        check_utf8(value, f"metadata.{clip(key)}")
    return dict(metadata)


# ---- a continued conversation too long for the context ------------------------------------------
START_ANEW = ("start a new conversation: send in input only the turns to keep, without previous_response_id "
              "(truncation \"auto\" is not supported: this server never drops turns itself)")
"""The way out of a kept conversation that leaves no room: the client chooses the turns to keep."""


def kept_message_count(echo: ResponsesEcho) -> int:
    """How many of the chat messages, the first ones, are the instructions and the kept turns
    previous_response_id continues (0 without it): those before the request's own input."""
    ends = [i + 1 for i, place in enumerate(echo._places) if place.whole == "previous_response_id"]
    return ends[-1] if ends else 0


def conversation_too_long(kept_tokens: int, prompt_tokens: int | None, most: int, why_most: str,
                          instructions: bool) -> ProtocolError:
    """The refusal of a continued conversation's prompt longer than a prompt here may be (`most`
    tokens, `why_most` saying why), in the terms the client can act on: the kept conversation's
    tokens (kept_tokens, with this request's instructions where it has some) and its own input's
    (prompt_tokens less those; None where the prompt was too long to count exactly)."""
    kept = f"the conversation previous_response_id continues{' (with the instructions)' if instructions else ''}"
    if kept_tokens >= most:
        return ProtocolError(f"previous_response_id: {kept} takes {kept_tokens} tokens in the chat template, and a "
                             f"prompt here has at most {most} ({why_most}): no room is left for new input; "
                             f"{START_ANEW}", param="previous_response_id", code="context_length_exceeded")
    own = (f"this request's input the other {max(0, prompt_tokens - kept_tokens)}" if prompt_tokens is not None
           else f"this request's input more than the {most - kept_tokens} left")
    return ProtocolError(f"the prompt{'' if prompt_tokens is None else f' has {prompt_tokens} tokens and'} is longer "
                         f"than a prompt here may be, at most {most} tokens ({why_most}): {kept} takes "
                         f"{kept_tokens} of them and {own}; shorten the input, or {START_ANEW}",
                         param="input", code="context_length_exceeded")


# ---- chat refusals named in the Responses request's terms ---------------------------------------
_RENAMED = [  # (chat prefix, Responses prefix), longest first
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("tool_choice.function", "tool_choice"),
    ("reasoning_effort", "reasoning.effort"),
]
_CALL_FIELDS = {"id": "call_id", "type": "type", "function": "", "function.name": "name",
                "function.arguments": "arguments"}
"""A message's tool call's fields (tool_calls.M.X) as the function_call item names them."""


def responses_param(chat_param: str | None, echo: ResponsesEcho | None = None) -> str | None:
    """The Responses field behind a chat parser's `param` (messages.2.content.0 -> input[1].content[0],
    max_completion_tokens -> max_output_tokens, response_format.json_schema.schema -> text.format.schema,
    tools.0.function.name -> tools[0].name, tool_choice.function.name -> tool_choice.name); `echo`,
    chat_body's, says which item each message came from (without it a message is only "input").
    Anything else is unchanged."""
    if chat_param is None:
        return None
    parts = chat_param.split(".")
    if parts[0] == "messages":
        return _message_param(parts[1:], echo)
    if parts[0] == "tools" and len(parts) > 1 and parts[1].isdigit():
        rest = parts[2:][1:] if parts[2:3] == ["function"] else parts[2:]
        return _path(f"tools[{parts[1]}]", rest)
    for chat, responses in _RENAMED:
        if chat_param == chat or chat_param.startswith(chat + "."):
            return _path(responses, chat_param[len(chat):].split(".")[1:])
    return chat_param


def _path(head: str, rest: list[str]) -> str:
    """head followed by rest, indices written [n] as the Responses paths write them."""
    return head + "".join(f"[{part}]" if part.isdigit() else f".{part}" for part in rest)


def _message_param(parts: list[str], echo: ResponsesEcho | None) -> str:
    if not parts or not parts[0].isdigit() or echo is None or int(parts[0]) >= len(echo._places):
        return "input"
    place, rest = echo._places[int(parts[0])], parts[1:]
    field_name = rest[0] if rest else None
    if field_name == "content" and place.content is not None:
        return _path(place.content, rest[1:])
    if field_name == "tool_calls" and place.calls:
        call = int(rest[1]) if len(rest) > 1 and rest[1].isdigit() else 0
        inner = ".".join(rest[2:])
        named = _CALL_FIELDS.get(inner)
        where = place.calls[min(call, len(place.calls) - 1)]
        return where if not named else f"{where}.{named}"
    if field_name in ("reasoning", "reasoning_content") and place.reasoning is not None:
        return f"{place.reasoning}.content"
    if field_name == "tool_call_id":
        return f"{place.whole}.call_id"
    if field_name == "role" and place.whole.startswith("input["):
        return f"{place.whole}.role"
    return place.whole
