"""tool_choice "auto" read in vLLM's "mistral" format (`--tool-call-parser mistral`), the one Mistral
Instruct models write: free text, then a `[TOOL_CALLS]` control token (kept in the text: special
tokens are not skipped for "auto") and the calls, in one of two forms by the tokenizer's version:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

The first before v11 (Mistral-7B-Instruct-v0.3 and its kin: one JSON array of calls, or one bare
call object); the second from v11 on (newer Mistral models: a function's name, `[ARGS]`, its
arguments, and a marker before each call). vLLM picks the form from the tokenizer (no `[ARGS]`
token: pre-v11); here the text says it, so no tokenizer is needed: the text after the first
`[TOOL_CALLS]` (markers with only whitespace between them count as one) that begins, whitespace
aside, with `[` or `{` is the pre-v11 JSON; any other is the v11 form.

Read as vLLM 0.32's MistralParser reads the whole text:
- The content is the text before the first marker, null when it is only whitespace.
- Pre-v11: the calls are in the first JSON value after the marker (json's raw_decode: text after
  it, later markers included, is ignored). A bare object is one call; items of the array that are
  no objects with a "name" or an "arguments" are skipped; a name that is no string is ""; arguments
  null or left out are "{}", a string is kept as it is (the model's own JSON text), any other value
  is written as JSON text (json.dumps, non-ASCII kept).
- v11: each marker's text is `name[ARGS]arguments` (or `name{...}`, the `{` starting the
  arguments, which vLLM takes too); the arguments are the first whole JSON value of the text after
  `[ARGS]` as the model wrote it, the text after that value dropped; "{}" when there is none; the
  text itself (stripped) when it does not start with a JSON value.
With parallel_tool_calls false only the first call is kept (vLLM's rule). Each call's id is 9
letters and digits (vLLM's MistralToolCall ids): Mistral's chat templates refuse any other id when
the calls come back in the conversation.

Where this reading differs from vLLM's (the same whole and streamed here):
- A text whose calls cannot be read (bad or cut JSON, a JSON value with no call in it, nothing after
  the marker, a v11 name that is not 1+ letters, digits, `_` or `-` followed by `[ARGS]` or `{`) is
  all content, the whole text, with no call, as the hermes reader does (and as a stream can say
  it). vLLM's pre-v11 reading returns only the text after the marker (stripped) as content, the
  text before it lost, and where its JSON does not decode tries the longest `[{...}]` anywhere in
  that text (a regex fallback, not followed here: it reaches up to the next marker or the end, where a stream must
  settle each call when its JSON value closes); its v11 reading makes a call of almost any text
  after a marker (any name, or "" for none; a name with no `[ARGS]`).
- Markers with only whitespace between them count as one in both forms (vLLM's v11 reading puts
  the second into the next call's name: `[TOOL_CALLS][TOOL_CALLS]f` calls "[TOOL_CALLS]f").
- v11: the content beside calls is kept as written (vLLM's whole v11 answer strips it, while its
  stream sends it as written). In vLLM's stream the text after the arguments' JSON value is sent as
  more arguments; here it is dropped, as vLLM's whole reading drops it.

Streamed, the content goes out as it comes up to the first marker, but for a tail that may be the
start of `[TOOL_CALLS]`, and but for content that is so far only whitespace (null if a call
follows). Each call goes out whole, in one tool_calls delta: pre-v11, all the calls of the JSON
value at once when it closes; v11, each call when its arguments' JSON value closes, or at the next
marker or the end of the text (arguments that are no JSON value, or none). Text after the calls is
no content, as in the whole answer. For any split of a text the stream says what the whole answer
says, with one exception that no stream can avoid: a v11 call that cannot be read after a good one.
The whole answer is then all content; the stream has already sent the good call, and sends the text
from the first marker after it on as content.

Pure (no tokenizer, no engine): the app's ChatRender drives a MistralCallReader per choice (its shared
part: launcher/serving/free_text_calls.py).
"""

from __future__ import annotations

import re
import secrets
import string

