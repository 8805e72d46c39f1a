"""tool_choice "auto" read in vLLM's "pythonic" format (`--tool-call-parser pythonic`), the one Llama
3.2 (and Llama 4, ToolACE) models write when their prompt asks for the calls as a Python list:

    [get_weather(city="Paris", unit="c"), get_time()]

Read as vLLM 0.32's PythonicToolParser reads the whole text: the text must start with `[` (no
whitespace before it) and that list must be one of calls, each a name (dotted names such as
`tools.get_weather` taken whole) with keyword arguments only, each argument's value a literal:
strings (f-strings without placeholders included), numbers (a sign before them included) that a
double holds, True, False, None and JSON's true, false, null, lists and tuples (written as JSON
lists), and dicts whose keys are plain strings. The arguments are written back as JSON text (json.dumps,
non-ASCII kept). Anything else (a positional argument, `**kwargs`, a name, an expression, a call as
a value, an f-string with a placeholder or as a dict key, bytes, a complex number, a number beyond a double's range
such as 1e400, which JSON cannot write, a set, a dict key that is no string, an empty list, Python
that does not parse, a list cut short) makes the whole text content, with no call. With parallel_tool_calls false only
the first call is kept (vLLM's rule).

Safety: nothing is evaluated. The list's text is split into Python tokens (tokenize) and read by a
small parser that takes only the forms above; Python's own parser sees only one string or number
token at a time, so no deep syntax tree is ever built (ast.parse of a long chain raised
RecursionError or MemoryError, at a length that depended on the caller's stack depth). Values nested
deeper than call_json.MAX_DEPTH, brackets or signs, are no call; strings with a lone surrogate are
written with ASCII escapes (launcher/serving/call_json.py). (Python 3.11's tokenize gives an
f-string as one string token; from 3.12 it comes in several tokens, and an f-string is refused.)

Where this reading differs from vLLM's (the same whole and streamed here, but for the stream's
exception below, where vLLM's whole answer and its stream disagree with each other):
- The text after the list's closing `]` belongs to no call and is no content. vLLM's whole answer
  parses the whole text as Python and reads its first statement: prose after the list (a syntax
  error) or Python that continues the list (`[f()] + [g()]`, `[f()][0]`) makes it all content
  there, another statement (`; x = 1`, a second list on the next line) is dropped; vLLM's stream
  mostly sends the calls and drops the text after the list, as here (a second list right after the
  first, `[f(a=1)][g(b=2)]`, makes it send nothing).
- vLLM's whole answer first asks a regular expression that wants the first call written tightly
  (`[name(` then `name=` or `)`, a name starting with an ASCII letter, and `)` then whitespace then
  `]` somewhere): `[f( x=1)]`, `[f(x = 1)]`, `[_f()]`, `[a.b(x=1)]`, `[f(),]` or `[f(x=1) # note` and
  `]` on the next line are content there. Its stream does not ask it, nor does this reading: the
  Python syntax decides (names as Python takes them: `a²`, which tokenize lets through and NFKC would
  turn into `a2`, is no name).
- A set, and a dict key that is no string, make the whole text content here: vLLM writes a set as a
  list and a key as JSON writes it (1 and "1" both as "1", one object then holding the key twice;
  1 and 1.0 merged into one key), and 1e400 as `Infinity`, which is no JSON.
- A positional argument (`f(1, a=2)`), which vLLM drops silently where that regex lets it through,
  `**kwargs` (vLLM writes its value under the key "null"), a keyword given twice (vLLM keeps the last)
  and a call written as `(f)()` make the whole text content here: no call is made with arguments the
  model did not mean.
- The `<|python_start|>` and `<|python_end|>` tokens Llama 4 may wrap its calls in are plain text, as
  for vLLM's "pythonic" (its "llama4_pythonic" parser strips them): such a text is content.

Streamed, the content goes out as it comes when the text does not start with `[`. From a leading `[`
each call goes out as it is written, at the granularity Python's syntax gives
(launcher/serving/pythonic_calls_stream.py):
- once its name and its `(` have come: one tool_calls entry with its index (its place in the list),
  a new id, "function", the name and the arguments "{". Announced there, not with its first
  argument, so that a client learns which tool runs as early as the JSON formats tell it (and as
  vLLM's pythonic stream does), even when the first argument is long (a file's text); the price: a
  call whose first argument is no keyword literal (`f(1)`, `f(x=y)`) is the exception below;
- then each keyword argument once its value is whole, which the comma or the `)` after it tells (a
  string may be joined to the next one written beside it, a number continued): `"city": "Paris"`,
  behind ", " after the first; and the closing "}" with the call's `)` (a call without arguments
  sends "{" then "}").
Each argument's piece is written with the whole answer's settings (json.dumps, non-ASCII kept), so
the pieces make exactly the whole answer's arguments text, with one exception: where one argument's
value holds a lone surrogate, the whole answer writes all the arguments with ASCII escapes
(call_json.arguments_text), while the stream has sent the arguments before it with non-ASCII kept
and escapes only that argument's piece (the same JSON value). The text after the list's `]` is no
content; with parallel_tool_calls false only the entries of index 0 go out (free_text_calls). For
any split of a text the stream says what the whole answer says, but where no stream can know yet
what it has sent: a list that turns out to be no list of calls (a later syntax error, a positional
or non-literal argument, a keyword given twice, nesting past MAX_DEPTH, the text ending inside the
list) after a call went out. The whole answer is then all content, with no call; the stream has sent
the calls announced so far (those whose `)` came whole, the breaking one with the arguments whole
before it) and sends the text from the breaking call's start on as content: from after the last
whole call's `)`, or from the list's `[` when the first call broke (then the stream's content is the
whole answer's, all of the text); a list cut just after a call's `)` leaves no content. A list that
breaks before any call was announced (`[]`, `[(f)()]`, a bad name) is all content, as whole. The
break is found where the list's next sign comes, or earlier, as the text comes, where the text since
the last sign can no longer be what belongs there (pythonic_calls_stream.HeadCheck: a second word
where a call's name or a keyword belongs, `[f(a=1), then I`; anything but whitespace after a call's
`)`): prose after a call goes out as content as it is written, not at the end of the text.

Pure (no tokenizer, no engine): the app's ChatRender drives a PythonicCallReader per choice (its
shared part: launcher/serving/free_text_calls.py).
"""

