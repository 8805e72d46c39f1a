"""tool_choice "auto" read in vLLM's "hermes" format (`--tool-call-parser hermes`), the one Qwen2 and
Qwen2.5 Instruct and Hermes models write: free text, in which each call is a block

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Read as vLLM 0.32's Hermes2ProToolParser reads the whole text: the calls are every block, and a last
block the output ended inside of (max_tokens, a stop string) when its JSON is whole; the content is
the text before the first block (null when there is none); a block whose JSON is no object with a
string "name" and an "arguments" (any JSON value, written back as JSON text) makes the whole text
content, with no call. With parallel_tool_calls false only the first call is kept (vLLM's rule).

Streamed, the content goes out as it comes but for a tail that may be the start of `<tool_call>`;
each call goes out as it is written (launcher/serving/required_calls_stream.py reads the block's
object): its id and name once the name's string has closed and the arguments' value has begun,
then its arguments piece by piece, as they are written (the whole answer gives them as json.dumps
writes them: the same JSON, as a named call's). A block that closes with its call never announced
(the arguments written before the name) sends it whole then. The text after the first block is
no content, as in the whole answer. For any split of a text the stream says what the whole answer
says, but where no stream can know yet what it has sent: a bad block (no call, or JSON that
breaks) after a good one, or whose own call began to stream before its JSON broke. The whole
answer is then all content; the stream has already sent those calls, and sends the text from the
bad block on as content (a call announced and found bad within one piece is not announced: that
piece can know). A block whose object's own level stops being JSON as it is written (prose after a
`<tool_call>` tag: a character no JSON object takes there) turns the stream to content right at
that character, not at its closing tag (which prose may never write). A block whose object repeats
its "name" or "arguments" key streams the first (the whole answer takes the last).

Pure (no tokenizer, no engine): the app's ChatRender drives a HermesCallReader per choice (its shared
part: launcher/serving/free_text_calls.py).
"""

from __future__ import annotations

from launcher.serving.call_json import loads_or_none, named_call
from launcher.serving.free_text_calls import CallsReading, FreeTextCallReader
from launcher.serving.required_calls_stream import RequiredCallsStream
from launcher.serving.stop_strings import held_tail_length

CALL_START, CALL_END = "<tool_call>", "</tool_call>"