from launcher.serving.call_json import JsonValueEnd, arguments_text, decode_at, is_text
from launcher.serving.free_text_calls import CallsReading, FreeTextCallReader
from launcher.serving.stop_strings import held_tail_length
from launcher.serving.tool_calls import tool_call

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_-")
"""A v11 function name's characters (OpenAI's rule for a function's name)."""
V11_CALL = re.compile(r"\s*([A-Za-z0-9_-]+)\s*(?:\[ARGS\]|(?=\{))")
"""A v11 call's head: its name, then `[ARGS]` or the `{` that starts the arguments."""
_ID_CHARS = string.ascii_letters + string.digits


def new_mistral_call_id() -> str:
    """A call id as Mistral's chat templates take them back: exactly 9 letters and digits."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(9))


def pre_v11_calls(parsed: object) -> list[tuple[str, str]]:
    """The calls of the JSON value after a pre-v11 marker, as vLLM takes them: see the module's doc."""
    items = [parsed] if isinstance(parsed, dict) else parsed if isinstance(parsed, list) else []
    calls = []
    for item in items:
        if not (isinstance(item, dict) and ("name" in item or "arguments" in item)):
            continue
        name, arguments = item.get("name"), item.get("arguments")
        if arguments is None:
            arguments = "{}"
        elif not isinstance(arguments, str):
            arguments = arguments_text(arguments)
        elif not is_text(arguments):  # a lone surrogate escape decoded: written back as the escape
            arguments = arguments.encode("utf-8", "backslashreplace").decode("utf-8")
        calls.append((name if is_text(name) else "", arguments))
    return calls


def v11_arguments(text: str) -> str:
    """A v11 call's arguments from the text after `[ARGS]`: its first JSON value as written, "{}"
    for no text, the text itself (stripped) when it starts with no JSON value."""
    stripped = text.strip()
    if not stripped:
        return "{}"
    value = decode_at(stripped)
    return stripped if value is None else stripped[:value[1]]


def v11_call(segment: str) -> tuple[str, str] | None:
    """(name, arguments) of one v11 marker's text, None when it holds no call."""
    head = V11_CALL.match(segment)
    return None if head is None else (head.group(1), v11_arguments(segment[head.end():]))


def read_whole(text: str) -> CallsReading:
    """The whole generated text's content and calls."""
    first = text.find(MARKER)
    if first == -1:
        return CallsReading(text)
    segments = [segment for segment in text[first + len(MARKER):].split(MARKER) if segment.strip()]
    if not segments:  # nothing after the marker
        return CallsReading(text)
    if segments[0].lstrip()[0] in "[{":  # pre-v11: one JSON value; what follows it is ignored
        value = decode_at(segments[0].strip())
        calls = [] if value is None else pre_v11_calls(value[0])
    else:
        read = [v11_call(segment) for segment in segments]
        calls = [] if None in read else read
    if not calls:
        return CallsReading(text)
    content = text[:first]
    return CallsReading(content if content.strip() else None, calls)


BAD = "bad"
"""A marker's text that holds no call: the whole text is content."""


