"""tool_choice "required"'s calls streamed as the model writes them, as vLLM 0.32 streams them.

The output is constrained to a JSON array of calls, `[{"name": "f", "parameters": {...}}, ...]`
(tool_calls.required_schema). A call goes out once its name's string has closed and its parameters'
value has begun: one tool_calls entry with its index, a new id, "function", the name and the
parameters' text so far; after that, each piece of text that extends the parameters' value goes out
as that call's arguments (no id, no name), so a client sees the arguments grow as it sees a named
call's. The arguments are the text as written, as the whole answer (tool_calls.required_calls, this
scan fed the whole text once it is one whole JSON array) gives them too; calls go out in the array's
order, and a call whose name is not yet known holds back those after it.

Only the array's own level is read: the element objects' keys and the extent of each value. Braces,
brackets and quotes inside values and strings are tracked (depth, string, escape) but not
interpreted. Text that does not open an array (JSON's whitespace aside) holds no call; text after
the array's closing bracket is not read (the whole reading refuses such a text: the output's schema
ends it at the bracket). So is anything out of place at the array's and the objects' own levels (a
second comma, a colon where a key belongs, a value where a comma belongs, whitespace JSON does not
take): the text is no JSON there, and nothing from it on goes out, as no call of it is read whole.
Inside an element, a bare token (a number, a word) is held back until it ends: NaN, Infinity,
-Infinity or a number beyond a double's range (1e400), which no call's JSON holds
(launcher/serving/call_json.py), ends the reading there, so none of it goes out (a call announced
before it keeps what it sent, as a stream cannot take it back; the whole reading finds no call).
The scan is incremental: each piece's characters are read once, and only the text a call may still
need (a key or a name being written, parameters not yet sent) is kept, so a long output costs its
length, not its length squared.

The same scan reads the calls of tool_choice "auto" in the JSON formats (hermes, llama3_json,
mistral's array): there the readers feed it the text of one call object at a time (one_object:
whitespace, then the object; any other text before it, or any text after it, ends the reading),
or the array, name the key their format writes the arguments under, and make the ids
their format's chat template expects. Only the first key of those named is streamed (a format
that allows two, llama3_json's "arguments" or "parameters", streams whichever comes first).

Pure (no tokenizer, no engine): tool_calls.ToolCallReader drives one per streamed "required" choice,
and the JSON readers of "auto" calls (hermes_calls, llama_calls: one per call object; mistral_calls:
one per pre-v11 array).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from launcher.serving.call_json import MAX_DEPTH, is_text, no_json_number
from launcher.serving.tool_calls import SentCalls, new_call_id

# What the scan expects next inside an element object of the array.
_KEY, _COLON, _VALUE, _STRING_VALUE, _NESTED_VALUE, _SCALAR_VALUE, _AFTER_VALUE = range(7)
# What the scan expects next at the array's own level.
_FIRST_ELEMENT, _ELEMENT, _COMMA = range(3)
_JSON_SPACE = " \t\n\r"
"""The only whitespace JSON takes between tokens (str.isspace takes more: a no-break space)."""
_BARE_TOKEN = frozenset("0123456789+-.eEabcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
"""The characters of a number or a bare word (true, NaN) outside strings: a bare token."""


@dataclass
class _Call:
    """Where one element of the array sits in the text (absolute offsets)."""

    name: str | None = None
    """Set once the name's string has closed and decodes as a JSON string."""
    arguments_start: int | None = None
    arguments_end: int | None = None
    """None while the parameters' value is still being written."""

    @property
    def ready(self) -> bool:
        return self.name is not None and self.arguments_start is not None


