"""The group leader's side of structured output: an llguidance tokenizer built once per serving
loop, and one matcher per structured request, which follows the request's tokens as they are chosen.

Only rank 0 chooses tokens, so only rank 0 holds these; the other ranks never see a grammar. The
driver builds a tokenizer of its own too, to take each grammar's first step before submitting it
(workers/structured/grammars.first_step)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from shardlib.structured_output import StructuredOutput
from workers.structured.grammars import NOT_THE_GRAMMARS

TOKENIZER_WAIT_S = 300.0
"""How long a structured request waits for the grammar tokenizer, which is built on a thread from
the first structured request (under a second for a 49k vocabulary, a few for 150k)."""


class GrammarTokenizer:
    """llguidance's view of the model's tokenizer (every token's bytes), built on a thread when the
    first structured request arrives: serving that never sees one never pays for it, and the
    requests already running go on while it is built."""

    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int) -> None:
        """load_tokenizer() -> a Hugging Face fast tokenizer; vocab_size: the model's logits' width
        (a tokenizer may have fewer tokens than the embedding has rows, never more that can be chosen)."""
        self._load, self.vocab_size = load_tokenizer, vocab_size
        self._value = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._build, name="corelaunch-grammar-tokenizer", daemon=True)
        self._started = False
        self._starting = threading.Lock()  # the driver's checks may come from several threads
        self._done = threading.Event()
        """Set once the build has ended, before the when_ready callbacks run (which run on the build's
        thread: its being alive must not read as not ready to a leader one of them woke)."""
        self._on_ready: list[Callable[[], None]] = []

    def ready(self) -> bool:
        """Whether the tokenizer is built (or failed to be); the first call starts building it."""
        with self._starting:
            if not self._started:
                self._started = True
                self._thread.start()
        return self._done.is_set()

    def when_ready(self, callback: Callable[[], None]) -> None:
        """Call callback() once the build has ended (built or failed): at once if it has, else on the
        build's thread. The serving loop posts itself a wake-up with it, so an idle leader starts the
        structured requests that waited for the tokenizer then, not at its next heartbeat."""
        with self._starting:
            if not self._done.is_set():
                self._on_ready.append(callback)
                return
        callback()

    def _build(self) -> None:
        try:
            import llguidance.hf

            tokenizer = self._load()
            self._value = llguidance.hf.from_tokenizer(tokenizer, n_vocab=max(self.vocab_size, len(tokenizer)))
        except BaseException as err:  # noqa: BLE001 - reported to every structured request
            self._error = err
        finally:
            with self._starting:
                self._done.set()
                callbacks, self._on_ready = self._on_ready, []
            for callback in callbacks:
                callback()

    def get(self, timeout_s: float = TOKENIZER_WAIT_S):
        """The llguidance tokenizer; ValueError saying why there is none."""
        self.ready()
        if not self._done.wait(timeout_s):
            raise ValueError(f"the model's tokenizer for structured output was not ready after {timeout_s:g} s")
        if self._error is not None:
            raise ValueError(f"structured output needs the model's tokenizer, and loading it for llguidance "
                             f"failed: {type(self._error).__name__}: {self._error}")
        return self._value


def start_matcher(tokenizer: GrammarTokenizer | None, spec: StructuredOutput, delivered: Sequence[int] = ()):
    """A RequestGrammar for spec, advanced past `delivered` (the tokens a request resumed after a
    group fault had already streamed). ValueError saying why there is none."""
    from llguidance import LLMatcher

    from workers.structured.grammars import grammar_text

    if tokenizer is None:
        raise ValueError("structured output needs the model's tokenizer on the group's leader, and this serving "
                         "loop was started without one")
    llg_tokenizer = tokenizer.get()
    matcher = matchers_own(lambda: LLMatcher(llg_tokenizer, grammar_text(spec)))
    if matcher.is_error():
        raise GrammarRefused(spec, error_of(matcher))
    grammar = RequestGrammar(matcher, llg_tokenizer.vocab_size, spec.after_token, tuple(llg_tokenizer.eos_tokens))
    for token in delivered:
        grammar.advance(token)
    return grammar


class MatcherFailed(ValueError):
    """llguidance raised out of a matcher's call something other than its ValueError: a Rust panic
    (PyO3's PanicException, a BaseException that `except Exception` misses, so it failed the whole
    serving loop or the driver's check, not one request; guidance-ai/llguidance#149), or any other
    error. A ValueError, so each caller fails the one request as it does for the matcher's own errors."""

    def __init__(self, err: BaseException) -> None:
        super().__init__(f"its structured output's matcher failed: {type(err).__name__}: {err}")


def matchers_own(call: Callable[[], object]):
    """call() (a call into llguidance), with whatever it raises other than a ValueError or one of
    NOT_THE_GRAMMARS (Ctrl-C and the like, never the matcher's) raised as MatcherFailed."""
    try:
        return call()
    except (ValueError, *NOT_THE_GRAMMARS):
        raise
    except BaseException as err:  # noqa: BLE001 - a panic included: the one request's failure
        raise MatcherFailed(err) from err


class GrammarRefused(ValueError):
    """llguidance would not make a matcher of spec; `reason` is its word."""

    def __init__(self, spec: StructuredOutput, reason: str) -> None:
        super().__init__(f"structured output ({spec.describe()}) cannot be used: {reason}")
        self.reason = reason


class RequestGrammar:
    """One request's matcher and the width of the masks it writes (its tokenizer's vocabulary).
    With an after_token (StructuredOutput.after_token) it waits, inactive, until that token is
    generated: no mask, no end of a match, the tokens before it not fed to the matcher."""

    def __init__(self, matcher, vocab_size: int, after_token: int | None = None, ends: tuple[int, ...] = ()) -> None:
        self.matcher = matcher
        self.ends = ends
        """Its tokenizer's EOS ids, which its mask allows wherever the output may end (min_tokens
        holds them back: token_choice)."""
        self.words = (vocab_size + 31) // 32
        """32-bit words in its mask: token t is bit t % 32 of word t // 32."""
        self.waits_for = after_token
        """The token the constraint starts after, until it has come; then None."""

    @property
    def active(self) -> bool:
        """Whether the output is constrained now (token_choice masks only active grammars' rows)."""
        return self.waits_for is None

    def write_mask(self, words) -> None:
        """Write the allowed next tokens into `words` (a contiguous int32 numpy array of self.words)."""
        matchers_own(lambda: self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes))
        if self.matcher.is_error():
            raise ValueError(f"the structured output's matcher failed: {error_of(self.matcher)}")

    def accepting(self) -> bool:
        """Whether the output so far is a whole match (ending it here is allowed)."""
        return matchers_own(self.matcher.is_accepting)

    def advance(self, token: int) -> bool:
        """Feed the chosen token; True when the output is now a whole match that cannot go on (the
        request ends there). ValueError when the grammar refuses it (only a token the mask allowed
        is chosen, so that is a fault of the matcher, or a resumed request's history that differs)."""
        if self.waits_for is not None:  # free text until the token the constraint starts after
            if token == self.waits_for:
                self.waits_for = None
            return False
        if not matchers_own(lambda: self.matcher.consume_token(token)):
            raise ValueError(f"the structured output's matcher refused token {token}: {error_of(self.matcher)}")
        return matchers_own(self.matcher.is_stopped)


def error_of(matcher) -> str:
    """The matcher's error on one line (llguidance appends its parser's whole state)."""
    from workers.structured.grammars import short_problem

    return short_problem(matcher.get_error().split("<state>")[0] or "unknown error")
