"""tool_choice "auto" read in vLLM's "qwen3_coder" format (`--tool-call-parser qwen3_coder`), the one
Qwen3-Coder models (Qwen3-Coder-30B-A3B-Instruct, 480B-A35B) write: free text, in which each call is a
block of XML-like tags whose parameter values are written as bare text

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Read as vLLM 0.32's qwen3_coder parser (vllm/parser/qwen3.py) reads a well-formed block: a value is the
text between `<parameter=KEY>` and `</parameter>` with one leading and one trailing newline trimmed,
converted to the type the request's tool schema gives KEY (qwen3_coder_types.py: vLLM's
coerce_to_schema_type); the arguments are the JSON object of the parameters in written order, as
json.dumps writes it; the name is any non-empty text without "<" (vLLM checks none against the
tools). The content is the text before the first block as written (null when there is none; vLLM
strips its whitespace, which a stream cannot do for the whitespace it has sent); text between and
after blocks is none. Tags a model leaves out (Qwen models drop `</parameter>` in long contexts) end
what they would have ended where the next tag shows it, as vLLM ends them: a value at the next
`<parameter=` or at `</function>` (vLLM drops a value ended there; this keeps it), a block at the
next `<tool_call>` or at other text after `</function>`; whitespace before a key is none. A block
that is not one call in this form (a stray tag or text between the call's tags) makes the whole
text content, with no call, as the hermes reader's fallback does (vLLM's grammar skips such text, or
reads a call out of it); a bare `<function=` outside a block is text: content before the first
block, none after one (vLLM reads a call from it). A text cut inside a block (max_tokens, a stop
string) keeps that call when its name is whole, with the parameters closed so far, and a
string-typed value cut short as written so far (vLLM's whole reading drops a cut value; its stream
has sent it).

Streamed, the content goes out as it comes but for a tail that may be the start of `<tool_call>`;
a call goes out (id, name, arguments "") once `<function=NAME>` closes, then its arguments: a
string-typed parameter's `{"city": "` once its key closes and its text as it comes (a newline held
back until the next character says it is not the trimmed last one), any other's `, "days": 3` once
its value ends (at `</parameter>`, or where that was left out, at the next `<parameter=` or
`</function>`), and `}` at `</function>` (`{}` with no parameter): the pieces join into the
whole answer's arguments text exactly. A block that breaks after its call went out keeps the call
(its arguments closed as sent so far) and the text from the block on goes out as content, as
hermes_calls.py does; a repeated key is written twice (json.loads keeps the last value, as vLLM's
object does; vLLM writes the key once, at its first place).
The whole reading is that same scan of the whole text, so for any split both say the same, but
where no stream can know yet what it has sent: a block that breaks after a call went out (its own,
or an earlier block's). The whole answer is then all content, with no call; the stream has sent
those calls and sends the text from the breaking block on as content.

Pure (no tokenizer, no engine): the app's ChatRender drives a Qwen3CoderCallReader per choice (its
shared part: launcher/serving/free_text_calls.py), made with the request's tools (the schemas).
"""

from __future__ import annotations

import json
import re

from launcher.serving.call_json import arguments_text
from launcher.serving.free_text_calls import CallsReading
from launcher.serving.hermes_calls import CALL_END, CALL_START, HermesCallReader
from launcher.serving.qwen3_coder_types import ToolSchemas
from launcher.serving.stop_strings import held_tail_length
from launcher.serving.tool_calls import SentCalls

FUNCTION_START, FUNCTION_END = "<function=", "</function>"
PARAMETER_START, PARAMETER_END = "<parameter=", "</parameter>"
TAG_CLOSE = ">"
_SPACE = re.compile(r"\s*")


