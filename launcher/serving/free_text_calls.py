"""What the readers of tool_choice "auto" share: each reads one choice's free text as content and tool
calls in its model's own format (hermes_calls, llama_calls, mistral_calls, pythonic_calls,
qwen3_coder_calls; tool_calls.PARSER_READERS names them), streamed (delta) or whole (push, then message), with
ToolCallReader's interface, which the app's ChatRender drives.

A reader supplies two things: `read_whole(text)`, the whole text's CallsReading, and
`_read_piece(piece, finished)`, what the stream sends for one more piece: content, and tool_calls
entries, each either a call's first (its index, id, type, name and the arguments written so far) or
more of an announced call's arguments (its index and the arguments' next piece), as a named call
streams. The rest is the same for every format: the calls are made once (their ids stay the same),
with parallel_tool_calls false only the first is kept (vLLM's rule), finish_reason says
"tool_calls" when the text ended by itself with calls, and calls() gives what the client was given
(the streamed calls, or the whole text's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from launcher.serving.tool_calls import SentCalls, tool_call


@dataclass(frozen=True)
class CallsReading:
    """A whole text read: content None only beside calls (vLLM's "content": null)."""

    content: str | None
    calls: list[tuple[str, str]] = field(default_factory=list)
    """(name, arguments as JSON text) of each call, in order."""


class FreeTextCallReader:
    """The shared part of a reader of one choice's text (the module's doc)."""

    needs_tools = False
    """True: tool_calls.ToolUse.reader builds the reader with the request's tools (tools=...)."""

    def __init__(self, parallel_tool_calls: bool = True):
        self.parallel_tool_calls = parallel_tool_calls
        self._pieces: list[str] = []
        """The whole text, for the whole reading."""
        self._streamed: SentCalls | None = None
        """The calls the stream sent (None: the text was not streamed)."""
        self._whole: tuple[CallsReading, list[dict]] | None = None

    @staticmethod
    def read_whole(text: str) -> CallsReading:
        raise NotImplementedError

    def _read_piece(self, piece: str, finished: bool) -> tuple[str, list[dict]]:
        """(content to send, streamed tool_calls entries) for one more piece of the text (the
        module's doc)."""
        raise NotImplementedError

    def _new_call(self, name: str, arguments: str, index: int | None = None) -> dict:
        """One call as the client gets it (a format whose chat template checks ids makes its own)."""
        return tool_call(name, arguments, index=index)

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    def delta(self, piece: str, finished: bool) -> dict:
        """The chunk's delta for this piece of the text: {"content"} and/or {"tool_calls"}, or {}."""
        if self._streamed is None:
            self._streamed = SentCalls()
        self._pieces.append(piece)
        content, calls = self._read_piece(piece, finished)
        if not self.parallel_tool_calls:  # vLLM's rule: the first call only
            calls = [call for call in calls if call["index"] == 0]
        for entry in calls:
            self._streamed.record(entry)
        return ({"content": content} if content else {}) | ({"tool_calls": calls} if calls else {})

    def push(self, piece: str, finished: bool) -> list:
        """Keep a piece of a text read whole (message, once it has all come)."""
        self._pieces.append(piece)
        return []

    def _whole_reading(self) -> tuple[CallsReading, list[dict]]:
        """The whole text's reading and its calls (made once: their ids stay the same)."""
        if self._whole is None:
            reading = self.read_whole(self.text)
            kept = reading.calls if self.parallel_tool_calls else reading.calls[:1]
            self._whole = reading, [self._new_call(name, arguments) for name, arguments in kept]
        return self._whole

    def calls(self) -> list[dict]:
        """The calls the client was given: those streamed, or the whole text's."""
        return self._whole_reading()[1] if self._streamed is None else self._streamed.calls()

    def finish_reason(self, finish: str | None) -> str | None:
        """"tool_calls" when the text ended by itself ("stop") with calls. vLLM says "tool_calls" after
        "length" too, whole and streamed; here both keep "length", which tells the client the text
        was cut."""
        return "tool_calls" if finish == "stop" and self.calls() else finish

    def message(self) -> dict:
        """The choice's message: the content and the calls, or the text as content."""
        reading, calls = self._whole_reading()
        if not calls:
            return {"role": "assistant", "content": reading.content}
        return {"role": "assistant", "content": reading.content, "tool_calls": calls}