from __future__ import annotations

import ast
import io
import keyword
import re
import tokenize
import unicodedata
import warnings
from collections.abc import Callable
from typing import TypeVar

from launcher.serving.call_json import MAX_DEPTH, arguments_text, is_text
from launcher.serving.free_text_calls import CallsReading, FreeTextCallReader

OUTSIDE_SIGNS = re.compile(r"""[\[\](){}'"#,]""")
"""Outside strings and comments, the characters that open or close a bracket, a string or a comment,
and the comma (which separates the list's calls and their arguments)."""
STRING_SIGNS = {quote: re.compile(r"[\\" + quote + "]") for quote in "'\""}
LINE_END = re.compile(r"[\r\n]")
JSON_NAMES = {"true": True, "false": False, "null": None}
"""Names some models write for JSON's literals (vLLM takes them, beside Python's True, False, None)."""
SKIPPED_TOKENS = {tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.ENDMARKER}
T = TypeVar("T")


class FormattedString(str):
    """The text of an f-string without placeholders: a string value, but no dict key (Python's f-string
    is an expression, and vLLM takes only plain constants as keys)."""


class NoCall(Exception):
    """The list's text is no list of calls vLLM would take (the whole text is then content)."""


class ListScanner:
    """Finds where a Python list that starts a text closes, over pieces of the text: brackets are
    counted outside strings (quotes of one or three, backslash escapes) and comments, with the state
    carried from piece to piece, so each piece is looked at once. The brackets of any kind count
    together; a bad match shows when the list is read.

    With marking, it also notes the list's own signs, for reading the list as it comes: the brackets
    of the list and of its calls' parentheses (a bracket of level 0 or 1) and the commas between
    calls and between arguments (level 1 or 2), each as (index in the piece, character, level), the
    level being the depth of the brackets the sign stands in (0 outside the list, 1 in it, 2 in a
    call's parentheses). Signs inside an argument's value (deeper) are not noted."""

    def __init__(self, marking: bool = False):
        self.marks: list[tuple[int, str, int]] | None = [] if marking else None
        """The signs noted since the reader last took them (None: not marking)."""
        self.depth = 0
        self.quote = ""
        """The open string's closing quote: one quote or three ("" outside strings)."""
        self.escaped = False
        """In a string, the next character is escaped by a backslash."""
        self.quote_run = 0
        """Quotes of self.quote's kind seen in a row: while opening (1 or 2: the third makes it a
        triple), or, in a triple-quoted string, toward its closing three."""
        self.opening = ""
        """The quote character being opened (its kind is known at the next other character)."""
        self.in_comment = False
        self.too_deep = False

    def feed(self, piece: str) -> int | None:
        """The index in the piece just after the list's closing bracket, None while it is open (or
        nested past MAX_DEPTH: too_deep)."""
        position = 0
        while position < len(piece) and not self.too_deep:
            if self.opening:
                position = self._opening_quote(piece, position)
            elif self.quote:
                position = self._in_string(piece, position)
            elif self.in_comment:
                end = LINE_END.search(piece, position)
                if end is None:
                    return None
                self.in_comment, position = False, end.end()
            else:
                sign = OUTSIDE_SIGNS.search(piece, position)
                if sign is None:
                    return None
                char, position = sign.group(), sign.end()
                if char in "'\"":
                    self.opening, self.quote_run = char, 1
                elif char == "#":
                    self.in_comment = True
                elif char == ",":
                    self._mark(position - 1, char, self.depth, deepest=2)
                elif char in "[({":
                    self._mark(position - 1, char, self.depth, deepest=1)
                    self.depth += 1
                    self.too_deep = self.depth > MAX_DEPTH
                else:
                    self.depth -= 1
                    self._mark(position - 1, char, self.depth, deepest=1)
                    if self.depth <= 0:
                        return position
        return None

    def _mark(self, at: int, char: str, level: int, deepest: int) -> None:
        """Note a sign of the list's own (at `level`, no deeper than `deepest`) when marking."""
        if self.marks is not None and level <= deepest:
            self.marks.append((at, char, level))

    def _opening_quote(self, piece: str, position: int) -> int:
        """After one or two quotes: a third makes a triple-quoted string, two then another character
        an empty string, one then another character a string of one quote."""
        char = piece[position]
        if char == self.opening and self.quote_run == 1:
            self.quote_run = 2
            return position + 1
        if char == self.opening:  # the third
            self.quote, self.opening, self.quote_run = char * 3, "", 0
            return position + 1
        if self.quote_run == 2:  # '' : an empty string, closed
            self.opening, self.quote_run = "", 0
        else:
            self.quote, self.opening, self.quote_run = self.opening, "", 0
        return position  # the character is read again, in its new state

    def _in_string(self, piece: str, position: int) -> int:
        """Inside a string: a backslash skips the next character (in raw strings too, as Python
        finds their end); one quote closes a string of one, three in a row a string of three."""
        if self.escaped:
            self.escaped, self.quote_run = False, 0
            return position + 1
        if len(self.quote) == 3 and self.quote_run:  # a quote run toward the closing three
            if piece[position] != self.quote[0]:
                self.quote_run = 0
                return position
            self.quote_run += 1
            if self.quote_run == 3:
                self.quote, self.quote_run = "", 0
            return position + 1
        sign = STRING_SIGNS[self.quote[0]].search(piece, position)
        if sign is None:
            return len(piece)
        if sign.group() == "\\":
            self.escaped = True
        elif len(self.quote) == 1:
            self.quote = ""
        else:  # a first quote toward a triple string's closing three
            self.quote_run = 1
        return sign.end()


