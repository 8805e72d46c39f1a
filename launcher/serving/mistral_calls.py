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
  text itself (stripped) when it does not start with a JSON value (NaN, Infinity and a number
  beyond a double's range are none: launcher/serving/call_json.py).
With parallel_tool_calls false only the first call is kept (vLLM's rule). Each call's id is 9
letters and digits (vLLM's MistralToolCall ids): Mistral's chat templates refuse any other id when
the calls come back in the conversation; forced calls (tool_choice "required" or a named function)
on a server with this parser get such ids too (tool_calls.PARSER_CALL_IDS).

Where this reading differs from vLLM's (the same whole and streamed here):
- A text whose calls cannot be read (bad or cut JSON, a JSON value with no call in it, nothing after
  the marker, a v11 name that is not 1+ letters, digits, `_` or `-` followed by `[ARGS]` or `{`) is
  all content, the whole text, with no call, as the hermes reader does (a stream too, but for the
  exceptions below). vLLM's pre-v11 reading returns only the text after the marker (stripped) as
  content, the text before it lost, and where its JSON does not decode tries the longest `[{...}]`
  anywhere in that text (a regex fallback, not followed here: it reaches up to the next marker or
  the end, where a stream must settle each call when its JSON value closes); its v11 reading makes
  a call of almost any text after a marker (any name, or "" for none; a name with no `[ARGS]`).
- Markers with only whitespace between them count as one in both forms (vLLM's v11 reading puts
  the second into the next call's name: `[TOOL_CALLS][TOOL_CALLS]f` calls "[TOOL_CALLS]f").
- v11: the content beside calls is kept as written (vLLM's whole v11 answer strips it, while its
  stream sends it as written). In vLLM's stream the text after the arguments' JSON value is sent as
  more arguments; here it is dropped, as vLLM's whole reading drops it.

Streamed, the content goes out as it comes up to the first marker, but for a tail that may be the
start of `[TOOL_CALLS]`, and but for content that is so far only whitespace (null if a call
follows). Each call's arguments go out piece by piece as they are written, as vLLM streams them: a
call's first tool_calls entry carries its index, id, type, name and the arguments so far, the later
ones only its index and the next piece of its arguments.
- Pre-v11: the JSON value is scanned as it comes (launcher/serving/required_calls_stream.py): a
  call goes out once its name's string has closed and its arguments' value has begun, its index
  its place in the array; its arguments are the text as written (the whole answer writes them as
  json.dumps does: the same JSON). Where the value closes, the whole reading of it decides, and the
  calls not sent yet go out whole: one whose name came after its arguments (or is no string), and
  one whose arguments are a JSON string or null, which the whole reading does not take as written
  (the string's text, "{}"), with every call after it. An object with its "name" or "arguments"
  key twice streams the first (the whole answer takes the last).
- v11 (launcher/serving/mistral_v11_arguments.py): a call goes out with the first non-whitespace
  character after `[ARGS]` (or the `{` of `name{`): whatever the arguments turn out to be, the whole reading strips them and keeps that
  character; with none before the next marker or the end, it goes out there with "{}". After it,
  each piece that is sure to belong to what the whole reading takes (the first JSON value as
  written; where the text starts with none, or with one that closes but is no JSON, all the text
  up to the next marker): whitespace waits for more text after it (the arguments are stripped), and
  so does a `.`, `e` or `e-` after a number (`1.x` takes the number 1), so the pieces add up to the
  whole answer's very text, over any split.
Text after the calls is no content, as in the whole answer. For any split of a text the stream
says what the whole answer says, but where no stream can know in time: a v11 call that cannot be
read after a good one, and a pre-v11 JSON value that breaks (bad or cut JSON, a marker inside it,
an integer Python's decoder refuses, NaN or a number beyond a double's range, nesting past
call_json.MAX_DEPTH) after one of its calls went
out (the piece in which the value closes or is cut is read whole before any call of it goes out,
so a break there sends none). The whole
answer is then all content, with no call; the stream has already sent those calls (a pre-v11 one
with the arguments written so far), and sends as content the text from the first marker after the
good v11 call on, or, pre-v11, all the text not sent yet, so that its content is the whole text, the
whole answer's. A pre-v11 value that is no JSON at its own level already as it is written (an
array's commas and bare values: `[1, 2, ` then prose, call_json.ArrayLevelCheck; a bare object's
keys and colons, judged by its call's scan) turns the stream to content right there, not at the next
marker or the end (a break deeper inside a value is found where the value closes).

Pure (no tokenizer, no engine): the app's ChatRender drives a MistralCallReader per choice (its shared
part: launcher/serving/free_text_calls.py).
"""

from __future__ import annotations

import re
import secrets
import string

from launcher.serving.call_json import ArrayLevelCheck, JsonValueEnd, arguments_text, decode_at, is_text
from launcher.serving.free_text_calls import CallsReading, FreeTextCallReader
from launcher.serving.mistral_v11_arguments import V11Arguments
from launcher.serving.required_calls_stream import RequiredCallsStream
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


def mistral_call(name: str, arguments: str, index: int | None = None) -> dict:
    """One call as the client gets it, with a Mistral call id."""
    return tool_call(name, arguments, index=index, call_id=new_mistral_call_id())


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
    saying with the last one that the text ends there (the next marker, or the end of the text,
    follows). Each returns the tool_calls entries now due, indexed from 0 among this text's calls
    (the reader puts them in place), or BAD. After the calls, the rest of the text is dropped."""

    def __init__(self, form: str | None):
        self.form = form
        """"json" (pre-v11), "named" (v11), None until the first non-blank character says."""
        self.stage = "lead"
        """"lead": only whitespace so far; "json": in the pre-v11 JSON value; "name", "gap" (the
        whitespace after it), "sep" (in `[ARGS]`): a v11 call's head; "arguments": the v11 call's
        arguments; "after": the calls are read, the rest is dropped."""
        self.name: list[str] = []
        self.args_matched = 0
        """"sep": how many characters of `[ARGS]` have come."""
        self.held: list[str] = []
        """"json": the value's text so far, read whole where it closes."""
        self.value_end = JsonValueEnd()
        self.scan: RequiredCallsStream | None = None
        """"json": the scan of the value's calls, which says when each call and each piece of its
        arguments can go out before the value closes."""
        self.array_check: ArrayLevelCheck | None = None
        """"json", an array: whether its own level is still JSON (a bare object: the scan says it)."""
        self.withheld_from: int | None = None
        """"json": the first call whose arguments the whole reading does not take as written (a JSON
        string, taken as its text, or null, taken as "{}"): it and those after it go out whole when
        the value closes."""
        self.arguments = V11Arguments()
        self.sent = 0
        """Calls announced."""
        self.settled = False
        """A call of this text is sure: v11, announced (its head is whole; any arguments are
        taken); pre-v11, the JSON value read."""

    def feed(self, text: str, ends: bool) -> list[dict] | str:
        at = 0
        while at < len(text) and self.stage not in ("json", "arguments", "after"):
            if self.stage == "lead":
                at = self._past_whitespace(text, at)
            else:
                taken = self._head_char(text[at])
                if taken is BAD:
                    return BAD
                at += taken
        if self.stage == "json":
            return self._json_piece(text[at:], ends)
        if self.stage == "arguments":
            return self._arguments_piece(text[at:], ends)
        if ends and self.stage not in ("lead", "after"):
            return BAD  # a v11 head with no `[ARGS]`
        return []

    def _past_whitespace(self, text: str, at: int) -> int:
        """Skip whitespace; the first other character starts the form's next stage."""
        while at < len(text) and text[at].isspace():
            at += 1
        if at < len(text):
            self.form = self.form or ("json" if text[at] in "[{" else "named")
            self.stage = "json" if self.form == "json" else "name"
            if self.stage == "json":
                self.scan = RequiredCallsStream(("arguments",), one_object=text[at] == "{",
                                                make_id=new_mistral_call_id)
                self.array_check = ArrayLevelCheck() if text[at] == "[" else None
        return at

    def _head_char(self, char: str) -> int | str:
        """One character of a v11 call's head (`name[ARGS]` or `name{`): how many characters it took
        (0 for the `{` that starts the arguments), BAD when it cannot be one."""
        if self.stage == "name" and char in NAME_CHARS:
            self.name.append(char)
        elif self.stage in ("name", "gap") and self.name and char.isspace():
            self.stage = "gap"
        elif self.stage in ("name", "gap") and self.name and char == "{":
            self.stage = "arguments"
            return 0
        elif self.stage in ("name", "gap") and self.name and char == "[":
            self.stage, self.args_matched = "sep", 1
        elif self.stage == "sep" and char == ARGS[self.args_matched]:
            self.args_matched += 1
            if self.args_matched == len(ARGS):
                self.stage = "arguments"
        else:
            return BAD
        return 1

    def _json_piece(self, text: str, ends: bool) -> list[dict] | str:
        """Pre-v11: the value's calls streamed as the scan finds them; where the value closes, the
        whole reading of it decides (BAD for none), and the calls not announced go out whole. A
        value cut by the next marker or the end is BAD; one that closes (or is cut) in this very
        piece is read whole before any of its calls goes out."""
        closed = self.value_end.feed(text)
        part = text if closed is None else text[:closed]
        self.held.append(part)
        if closed is None and not ends:
            entries = self.scan.feed(part)
            if self._no_json_already(part):  # BAD now, not at a next marker or the end
                return BAD
            return self._sendable(entries)
        value = None if closed is None else decode_at("".join(self.held))
        calls = [] if value is None else pre_v11_calls(value[0])
        if not calls:
            return BAD
        entries = self._sendable(self.scan.feed(part))
        self.stage, self.held, self.settled = "after", [], True
        return entries + [mistral_call(name, arguments, index)
                          for index, (name, arguments) in enumerate(calls) if index >= self.sent]

    def _no_json_already(self, part: str) -> bool:
        """Whether the open value, with this part, is no JSON already at its own level (an array's: its
        commas and bare values, `[1, 2, ` then prose; a bare object's keys and colons, judged by its
        call's scan), so that no whole reading takes it: what comes after is content, sent as it
        comes. The scan (fed the part already) is not asked of an array: it stops at an element that
        is no object, which the whole reading skips. A break deeper inside is found where the value
        closes, as before."""
        if self.array_check is not None:
            return not self.array_check.feed(part)
        return self.scan.stopped

    def _sendable(self, scanned: list[dict]) -> list[dict]:
        """The scan's entries for a part of the value, but for the calls withheld."""
        entries = []
        for entry in scanned:
            index = entry["index"]
            if "id" in entry and self.withheld_from is None and entry["function"]["arguments"][:1] in ('"', "n"):
                self.withheld_from = index
            if self.withheld_from is not None and index >= self.withheld_from:
                continue
            self.sent += "id" in entry
            entries.append(entry)
        return entries

    def _arguments_piece(self, text: str, ends: bool) -> list[dict]:
        """v11: the call goes out with its arguments' first sure piece (their first non-whitespace
        character, or "{}" at the end for none), then each sure piece after it."""
        piece = self.arguments.feed(text)
        if ends:
            piece += self.arguments.end()
        if self.arguments.stage == "done":
            self.stage = "after"
        if not piece:
            return []
        if self.sent:
            return [{"index": 0, "function": {"arguments": piece}}]
        self.sent, self.settled = 1, True
        return [mistral_call("".join(self.name), piece, index=0)]


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
        """"content": the content not sent yet after _blank (a tail that may start a marker);
        "calls": a tail that may start the next marker."""
        self._find_from = 0
        """"content": where in _open the marker's search resumes."""
        self._blank: list[str] = []
        """"content", no content sent yet: the start known to be only whitespace, held while a call
        may follow it, in the pieces it came in (one growing string copied it all at every piece)."""
        self._content_sent = False
        """Content with more than whitespace has been sent."""
        self._unsent: list[str] = []
        """"calls": the text since the last call settled (or from the start, whitespace content
        included), sent as content if no call can be read."""
        self._marker_text = MarkerText(None)
        self._read = 0
        """The calls of the marker texts before the current one (its first call's index)."""

    def _new_call(self, name: str, arguments: str, index: int | None = None) -> dict:
        return mistral_call(name, arguments, index)

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
            if not (finished or self._content_sent or self._open[:ready].strip()):
                # whitespace so far: no content if a call follows (a marker holds no whitespace, so
                # none starts inside it)
                self._blank.append(self._open[:ready])
                self._open = self._open[ready:]
                self._find_from = max(0, len(self._open) - len(MARKER) + 1)
                return "", ""
            out, self._open = self._take_blank() + self._open[:ready], self._open[ready:]
            self._content_sent, self._find_from = True, 0
            return out, ""
        blank = self._take_blank()
        before, after = blank + self._open[:at], self._open[at + len(MARKER):]
        self._open, self._mode = "", "calls"
        if self._content_sent or before[len(blank):].strip():
            self._content_sent = True
            self._unsent = [MARKER]
            return before, after
        self._unsent = [before, MARKER]
        return "", after

    def _take_blank(self) -> str:
        """The whitespace start held so far, joined, and no longer held."""
        blank, self._blank = "".join(self._blank), []
        return blank

    def _calls_in(self, text: str, finished: bool) -> tuple[list[dict], str]:
        """(the tool_calls entries of the text after the first marker, the text that turned to
        content)."""
        text, self._open = self._open + text, ""
        calls, at = [], 0
        while True:
            marker = text.find(MARKER, at)
            if marker != -1:
                end = marker
            else:
                end = len(text) - (0 if finished else held_tail_length(text[at:], (MARKER,)))
            calls += self._entries(text[at:end], ends=marker != -1 or finished)
            if self._mode != "calls":
                return calls, self._turned_to_content(text[end:])
            if marker == -1:
                self._open = text[end:]
                if finished and not self._read + self._marker_text.sent:  # markers with nothing after them
                    self._mode = "text"
                return calls, self._turned_to_content("")
            self._unsent.append(MARKER)
            self._read += self._marker_text.sent
            self._marker_text, at = MarkerText(self._marker_text.form), marker + len(MARKER)

    def _entries(self, text: str, ends: bool) -> list[dict]:
        """The entries one more piece of the current marker's text makes, each at its place among the
        choice's calls; BAD turns the mode to "text", pre-v11 calls read to "done"."""
        if not self._marker_text.settled:
            self._unsent.append(text)
        read = self._marker_text.feed(text, ends)
        if read is BAD:
            self._mode = "text"
            return []
        if self._marker_text.settled:
            self._unsent = []  # the whitespace content before the calls, or the text after the last one
            if self._marker_text.form == "json" and self._marker_text.stage == "after":
                self._mode = "done"  # pre-v11: everything after the JSON value is ignored
        return [{**entry, "index": self._read + entry["index"]} for entry in read]

    def _turned_to_content(self, rest: str) -> str:
        """Mode "text": the held text, and what follows, go out as content."""
        if self._mode != "text":
            return ""
        out, self._unsent = "".join(self._unsent) + rest, []
        return out
