"""A pythonic list of calls (`[get_weather(city="Paris"), get_time()]`) streamed as it is written:
CallListStream says which tool_calls entries go out as the text comes (each call at its `(`, each
keyword argument once the sign after it shows its value whole, `}` at the call's `)`), reading the
names and values with the whole reading's own scanner and token reader
(launcher/serving/pythonic_calls.py, whose PythonicCallReader drives one per streamed choice; its
module doc has the rules).
"""

from __future__ import annotations

from collections.abc import Callable

from launcher.serving.pythonic_calls import ListScanner, NoCall, TokenReader, json_text


def argument_piece(key: str, value: object, first: bool) -> str:
    """One keyword argument as the whole answer's arguments text writes it inside its braces: the
    json.dumps of a dict writes `"key": value`, each after the first behind ", ", key and value as
    json.dumps writes them alone (non-ASCII kept; a value holding a lone surrogate with ASCII
    escapes: call_json.arguments_text, for this piece only)."""
    return ("" if first else ", ") + json_text(key) + ": " + json_text(value)


# Where CallListStream is in the list: before its `[`, where a call's name (or the list's end) may
# come, inside a call's parentheses, after a call's `)`.
_START, _NAME, _ARGUMENTS, _AFTER_CALL = range(4)
_SPACE = frozenset(" \t\f\r\n")
"""The whitespace Python takes between tokens inside brackets (any other is no Python)."""


class HeadCheck:
    """Whether the text since one of the list's signs can still begin what belongs there, judged
    character by character as it comes (each once): a dotted name where a call's name belongs, a
    keyword's name up to its `=` in a call's parentheses, only whitespace after a call's `)`.
    Judged conservatively, only where no Python the whole reading takes could follow: a comment or
    a backslash (line joining), or any non-ASCII character, stops the judging (the sign after the
    text decides, as before); so does the `=` after a keyword (its value is judged at its sign).
    Prose after a call (`[f(a=1), then I`) is found out at its second word, not at a sign that
    prose may never write."""

    def __init__(self, place: int):
        self._place, self._state = place, "lead"
        """"lead", "name", "after_name" (whitespace after a name), "dot" (after a `.`), or "done"."""

    def feed(self, text: str) -> bool:
        """False once the text can no longer be what belongs at this place."""
        if self._place == _START:
            return True
        for char in text:
            if self._state == "done":
                return True
            if char in "#\\" or not char.isascii():
                self._state = "done"
            elif not self._takes(char):
                return False
        return True

    def _takes(self, char: str) -> bool:
        space, word = char in _SPACE, char.isalnum() or char == "_"
        if self._place == _AFTER_CALL:
            return space
        state = self._state
        if space:
            self._state = "after_name" if state == "name" else state
            return True
        if word and state in ("lead", "name", "dot"):
            self._state = "name"
            return True
        if char == "." and self._place == _NAME and state in ("name", "after_name"):
            self._state = "dot"
            return True
        if char == "=" and self._place == _ARGUMENTS and state in ("name", "after_name"):
            self._state = "done"  # the value: judged where its sign comes
            return True
        return False


