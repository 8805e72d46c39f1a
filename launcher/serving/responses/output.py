"""The chat route's answer told in the Responses API's shapes: the usage, the output items of a
whole answer and the Response object (output_items, response_object), and the stream's events
(ResponseEvents), framed by sse. Pure: dicts in, dicts and strings out (the request side:
launcher/serving/responses/request.py).

The stream (ResponseEvents), framed by sse as vLLM frames it ("event: TYPE" and "data: JSON"; no
[DONE]: the stream ends with response.completed, response.incomplete or response.failed):
  response.created, response.in_progress (the response with status in_progress, no output);
  per item, in output order: response.output_item.added (status in_progress), then
    reasoning: response.content_part.added (an empty reasoning_text part), response.reasoning_text.delta...,
      response.reasoning_text.done, response.content_part.done;
    message: response.content_part.added (an empty output_text part), response.output_text.delta...
      (each with the logprobs, where asked, of the tokens up to its text not carried before),
      response.output_text.done, response.content_part.done (with the message's logprobs);
    function_call: response.function_call_arguments.delta... (the item is added with arguments ""),
      response.function_call_arguments.done (the whole arguments and the name);
  then response.output_item.done with the whole item. A reasoning or message item is closed when
  output of another kind begins; a function call stays open (its pieces go to its item by the
  chat's index) until reasoning, content or another call comes, or the end, which closes every open
  item in output order: each item is done before the next one is added. An answer with no output
  at all still gets one empty message, as output_items gives it.
  Content while a call is open means the chat's reader turned that call back into text (the
  length limit cut its JSON, or it held no call): the call is closed as incomplete and left out of
  the response, and the message after it joins the message before it, so the response holds the
  whole answer's items (one message, all text), and a kept turn no broken call.
  Last: response.completed (response.incomplete, incomplete_details.reason "max_output_tokens",
  for a length finish) holding every item whole (but such calls) and the usage; where the server
  gives finish() the whole answer's items (it does: the answer read whole at its end), the response
  holds those, with the ids and call ids of the streamed items they match, so it and the kept turn
  are the whole answer's even where a cut turned calls already streamed back to text; or, on a failure
  after the stream began, an "error" event and response.failed (store false: it is not kept).
  sequence_number counts every event from 0.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
import uuid
from dataclasses import dataclass, field

from launcher.serving.openai_protocol import sse_event
from launcher.serving.responses.request import ResponsesEcho


# ---- the answer -------------------------------------------------------------------------------
def usage(chat_usage: dict) -> dict:
    """The chat usage in the Responses form. cache_write_tokens (which the client's type requires) is
    0: prefix caching keeps blocks by itself; no prompt is written to a cache the API names."""
    prompt_details = chat_usage.get("prompt_tokens_details") or {}
    completion_details = chat_usage.get("completion_tokens_details") or {}
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": prompt_details.get("cached_tokens") or 0,
                                     "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": completion_details.get("reasoning_tokens") or 0},
            "total_tokens": chat_usage["prompt_tokens"] + chat_usage["completion_tokens"]}


def response_object(response_id: str, created_at: int, model: str, echo: ResponsesEcho, output: list[dict],
                    status: str, usage_: dict | None, incomplete_reason: str | None = None,
                    error: dict | None = None) -> dict:
    """The whole Response object: the answer's items and status, and what the request echoes."""
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": error, "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
        "model": model, "output": output, "usage": usage_,
        "instructions": echo.instructions, "max_output_tokens": echo.max_output_tokens,
        "max_tool_calls": echo.max_tool_calls, "parallel_tool_calls": echo.parallel_tool_calls,
        "temperature": echo.temperature, "top_p": echo.top_p, "top_logprobs": echo.top_logprobs,
        "tool_choice": echo.tool_choice, "tools": echo.tools, "text": echo.text, "reasoning": echo.reasoning,
        "metadata": echo.metadata, "user": echo.user, "store": echo.store, "truncation": echo.truncation,
        "previous_response_id": echo.previous_response_id, "background": echo.background,
        "service_tier": echo.service_tier, "prompt_cache_key": echo.prompt_cache_key,
        "safety_identifier": echo.safety_identifier,
    }


