"""From the engine's stream deltas to the OpenAI objects of one response: streamed chunks, or the
whole response once the stream ends. One renderer per choice of a request (`n`; each renders its
`index`); pure (a tokenizer is only asked for the
text and bytes of single tokens, for log-probabilities: launcher/serving/token_pieces.py). A
token's log-probability goes out with the engine's text that holds it, never before it, and not at
all for the tokens of a stop string the text leaves out (launcher/serving/logprob_alignment.py). A
chat choice's readers (a tool-call parser, a reasoning parser) may hold a tail of that text back a
little longer (a tag being written), so there its log-probability can come a chunk before the
text."""

from __future__ import annotations

import copy

from launcher.serving import openai_protocol as proto
from launcher.serving.echoed_prompt import EchoedPrompt, prompt_logprobs, shifted
from launcher.serving.logprob_alignment import AlignedLogprobs
from launcher.serving.reasoning import ReasoningTokenCount, ThinkTokens, read_reasoning, reasoning_splitter
from launcher.serving.token_pieces import TokenPieces


def _told_stop_reason(choice: dict, stop_reason: str | int | None) -> dict:
    """`choice` with its stop_reason (vLLM's field beside finish_reason: the stop string that matched,
    or the stop token id that ended the answer; null otherwise), set on a whole answer's choices and
    on the streamed chunk that carries the finish_reason."""
    choice["stop_reason"] = stop_reason
    return choice


def _text_of_one_kind(before: dict, message: dict) -> bool:
    """Whether two message deltas are both only content, or both only reasoning (one delta can say
    them both)."""
    return len(before) == len(message) == 1 and before.keys() == message.keys() and \
        next(iter(message)) in ("content", "reasoning")


class _Render:
    """What both renderers share: the choice's index, its logprobs' alignment with the text, vLLM's
    prompt_logprobs when asked (`prompt_top`), and how the response counts a delta's tokens."""

    response_object = ""

    def __init__(self, pieces: TokenPieces, logprobs: bool, index: int, prompt_top: int | None,
                 skip_special_tokens: bool = True, prompt_ids=()):
        # prompt_ids: what the choice's text was primed with (ChoiceStreams.prompt_context), so the
        # logprobs' offsets count the same text; no alignment without logprobs (its priming decodes
        # the prompt's last tokens again, for nothing)
        self.pieces = pieces
        self.aligned = AlignedLogprobs(pieces, skip_special_tokens, prompt_ids) if logprobs else None
        self.logprobs, self.index = logprobs, index
        self.prompt_top, self.prompt_entries = prompt_top, []
        self.stop_reason: str | int | None = None
        """The ending delta's stop_reason, kept by collect() for choice()."""

    def completion_tokens(self, delta) -> int:
        return delta.completion_tokens

    def new_tokens(self, delta) -> int:
        """The delta's tokens the response counts (the metrics time them)."""
        return len(delta.token_ids)

    def finish_reason(self, finish: str | None) -> str | None:
        return finish

    def sent_stop_reason(self, delta) -> str | int | None:
        """The stop_reason the client is told for the delta that ends the choice."""
        return delta.stop_reason

    def _keep_stop_reason(self, delta) -> None:
        if delta.finish_reason is not None:
            self.stop_reason = self.sent_stop_reason(delta)

    def _every_chunk(self, chunk: dict, delta) -> dict:
        """A streamed chunk with a stop_reason, null before the last (completions' chunks all carry
        the key, as vLLM's do: a client reading it from every chunk failed on the first)."""
        _told_stop_reason(chunk["choices"][0], self.sent_stop_reason(delta) if delta.finish_reason else None)
        return chunk

    def reasoning_tokens(self) -> int | None:
        """The choice's reasoning tokens so far, for the usage's completion_tokens_details; None where
        they are not counted (no reasoning parser), which leaves that field out."""
        return None

    def _keep_prompt_entries(self, delta) -> None:
        self.prompt_entries = delta.prompt_logprobs or self.prompt_entries

    def _vllm_prompt_logprobs(self) -> list:
        return proto.vllm_prompt_logprobs(self.prompt_entries, self.pieces, self.prompt_top)

    def response_extras(self) -> dict:
        """Top-level fields of the whole response beside OpenAI's."""
        return {}

    def choice(self, finish) -> dict:
        raise NotImplementedError

    def response(self, meta, finish, usage) -> dict:
        return proto.response(meta, self.response_object, [self.choice(finish)], usage)


