"""One request's tokens turned into text deltas: incremental detokenization, then stop strings."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from launcher.serving.detokenizer import IncrementalDetokenizer
from launcher.serving.stop_strings import StopStringMatcher
from launcher.serving.stream_types import StreamDelta
from workers.serving.requests import TokenEvent


def shown_tokens(ids: list[int], finish: str | None, hidden_endings: Collection[int]) -> list[int]:
    """The tokens whose text is shown: all but a stop token that ended the request ("stop" on one of
    `hidden_endings`), whose text vLLM leaves out. "stop" on a token that is no stop token is a
    structured output's last token: its text stays."""
    return ids[:-1] if finish == "stop" and ids and ids[-1] in hidden_endings else ids


def stop_token_reason(ids: Sequence[int], finish: str | None, ending_ids: Collection[int],
                      eos_id: int | None) -> int | None:
    """The stop token id that ended a "stop" answer (its last token, one of `ending_ids`), as its
    stop_reason says it; None for the tokenizer's own EOS (the plain end of an answer, which names
    no stop) and for a last token that is no stop token (a structured output's end). An end token
    of the model's generation config other than the tokenizer's EOS (Llama 3's end of turn, say) is
    a stop token id like the request's own, so it is named."""
    if finish != "stop" or not ids:
        return None
    last = ids[-1]
    return last if last in ending_ids and last != eos_id else None


def one_token_events(event: TokenEvent) -> list[TokenEvent]:
    """An event of several tokens (a stream_interval's) as the events of one token each it gathered:
    the end, error and time on the last, the first token's prompt log-probabilities and cached count
    on the first."""
    last = len(event.token_ids) - 1
    return [TokenEvent(event.request_id, [token], event.finish_reason if i == last else None,
                       None if event.logprobs is None else [event.logprobs[i]],
                       None if event.logits is None else [event.logits[i]], event.at_s,
                       event.error if i == last else None,
                       event.prompt_logprobs if i == 0 else None, event.cached_tokens if i == 0 else None)
            for i, token in enumerate(event.token_ids)]


def merged(deltas: list[StreamDelta]) -> StreamDelta:
    """One delta of consecutive deltas of one request, which it keeps as its parts (theirs, where
    they have some: one token each); the delta itself where there is one."""
    if len(deltas) == 1:
        return deltas[0]
    deltas = [part for d in deltas for part in d.parts or (d,)]
    first, last = deltas[0], deltas[-1]
    logprobs = None if all(d.logprobs is None for d in deltas) else [p for d in deltas for p in d.logprobs or []]
    return dataclasses.replace(last, text="".join(d.text for d in deltas),
                               token_ids=[t for d in deltas for t in d.token_ids], logprobs=logprobs,
                               time_to_first_token_s=first.time_to_first_token_s,
                               prompt_logprobs=first.prompt_logprobs, cached_tokens=first.cached_tokens,
                               parts=deltas)


