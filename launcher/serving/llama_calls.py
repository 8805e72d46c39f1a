"""tool_choice "auto" read in vLLM's "llama3_json" format (`--tool-call-parser llama3_json`), the one
Llama 3.1, 3.2 and 3.3 Instruct models write: the reply is the call itself, a JSON object, after the
`<|python_tag|>` token or not (special tokens are kept in the text for "auto"),

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}

and several calls are objects one after another, separated by `; ` in the models' own prompts.

Read as vLLM 0.32's Llama3JsonToolParser reads the whole text: every `{` that is not inside an object
already read starts a JSON object (json's raw_decode); each must hold a string "name" and the
arguments under "arguments", or under "parameters" when there is no "arguments" (any JSON value,
written back as JSON text). If any of them is no such object (bad or cut JSON, a key missing, a
name that is no string), the whole text is content, with no call. The text between and after the
objects (`; `, whitespace, words) belongs to no call and is no content. With parallel_tool_calls
false only the first call is kept (vLLM's rule).

Where this reading differs from vLLM's (the same whole and streamed here, where vLLM's whole answer
and its stream disagree with each other):
- The text before the first `{` is the content beside the calls (null when it is only whitespace),
  where vLLM's whole answer drops it (content null); vLLM's stream reads calls only in a text that
  starts with `{` or `<|python_tag|>`, and sends any other text as content, calls and all: here a
  call is read wherever the first `{` is.
- One `<|python_tag|>` at the very start (whitespace before it allowed) is the model's marker that a
  call follows, never content: it is left out of the content, calls or not, the whole text read as
  content included (vLLM keeps it there). A stream cannot send text after it and then take it back,
  so both readings drop it. Anywhere else `<|python_tag|>` is plain text: content before the first
  `{`, ignored between objects (as vLLM's whole answer, whose content is the text as it is or null).
- Objects written with nothing between them (`}{`) are each read. vLLM skips a `{` right after an
  object's `}` (its "inside the last object" check takes the index after the object for one in it),
  then reads that object's inner objects: it loses the call, or makes the whole text content.

Streamed, the content goes out as it comes until the first `{`, but for the text at the very start
that is only whitespace or the beginning of `<|python_tag|>` (if a call follows, it is no content).
From the first `{` on, each object's call goes out as it is written (launcher/serving/
required_calls_stream.py reads the object): its id and name once the name's string has closed and
the arguments' value has begun, then its arguments piece by piece, as the model writes them (the
whole answer gives them as json.dumps writes them: the same JSON, as a named call's). An object that
closes with its call never announced (the arguments written before the name) sends it whole then.
An object that closes without being a call (or is still open when the text ends: max_tokens, a stop
string) sends the text from the first `{` on as content, so the stream's content is the whole
text's less a leading tag, as the whole answer says. So does an object whose own level stops being
JSON as it is written (prose or code in braces, `x { y`: a character no JSON object takes there, a
number no call's JSON holds), right at that character, not at its `}` (which prose may never write):
no whole reading takes such an object as a call. For any split of a text the stream says what
the whole answer says, but where no stream can know yet what it has sent: an object that is no call
after a good one, or whose own call went out before the object turned out no call (its JSON breaks,
the text ends inside it, a number or a nesting the whole reading refuses). The whole answer is then
all content; the stream has already sent those calls (the last with the arguments written so far),
and sends the text from the bad object on as content.

Two more differences, documented, not fixed, where the whole answer takes what a stream has not yet
seen when it sends: an object that repeats its arguments' key streams the first value, and one that
repeats "name" after its call went out keeps the name sent (the whole answer takes the last of each,
as json does); an object holding both "parameters" and "arguments" streams the one written first,
where the whole answer takes "arguments" (vLLM's order).

Pure (no tokenizer, no engine): the app's ChatRender drives a Llama3JsonCallReader per choice (its
shared part: launcher/serving/free_text_calls.py).
"""

from __future__ import annotations

from collections.abc import Iterator

from launcher.serving.call_json import JsonValueEnd, decode_at, named_call
from launcher.serving.free_text_calls import CallsReading, FreeTextCallReader
from launcher.serving.required_calls_stream import RequiredCallsStream

PYTHON_TAG = "<|python_tag|>"


def without_leading_tag(text: str) -> str:
    """The text less a `<|python_tag|>` at its very start (after whitespace, which stays)."""
    rest = text.lstrip()
    if not rest.startswith(PYTHON_TAG):
        return text
    return text[:len(text) - len(rest)] + rest[len(PYTHON_TAG):]


