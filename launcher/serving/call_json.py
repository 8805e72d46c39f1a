"""JSON read from a model's tool calls, made safe to answer with.

- Depth. Python's JSON decoder and encoder recurse once per level of nesting, so a value nested
  about a thousand levels deep raised RecursionError, and how deep was too deep depended on how
  deep the caller's own stack was: a streamed reading (called from deeper frames) and the whole
  reading of the same text disagreed near the limit, and an encoder's RecursionError escaped as a
  500. Values nested deeper than MAX_DEPTH are therefore no call's JSON, whoever reads them.
- Text. A string written with a lone surrogate escape ("\\ud83d") decodes to a lone surrogate, which
  no UTF-8 response can carry (the whole answer failed with UnicodeEncodeError; the stream, which
  escapes non-ASCII, did not). Arguments holding one are written with ASCII escapes (the same JSON
  value, as the model wrote it); a name holding one is no function's name.
- Numbers. Python's decoder takes NaN, Infinity and -Infinity, and reads a number written with a
  fraction or an exponent that no double can hold (1e400) as infinity; json.dumps then wrote them
  back as NaN and Infinity, which are no JSON (JavaScript's JSON.parse and serde refuse them). Such a
  text holds no JSON value here, whoever reads it, as qwen3_coder_types.py already said. An integer
  is exact in Python and is kept, however large (up to Python's digit limit: past it, no value).
"""

from __future__ import annotations

import json
import math
import re

MAX_DEPTH = 128
"""Deepest nesting of objects and arrays taken in a call's JSON: far below where Python's recursion
limit (1000 frames and levels together: a value 600 levels deep failed 400 frames down) stops the
decoder or the encoder, however deep the caller's stack, and far above any call's arguments."""

_SIGNS = re.compile(r'[\[\]{}"\\]')


class JsonValueEnd:
    """Where a JSON object, array or string ends, found as its text comes: fed the value's text from
    its first character on, it counts brackets and follows strings (escapes included) over each new
    piece only. The end it finds is the end of the first JSON value when the text is JSON; a text
    that is not is found out by parsing it once it ends. With max_depth, it stops at the first
    bracket past that nesting (too_deep is then set)."""

    def __init__(self, max_depth: int | None = None):
        self.depth = 0
        self.in_string = False
        self.escaped = False
        """In a string, the last piece ended with a backslash: the next character is escaped."""
        self.max_depth = max_depth
        self.too_deep = False

    def feed(self, text: str, start: int = 0) -> int | None:
        """The index in `text` just after the character that closes the value (reading from `start`),
        None while it is open (or once it is too deep)."""
        pos = start
        if self.escaped and pos < len(text):
            self.escaped, pos = False, pos + 1
        while (found := _SIGNS.search(text, pos)) is not None:
            char, pos = found.group(), found.end()
            if self.in_string:
                if char == "\\":
                    if pos == len(text):
                        self.escaped = True
                        return None
                    pos += 1
                elif char == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return pos
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
                if self.max_depth is not None and self.depth > self.max_depth:
                    self.too_deep = True
                    return None
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return pos
        return None


def too_deep(text: str, start: int = 0) -> bool:
    """Whether the JSON value starting at text[start] (whitespace before it skipped) nests deeper than
    MAX_DEPTH, scanning up to where that value closes (or the text ends). Strings are stepped over,
    escapes included, so brackets inside them do not count."""
    position = len(text) - len(text[start:].lstrip()) if text[start:start + 1].isspace() else start
    if text[position:position + 1] not in ("[", "{", '"'):  # a number or a literal: no nesting
        return False
    scanner = JsonValueEnd(MAX_DEPTH)
    scanner.feed(text, position)
    return scanner.too_deep


def finite_float(text: str) -> float:
    """A JSON number written with a fraction or an exponent, as a float; ValueError where no double
    holds it (it would read as infinity, which no JSON writes back)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is beyond a double's range; no JSON value holds it")
    return value


def no_constant(name: str) -> object:
    """Python's decoder calls this for NaN, Infinity and -Infinity: no JSON, so ValueError."""
    raise ValueError(f"{name} is no JSON value")


_DECODER = json.JSONDecoder(parse_float=finite_float, parse_constant=no_constant)
"""json's decoder, but refusing the numbers no JSON writes (module doc)."""
_SHAPE_DECODER = json.JSONDecoder(parse_float=finite_float, parse_constant=no_constant, parse_int=str)
"""The same, with integers left as their text: Python's digit limit does not apply (shape_or_none)."""


def decode_at(text: str, start: int = 0) -> tuple[object, int] | None:
    """The JSON value at text[start] and the index after it (json's raw_decode), None when there is
    none whole: bad or cut JSON, NaN or a number beyond a double's range (module doc), an integer
    past Python's digit limit (ValueError), or nesting past MAX_DEPTH (the same answer whatever the
    caller's stack)."""
    if too_deep(text, start):
        return None
    try:
        return _DECODER.raw_decode(text, start)
    except (ValueError, RecursionError):
        return None


def loads_or_none(text: str) -> object:
    """The JSON value the whole text is (json.loads: whitespace around it allowed), None where there
    is none: bad JSON, NaN or a number beyond a double's range, an integer past Python's digit
    limit, or nesting past MAX_DEPTH (the same answer whatever the caller's stack). A text that is
    `null` also gives None, which no caller takes as a call either."""
    return _whole_value(text, _DECODER)


