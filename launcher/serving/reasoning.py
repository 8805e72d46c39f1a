"""A thinking model's text split into its reasoning and its answer, as vLLM 0.32's `--reasoning-parser`
splits it: the reasoning goes to the message's `reasoning` field (streamed as delta `reasoning`), the
rest is the `content` (what a tool-call parser then reads). Two formats, both written with the tags

    <think>
    The user wants the weather in Paris; I should call the tool.
    </think>

    It is sunny in Paris.

"qwen3" (the Qwen3 series: the model writes `<think>` itself; `{"enable_thinking": false}` in the
request's chat_template_kwargs turns thinking off) and "deepseek_r1" (DeepSeek-R1, its distills and
QwQ-32B, as vLLM's docs pair them: the chat template writes `<think>` into the prompt, so the text
usually starts inside the thinking, with no opening tag).

The rules, per parser (the tags are text: corelaunch reads decoded text, where vLLM's stream looks for
the tags' token ids; with the models' tokenizers each tag is one token, so the two agree):

- Both start in the reasoning, tag or no tag: `abc</think>xyz` is reasoning "abc", content "xyz", and
  a text with no `</think>` (cut short by max_tokens) is all reasoning, content null.
- Before the end of the reasoning, every `<think>` is markup and dropped; the text before it stays
  reasoning (`pre<think>abc</think>` is reasoning "preabc").
- The reasoning ends at the first `</think>`, which is dropped. qwen3 also ends it at the first
  `<tool_call>` (a call written without closing the thinking), which stays, as the content's start
  (not in a constrained answer: below).
- After it, deepseek_r1 keeps the text as it is (a later `<think>` or `</think>` is content); qwen3
  drops every later `</think>` (vLLM's grammar takes it for a repeat; not in a constrained answer)
  and keeps `<think>` as text.
- qwen3 with a structured output (a forced tool call, response_format, structured_outputs: the
  request's reasoning() says `constrained`): the engine's grammar starts only after the `</think>`
  token (openai_protocol's settle_thinking), so the split ends the thinking there alone, as the
  constraint does: a `<tool_call>` written while thinking is unconstrained text and stays reasoning,
  and the answer, which the grammar wrote, is kept as written (a `</think>` in a call's arguments or
  in the JSON stays). deepseek_r1 reads every answer so already.
- Nothing is stripped: `<think>\n\n</think>\n\nxyz` is reasoning "\n\n", content "\n\nxyz".
- Empty content is null. Empty reasoning is null for qwen3, "" for deepseek_r1 (vLLM's whole
  answers: `<think></think>xyz` gives reasoning "" under deepseek_r1, null under qwen3).
- qwen3 with thinking off (`enable_thinking` false, or null: vLLM tests its truth): no reasoning at
  all, the content is the text as it is, tags included, "" kept (the answer of a server with no
  parser). deepseek_r1 reads no chat_template_kwargs (vLLM's doesn't): `thinking` changes nothing.

Where vLLM 0.32's stream and whole answer disagree, one rule is taken for both, so that the stream's
deltas add up to the whole answer for any split of the text:

- deepseek_r1, text before `<think>`, or a second `<think>` in the reasoning: vLLM's whole answer
  drops the text before the first `<think>` (`pre<think>abc</think>xyz`: reasoning "abc") and keeps a
  second one as text; its stream (a token a delta) drops each `<think>` token and keeps the rest as
  reasoning ("preabc"). The stream's rule is taken: it loses no text the model wrote.
- deepseek_r1, `<think>` in the answer: vLLM's whole answer looks for `<think>` first, so
  `abc</think>x<think>y</think>z` gives reasoning "y", content "z" (the answer and thinking lost);
  its stream gives reasoning "abc", content "x<think>y</think>z". The stream's rule is taken.
- qwen3, a second `</think>` in the answer: vLLM's whole answer drops it; its server stream sends it
  as content when it comes in a later delta than the first (after the reasoning ends the server
  stops feeding its parser). The whole answer's rule is taken: the duplicate is markup, which is
  why vLLM's grammar drops it; the stream only keeps it by accident.

Another vLLM stream behaviour not followed: a delta holding several tokens (vLLM's stream_interval,
a detokenizer catching up) makes vLLM's deepseek_r1 stream keep a `<think>` as reasoning text. A
prompt already holding a `</think>` after its last `<think>` makes vLLM stream the whole output as
content while its whole answer still reads reasoning; the server here (openai_protocol's
settle_thinking, which reads the prompt's token ids) makes it all content, streamed and whole, for
both parsers, so this splitter is not used there.

Streamed, each piece goes out at once but for a tail that may still grow into a tag that matters in
the current part (at most 10 characters: `<tool_call` without its `>`); the work per piece is that
piece's, the text already sent never being read again.

The usage counts the reasoning's tokens (`completion_tokens_details.reasoning_tokens`, as vLLM 0.32
reports it with a parser; ReasoningTokenCount, one per choice): the generated tokens from where the
thinking opened up to its end, the tags' own tokens left out. It opens before the first generated
token whenever the request's thinking is on (deepseek_r1's prompt opens it; qwen3, whose model
writes `<think>` itself, is read as starting inside it too, as the split does); a generated `<think>`
token inside it is a tag, not counted. It ends at the first `</think>` token (qwen3: or a
`<tool_call>` token, unless the answer is `constrained`), and nothing after it counts. Thinking
off, or a prompt that already closed it (the app's settle_thinking): 0. vLLM's deepseek_r1 count
differs: it counts only between a generated `<think>` and a `</think>`, so DeepSeek-R1, whose prompt
holds the `<think>`, reports 0 there (its qwen3 count starts inside the thinking, as this one).
Where the tokenizer has no `</think>` token, the count reads the text instead: a token counts when
its text went wholly to the reasoning (ReasoningSplitter's), so the tokens that spell a tag, or a
piece of one, are not counted, nor is one whose text is part reasoning, part answer.

Pure (no tokenizer, no engine): the app drives one ReasoningSplitter and one ReasoningTokenCount
per choice.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from launcher.serving.stop_strings import held_tail_length

THINK_START, THINK_END, CALL_START = "<think>", "</think>", "<tool_call>"

REASONING_PARSERS = {
    "deepseek_r1": "DeepSeek-R1, its distills, QwQ-32B: thinking up to </think> (the prompt opens it), "
                   "then the answer",
    "qwen3": "Qwen3: <think>...</think> (or up to a <tool_call>), then the answer; "
             "chat_template_kwargs {\"enable_thinking\": false} makes it all answer",
}
"""The --reasoning-parser names, as vLLM 0.32 names them, with what each reads."""


def check_parser(parser: str) -> str:
    """The parser's name; ValueError naming it and the known ones when it is none of them."""
    if parser not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {parser!r}; use one of "
                         f"{', '.join(sorted(REASONING_PARSERS))}")
    return parser