class CompletionRender(_Render):
    """/v1/completions objects from the engine's deltas; with `echo`, the prompt's text (and its
    tokens' logprobs) come first, in the first chunk (launcher/serving/echoed_prompt.py)."""

    id_prefix, chunk_object, response_object = "cmpl", "text_completion", "text_completion"

    def __init__(self, pieces: TokenPieces, logprobs: bool, index: int = 0, echo: EchoedPrompt | None = None,
                 echo_only: bool = False, prompt_top: int | None = None, top_n: int | None = None,
                 skip_special_tokens: bool = True, prompt_ids=()):
        """echo_only (`max_tokens` 0 with `echo`): the engine generates one token, which is dropped:
        the choice is the prompt alone, finished for "length", no completion token counted.
        prompt_top: vLLM's prompt_logprobs asked (the choice carries them). top_n: the alternatives
        an echoed prompt token lists (the request's logprobs; None: as many as the engine sent)."""
        super().__init__(pieces, logprobs, index, prompt_top, skip_special_tokens, prompt_ids)
        self.top_n = top_n
        self.text, self.logprob_parts = [], []
        self.echo, self._echo_pending = echo, echo is not None
        self.echo_only = echo_only

    def completion_tokens(self, delta) -> int:
        return 0 if self.echo_only else delta.completion_tokens

    def new_tokens(self, delta) -> int:
        return 0 if self.echo_only else len(delta.token_ids)

    def finish_reason(self, finish: str | None) -> str | None:
        return "length" if self.echo_only and finish is not None else finish

    def sent_stop_reason(self, delta) -> str | int | None:
        return None if self.echo_only else delta.stop_reason  # its one token is dropped: nothing stopped it

    def _logprobs(self, delta) -> dict | None:
        if not self.logprobs or self.echo_only:
            return None
        ready = self.aligned.push(delta)
        part = proto.completion_logprobs(ready, self.pieces) if ready else None
        return shifted(part, len(self.echo.text)) if self.echo is not None else part

    def _echoed(self, delta) -> tuple[str, dict | None]:
        """The echoed prompt's text and logprobs with the first delta (it carries the prompt's
        logprobs), then nothing."""
        if not self._echo_pending:
            return "", None
        self._echo_pending = False
        if not self.logprobs:
            return self.echo.text, None
        return self.echo.text, prompt_logprobs(self.echo, delta.prompt_logprobs or [], self.pieces, self.top_n)

    def _text_and_logprobs(self, delta) -> tuple[str, list[dict]]:
        echo_text, echo_logprobs = self._echoed(delta)
        parts = [part for part in (echo_logprobs, self._logprobs(delta)) if part is not None]
        return echo_text + ("" if self.echo_only else delta.text), parts

    def opening(self, meta) -> list[dict]:
        return []

    def chunk(self, meta, delta) -> dict | None:
        text, parts = self._text_and_logprobs(delta)
        logprobs = proto.merge_completion_logprobs(parts) if parts else None
        if not text and logprobs is None and delta.finish_reason is None:
            return None  # tokens whose text is held back (a possible stop string, a partial character)
        chunk = proto.completion_chunk(meta, text, self.finish_reason(delta.finish_reason), logprobs, self.index)
        return self._every_chunk(chunk, delta)

    def collect(self, delta) -> None:
        text, parts = self._text_and_logprobs(delta)
        self.text.append(text)
        self.logprob_parts.extend(parts)
        self._keep_prompt_entries(delta)
        self._keep_stop_reason(delta)

    def choice(self, finish) -> dict:
        logprobs = proto.merge_completion_logprobs(self.logprob_parts) if self.logprobs else None
        choice = proto.completion_choice("".join(self.text), self.finish_reason(finish), logprobs, self.index)
        _told_stop_reason(choice, self.stop_reason)
        if self.prompt_top is not None:  # vLLM's extension, per choice on completions
            choice["prompt_logprobs"] = self._vllm_prompt_logprobs()
        return choice