def shape_or_none(text: str) -> object:
    """As loads_or_none, but with each integer left as its text (a str), however long: for a reader
    that checks the value's shape and keeps the text as written (tool_calls.required_calls), so an
    integer past Python's digit limit, which the output's grammar allows, is no reason to drop a
    call."""
    return _whole_value(text, _SHAPE_DECODER)


def _whole_value(text: str, decoder: json.JSONDecoder) -> object:
    if too_deep(text):
        return None
    try:
        return decoder.decode(text)
    except (ValueError, RecursionError):
        return None


def named_call(parsed: object, arguments_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a decoded call object, None when it holds none: no object, a
    name no UTF-8 text can carry, or none of `arguments_keys` (the first present is taken, as vLLM's
    parsers take them). The arguments, any JSON value, are written back by arguments_text."""
    if not (isinstance(parsed, dict) and is_text(parsed.get("name"))):
        return None
    for key in arguments_keys:
        if key in parsed:
            return parsed["name"], arguments_text(parsed[key])
    return None


def is_text(value: object) -> bool:
    """A str that UTF-8 can carry (no lone surrogate)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def arguments_text(value: object) -> str:
    """A call's arguments as JSON text, as vLLM writes them (json.dumps, non-ASCII kept), but with
    ASCII escapes where the value holds a lone surrogate (module doc). ValueError where the value
    holds a float no JSON writes (inf, NaN: a pythonic literal's 1e400), as for a key JSON cannot
    write (TypeError); the JSON readers' values never hold one (their decoder refuses them)."""
    text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    return text if is_text(text) else json.dumps(value, allow_nan=False)


def no_json_number(token: str) -> bool:
    """Whether a bare token is one the whole reading refuses as no call's JSON: NaN, Infinity,
    -Infinity, or a number written with a fraction or an exponent beyond a double's range (1e400).
    An integer is exact, kept however long; any other word is left to the whole reading."""
    if token in ("NaN", "Infinity", "-Infinity"):
        return True
    if not any(sign in token for sign in ".eE"):
        return False
    try:
        return not math.isfinite(float(token))
    except ValueError:
        return False


_LEVEL_SIGNS = re.compile(r'[\[\]{}"\\]')
_JSON_TOKEN = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null")
_TOKEN_CHARS = frozenset("0123456789+-.eEabcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_")


class ArrayLevelCheck:
    """Whether a JSON array's text, fed as it comes from its `[`, is still JSON at the array's own
    level: values separated by single commas, JSON's whitespace between them, each bare value a JSON
    number (that a double holds) or true, false, null. Inside the elements (strings, objects, inner
    arrays) only the nesting is followed, nothing judged, so `broken` is sure (no decoder takes the
    text, whatever follows) but late for a break inside an element. The elements are stepped over a
    regular expression's search at a time; only the array's own level is read character by
    character (`[1, 2, ` then prose is found out at the prose's first word)."""

    def __init__(self) -> None:
        self.broken = False
        self._depth = 0
        self._in_string = self._escaped = False
        self._expect = "first"
        """At the array's own level: "first" (a value or `]`), "value", "comma" (`,` or `]`), "token"
        (in a bare value), "end" (the array has closed)."""
        self._token: list[str] = []

    def feed(self, text: str) -> bool:
        """More of the array's text; False once it is no JSON array (broken)."""
        position = 0
        while position < len(text) and not self.broken and self._expect != "end":
            if self._depth > 1 or self._in_string:
                position = self._step_inside(text, position)
            else:
                self._level_char(text[position])
                position += 1
        return not self.broken

    def _step_inside(self, text: str, position: int) -> int:
        """Past an element's inside text up to the next sign that matters (its nesting, its strings)."""
        if self._escaped:
            self._escaped = False
            return position + 1
        found = _LEVEL_SIGNS.search(text, position)
        if found is None:
            return len(text)
        char = found.group()
        if self._in_string:
            if char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
                if self._depth == 1:
                    self._expect = "comma"
        elif char == '"':
            self._in_string = True
        elif char in "[{":
            self._depth += 1
        elif char in "]}":
            self._depth -= 1
            if self._depth == 1:
                self._expect = "comma"
        return found.end()

    def _level_char(self, char: str) -> None:
        """One character at the array's own level (or its opening `[`)."""
        if self._depth == 0:
            self._depth, self.broken = 1, char != "["
            return
        if self._expect == "token":
            if char in _TOKEN_CHARS:
                self._token.append(char)
                return
            token, self._token = "".join(self._token), []
            if _JSON_TOKEN.fullmatch(token) is None or no_json_number(token):
                # no JSON value, or a number no call's JSON holds (1e400; an integer of any length is exact)
                self.broken = True
                return
            self._expect = "comma"
        if char in " \t\n\r":
            return
        if self._expect in ("first", "value"):
            if char == "]" and self._expect == "first":
                self._depth, self._expect = 0, "end"
            elif char == '"':
                self._in_string = True
            elif char in "[{":
                self._depth += 1
            elif char in _TOKEN_CHARS:
                self._expect, self._token = "token", [char]
            else:
                self.broken = True
        elif char == ",":
            self._expect = "value"
        elif char == "]":
            self._depth, self._expect = 0, "end"
        else:
            self.broken = True