def read_whole(text: str, tools: list[dict] | None = None) -> CallsReading:
    """The whole generated text's content and calls (vLLM's extract_tool_calls for well-formed
    blocks), `tools` as the chat template takes them (tool_calls.ToolUse.tools)."""
    scan = Qwen3CoderCallReader(tools=tools)
    _, entries = scan._read_piece(text, True)
    if scan._mode != "calls":  # no block, or a block without a call: all content
        return CallsReading(text)
    sent = SentCalls()
    for entry in entries:
        sent.record(entry)
    return CallsReading(text[:text.find(CALL_START)] or None,
                        [(call["function"]["name"], call["function"]["arguments"]) for call in sent.calls()])


def _joined(entries: list[dict]) -> list[dict]:
    """The entries with each run of one call's pieces in one entry (a call's first entry takes the
    arguments that follow it): one delta says each call once. Pieces are joined once per run (the
    whole reading's one piece may hold many parameters)."""
    runs: list[tuple[dict, list[str]]] = []
    for entry in entries:
        if runs and runs[-1][0]["index"] == entry["index"] and "id" not in entry:
            runs[-1][1].append(entry["function"]["arguments"])
        else:
            runs.append((entry, [entry["function"]["arguments"]]))
    return [entry if len(pieces) == 1 else {**entry, "function": {**entry["function"], "arguments": "".join(pieces)}}
            for entry, pieces in runs]