def call_of(parsed: object) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a decoded object, None when it holds no call. The arguments are
    "arguments" when there, else "parameters" (vLLM's order), written back as vLLM writes them
    (json.dumps, non-ASCII kept): any JSON value is taken. A name no UTF-8 text can carry is none
    (launcher/serving/call_json.py)."""
    return named_call(parsed, ("arguments", "parameters"))


def calls_from(text: str, first: int) -> list[tuple[str, str]] | None:
    """The call of each object from text[first] (a `{`) on, each next one at the first `{` after the
    last one's end; None when any of them is no call (vLLM's extract_tool_calls)."""
    calls, start = [], first
    while start != -1:
        decoded = decode_at(text, start)
        call = None if decoded is None else call_of(decoded[0])
        if call is None:
            return None
        calls.append(call)
        start = text.find("{", decoded[1])
    return calls


def read_whole(text: str) -> CallsReading:
    """The whole generated text's content and calls."""
    first = text.find("{")
    calls = None if first == -1 else calls_from(text, first)
    if calls is None:  # no object, or one without a call: all content (vLLM's fallback)
        return CallsReading(without_leading_tag(text))
    before = without_leading_tag(text[:first])
    return CallsReading(before if before.strip() else None, calls)


def object_call(text: str) -> tuple[str, str] | None:
    """The call of one closed object's whole text (from its `{` to its `}`), None when it holds none."""
    decoded = decode_at(text, 0)
    if decoded is None or decoded[1] != len(text):
        return None
    return call_of(decoded[0])