class CallListStream:
    """Reads a list of calls that starts a text, piece by piece (feed), and says which tool_calls
    entries go out: a call once its name and its `(` have come (its index, id, name, arguments "{"),
    then each keyword argument once its value is whole, the closing "}" at its `)`.

    A value is whole at the comma or the `)` after it (a string may be followed by another it is
    joined to, a number by more of an expression). ListScanner notes the list's own signs (its
    brackets, its calls' parentheses, the commas between calls and arguments); the text between two
    of them is read by TokenReader.between_signs, the same small parser the whole reading uses,
    once that text has come. Each character is scanned once and each text between signs read once.

    Kept: the text from the current call's start (the first call's from the list's `[`), which is
    content if the list breaks, and the text since the last sign. A list that breaks (its text no list
    of calls, nested too deep, or cut short by the end) makes `broken` the text from the current call's
    start on: the calls before it went out whole."""

    def __init__(self, new_call: Callable[[str, str, int], dict]):
        self._new_call = new_call
        """Makes a call's first entry from its name, its arguments so far and its index."""
        self._scanner = ListScanner(marking=True)
        self._place = _START
        self._held: list[str] = []
        """The text from the current call's start (from after the last whole call's `)`, or from the
        list's `[` until the first call is whole)."""
        self._since_sign: list[str] = []
        """The text since the last of the list's own signs."""
        self._calls = 0
        """Calls announced: the one being read, in _ARGUMENTS, is at index _calls - 1."""
        self._keys: set[str] = set()
        """The current call's argument names so far (each may come once)."""
        self.closed = False
        """The list closed as a list of calls: nothing after it is read."""
        self.broken: str | None = None
        """Once the list broke: the text to send as content from there (all later text is content)."""
        self._head = HeadCheck(_START)
        """The text since the last sign, judged as it comes (a break found before the next sign)."""

    def feed(self, piece: str, finished: bool) -> list[dict]:
        """The entries this piece makes; `finished`: the text ends with it."""
        entries: list[dict] = []
        self._scanner.feed(piece)
        marks, self._scanner.marks = self._scanner.marks, []
        position = 0
        try:
            for at, char, level in marks:
                self._take(piece[position:at])
                position = at
                self._sign(char, level, entries)
                self._head = HeadCheck(self._place)  # the text after the sign, judged for its new place
                position = at + 1
                if self.closed:
                    self._held, self._since_sign = [], []
                    return entries
            self._take(piece[position:])
            position = len(piece)
            if self._scanner.too_deep:
                raise NoCall("nested deeper than call_json.MAX_DEPTH")
            if finished:
                raise NoCall("the text ends inside the list")
        except NoCall:
            self.broken = "".join(self._held) + piece[position:]
            self._held, self._since_sign = [], []
        return entries

    def _take(self, text: str) -> None:
        """More text between signs: NoCall, before it is held, where it can no longer be what belongs
        there (HeadCheck: the text goes out as content with the piece's rest)."""
        if text and not self._head.feed(text):
            raise NoCall(f"{text!r} where a call's name, a keyword or a comma belongs")
        if text:
            self._held.append(text)
            self._since_sign.append(text)

    def _text_since_sign(self) -> str:
        text, self._since_sign = "".join(self._since_sign), []
        return text

    def _sign(self, char: str, level: int, entries: list[dict]) -> None:
        """One of the list's own signs (ListScanner's marks): NoCall where the list is no list of
        calls there (before any of the held text changes: it is then content)."""
        if self._place == _START:  # the text starts with `[`: always the list's own
            self._held.append(char)
            self._place = _NAME
        elif self._place == _NAME:
            self._at_name(char, level, entries)
        elif self._place == _ARGUMENTS:
            self._in_arguments(char, level, entries)
        else:
            self._after_call(char, level)

    def _at_name(self, char: str, level: int, entries: list[dict]) -> None:
        """After `[` or a comma between calls: a name then `(` (the call is announced), or, after a
        comma, the list's `]` (a trailing comma)."""
        if char == "]" and level == 0 and self._calls:
            TokenReader.between_signs(self._text_since_sign(), lambda reader: None)
            self.closed = True
            return
        if char != "(" or level != 1:
            raise NoCall(f"{char!r} where a call's name or the list's end belongs")
        name = TokenReader.between_signs(self._text_since_sign(), TokenReader.dotted_name)
        entries.append(self._new_call(name, "{", self._calls))
        self._calls, self._keys = self._calls + 1, set()
        self._held.append(char)
        self._place = _ARGUMENTS

    def _in_arguments(self, char: str, level: int, entries: list[dict]) -> None:
        """A comma after an argument, or the call's `)` (after an argument, a trailing comma or none)."""
        closing = level == 1
        if closing and char != ")":
            raise NoCall(f"{char!r} closes a call's parenthesis")
        read = TokenReader.last_keyword_argument if closing else TokenReader.keyword_argument
        argument = TokenReader.between_signs(self._text_since_sign(), read)
        if argument is not None:
            key, value = argument
            if key in self._keys:
                raise NoCall(f"the argument {key!r} is given twice")
            self._send(entries, argument_piece(key, value, first=not self._keys))
            self._keys.add(key)
        if closing:
            self._send(entries, "}")
            self._held, self._place = [], _AFTER_CALL  # the call is whole: its text is settled
        else:
            self._held.append(char)

    def _after_call(self, char: str, level: int) -> None:
        """After a call's `)`: nothing but a comma (another call may come) or the list's `]`."""
        if not ((char == "," and level == 1) or (char == "]" and level == 0)):
            raise NoCall(f"{char!r} after a call")
        TokenReader.between_signs(self._text_since_sign(), lambda reader: None)
        if char == "]":
            self.closed = True
        else:
            self._held.append(char)
            self._place = _NAME

    def _send(self, entries: list[dict], arguments: str) -> None:
        """More of the current call's arguments: added to this piece's entry for that call, if any
        (one entry a call a piece)."""
        index = self._calls - 1
        if entries and entries[-1]["index"] == index:
            entries[-1]["function"]["arguments"] += arguments
        else:
            entries.append({"index": index, "function": {"arguments": arguments}})