class Qwen3CoderCallReader(HermesCallReader):
    """One choice's text read in the qwen3_coder format, streamed (delta) or whole (push, then message).

    Its blocks are hermes's `<tool_call>` blocks with another inside: the content before the first
    and the text from a bad block on are read as HermesCallReader reads them (its _read_piece and
    _content_before_a_block); what is inside a block is this reader's own scan (_call_entries).
    One scan does the whole and the streamed reading: the text not yet settled is kept only from
    where it may still matter (a tail that may start the next tag), each search covers the new piece
    and that tail, and a value's text is kept in pieces until its parameter closes, so the work per
    piece is that piece's."""

    needs_tools = True
    """tool_calls.ToolUse.reader hands this reader the request's tools: the values' types are theirs."""

    def __init__(self, parallel_tool_calls: bool = True, tools: list[dict] | None = None):
        super().__init__(parallel_tool_calls)
        self.tools = tools
        self._schemas = ToolSchemas(tools)
        self._at = 0
        """"calls": where in _open (HermesCallReader's unsettled text) the scan reads on; _open is cut
        there after each piece."""
        self._state: str | None = None
        """"calls": where the open block's scan is ("head", "name", "params", "key", "value", "tail"),
        None between blocks."""
        self._run: list[str] = []
        """The name, key or non-string value read so far, in pieces."""
        self._properties: dict = {}
        """The open call's parameter schemas."""
        self._param: str | None = None
        """The open parameter's key."""
        self._streams_text = False
        """The open parameter's value stays text: it streams as it comes."""
        self._value_begun = False
        """The value's first character has come (its leading newline, if any, trimmed)."""
        self._newline_held = False
        """A string value's last character so far is a newline not sent: the trimmed one if the
        parameter closes next."""
        self._written = 0
        """Parameters of the open call whose arguments text has begun."""

    def read_whole(self, text: str) -> CallsReading:
        return read_whole(text, self.tools)

    # ---- the scan ------------------------------------------------------------------------------
    def _open_block(self) -> None:
        """_open holds a block's opening tag at _at: the block's scan begins after it."""
        self._at, self._block_read, self._blocks = self._at + len(CALL_START), [CALL_START], self._blocks + 1
        self._state, self._run, self._written = "head", [], 0

    def _call_entries(self, finished: bool) -> list[dict]:
        """The tool_calls entries the blocks make so far (the module's doc), each call's once per piece;
        _open then keeps only what the scan has not read."""
        entries = _joined(self._scan_blocks(finished))
        self._open, self._at = self._open[self._at:], 0
        return entries

    def _consume(self, end: int) -> str:
        """_open's text from _at to `end`, now read as the open block's text (_at moves on: slicing
        off the rest at each step made a long whole text quadratic)."""
        read, self._at = self._open[self._at:end], end
        self._block_read.append(read)
        return read

    def _expect(self, tags: tuple[str, ...], unread: tuple[str, ...] = ()) -> str | None:
        """After whitespace, which of `tags` the text read on with (read, but for those in `unread`,
        left for the next step); None while it may still be one (text that ends there is cut: _cut),
        "" when it cannot be (the block holds no call)."""
        self._consume(_SPACE.match(self._open, self._at).end())
        for tag in tags:
            if self._open.startswith(tag, self._at):
                if tag not in unread:
                    self._consume(self._at + len(tag))
                return tag
        rest = len(self._open) - self._at
        return None if any(rest < len(tag) and tag.startswith(self._open[self._at:]) for tag in tags) else ""

    def _until(self, tag: str) -> tuple[str, bool]:
        """The text up to `tag` and whether the tag came (then read too); without it, all but a tail
        that may start the tag."""
        text, came = self._until_first((tag,))
        if came:
            self._consume(self._at + len(tag))
        return text, came is not None

    def _until_first(self, tags: tuple[str, ...]) -> tuple[str, str | None]:
        """The text up to the first of `tags` to come and which came (not read: the next step reads
        it); without one, all but a tail that may start one, and None."""
        end, came = len(self._open), None
        for tag in tags:  # each search bounded by the earliest found so far: every tag has "<" only
            at = self._open.find(tag, self._at, end)  # first, so none starting earlier runs past it
            if at != -1:
                end, came = at, tag
        if came is not None:
            return self._consume(end), came
        tail = self._open[max(self._at, len(self._open) - max(map(len, tags))):]
        return self._consume(len(self._open) - held_tail_length(tail, tags)), None

    def _scan_blocks(self, finished: bool) -> list[dict]:
        """The tool_calls entries the blocks make so far, as the scan reads them. A block without a
        call turns the mode to "text" from its start."""
        entries: list[dict] = []
        while True:
            if self._state is None:
                start = self._open.find(CALL_START, self._at)
                if start == -1:  # text between blocks is none: keep only a tail that may open one
                    tail = self._open[max(self._at, len(self._open) - len(CALL_START)):]
                    self._at = len(self._open) - held_tail_length(tail, (CALL_START,))
                    return entries
                self._at = start
                self._open_block()
            # each step reads on from its state: entries (it moved on), None (it needs more text),
            # False (the block holds no call)
            step = getattr(self, f"_at_{self._state}")(self._blocks - 1)
            if step is None:  # waiting for more text
                if finished:
                    entries += self._cut(self._blocks - 1)
                return entries
            if step is False:
                return entries + self._break(self._blocks - 1)
            entries += step

    def _at_head(self, index: int) -> list[dict] | bool | None:
        tag = self._expect((FUNCTION_START,))
        if tag is None:
            return None
        if not tag:
            return False
        self._state = "name"
        return []

    def _at_name(self, index: int) -> list[dict] | bool | None:
        text, closed = self._until(TAG_CLOSE)
        if "<" in text:  # a tag before the name closed: no call
            return False
        self._run.append(text)
        if not closed:
            return None
        name = "".join(self._run).strip()
        if not name:
            return False
        self._properties, self._state = self._schemas.properties(name), "params"
        return [self._new_call(name, "", index=index)]

    def _at_params(self, index: int) -> list[dict] | bool | None:
        tag = self._expect((PARAMETER_START, FUNCTION_END))
        if tag is None:
            return None
        if not tag:
            return False
        if tag == FUNCTION_END:
            self._state = "tail"
            return [self._arguments("}" if self._written else "{}", index)]
        self._state, self._run = "key", []
        return []

    def _at_key(self, index: int) -> list[dict] | bool | None:
        text, closed = self._until(TAG_CLOSE)
        if "<" in text:
            return False
        self._run.append(text)
        if not closed:
            return None
        self._param, self._run, self._state = "".join(self._run).lstrip(), [], "value"  # vLLM's \s* before it
        self._streams_text = self._schemas.stays_text(self._properties.get(self._param))
        self._value_begun = self._newline_held = False
        if self._streams_text:  # the value's text goes out as it comes
            return [self._arguments(self._key_text() + '"', index)]
        return []

    def _at_value(self, index: int) -> list[dict] | bool | None:
        # a value ends at its </parameter>, or where one was left out, at the next parameter or the
        # call's end (models drop the tag in long contexts; else the value would run on over later calls)
        text, end = self._until_first((PARAMETER_END, PARAMETER_START, FUNCTION_END))
        if end == PARAMETER_END:
            self._consume(self._at + len(PARAMETER_END))
        closed = end is not None
        if text and not self._value_begun:
            self._value_begun, text = True, text[1:] if text.startswith("\n") else text
        if self._streams_text:
            sent = self._string_piece(text)
            if closed:
                self._state, self._newline_held = "params", False
                return [self._arguments(sent + '"', index)]
            return [self._arguments(sent, index)] if sent else None
        self._run.append(text)
        if not closed:
            return None
        value = "".join(self._run)
        value = value[:-1] if value.endswith("\n") else value
        self._state, self._run = "params", []
        return [self._arguments(self._key_text() + arguments_text(self._schemas.value(value, self._properties.get(
            self._param))), index)]

    def _at_tail(self, index: int) -> list[dict] | bool | None:
        """A call is whole at </function>: what follows ends its block, whether `</tool_call>`, the
        next block's `<tool_call>` (the end tag left out: read it next) or other text (none, as text
        between blocks is)."""
        if self._expect((CALL_END, CALL_START), unread=(CALL_START,)) is None:
            return None
        self._state = None
        return []

    # ---- the ends of a block -------------------------------------------------------------------
    def _key_text(self) -> str:
        """The open parameter's key as it begins its place in the arguments (`{` or `, ` before it)."""
        self._written += 1
        return ("{" if self._written == 1 else ", ") + json.dumps(self._param, ensure_ascii=False) + ": "

    def _string_piece(self, text: str) -> str:
        """A string value's next text as its JSON string's inside, after a newline held before it and
        holding back a last newline (the trimmed one if the parameter closes next)."""
        text = ("\n" if self._newline_held else "") + text
        self._newline_held = text.endswith("\n")
        return json.dumps(text[:-1] if self._newline_held else text, ensure_ascii=False)[1:-1]

    @staticmethod
    def _arguments(text: str, index: int) -> dict:
        return {"index": index, "function": {"arguments": text}}

    def _closing(self, index: int) -> list[dict]:
        """The piece that closes an announced call's arguments as sent so far (a string value cut as
        written so far: its held newline is the trimmed one)."""
        if self._state in ("head", "name", "tail"):
            return []
        close = '"}' if self._state == "value" and self._streams_text else "}"
        return [self._arguments(close if self._written else "{}", index)]

    def _cut(self, index: int) -> list[dict]:
        """The text ended inside the open block: its call is kept once its name is whole."""
        if self._state in ("head", "name"):
            return self._break(index)
        if self._state == "value" and self._streams_text:  # _open is a tail that turned out not to be the tag
            piece, self._at = self._string_piece(self._open[self._at:]), len(self._open)
            entries = [self._arguments(piece, index)] if piece else []
        else:
            entries = []
        entries += self._closing(index)
        self._state = None
        return entries

    def _break(self, index: int) -> list[dict]:
        """The open block holds no call: it and all after it are content (a call already announced
        stays, its arguments closed)."""
        entries = self._closing(index)
        self._mode, self._state = "text", None
        self._open, self._at = "".join(self._block_read) + self._open[self._at:], 0
        return entries