def call_of(block: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of one block's text, None when it holds no call. The arguments are
    written back as vLLM writes them (json.dumps, non-ASCII kept), so spacing is the same whatever
    the model wrote; like vLLM's, any JSON value is taken (a model writing its arguments as a JSON
    string gets that string back as JSON text). JSON nested past call_json.MAX_DEPTH, or a name
    no UTF-8 text can carry, is no call (launcher/serving/call_json.py)."""
    return named_call(loads_or_none(block), ("arguments",))


def blocks(text: str) -> list[str]:
    """The text inside each block, as vLLM's pattern `<tool_call>(.*?)</tool_call>|<tool_call>(.*)`
    finds them: up to the first closing tag after the opening one, or the rest of the text."""
    found, start = [], text.find(CALL_START)
    while start != -1:
        inside = start + len(CALL_START)
        end = text.find(CALL_END, inside)
        if end == -1:
            found.append(text[inside:])
            break
        found.append(text[inside:end])
        start = text.find(CALL_START, end + len(CALL_END))
    return found


def read_whole(text: str) -> CallsReading:
    """The whole generated text's content and calls (vLLM's extract_tool_calls)."""
    if CALL_START not in text:
        return CallsReading(text)
    calls = [call_of(block) for block in blocks(text)]
    if any(call is None for call in calls):  # vLLM's fallback: nothing is taken as a call
        return CallsReading(text)
    return CallsReading(text[:text.find(CALL_START)] or None, calls)


class HermesCallReader(FreeTextCallReader):
    """One choice's text read in the hermes format, streamed (delta) or whole (push, then message).

    Streamed, the work per piece is that piece's (plus a tag's length): the text not yet settled is
    kept from where it may still matter, and each search resumes where the last one stopped (a
    whole-text search per piece made a long output quadratic: 12 s of the event loop for 100k
    pieces).

    qwen3_coder_calls.Qwen3CoderCallReader subclasses it: it replaces _open_block and _call_entries,
    and relies on _read_piece's modes, on _content_before_a_block calling _open_block with the tag at
    _open's start, and on _open, _mode, _block_read and _blocks meaning what they mean here."""

    read_whole = staticmethod(read_whole)

    def __init__(self, parallel_tool_calls: bool = True):
        super().__init__(parallel_tool_calls)
        self._open = ""
        """Streamed: the text not settled yet (content that may open a block; in a block, its text
        that may start the closing tag); what came before it was sent as content, read as calls, or
        is in _block_read."""
        self._mode = "content"
        """"content": before the first block; "calls": at or after it; "text": a block held no call,
        and the rest goes out as content."""
        self._block_read: list[str] = []
        """"calls", in a block: its text from its opening tag on that its scan has read (holding no
        closing tag), in the pieces it came in: one growing string copied it all at every piece."""
        self._block_stream: RequiredCallsStream | None = None
        """"calls", in a block: the scan of its object, which says when its call and each piece of its
        arguments can go out."""
        self._blocks = 0
        """Blocks opened so far: each holds a call (a bad one ends the reading), so the block being
        read holds the call at index _blocks - 1."""

    def _read_piece(self, piece: str, finished: bool) -> tuple[str, list[dict]]:
        self._open += piece
        content, calls = "", []
        if self._mode == "content":
            content = self._content_before_a_block(finished)
        if self._mode == "calls":
            calls = self._call_entries(finished)
            if self._mode == "text":
                calls = self._unannounced_if_broken_here(calls)
        if self._mode == "text":
            content, self._open = content + self._open, ""
        return content, calls

    def _unannounced_if_broken_here(self, calls: list[dict]) -> list[dict]:
        """The piece's entries but a call this same piece announced and then found no call in its
        block (the text from that block on goes out as content): announcing it would tell it twice,
        as a call and as content, where one piece (a gathered delta, stream_interval's) could know
        better. A call announced by an earlier piece keeps its last pieces (it went out already)."""
        broken = self._blocks - 1
        if not any(entry.get("index") == broken and "id" in entry for entry in calls):
            return calls
        return [entry for entry in calls if entry.get("index") != broken]

    def _content_before_a_block(self, finished: bool) -> str:
        """The content now sendable; at the first block's start the mode turns to "calls"."""
        start = self._open.find(CALL_START)
        if start != -1:
            out, self._open = self._open[:start], self._open[start:]
            self._mode = "calls"
            self._open_block()
            return out
        # all of it, but for a tail that may open a block (at the end, nothing more will come)
        keep = 0 if finished else held_tail_length(self._open, (CALL_START,))
        out, self._open = self._open[:len(self._open) - keep], self._open[len(self._open) - keep:]
        return out

    def _open_block(self) -> None:
        """_open now starts with a block's opening tag: read its object from after the tag."""
        self._blocks += 1
        self._block_read, self._open = [CALL_START], self._open[len(CALL_START):]
        self._block_stream = RequiredCallsStream(("arguments",), one_object=True)

    def _block_pieces(self, upto: int, index: int) -> list[dict]:
        """The entries _open[:upto], the block's next text, makes as the call at `index`; that text is
        then the block's read text, no longer in _open."""
        if upto <= 0:
            return []
        read, self._open = self._open[:upto], self._open[upto:]
        self._block_read.append(read)
        return [{**entry, "index": index} for entry in self._block_stream.feed(read)]

    def _call_entries(self, finished: bool) -> list[dict]:
        """The tool_calls entries the blocks make so far: each call and its argument pieces as its
        block's scan reads them, and a call never announced, whole, where its block closes (finished:
        an unterminated last one too). A block without a call turns the mode to "text" from its
        start. Text between blocks is no content."""
        calls = []
        while True:
            if not self._block_read:  # no block open (its read text is kept from its opening tag)
                start = self._open.find(CALL_START)
                if start == -1:  # keep only a tail that may open the next block
                    self._open = self._open[len(self._open) - held_tail_length(self._open, (CALL_START,)):]
                    return calls
                self._open = self._open[start:]
                self._open_block()
            index = self._blocks - 1
            # _open holds less than a closing tag before this piece: the search is the piece's
            end = self._open.find(CALL_END)
            if end == -1 and not finished:
                # all read but a tail that may open the closing tag
                calls += self._block_pieces(len(self._open) - held_tail_length(self._open, (CALL_END,)), index)
                if self._block_stream.stopped:
                    # its object's own level is no JSON already (prose after a `<tool_call>` tag): no
                    # whole reading takes the block as a call, so the text from it on is content now,
                    # not at a closing tag prose may never write
                    self._mode, self._open = "text", "".join(self._block_read) + self._open
                return calls
            calls += self._block_pieces(len(self._open) if end == -1 else end, index)
            block = "".join(self._block_read)
            call = call_of(block[len(CALL_START):])
            if call is None:
                self._mode, self._open = "text", block + self._open  # the block, and all after it, are content
                return calls
            if not self._block_stream.announced:  # never announced (its name came after its arguments)
                calls.append(self._new_call(*call, index=index))
            self._block_read = []
            if end == -1:
                self._open = ""
                return calls
            self._open = self._open[len(CALL_END):]