class MarkerText:
    """The text after one marker (up to the next, or the end), read as it comes: feed() the pieces,
    end() when the next marker or the end of the text has come. Each returns the calls now read (a
    list, empty for none yet), or BAD. After calls, the rest of the text is dropped."""

    def __init__(self, form: str | None):
        self.form = form
        """"json" (pre-v11), "named" (v11), None until the first non-blank character says."""
        self.stage = "lead"
        """"lead": only whitespace so far; "json": in the pre-v11 JSON value; "name", "gap" (the
        whitespace after it), "sep" (in `[ARGS]`): a v11 call's head; "args_lead": the arguments'
        leading whitespace; "value": in the arguments' JSON value; "raw": arguments to be read at
        the end; "after": calls read, the rest is dropped."""
        self.name: list[str] = []
        self.args_matched = 0
        """"sep": how many characters of `[ARGS]` have come."""
        self.held: list[str] = []
        """The pre-v11 JSON value's text, or a v11 call's arguments' text, so far."""
        self.value_end = JsonValueEnd()

    def feed(self, text: str) -> list[tuple[str, str]] | str:
        at = 0
        while at < len(text) and self.stage != "after":
            if self.stage in ("lead", "args_lead"):
                at = self._past_whitespace(text, at)
            elif self.stage in ("json", "value"):
                closed = self.value_end.feed(text[at:])
                self.held.append(text[at:] if closed is None else text[at:at + closed])
                if closed is None:
                    return []
                at += closed
                read = self._value_closed()
                if read:
                    return read
            elif self.stage == "raw":
                self.held.append(text[at:])
                return []
            else:
                taken = self._head_char(text[at])
                if taken is BAD:
                    return BAD
                at += taken
        return []

    def _past_whitespace(self, text: str, at: int) -> int:
        """Skip whitespace; the first other character starts the form's next stage."""
        start = at
        while at < len(text) and text[at].isspace():
            at += 1
        if self.stage == "args_lead":
            self.held.append(text[start:at])
        if at == len(text):
            return at
        if self.stage == "lead":
            self.form = self.form or ("json" if text[at] in "[{" else "named")
            self.stage = "json" if self.form == "json" else "name"
        else:
            self.stage = "value" if text[at] in '{["' else "raw"
        return at

    def _head_char(self, char: str) -> int | str:
        """One character of a v11 call's head (`name[ARGS]` or `name{`): how many characters it took
        (0 for the `{` that starts the arguments), BAD when it cannot be one."""
        if self.stage == "name" and char in NAME_CHARS:
            self.name.append(char)
        elif self.stage in ("name", "gap") and self.name and char.isspace():
            self.stage = "gap"
        elif self.stage in ("name", "gap") and self.name and char == "{":
            self.stage = "args_lead"
            return 0
        elif self.stage in ("name", "gap") and self.name and char == "[":
            self.stage, self.args_matched = "sep", 1
        elif self.stage == "sep" and char == ARGS[self.args_matched]:
            self.args_matched += 1
            if self.args_matched == len(ARGS):
                self.stage = "args_lead"
        else:
            return BAD
        return 1

    def _value_closed(self) -> list[tuple[str, str]] | str:
        """The JSON value closed: pre-v11, its calls (or BAD); v11, the call, or if the value is no
        JSON, nothing yet (its arguments are then the whole text up to the next marker)."""
        text = "".join(self.held).lstrip()
        value = decode_at(text)
        if self.form == "json":
            calls = [] if value is None else pre_v11_calls(value[0])
            self.stage, self.held = "after", []
            return calls or BAD
        if value is None:
            self.stage = "raw"
            return []
        self.stage, self.held = "after", []
        return [("".join(self.name), text[:value[1]])]

    def end(self) -> list[tuple[str, str]] | str:
        """The next marker or the end of the text came: the call this text makes, if not read yet."""
        if self.stage in ("lead", "after"):
            return []
        if self.stage in ("args_lead", "value", "raw"):
            arguments, self.stage, self.held = v11_arguments("".join(self.held)), "after", []
            return [("".join(self.name), arguments)]
        return BAD  # a pre-v11 JSON value still open, or a v11 head with no `[ARGS]`