class ChatRender(_Render):
    """/v1/chat/completions objects from the engine's deltas: the text as the message's content, or,
    when a tool call is forced, read as tool calls (`tool_calls`, a launcher.serving.tool_calls
    ToolCallReader of this choice), or with tool_choice "auto" read as content and calls (the
    server's tool-call parser's reader: launcher.serving.tool_calls PARSER_READERS). On a server with
    a reasoning parser, the thinking first goes to the message's `reasoning` (launcher/serving/
    reasoning.py), and only the rest is the content, or what the tool-call reader reads."""

    id_prefix, chunk_object, response_object = "chatcmpl", "chat.completion.chunk", "chat.completion"

    def __init__(self, pieces: TokenPieces, logprobs: bool, index: int = 0, prompt_top: int | None = None,
                 skip_special_tokens: bool = True, tool_calls=None, reasoning: tuple | None = None,
                 include_reasoning: bool = True, think_tokens: ThinkTokens | None = None, prompt_ids=()):
        """prompt_top: vLLM's prompt_logprobs asked (the response carries them, as vLLM's chat does).
        reasoning: (parser, thinking on[, constrained]) when the answer's thinking is split off (the
        request's reasoning()); include_reasoning false leaves it out of the answer, and the logprobs
        too (their tokens would spell it; vLLM leaves them out likewise). think_tokens: given on a server with a
        reasoning parser, whose usage counts the reasoning's tokens (0 where `reasoning` is None: the
        text is all content), hidden or not, as vLLM counts them."""
        if reasoning is not None and reasoning[1] and not include_reasoning:  # only thinking has tokens to hide
            logprobs = False
        super().__init__(pieces, logprobs, index, prompt_top, skip_special_tokens, prompt_ids)
        self.text, self.entries = [], []
        self.calls = tool_calls
        self.reasoning, self.include_reasoning = reasoning, include_reasoning
        self.splitter = reasoning_splitter(*reasoning) if reasoning is not None else None
        """This choice's text split as it streams (a whole answer is read at its end: choice())."""
        self.counts_reasoning = think_tokens is not None
        self.thinking_count = (ReasoningTokenCount(*reasoning[:2], think_tokens, *reasoning[2:])
                               if self.counts_reasoning and reasoning is not None else None)
        """Fed every delta; None where nothing is counted (no parser, or an answer all content)."""

    def reasoning_tokens(self) -> int | None:
        if not self.counts_reasoning:
            return None
        return self.thinking_count.count if self.thinking_count is not None else 0

    def _count_reasoning(self, delta) -> None:
        if self.thinking_count is not None:
            for part in delta.parts or (delta,):  # a token at a time: a gathered delta's may end the thinking
                self.thinking_count.push(part.token_ids, part.text, part.finish_reason is not None)

    def _sent_finish(self, finish: str | None) -> str | None:
        """The finish reason the client is told: "tool_calls" for "required" calls (tool_calls.py).
        The metrics count the engine's (finish_reason), whose outcomes are stop and length."""
        return finish if self.calls is None else self.calls.finish_reason(finish)

    def _delta(self, delta) -> dict:
        """The chunk's delta: the text, or what the reader makes of it (tool calls' pieces; with
        tool_choice "auto", content and whole calls), after the thinking went to "reasoning"."""
        text, finished, thought = delta.text, delta.finish_reason is not None, ""
        if self.splitter is not None:
            thought, text = self.splitter.feed(text, finished)
        message = self.calls.delta(text, finished) if self.calls is not None else {"content": text} if text else {}
        if thought and self.include_reasoning:
            message = {"reasoning": thought, **message}
        return message

    def _ready(self, delta) -> list:
        return [entry for entry, _ in self.aligned.push(delta)] if self.logprobs else []

    def opening(self, meta) -> list[dict]:
        return [proto.chat_chunk(meta, {"role": "assistant", "content": ""}, index=self.index)]

    def message(self, delta) -> dict:
        """The streamed message delta for this engine delta (counted), without the chunk around it
        (the Responses stream reads a delta's parts one by one: messages())."""
        self._count_reasoning(delta)
        return self._delta(delta)

    def messages(self, delta) -> list[tuple[dict, list[dict]]]:
        """The Responses stream's message deltas for this engine delta (counted), each with its
        tokens' log-probabilities (message_logprobs): one per part of a gathered delta
        (stream_interval), read by the readers a part at a time, as they would have come. One delta
        of them all would lose their order: a call and the text after it (a call the reader turned
        back into text) would come as content and calls, which the stream tells content first.
        Parts of text alone, of one kind, are joined again (the interval's fewer events)."""
        self._count_reasoning(delta)
        told = []
        for part in delta.parts or (delta,):
            logprobs = self.message_logprobs(part)  # before _delta() feeds the part to the splitter
            message = self._delta(part)
            if told and _text_of_one_kind(told[-1][0], message):
                [(kind, text)] = message.items()
                told[-1] = ({kind: told[-1][0][kind] + text}, told[-1][1] + logprobs)
            else:
                told.append((message, logprobs))
        return told

    def message_logprobs(self, delta) -> list[dict]:
        """The log-probabilities of the tokens whose text is now whole (chat's logprobs content
        entries), [] where none were asked, or where this delta comes while the answer still thinks
        (its end tag's included: vLLM's stream gives the answer's tokens only); the Responses
        stream's, called before message() feeds the delta to the splitter. A gathered delta's
        (stream_interval) are taken part by part, as their deltas would have come."""
        if not self.logprobs:
            return []
        parts = delta.parts or (delta,)
        kept = []
        for part, thinking in zip(parts, self._thinking_before(parts)):
            ready = self._ready(part)  # every part's: the alignment goes on through the thinking
            if not thinking:
                kept.extend(ready)
        return proto.chat_logprobs(kept, self.pieces)["content"] if kept else []

    def _thinking_before(self, parts) -> list[bool]:
        """Whether the answer still thinks as each part comes, read from a copy of the splitter that
        message() has not fed them to yet."""
        if self.splitter is None:
            return [False] * len(parts)
        if len(parts) == 1:
            return [self.splitter.in_reasoning]
        ahead, thinking = copy.copy(self.splitter), []  # a shallow copy will do: its state is a bool and a str
        for part in parts:
            thinking.append(ahead.in_reasoning)
            ahead.feed(part.text, part.finish_reason is not None)
        return thinking

    def chunk(self, meta, delta) -> dict | None:
        ready = self._ready(delta)
        logprobs = proto.chat_logprobs(ready, self.pieces) if ready else None
        message = self.message(delta)
        if not message and logprobs is None and delta.finish_reason is None:
            return None
        chunk = proto.chat_chunk(meta, message, self._sent_finish(delta.finish_reason), logprobs, self.index)
        # chat's chunks carry the stop_reason only where the choice finishes (as vLLM's)
        return self._every_chunk(chunk, delta) if delta.finish_reason is not None else chunk

    def collect(self, delta) -> None:
        self._count_reasoning(delta)
        self.text.append(delta.text)
        if self.calls is not None and self.reasoning is None:  # with reasoning: the content, in choice()
            self.calls.push(delta.text, delta.finish_reason is not None)
        self.entries.extend(self._ready(delta))
        self._keep_prompt_entries(delta)
        self._keep_stop_reason(delta)

    def response_extras(self) -> dict:
        return {} if self.prompt_top is None else {"prompt_logprobs": self._vllm_prompt_logprobs()}

    def choice(self, finish) -> dict:
        logprobs = proto.chat_logprobs(self.entries, self.pieces) if self.logprobs else None
        content, thought = "".join(self.text), None
        if self.reasoning is not None:
            thought, content = read_reasoning(self.reasoning[0], content, *self.reasoning[1:])
            if self.calls is not None:
                self.calls.push(content or "", True)
        choice = _told_stop_reason(proto.chat_choice(content, self._sent_finish(finish), logprobs, self.index),
                                   self.stop_reason)
        if self.calls is not None:
            choice["message"] = self.calls.message()
            if content is None and not choice["message"].get("tool_calls"):  # all thinking: null, as without calls
                choice["message"]["content"] = None
        if self.reasoning is not None and self.include_reasoning:
            choice["message"]["reasoning"] = thought
        return choice