class TokenReader:
    """Reads a closed list's Python tokens as calls, or, streamed, the text between two of the list's
    own signs (between_signs): a small parser of the whitelisted forms only (module doc); NoCall for
    anything else."""

    def __init__(self, text: str):
        try:
            # newline=None: a bare "\r" ends a line, as Python's compiler reads it (else an ERRORTOKEN)
            tokens = list(tokenize.generate_tokens(io.StringIO(text + "\n", newline=None).readline))
        except (tokenize.TokenError, SyntaxError, ValueError) as error:
            raise NoCall(str(error)) from None
        self.tokens = [token for token in tokens if token.type not in SKIPPED_TOKENS]
        self.at = 0

    def _peek(self) -> tokenize.TokenInfo | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def _next(self) -> tokenize.TokenInfo:
        token = self._peek()
        if token is None:
            raise NoCall("the list ends early")
        self.at += 1
        return token

    def _is_op(self, text: str) -> bool:
        token = self._peek()
        return token is not None and token.type == tokenize.OP and token.string == text

    def _expect(self, text: str) -> None:
        if not self._is_op(text):
            raise NoCall(f"{text!r} expected")
        self.at += 1

    def calls(self) -> list[tuple[str, str]]:
        """`[call, call, ...]` (a comma after the last allowed), and nothing after it."""
        self._expect("[")
        calls = []
        while not self._is_op("]"):
            calls.append(self._call())
            if not self._is_op("]"):
                self._expect(",")
        self._expect("]")
        if not calls or self._peek() is not None:
            raise NoCall("no call, or more than the list")
        return calls

    def _name(self) -> str:
        token = self._next()
        if (token.type != tokenize.NAME or keyword.iskeyword(token.string) or not is_text(token.string)
                or not token.string.isidentifier()):  # tokenize's \w+ takes "a²", Python refuses it
            raise NoCall(f"{token.string!r} is no name")
        return unicodedata.normalize("NFKC", token.string)  # as Python reads identifiers

    def _call(self) -> tuple[str, str]:
        """`name(key=value, ...)`, the name dotted or not: keyword arguments only, each once."""
        name = self.dotted_name()
        self._expect("(")
        arguments = {}
        while not self._is_op(")"):
            key, value = self.keyword_argument()
            if key in arguments:
                raise NoCall(f"the argument {key!r} is given twice")
            arguments[key] = value
            if not self._is_op(")"):
                self._expect(",")
        self._expect(")")
        return name, json_text(arguments)

    def dotted_name(self) -> str:
        """A call's name: `name` or `a.b.name` (taken whole)."""
        parts = [self._name()]
        while self._is_op("."):
            self.at += 1
            parts.append(self._name())
        return ".".join(parts)

    def keyword_argument(self) -> tuple[str, object]:
        """`key=value`, the value a literal."""
        key = self._name()
        self._expect("=")
        return key, self._value(1)

    def last_keyword_argument(self) -> tuple[str, object] | None:
        """Before a call's `)`: a keyword argument, or none (`f()`, or a comma after the last)."""
        return None if self._is_op(")") else self.keyword_argument()

    @classmethod
    def between_signs(cls, text: str, read: Callable[[TokenReader], T]) -> T:
        """What `read` reads from the text between two of the list's own signs (ListScanner's marks:
        a call's name, one argument), which must hold nothing more. The text is put in parentheses,
        so tokenize reads it as it reads it inside the list (no indentation; a line break is no
        statement's end), and tokens never cross a sign (each sign is a token of its own, and
        strings and comments end before it): its tokens are the whole list's there."""
        reader = cls("(" + text + ")")
        reader._expect("(")
        value = read(reader)
        reader._expect(")")
        if reader._peek() is not None:
            raise NoCall(f"{reader._peek().string!r} after {text!r}")
        return value

    def _value(self, depth: int) -> object:
        """A literal's value. Signs before a number are read in a loop (each a level of nesting),
        containers by recursion: two frames a level, so MAX_DEPTH levels stay far inside Python's
        recursion limit."""
        signs = []
        token = self._next()
        while token.type == tokenize.OP and token.string in ("-", "+"):
            signs.append(token.string)
            token = self._next()
        depth += len(signs)
        if depth > MAX_DEPTH:
            raise NoCall("nested too deep")
        if token.type == tokenize.STRING:
            value = self._strings(token)
        elif token.type == tokenize.NUMBER:
            value = self._constant(token.string, (int, float))
        elif token.type == tokenize.NAME and token.string in ("True", "False", "None"):
            value = {"True": True, "False": False, "None": None}[token.string]
        elif token.type == tokenize.NAME and token.string in JSON_NAMES:
            value = JSON_NAMES[token.string]
        elif token.type == tokenize.OP and token.string == "[":
            value = self._items("]", depth)
        elif token.type == tokenize.OP and token.string == "(":
            value = self._parenthesized(depth)
        elif token.type == tokenize.OP and token.string == "{":
            value = self._braced(depth)
        else:
            raise NoCall(f"{token.string!r} is no literal")
        if not signs:
            return value
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise NoCall("a sign before no number")
        return -value if signs.count("-") % 2 else value

    def _strings(self, first: tokenize.TokenInfo) -> str:
        """One string, or several written side by side (joined, as Python joins them); with an
        f-string without placeholders among them, a FormattedString."""
        texts = [first.string]
        while self._peek() is not None and self._peek().type == tokenize.STRING:
            texts.append(self._next().string)
        try:  # only string tokens: a flat, small tree
            with warnings.catch_warnings():  # an unknown escape ("\d") is kept as written, unwarned
                warnings.simplefilter("ignore")
                node = ast.parse(" ".join(texts), mode="eval").body
        except (SyntaxError, ValueError, MemoryError, RecursionError) as error:
            raise NoCall(str(error)) from None
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.JoinedStr) and all(isinstance(part, ast.Constant) for part in node.values):
            return FormattedString("".join(part.value for part in node.values))
        raise NoCall("bytes, or an f-string with a placeholder")

    @staticmethod
    def _constant(text: str, kinds: tuple[type, ...]) -> object:
        try:
            value = ast.literal_eval(text)
        except (SyntaxError, ValueError, MemoryError, RecursionError) as error:
            raise NoCall(str(error)) from None
        if not isinstance(value, kinds):
            raise NoCall(f"{text!r} is no JSON number")
        return value

    def _items(self, closer: str, depth: int) -> list:
        """Values separated by commas (one after the last allowed) up to `closer`."""
        items = []
        while not self._is_op(closer):
            items.append(self._value(depth + 1))
            if not self._is_op(closer):
                self._expect(",")
        self._expect(closer)
        return items

    def _parenthesized(self, depth: int) -> object:
        """`()` and `(a, ...)`: a tuple, written as a list; `(a)`: a itself."""
        if self._is_op(")"):
            self.at += 1
            return []
        first = self._value(depth + 1)
        if self._is_op(")"):
            self.at += 1
            return first
        self._expect(",")
        return [first, *self._items(")", depth)]

    def _braced(self, depth: int) -> dict:
        """`{}` and `{key: value, ...}`, a dict whose keys are plain strings, as JSON's are: a key of another
        kind (1, None, True) would be written as a string that may equal another key's (`{1: "x",
        "1": "y"}` wrote "1" twice), and Python's own equal keys (1, 1.0, True) merge. A set (`{a, b}`)
        is no JSON value, and no list: both are no call."""
        if self._is_op("}"):
            self.at += 1
            return {}
        pairs = {}
        while True:
            key = self._value(depth + 1)
            if type(key) is not str:  # a number, None, a bool, a FormattedString, a container
                raise NoCall(f"the dict key {key!r} is no plain string" if self._is_op(":")
                             else "a set is no JSON value")
            self._expect(":")
            pairs[key] = self._value(depth + 1)
            if not self._is_op("}"):
                self._expect(",")
            if self._is_op("}"):
                self.at += 1
                return pairs