def thinking_requested(parser: str, chat_template_kwargs: Mapping | None) -> bool:
    """Whether the request leaves thinking on, as vLLM 0.32 reads its chat_template_kwargs: qwen3 looks
    at "enable_thinking" (default true; any false value, null included, turns it off, as vLLM tests
    the value's truth); deepseek_r1 looks at nothing, so always thinks. ("thinking", the key some
    other templates read, is not looked at by either.)"""
    if check_parser(parser) == "qwen3":
        return bool((chat_template_kwargs or {}).get("enable_thinking", True))
    return True


def read_reasoning(parser: str, text: str, thinking: bool = True,
                   constrained: bool = False) -> tuple[str | None, str | None]:
    """The whole generated text's (reasoning, content) under `parser` (module docstring: the rules).
    thinking False: the request turned thinking off (thinking_requested). constrained: a structured
    output starts after the `</think>` token (the request's reasoning() says so)."""
    qwen3 = check_parser(parser) == "qwen3"
    if qwen3 and not thinking:
        return None, text
    if qwen3 and not constrained:
        end = _first_reasoning_end_qwen3(text)
        if end is None:
            return text.replace(THINK_START, "") or None, None
        head, rest = text[:end], text[end:]
        if rest.startswith(THINK_END):
            rest = rest[len(THINK_END):]  # a <tool_call> that ends the reasoning stays: the content's start
        return head.replace(THINK_START, "") or None, rest.replace(THINK_END, "") or None
    # deepseek_r1's rule, which a constrained qwen3 answer follows too (only the grammar's own start
    # ends the thinking; what it wrote is kept as written), qwen3's empty reasoning being null
    head, end, rest = text.partition(THINK_END)
    reasoning = head.replace(THINK_START, "")
    return (reasoning or None) if qwen3 else reasoning, (rest if end else "") or None


def _first_reasoning_end_qwen3(text: str) -> int | None:
    """Where the first </think> or <tool_call> begins (the tags cannot overlap: each holds one "<",
    its first character), None when there is neither."""
    found = [i for tag in (THINK_END, CALL_START) if (i := text.find(tag)) >= 0]
    return min(found, default=None)