class MistralCallReader(FreeTextCallReader):
    """One choice's text read in the mistral format, streamed (delta) or whole (push, then message).

    Streamed, the work per piece is that piece's (plus a marker's length): the text not yet settled
    is kept from where it may still matter, the marker's search resumes where the last one stopped,
    and a JSON value's end is found over its new characters only."""

    read_whole = staticmethod(read_whole)

    def __init__(self, parallel_tool_calls: bool = True):
        super().__init__(parallel_tool_calls)
        self._mode = "content"
        """"content": before the first marker; "calls": after it; "text": no call could be read, and
        the rest goes out as content; "done": the pre-v11 calls were read, the rest is dropped."""
        self._open = ""
        """"content": the content not sent yet (a tail that may start a marker, or only whitespace);
        "calls": a tail that may start the next marker."""
        self._find_from = 0
        """"content": where in _open the marker's search resumes."""
        self._blank_to = 0
        """"content", no content sent yet: _open[:_blank_to] is known to be whitespace."""
        self._content_sent = False
        """Content with more than whitespace has been sent."""
        self._unsent: list[str] = []
        """"calls": the text since the last call read (or from the start, whitespace content
        included), sent as content if no call can be read."""
        self._marker_text = MarkerText(None)
        self._read = 0
        """The calls read so far (the next one's index)."""

    def _new_call(self, name: str, arguments: str, index: int | None = None) -> dict:
        return tool_call(name, arguments, index=index, call_id=new_mistral_call_id())

    def _read_piece(self, piece: str, finished: bool) -> tuple[str, list[dict]]:
        content, calls, rest = "", [], piece
        if self._mode == "content":
            content, rest = self._content_up_to_a_marker(piece, finished)
        if self._mode == "calls":
            calls, rest = self._calls_in(rest, finished)
        if self._mode == "text":
            content += rest
        return content, calls

    def _content_up_to_a_marker(self, piece: str, finished: bool) -> tuple[str, str]:
        """(the content now sendable, the text after the first marker); at the marker the mode turns
        to "calls". Content that is only whitespace is held while a call may follow it."""
        self._open += piece
        at = self._open.find(MARKER, self._find_from)
        if at == -1:
            keep = 0 if finished else held_tail_length(self._open, (MARKER,))
            ready = len(self._open) - keep
            self._find_from = max(0, len(self._open) - len(MARKER) + 1)
            if not (finished or self._content_sent or self._open[self._blank_to:ready].strip()):
                self._blank_to = ready  # whitespace so far: no content if a call follows
                return "", ""
            out, self._open = self._open[:ready], self._open[ready:]
            self._content_sent, self._find_from, self._blank_to = True, 0, 0
            return out, ""
        before, after = self._open[:at], self._open[at + len(MARKER):]
        self._open, self._mode = "", "calls"
        if self._content_sent or before[self._blank_to:].strip():
            self._content_sent = True
            self._unsent = [MARKER]
            return before, after
        self._unsent = [before, MARKER]
        return "", after

    def _calls_in(self, text: str, finished: bool) -> tuple[list[dict], str]:
        """(the calls read in the text after the first marker, the text that turned to content)."""
        text, self._open = self._open + text, ""
        calls, at = [], 0
        while True:
            marker = text.find(MARKER, at)
            if marker != -1:
                end = marker
            else:
                end = len(text) - (0 if finished else held_tail_length(text[at:], (MARKER,)))
            if self._marker_text.stage != "after":  # text after a call is dropped
                self._unsent.append(text[at:end])
            calls += self._take(self._marker_text.feed(text[at:end]))
            if self._mode != "calls":
                return calls, self._turned_to_content(text[end:])
            if marker == -1:
                self._open = text[end:]
                if finished:
                    calls += self._take(self._marker_text.end())
                    if self._mode == "calls" and not self._read:  # markers with nothing after them
                        self._mode = "text"
                return calls, self._turned_to_content("")
            calls += self._take(self._marker_text.end())
            if self._mode != "calls":
                return calls, self._turned_to_content(text[marker:])
            self._unsent.append(MARKER)
            self._marker_text, at = MarkerText(self._marker_text.form), marker + len(MARKER)

    def _take(self, read: list[tuple[str, str]] | str) -> list[dict]:
        """The calls just read, as the stream sends them; BAD turns the mode to "text"."""
        if read is BAD:
            self._mode = "text"
            return []
        if not read:
            return []
        calls = [self._new_call(name, arguments, index=self._read + i) for i, (name, arguments) in enumerate(read)]
        self._read += len(calls)
        self._unsent = []  # settled: the whitespace content before them, or the text after the last call
        if self._marker_text.form == "json":
            self._mode = "done"  # pre-v11: everything after the JSON value is ignored
        return calls

    def _turned_to_content(self, rest: str) -> str:
        """Mode "text": the held text, and what follows, go out as content."""
        if self._mode != "text":
            return ""
        out, self._unsent = "".join(self._unsent) + rest, []
        return out