def json_text(value: object) -> str:
    """call_json.arguments_text(value), NoCall where JSON cannot write the value: a key JSON cannot
    write, an integer past Python's digit limit."""
    try:
        return arguments_text(value)
    except (TypeError, ValueError) as error:
        raise NoCall(str(error)) from None


def list_calls(text: str) -> list[tuple[str, str]] | None:
    """(name, arguments JSON text) of each call of a closed list's text, None when it is no list of
    calls."""
    try:
        return TokenReader(text).calls()
    except NoCall:
        return None
    except RecursionError:  # only from a caller already near Python's limit: never escapes
        return None


def read_whole(text: str) -> CallsReading:
    """The whole generated text's content and calls."""
    if not text.startswith("["):
        return CallsReading(text)
    scanner = ListScanner()
    end = scanner.feed(text)
    calls = None if end is None else list_calls(text[:end])
    if calls is None:  # cut, too deep, or no list of calls: all content (vLLM's fallback)
        return CallsReading(text)
    return CallsReading(None, calls)


class PythonicCallReader(FreeTextCallReader):
    """One choice's text read in the pythonic format, streamed (delta) or whole (push, then message).

    Streamed, the work per piece is that piece's: a CallListStream follows the list over the new
    characters only and reads each call's name and each argument once, when the sign after it has
    come. What is kept is only the text not settled yet: the current call's (content, if the list
    turns out to be no list of calls) and the text since the list's last sign."""

    read_whole = staticmethod(read_whole)

    def __init__(self, parallel_tool_calls: bool = True):
        super().__init__(parallel_tool_calls)
        self._mode = "start"
        """"start": no character yet; "list": the text started with `[` and the list is open;
        "after": the list held calls, the rest is no content; "content": all the rest is content."""
        from launcher.serving.pythonic_calls_stream import CallListStream  # it imports this module

        self._list = CallListStream(self._new_call)

    def _read_piece(self, piece: str, finished: bool) -> tuple[str, list[dict]]:
        if self._mode == "start" and piece:
            self._mode = "list" if piece.startswith("[") else "content"
        if self._mode == "content":
            return piece, []
        if self._mode == "list":
            return self._list_piece(piece, finished)
        return "", []

    def _list_piece(self, piece: str, finished: bool) -> tuple[str, list[dict]]:
        entries = self._list.feed(piece, finished)
        if self._list.broken is not None:  # no list of calls: its text from the current call on is content
            self._mode = "content"
            return self._list.broken, entries
        if self._list.closed:
            self._mode = "after"
        return "", entries