class ReasoningSplitter:
    """One choice's streamed text split into (reasoning delta, content delta) per piece.

    In each part (reasoning, content) a few tags matter: each is found, acted on, and the text
    between goes out at once; only a tail that may be the start of one is held for the next piece.
    The text already sent is never looked at again."""

    def __init__(self, parser: str, thinking: bool = True):
        self.parser = check_parser(parser)
        self.thinking = bool(thinking)
        self._in_reasoning = parser == "deepseek_r1" or self.thinking
        self._held = ""

    @property
    def in_reasoning(self) -> bool:
        """Whether the text that comes next is still reasoning."""
        return self._in_reasoning

    @property
    def held(self) -> str:
        """The text received but not yet sent: it may be the start of a tag."""
        return self._held

    def feed(self, piece: str, finished: bool) -> tuple[str, str]:
        """(reasoning, content) to send for this piece; finished: the last piece, so nothing is held."""
        text, self._held = self._held + piece, ""
        reasoning, content = [], []
        start = 0
        while start < len(text):
            tags = self._tags()
            if not tags:
                content.append(text[start:])
                break
            found = _tag_pattern(tags).search(text, start)
            if found is None:
                keep = 0 if finished else held_tail_length(text[start:], tags)
                (reasoning if self._in_reasoning else content).append(text[start:len(text) - keep])
                self._held = text[len(text) - keep:]
                break
            (reasoning if self._in_reasoning else content).append(text[start:found.start()])
            self._act_on(found.group(), content)
            start = found.end()
        return "".join(reasoning), "".join(content)

    def _tags(self) -> tuple[str, ...]:
        """The tags that mean something in the current part."""
        if self._in_reasoning:
            return (THINK_START, THINK_END, CALL_START) if self.parser == "qwen3" else (THINK_START, THINK_END)
        return (THINK_END,) if self.parser == "qwen3" and self.thinking else ()

    def _act_on(self, tag: str, content: list[str]) -> None:
        """Apply a found tag. Dropped: <think> in the reasoning, </think> (qwen3's, in the content too).
        A <tool_call> ends qwen3's reasoning and is the content's start."""
        if tag == CALL_START:
            self._in_reasoning = False
            content.append(tag)
        elif tag == THINK_END:
            self._in_reasoning = False


def reasoning_splitter(parser: str, thinking: bool = True, constrained: bool = False) -> ReasoningSplitter:
    """A new splitter of one choice's stream; constrained: the request's reasoning() says its answer
    is (read_reasoning's), which splits as deepseek_r1's: only `</think>` ends the thinking, and the
    answer goes out as written."""
    return ReasoningSplitter("deepseek_r1" if constrained else parser, thinking)


@functools.cache
def _tag_pattern(tags: tuple[str, ...]) -> re.Pattern:
    """One search for the earliest of `tags` (compiled once per set of tags)."""
    return re.compile("|".join(map(re.escape, tags)))


@dataclass(frozen=True)
class ThinkTokens:
    """The ids of the tokenizer's tags where each is one token the model can generate, else None:
    the usage counts the thinking by them (ReasoningTokenCount)."""

    start: int | None = None
    end: int | None = None
    call: int | None = None
    """`<tool_call>`'s, which ends qwen3's thinking too (not a `constrained` answer's)."""


class ReasoningTokenCount:
    """How many of one choice's generated tokens are its reasoning, so far (module docstring: the
    rule). Fed every delta's token ids and text in order; by ids where the tokenizer has a `</think>`
    token, by the text otherwise."""

    def __init__(self, parser: str, thinking: bool, tokens: ThinkTokens, constrained: bool = False):
        """constrained: a structured output starts after the `</think>` token, which alone ends the
        thinking then (read_reasoning's)."""
        self.count = 0
        self._in_thinking = bool(thinking)  # deepseek_r1 passes True: the request's reasoning()
        self._start = tokens.start
        ends_at_call = check_parser(parser) == "qwen3" and not constrained
        self._ends = {tokens.end} | ({tokens.call} if ends_at_call and tokens.call is not None else set())
        # by text where the ids cannot say where the thinking ends as the split says it: no
        # `</think>` token, or free qwen3 without a `<tool_call>` token (its thinking ends at that text too)
        self._by_text = tokens.end is None or (ends_at_call and tokens.call is None)
        self._splitter = reasoning_splitter(parser, thinking, constrained) if self._by_text else None
        self._undecided = 0
        """By text: tokens whose text the splitter still holds (it may be a tag's start)."""

    def push(self, token_ids: Sequence[int], text: str, finished: bool) -> None:
        if not self._in_thinking:
            return
        if self._by_text:
            self._push_text(len(token_ids), text, finished)
            return
        for token in token_ids:
            if token in self._ends:
                self._in_thinking = False
                return
            if token != self._start:
                self.count += 1

    def _push_text(self, tokens: int, text: str, finished: bool) -> None:
        """Count the tokens once their text is known to be wholly reasoning: the splitter holds none of
        it back and is still in the thinking. Those whose text ended the thinking count none, nor do
        those whose text spelled a `<think>` the split dropped. A token whose text is still to come
        (the engine holds it: a stop string's possible start, part of a UTF-8 character) waits for it."""
        self._undecided += tokens
        before = len(self._splitter.held) + len(text)
        reasoning, _ = self._splitter.feed(text, finished)
        if not self._splitter.in_reasoning:
            self._in_thinking, self._undecided = False, 0
        elif len(reasoning) + len(self._splitter.held) < before:  # a tag was dropped: its tokens spelled it
            self._undecided = 0
        elif not self._splitter.held and (text or finished):
            self.count, self._undecided = self.count + self._undecided, 0