class Llama3JsonCallReader(FreeTextCallReader):
    """One choice's text read in the llama3_json format, streamed (delta) or whole (push, then
    message).

    Streamed, the work per piece is that piece's: where an object closes is found by following its
    braces and strings over the new characters only (the state carried from piece to piece), its
    call's scan reads those same characters once, and the object is decoded once, when it has closed
    (decoding the open text again per piece made a long output quadratic: the hermes reader measured
    12 s of the event loop for 100k pieces). What is kept is only the text not settled yet: the start
    that may still be whitespace and the tag, and the object being written (its pieces, joined once
    when it closes, for the whole reading's decision: a call, or content)."""

    read_whole = staticmethod(read_whole)

    def __init__(self, parallel_tool_calls: bool = True):
        super().__init__(parallel_tool_calls)
        self._mode = "start"
        """"start": the text so far is whitespace, and at most one `<|python_tag|>` or its beginning;
        "content": content before the first `{`; "calls": at or after the first `{`; "text": an
        object held no call, and the rest goes out as content."""
        self._held = ""
        """"start": the whitespace so far (the tag, when whole, left out); "calls", before the first
        object has closed: the same, which is content only if that object is no call."""
        self._tag = ""
        """"start": the beginning of `<|python_tag|>` written so far (all of it: the tag is read)."""
        self._tag_read = False
        self._object: list[str] = []
        """"calls": the text of the object being written, from its `{`."""
        self._object_end: JsonValueEnd | None = None
        """"calls": where the open object ends, found piece by piece (None: between objects)."""
        self._read_calls = 0
        """"calls": the objects read as calls so far (parallel_tool_calls false sends only the first);
        the open object's call, if it is one, is the call at this index."""
        self._object_scan: RequiredCallsStream | None = None
        """"calls": the scan of the open (or last closed) object, which says when its call and each
        piece of its arguments can go out, and where the object stops being JSON a call is read from
        (its own level out of place: prose or code in braces)."""
        self._object_sendable = True
        """"calls": the open (or last closed) object's call, if it is one, goes out (False: past the
        first with parallel_tool_calls false, vLLM's rule)."""
        self._scanned: list[dict] = []
        """"calls": the entries the scans made that have not gone out yet, each as its call's index."""

    def _read_piece(self, piece: str, finished: bool) -> tuple[str, list[dict]]:
        content, calls = "", []
        if self._mode == "start":
            content, piece = self._past_the_start(piece, finished)
        if self._mode == "content":
            sendable, piece = self._content_before_an_object(piece)
            content += sendable
        if self._mode == "calls":
            calls, piece = self._call_entries(piece, finished)
        if self._mode == "text":
            content += piece
        return content, calls

    def _past_the_start(self, piece: str, finished: bool) -> tuple[str, str]:
        """(content now sendable, the piece's rest for the next mode). The start (whitespace and one
        tag) is held; the first other character ends it: a `{` right after a start of whitespace
        only turns the mode to "calls" with that whitespace still held (content only if the first
        object is no call), anything else to "content" with the start sent."""
        for i, char in enumerate(piece):
            if char.isspace() and not self._tag:  # whitespace before the tag, or after it
                self._held += char
            elif not self._tag_read and PYTHON_TAG.startswith(self._tag + char):
                self._tag += char
                if self._tag == PYTHON_TAG:  # the marker: no content
                    self._tag, self._tag_read = "", True
            else:
                start, self._held, self._tag = self._held + self._tag, "", ""
                if char == "{" and not start.strip():
                    self._mode, self._held = "calls", start
                    return "", piece[i:]
                self._mode = "content"
                return start, piece[i:]
        if not finished:
            return "", ""
        start, self._held, self._tag, self._mode = self._held + self._tag, "", "", "content"
        return start, ""

    def _content_before_an_object(self, piece: str) -> tuple[str, str]:
        """(content now sendable, the piece's rest from the first `{`); at a `{` the mode turns to
        "calls". A `<|python_tag|>` here is text."""
        brace = piece.find("{")
        if brace == -1:
            return piece, ""
        self._mode = "calls"
        return piece[:brace], piece[brace:]

    def _call_entries(self, piece: str, finished: bool) -> tuple[list[dict], str]:
        """(the calls' entries this piece makes, the text now to send as content). A call goes out as
        its object is written; an object that closes with its call never announced sends it whole. An
        object that is no call, or still open when the text ends, turns the mode to "text": the text
        from it on is content (with the held start, when no call came before it), and what its call
        sent stays sent (a stream cannot take it back)."""
        calls = []
        for text, end in self._closed_objects(piece):
            calls += self._take_scanned()
            call = object_call(text)
            if call is None:
                return calls, self._now_text(text + piece[end:])
            index, self._read_calls, self._held = self._read_calls, self._read_calls + 1, ""
            # not sendable: a call not sent (vLLM's rule without parallel calls: the first only)
            if self._object_sendable and not self._object_scan.announced:  # never announced
                calls.append(self._new_call(*call, index=index))
        calls += self._take_scanned()
        # cut inside an object, or its own level already no JSON (`{ y`, a code block's braces): no
        # whole reading takes it as a call, so the text from it on is content now, not at its `}`
        # (which prose may never write: a Java class streamed nothing for 2900 characters)
        if self._object_end is not None and (finished or self._object_scan.stopped):
            return calls, self._now_text("".join(self._object))
        return calls, ""

    def _take_scanned(self) -> list[dict]:
        taken, self._scanned = self._scanned, []
        return taken

    def _open_object(self) -> None:
        """A `{` between objects: follow the object from it, and scan it (its call sent only if it can
        be: _object_sendable; scanned either way, to see where it stops being a call's JSON)."""
        self._object_end = JsonValueEnd()
        self._object_sendable = self._read_calls == 0 or self.parallel_tool_calls
        self._object_scan = RequiredCallsStream(("arguments", "parameters"), one_object=True)

    def _scan_object_part(self, part: str) -> None:
        """More of the open object's text read by its scan: its entries, as the call at the object's
        place (the scan numbers its one call 0); an object whose call is not sent is only scanned."""
        entries = self._object_scan.feed(part)
        if self._object_sendable:
            self._scanned += [{**entry, "index": self._read_calls} for entry in entries]

    def _now_text(self, rest: str) -> str:
        """Turn the mode to "text": the content to send now is `rest` (after the held start)."""
        sent, self._held, self._object, self._object_end, self._mode = self._held + rest, "", [], None, "text"
        return sent

    def _closed_objects(self, piece: str) -> Iterator[tuple[str, int]]:
        """Follow the objects over the piece's characters (call_json.JsonValueEnd, its state carried
        from the last piece): (each object that closed in it, whole from its `{`; the index in the
        piece after it). The open object's part of the piece is kept in _object; each part of an
        object is also read by its call's scan (_scanned); text between objects is dropped."""
        position = 0  # where the scan resumes
        while position < len(piece) or self._object_end is None:
            if self._object_end is None:  # between objects: only a `{` matters
                position = piece.find("{", position)
                if position == -1:
                    return
                self._open_object()
            opened = position if not self._object else 0
            end = self._object_end.feed(piece, position)
            part = piece[opened:] if end is None else piece[opened:end]
            self._scan_object_part(part)
            if end is None:
                self._object.append(part)
                return
            text = "".join(self._object) + part
            self._object, self._object_end, position = [], None, end
            yield text, end