class RequiredCallsStream:
    """Reads one choice's text piece by piece (feed) and says which call entries to send."""

    def __init__(self, arguments_keys: tuple[str, ...] = ("parameters",), one_object: bool = False,
                 make_id: Callable[[], str] = new_call_id) -> None:
        """arguments_keys: the keys a call's arguments may be written under (the first of them that
        comes is streamed); one_object: the text is one call object, not an array of them (read as
        the array's first element); make_id: a new call's id."""
        self._arguments_keys, self._make_id, self._one_object = arguments_keys, make_id, one_object
        self._calls: list[_Call] = []
        self._depth = 1 if one_object else 0
        """Nesting of {} and []: the array is 1, its element objects 2."""
        self._in_string = self._escaped = False
        self._string_start = 0
        self._current: _Call | None = None
        self._expect = _KEY
        self._key: str | None = None
        self._value_start = 0
        self._over = False
        """The array has closed, or the text does not open one: nothing more is read."""
        self._read_to = 0
        """The text read so far: all of it, or up to where reading stopped (_over)."""
        self._kept_pieces: list[str] = []
        self._kept_from, self._length = 0, 0
        """The text from offset _kept_from on (what may still be needed), as the pieces it came in
        (joined only when read or trimmed: while a call's arguments wait for its name, appending to
        one string copied them all at every piece); the whole text's length."""
        self._sent_to: list[int] = []
        """Per sent call, the offset its arguments have been sent up to."""
        self._first_open = 0
        """The first call not yet sent whole (the calls before it have nothing more to send: without
        this every piece went over every call, quadratic in the calls of a long array)."""
        self._value_is_arguments = False
        """The value being written is the element's (first) parameters."""
        self._after_comma = False
        """In an element, a comma came last: a key must follow (a closing brace would be no JSON)."""
        self._array_expect = _FIRST_ELEMENT
        """At the array's own level, what may come next."""
        self._sent = SentCalls()
        self._token_start: int | None = None
        """Where the bare token being written inside an element began (None: none is): its text is
        held back until it ends, and a number no call's JSON holds ends the reading there."""

    def feed(self, piece: str) -> list[dict]:
        """The tool_calls entries this piece of the text makes ([] for none)."""
        start = self._length
        self._kept_pieces.append(piece)
        self._length += len(piece)
        if not self._over:
            self._scan(piece, start)
        if not self._over:
            self._read_to = self._length if self._token_start is None else self._token_start
        entries = self._entries()
        self._forget()
        return entries

    @property
    def sent(self) -> list[dict]:
        """The calls sent so far, each as a whole answer's entry (id, type, function name and the
        arguments sent so far)."""
        return self._sent.calls()

    @property
    def stopped(self) -> bool:
        """Whether the reading has stopped: the text is no call's JSON from a point on (a character out
        of place at the array's or an element's own level, a number no call's JSON holds, nesting past
        MAX_DEPTH), or the array (one_object: the object) has ended. A reader fed one object's text up
        to its end only knows from this that no whole reading can take the object as a call."""
        return self._over

    @property
    def announced(self) -> int:
        """How many calls have gone out (without joining their arguments, as sent does)."""
        return len(self._sent)

    def _text(self, start: int, end: int) -> str:
        return self._kept[start - self._kept_from:end - self._kept_from]

    @property
    def _kept(self) -> str:
        """The kept text, joined (and kept joined)."""
        if len(self._kept_pieces) != 1:
            self._kept_pieces = ["".join(self._kept_pieces)]
        return self._kept_pieces[0]

    # ---- which entries go out ----------------------------------------------------------------------
    def _entries(self) -> list[dict]:
        entries = []
        for index in range(self._first_open, len(self._calls)):
            call = self._calls[index]
            if not call.ready:  # elements are written in order: nothing after it can be sent
                break
            end = call.arguments_end if call.arguments_end is not None else self._read_to
            if index == self._first_open and index < len(self._sent) and self._sent_to[index] == call.arguments_end:
                self._first_open += 1  # sent whole before this piece
                continue
            if index < len(self._sent):
                if end > self._sent_to[index]:
                    piece = {"index": index, "function": {"arguments": self._text(self._sent_to[index], end)}}
                    self._sent.record(piece)
                    self._sent_to[index] = end
                    entries.append(piece)
                continue
            if end <= call.arguments_start:  # a bare token held back: the first entry carries its text
                break
            arguments = self._text(call.arguments_start, end)
            entry = {"id": self._make_id(), "type": "function", "function": {"name": call.name, "arguments": arguments}}
            self._sent.record(entry)
            self._sent_to.append(end)
            entries.append({"index": index, **entry})  # SentCalls.record keeps its own copy
        return entries

    def _forget(self) -> None:
        """Drop the kept text no call needs any more: everything before the earliest of a key or
        name being written and the parameters of a call not sent yet."""
        needed = self._length
        # a key or a name being written is read whole once it closes; any other string at this level
        # is not (a call's arguments are kept below, from their start, until sent; another key's
        # value is not needed at all)
        if self._in_string and self._depth == 2 and (
                self._expect == _KEY or (self._expect == _STRING_VALUE and self._key == "name")):
            needed = self._string_start
        for call in self._calls[len(self._sent):]:
            if call.arguments_start is not None:
                needed = min(needed, call.arguments_start)
        if self._token_start is not None:
            needed = min(needed, self._token_start)
        if needed > self._kept_from:
            self._kept_pieces = [self._kept[needed - self._kept_from:]]
            self._kept_from = needed

    # ---- the scan ----------------------------------------------------------------------------------
    def _scan(self, piece: str, offset: int) -> None:
        for i, ch in enumerate(piece, offset):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                    self._string_closed(i)
                continue
            if self._token_start is not None and ch not in _BARE_TOKEN:
                token, self._token_start = self._text(self._token_start, i), None
                if no_json_number(token):  # no call's JSON: nothing from the token on goes out
                    self._over, self._read_to = True, i - len(token)
                    return
            elif self._token_start is None and ch in _BARE_TOKEN and self._depth >= 2:
                self._token_start = i
            if self._depth == 0 and not (ch == "[" or ch in _JSON_SPACE):  # text before the array: no call
                self._over, self._read_to = True, i
                return
            if self._one_object and self._depth == 1 and ch not in _JSON_SPACE and (ch != "{" or self._calls):
                self._over, self._read_to = True, i  # text before the object, or after it
                return
            if self._out_of_place(ch):  # no JSON from here on: nothing more goes out
                self._over, self._read_to = True, i
                return
            if ch == '"':
                self._in_string, self._string_start = True, i
                if self._depth == 2 and self._current is not None:
                    if self._expect == _VALUE:
                        self._start_value(i, _STRING_VALUE)
                    else:  # a key
                        self._after_comma = False
            elif ch in "{[":
                if not self._opened(ch, i):
                    self._over, self._read_to = True, i
                    return
            elif ch in "}]":
                if not self._closed(i):
                    self._over, self._read_to = True, i + 1
                    return
            elif self._depth == 2 and self._current is not None:
                self._element_character(ch, i)

    def _out_of_place(self, ch: str) -> bool:
        """Whether a character outside strings cannot come here in JSON, at the array's own level or an
        element object's (deeper, inside a value, nothing is checked: the value's text is what the
        call sends, and the whole reading judges it). At the array's level a comma is taken here."""
        if self._depth == 1 and not self._one_object:
            if ch in _JSON_SPACE:
                return False
            if ch == ",":
                if self._array_expect != _COMMA:
                    return True
                self._array_expect = _ELEMENT
                return False
            if ch == "]":
                return self._array_expect == _ELEMENT
            return ch != "{" or self._array_expect == _COMMA  # an element must be an object (_opened)
        if self._depth != 2 or self._current is None or ch in _JSON_SPACE:
            return False
        expect = self._expect
        if ch == '"':
            return expect not in (_KEY, _VALUE)
        if ch in "{[":
            return expect != _VALUE
        if ch == "}":
            return not (expect in (_AFTER_VALUE, _SCALAR_VALUE) or (expect == _KEY and not self._after_comma))
        if ch == ":":
            return expect != _COLON
        if ch == ",":
            return expect not in (_AFTER_VALUE, _SCALAR_VALUE)
        # "]" closes nothing here; other whitespace is no JSON's; the rest is a scalar's text
        return ch == "]" or ch.isspace() or expect not in (_VALUE, _SCALAR_VALUE)

    def _string_closed(self, i: int) -> None:
        if self._depth != 2 or self._current is None:
            return
        if self._expect == _KEY:
            self._key, self._expect = self._text(self._string_start + 1, i), _COLON
        elif self._expect == _STRING_VALUE:
            self._end_value(i + 1)

    def _opened(self, ch: str, i: int) -> bool:
        """False where the text is no array of objects, or nests past call_json.MAX_DEPTH: nothing
        more is read, so no argument past the limit and no later call goes out (the whole reading
        finds no call in such a text; a call announced before the limit keeps what it sent, as a
        stream cannot take back)."""
        if self._depth == 1:
            if ch != "{":
                return False
            self._current = _Call()
            self._calls.append(self._current)
            self._expect, self._key, self._after_comma, self._array_expect = _KEY, None, False, _COMMA
        elif self._depth == 2 and self._current is not None and self._expect == _VALUE:
            self._start_value(i, _NESTED_VALUE)
        self._depth += 1
        # deeper is no call's JSON (call_json), as the whole reading says; one object's scan counts
        # an array level that its text does not have
        return self._depth - self._one_object <= MAX_DEPTH

    def _closed(self, i: int) -> bool:
        """False once the array itself has closed (or a stray closing bracket came first)."""
        if self._depth == 2 and self._current is not None and self._expect == _SCALAR_VALUE:
            self._end_value(i)
        self._depth -= 1
        if self._depth == 2 and self._current is not None and self._expect == _NESTED_VALUE:
            self._end_value(i + 1)
        elif self._depth == 1:
            self._current = None
        return self._depth > 0

    def _element_character(self, ch: str, i: int) -> None:
        """A character outside strings at the element objects' own level."""
        if ch == ":":
            if self._expect == _COLON:
                self._expect = _VALUE
        elif ch == ",":
            if self._expect == _SCALAR_VALUE:
                self._end_value(i)
            self._expect, self._key, self._after_comma = _KEY, None, True
        elif ch in _JSON_SPACE:
            if self._expect == _SCALAR_VALUE:
                self._end_value(i)
        elif self._expect == _VALUE:
            self._start_value(i, _SCALAR_VALUE)

    def _start_value(self, i: int, state: int) -> None:
        self._value_start, self._expect = i, state
        # a repeated key is no call's arguments (the output's schema allows none; the whole reading
        # would take the last, a stream has sent the first)
        self._value_is_arguments = self._key in self._arguments_keys and self._current.arguments_start is None
        if self._value_is_arguments:
            self._current.arguments_start = i

    def _end_value(self, end: int) -> None:
        if self._value_is_arguments:
            self._current.arguments_end, self._value_is_arguments = end, False
        elif self._key == "name" and self._expect == _STRING_VALUE:
            try:
                name = json.loads(self._text(self._value_start, end))
            except json.JSONDecodeError:  # never a call, as the whole reading refuses the array
                name = None
            if is_text(name):  # no lone surrogate, as the whole reading takes names
                self._current.name = name
        self._expect = _AFTER_VALUE