class TextStream:
    def __init__(self, request_id: str, tokenizer, stops: tuple[str, ...], prompt_tokens: int,
                 min_tokens: int = 0, include_stop_str_in_output: bool = False,
                 skip_special_tokens: bool = True, stop_token_ids: Collection[int] = (),
                 prompt_ids: Sequence[int] = (), ignore_eos: bool = False, eos_token_id: int | None = None) -> None:
        """min_tokens: a stop string counts only where it ends in the text of the tokens after the
        first min_tokens (vLLM's rule: its min_tokens holds stop strings back as it holds stop
        tokens); it may begin earlier. include_stop_str_in_output (vLLM's): the text ends with the
        stop string that ended it, rather than just before it, and keeps the text (if any) of the
        stop token that ended it. skip_special_tokens (vLLM's): False keeps the special tokens' text
        (`<|im_end|>`) in the text, where the stop strings are looked for too. stop_token_ids: the
        ids that end the request (its stop token ids, and the EOS ids unless ignore_eos): one that
        ends it leaves its text out, special or not, as vLLM leaves a stop token's out, unless
        include_stop_str_in_output. prompt_ids: the request's prompt, whose last tokens the text is
        decoded after (never shown), as vLLM's: a SentencePiece first token keeps its space
        (launcher/serving/detokenizer.py)."""
        self.request_id = request_id
        self._detokenizer = (IncrementalDetokenizer(tokenizer, skip_special_tokens, prompt_ids)
                             if tokenizer is not None else None)
        self.prompt_context: list[int] = self._detokenizer.context if self._detokenizer is not None else []
        """The prompt's last ids the text was primed with: a render places the logprobs' tokens in the
        same text (launcher/serving/logprob_alignment.py)."""
        self._ending_ids = frozenset(stop_token_ids)
        self._hidden_endings = frozenset() if include_stop_str_in_output else self._ending_ids
        # the tokenizer's EOS ends an answer plainly (no stop_reason) unless ignore_eos: then it ends
        # one only as a stop token id the request named, which stop_reason names, as vLLM's does
        # (eos_token_id: the plain end where the tokenizer names none, a launch without one say)
        plain_end = getattr(tokenizer, "eos_token_id", None)
        self._eos_id = None if ignore_eos else (plain_end if plain_end is not None else eos_token_id)
        self._stops = StopStringMatcher(stops, include_stop_str_in_output) if stops else None
        self._min_tokens = min_tokens
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.stopped_by_string = False
        self.stop_reason: str | int | None = None
        """What ended a "stop", once it ended (StreamDelta.stop_reason): the stop string, or the stop
        token id."""

    def delta(self, event: TokenEvent, time_to_first_token_s: float | None = None) -> StreamDelta:
        """The delta for one event; after a stop string, finish_reason is "stop" whatever the event says.
        time_to_first_token_s goes on the delta that carries the first token (StreamHandle times it)."""
        if len(event.token_ids) < 2:
            return self._delta(event, time_to_first_token_s)
        # An event of several tokens (a stream_interval's) is read a token at a time, as its tokens
        # would have come: the text is decoded as it would have been, and readers that need each
        # token's text by itself find it in the delta's parts. (A stop string a token inside
        # completes would end the request at that token; the leader holds no request with stop
        # strings, so only a TextStream used alone meets that.)
        deltas = []
        for one in one_token_events(event):
            deltas.append(self._delta(one, time_to_first_token_s))
            if deltas[-1].finish_reason is not None:
                break
        return merged(deltas)

    def held_delta(self) -> StreamDelta | None:
        """The text held back so far (the detokenizer's unfinished character, the tail that may begin
        a stop string) as a delta of no token, for a request that failed: its reader, which has every
        token it was sent, then has their text too, as at a request's end. None when none is held."""
        text = self._detokenizer.flush() if self._detokenizer is not None else ""
        if self._stops is not None:
            text, _ = self._stops.push(text)
            text += self._stops.flush()
        if not text:
            return None
        return StreamDelta(self.request_id, text, [], None, self.prompt_tokens, self.completion_tokens,
                           stopped_by_string=self.stopped_by_string)

    def _delta(self, event: TokenEvent, time_to_first_token_s: float | None) -> StreamDelta:
        first = time_to_first_token_s if event.token_ids and self.completion_tokens == 0 else None
        finish = event.finish_reason
        ids = list(event.token_ids)
        # this event's tokens within the first min_tokens, whose text no stop string may end in, and the rest
        within = min(len(ids), max(self._min_tokens - self.completion_tokens, 0))
        early = late = ""
        shown = shown_tokens(ids, finish, self._hidden_endings)
        if self._detokenizer is not None:
            # one push per early token: a push whose text ends inside a character holds all of it back,
            # and whole early tokens held with the next one's half character would come out as late text
            early = "".join(self._detokenizer.push([token]) for token in shown[:within])
            late = self._detokenizer.push(shown[within:])
            if finish is not None:
                late += self._detokenizer.flush()
        hit = False
        if self._stops is not None:
            if within:
                early, _ = self._stops.push(early, match=False)
            late, hit = self._stops.push(late, match=within < len(ids))
        text = early + late
        if hit:
            finish, self.stopped_by_string = "stop", True
            self.stop_reason = self._stops.found
        elif finish is not None and self._stops is not None:
            text += self._stops.flush()
        if finish is not None and not hit:
            self.stop_reason = stop_token_reason(ids, finish, self._ending_ids, self._eos_id)
        self.completion_tokens += len(ids)
        self.finish_reason = finish
        return StreamDelta(self.request_id, text, ids, finish, self.prompt_tokens,
                           self.completion_tokens, event.logprobs, first, event.prompt_logprobs,
                           self.stopped_by_string, event.cached_tokens,
                           stop_reason=self.stop_reason,  # set only on the delta that ends it
                           stop_token_hidden=len(shown) < len(ids))