def item_id(prefix: str) -> str:
    """A new id of the Responses API's form: PREFIX_ and 32 hex digits (resp, msg, rs, fc, ...)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def _reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": status}


def _output_text_part(text: str, logprobs: list | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _message_item(item_id: str, text: str, status: str, logprobs: list | None = None) -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [_output_text_part(text, logprobs)]}


def _joined_messages(first: dict, then: dict) -> dict:
    """One message of two told apart by a call dropped between them: the first's id, the second's
    status, their text and logprobs one after the other."""
    [first_part], [then_part] = first["content"], then["content"]
    return _message_item(first["id"], first_part["text"] + then_part["text"], then["status"],
                         first_part["logprobs"] + then_part["logprobs"])


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _finished(finish_reason: str | None) -> tuple[str, str | None]:
    """(the response's status, its incomplete reason): a length finish is max_output_tokens' doing."""
    return ("incomplete", "max_output_tokens") if finish_reason == "length" else ("completed", None)


def output_items(message: dict, finish_reason: str | None,
                 logprobs: list | None = None) -> tuple[list[dict], str, str | None]:
    """A whole chat choice's message as output items (reasoning, message, function calls, in that
    order), the response's status and its incomplete reason (module docstring). logprobs: the
    choice's tokens' (the chat's logprobs content), which the message's text part carries (every
    token's, as vLLM gives them; none without a message item)."""
    status, reason = _finished(finish_reason)
    made: list[tuple] = []  # (maker, arguments but the status)
    thought = message.get("reasoning") or message.get("reasoning_content")
    calls = message.get("tool_calls") or []
    if thought:
        made.append((_reasoning_item, (item_id("rs"), thought)))
    if message.get("content") or not (thought or calls):
        made.append((functools.partial(_message_item, logprobs=logprobs),
                     (item_id("msg"), message.get("content") or "")))
    for call in calls:
        made.append((_call_item, (item_id("fc"), call["id"], call["function"]["name"],
                                  call["function"]["arguments"])))
    last = len(made) - 1
    items = [maker(*args, "incomplete" if status == "incomplete" and i == last else "completed")
             for i, (maker, args) in enumerate(made)]
    return items, status, reason


def _with_streamed_ids(whole: list[dict], streamed: list[dict]) -> list[dict]:
    """The whole answer's items with the ids of the streamed items they match, in order: a message
    or reasoning takes the next streamed item of its type (its text may be longer: a dropped call's
    text joined it), and a message of the same text its logprobs too (the stream's carry its text's
    tokens, as vLLM streams them, not a call's after it); a call takes the id and call_id (which the
    client got and answers with) of its streamed counterpart (_paired_calls). An item matching none
    keeps its own id."""
    items, start = [], 0
    paired = _paired_calls(whole, streamed)
    for index, item in enumerate(whole):
        if item["type"] == "function_call":
            at = paired.get(index)
        else:
            at = next((at for at in range(start, len(streamed)) if streamed[at]["type"] == item["type"]), None)
        if at is not None:
            told = streamed[at]
            item = {**item, "id": told["id"]}
            if item["type"] == "function_call":
                item["call_id"] = told["call_id"]
            elif item["type"] == "message" and told["content"][0]["text"] == item["content"][0]["text"]:
                item["content"] = [{**item["content"][0], "logprobs": told["content"][0]["logprobs"]}]
            start = max(start, at + 1)
        items.append(item)
    return items


def _paired_calls(whole: list[dict], streamed: list[dict]) -> dict[int, int]:
    """{whole item index: streamed item index} for the calls. Within each name, by order where the
    stream told as many calls of it (all, or those it finished): the whole answer writes arguments
    as json.dumps does and the stream as the model wrote them (compact, escaped, a repeated key the
    stream read first and the whole answer last), so matching by text, or even by JSON value, gave a
    call another call's call_id, or one the client never saw, and its next turn was refused. Where
    the counts differ (a call the stream dropped), by JSON value, in order, and no pair otherwise."""
    def calls(items: list[dict], name: str) -> list[int]:
        return [i for i, item in enumerate(items) if item["type"] == "function_call" and item["name"] == name]

    pairs: dict[int, int] = {}
    for name in dict.fromkeys(item["name"] for item in whole if item["type"] == "function_call"):
        mine, told = calls(whole, name), calls(streamed, name)
        finished = [j for j in told if streamed[j].get("status") != "incomplete"]
        same_count = next((t for t in (told, finished) if len(t) == len(mine)), None)
        if same_count is not None:
            pairs.update(zip(mine, same_count))
            continue
        after = 0
        for i in mine:
            at = next((k for k in range(after, len(told))
                       if _as_json(streamed[told[k]]["arguments"]) == _as_json(whole[i]["arguments"])), None)
            if at is not None:
                pairs[i], after = told[at], at + 1
    return pairs


def _as_json(arguments: str):
    """Arguments as the JSON value they read as (their text where they do not parse)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


# ---- the stream -------------------------------------------------------------------------------
@dataclass
class _OpenItem:
    """An output item being streamed: its kind (reasoning, message, function_call), place and text."""

    kind: str
    output_index: int
    item_id: str
    pieces: list[str] = field(default_factory=list)
    call_id: str = ""
    name: str = ""
    logprobs: list = field(default_factory=list)
    """A message's: the log-probabilities its deltas carried."""

    def whole(self, status: str) -> dict:
        text = "".join(self.pieces)
        if self.kind == "reasoning":
            return _reasoning_item(self.item_id, text, status)
        if self.kind == "message":
            return _message_item(self.item_id, text, status, self.logprobs)
        return _call_item(self.item_id, self.call_id, self.name, text, status)


RESPONSE_ERROR_CODES = ("server_error", "rate_limit_exceeded", "invalid_prompt")
"""The codes of OpenAI's ResponseError (a Response's error) that this server's failures can be; its
type takes no other text codes."""


class ResponseEvents:
    """The Responses stream of one chat choice's chunks (module docstring: the events' order)."""

    def __init__(self, response_id: str, created_at: int, model: str, echo: ResponsesEcho):
        self.response_id, self.created_at, self.model, self.echo = response_id, created_at, model, echo
        self.output: list[dict | None] = []
        """Every item in output order: whole once closed, None while open."""
        self._text: _OpenItem | None = None
        """The open reasoning or message item."""
        self._calls: dict[int, _OpenItem] = {}
        """The open function call (one at most: a new call closes it), by its chat index."""
        self._sequence = 0
        self._logprobs: list[dict] = []
        """Log-probabilities of tokens whose text no output_text delta has carried yet."""
        self._final: list[dict] | None = None
        """The final response's items where finish() was given the whole answer's."""
        self._dropped: set[int] = set()
        """The output indexes of calls the reader turned back into text (_abandon_calls): closed as
        incomplete in their events, left out of the response (and so of what is kept)."""

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _response(self, status: str, usage_: dict | None = None, incomplete_reason: str | None = None,
                  error: dict | None = None) -> dict:
        items = self._kept_items() if self._final is None else self._final
        return response_object(self.response_id, self.created_at, self.model, self.echo, items,
                               status, usage_, incomplete_reason, error)

    def _kept_items(self) -> list[dict]:
        """The response's items: every closed one but the dropped calls; a message that came after a
        dropped call joins the message before that call, as the whole answer (all text: output_items)
        has them as one message."""
        items, after_a_drop = [], False
        for index, item in enumerate(self.output):
            if index in self._dropped:
                after_a_drop = True
                continue
            if item is None:
                continue
            if after_a_drop and items and item["type"] == items[-1]["type"] == "message":
                items[-1] = _joined_messages(items[-1], item)
            else:
                items.append(item)
            after_a_drop = False
        return items

    def opening(self) -> list[dict]:
        """response.created and response.in_progress."""
        return [self._event("response.created", response=self._response("in_progress")),
                self._event("response.in_progress", response=self._response("in_progress"))]

    def delta(self, chat_delta: dict, logprobs: list | None = None) -> list[dict]:
        """One chat chunk's delta as events: the next pieces of calls already open, its reasoning,
        its content, then the calls it opens. A delta whose text turned to content or reasoning (a
        call cut short by the length limit, or no call after all) carries the open call's last piece
        too, which belongs before that text (after it, the text had closed the call and the piece
        found none: the stream failed). logprobs: the delta's tokens' (asked for: the answer's,
        ChatRender.message_logprobs), carried by the next output_text delta, this one's or a later's."""
        self._logprobs += logprobs or []
        entries = chat_delta.get("tool_calls") or []
        events = []
        for entry in entries:
            if "id" not in entry:
                events += self._call_piece(entry)
        if chat_delta.get("reasoning"):
            events += self._text_piece("reasoning", chat_delta["reasoning"])
        if chat_delta.get("content"):
            events += self._text_piece("message", chat_delta["content"])
        for entry in entries:
            if "id" in entry:
                events += self._call_piece(entry)
        return events

    def finish(self, finish_reason: str | None, usage_: dict, whole: list[dict] | None = None) -> list[dict]:
        """Every open item closed, then response.completed (response.incomplete for a length finish).
        whole: the whole answer's items (output_items of the answer read at its end), which the
        final response holds in place of the items streamed, with the ids (and call ids) of the
        streamed items they match (_with_streamed_ids): the events told the answer a piece at a time,
        and a reader that reads pieces cannot take back a call it announced when a later cut turns
        the whole answer's calls to text; the final response, which is kept, is the whole answer."""
        status, reason = _finished(finish_reason)
        events = []
        if not self.output:  # nothing at all was said: an empty message, as output_items gives it
            events += self._open_text("message")
        self._carry_the_rest()
        events += self._close_all(last_status="incomplete" if status == "incomplete" else "completed")
        if whole is not None:
            self._final = _with_streamed_ids(whole, [item for item in self.output if item is not None])
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return events + [self._event(kind, response=self._response(status, usage_, reason))]

    def failed(self, error: dict) -> list[dict]:
        """An error event, then response.failed holding the items so far (open ones as they stand,
        incomplete), saying store false: a failed response is not kept. `error`: OpenAI's error
        object's inside ({"message", "type", "param", "code"})."""
        code = error.get("code") or error.get("type")
        self.echo = dataclasses.replace(self.echo, store=False)  # a failed response is never kept
        for item in [self._text, *self._calls.values()]:
            if item is not None:
                self.output[item.output_index] = item.whole("incomplete")
        self._text, self._calls = None, {}
        if error.get("code") in RESPONSE_ERROR_CODES:
            response_code = error["code"]
        else:  # the Response's error takes only OpenAI's listed codes
            response_code = "invalid_prompt" if error.get("type") == "invalid_request_error" else "server_error"
        return [self._event("error", code=code, message=error.get("message", ""), param=error.get("param")),
                self._event("response.failed", response=self._response(
                    "failed", error={"code": response_code, "message": error.get("message", "")}))]

    # -- items --
    def _text_piece(self, kind: str, text: str) -> list[dict]:
        events = []
        if self._calls and kind == "message":
            # content while a call is open: the call's reader turned it back into text (thinking
            # after a call is the reasoning parser's, and closes the call as before)
            events += self._abandon_calls()
        if self._text is None or self._text.kind != kind or self._calls:
            events += self._close_all()
            events += self._open_text(kind)
        item = self._text
        item.pieces.append(text)
        delta_kind = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {}
        if kind == "message":
            extra["logprobs"], self._logprobs = self._logprobs, []
            item.logprobs += extra["logprobs"]
        return events + [self._event(delta_kind, item_id=item.item_id, output_index=item.output_index,
                                     content_index=0, delta=text, **extra)]

    def _open_text(self, kind: str) -> list[dict]:
        item = self._text = _OpenItem(kind, len(self.output), item_id("rs" if kind == "reasoning" else "msg"))
        self.output.append(None)
        if kind == "reasoning":
            added = {"type": "reasoning", "id": item.item_id, "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            added = {"type": "message", "id": item.item_id, "role": "assistant", "status": "in_progress",
                     "content": []}
            part = _output_text_part("")
        return [self._event("response.output_item.added", output_index=item.output_index, item=added),
                self._event("response.content_part.added", item_id=item.item_id, output_index=item.output_index,
                            content_index=0, part=part)]

    def _call_piece(self, entry: dict) -> list[dict]:
        index, function = entry.get("index", 0), entry.get("function") or {}
        piece, events = function.get("arguments") or "", []
        if entry.get("id"):  # a new call: what was said before it, earlier calls too, is over
            # (each item is done before the next is added, as OpenAI streams them)
            events += self._close_all()
            item = self._calls[index] = _OpenItem("function_call", len(self.output), item_id("fc"),
                                                  call_id=entry["id"], name=function.get("name") or "")
            self.output.append(None)
            events.append(self._event("response.output_item.added", output_index=item.output_index,
                                      item=_call_item(item.item_id, item.call_id, item.name, "", "in_progress")))
        elif index not in self._calls:  # the chat streams send a call's pieces before any other output
            raise ValueError(f"tool call {index}'s arguments came with no open call (its first piece, with its "
                             f"id, opens it)")
        item = self._calls[index]
        if piece:
            item.pieces.append(piece)
            events.append(self._event("response.function_call_arguments.delta", item_id=item.item_id,
                                      output_index=item.output_index, delta=piece))
        return events

    def _abandon_calls(self) -> list[dict]:
        """Close the open calls as incomplete and drop them from the response: content came while
        they were open, so the reader found no call there after all (its JSON broke, or the length
        limit cut it) and tells the call's text as content, as the whole answer does. Kept, such a call
        would go into the next turn's prompt as a call with broken arguments."""
        events = []
        for item in sorted(self._calls.values(), key=lambda item: item.output_index):
            events += self._close(item, "incomplete")
            self._dropped.add(item.output_index)
        self._calls = {}
        return events

    def _carry_the_rest(self) -> None:
        """At the end, log-probabilities no delta carried (tokens after the last text, the end token's)
        go to the message still open, in its done events and the final response alike; with none
        open (a call came after the text) they are carried by no event."""
        if self._logprobs and self._text is not None and self._text.kind == "message":
            self._text.logprobs += self._logprobs
        self._logprobs = []

    def _close_all(self, last_status: str = "completed") -> list[dict]:
        """Close every open item in output order; the last one gets `last_status`."""
        open_items = sorted([item for item in [self._text, *self._calls.values()] if item is not None],
                            key=lambda item: item.output_index)
        self._text, self._calls = None, {}
        events = []
        for i, item in enumerate(open_items):
            last = i == len(open_items) - 1 and item.output_index == len(self.output) - 1
            events += self._close(item, last_status if last else "completed")
        return events

    def _close(self, item: _OpenItem, status: str) -> list[dict]:
        whole = self.output[item.output_index] = item.whole(status)
        text, where = "".join(item.pieces), {"item_id": item.item_id, "output_index": item.output_index}
        if item.kind == "function_call":
            events = [self._event("response.function_call_arguments.done", **where, name=item.name, arguments=text)]
        elif item.kind == "reasoning":
            events = [self._event("response.reasoning_text.done", **where, content_index=0, text=text),
                      self._event("response.content_part.done", **where, content_index=0,
                                  part={"type": "reasoning_text", "text": text})]
        else:
            events = [self._event("response.output_text.done", **where, content_index=0, text=text,
                                  logprobs=item.logprobs),
                      self._event("response.content_part.done", **where, content_index=0,
                                  part=_output_text_part(text, item.logprobs))]
        return events + [self._event("response.output_item.done", output_index=item.output_index, item=whole)]


def sse(event: dict) -> str:
    """One server-sent event as vLLM frames the Responses stream: its type as the SSE event name, the
    event as compact JSON on one line."""
    return f"event: {event['type']}\n" + sse_event(event)
