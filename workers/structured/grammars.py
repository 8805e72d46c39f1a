"""A StructuredOutput as the grammar llguidance matches, and the check of that grammar.

llguidance compiles JSON schemas, regular expressions and Lark grammars lazily, token by token, so
a request's grammar costs little before its first step. Its compile check needs no tokenizer (the
OpenAI front end's 400s); the driver also takes the first step with its own tokenizer, which finds
a pattern no text matches, before the request is submitted."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

import numpy as np

from shardlib.structured_output import StructuredOutput

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON is generated without free whitespace (one space after each `:` and `,`, none elsewhere): with
whitespace allowed anywhere, a small model can fill its whole budget with newlines inside a value
that is still valid JSON."""

ANY_OBJECT = '{"type": "object"}'

NOT_THE_GRAMMARS = (KeyboardInterrupt, SystemExit, GeneratorExit, asyncio.CancelledError)
"""BaseExceptions that are not llguidance's: let through where a call into llguidance catches
BaseException (a Rust panic comes as PyO3's PanicException, a BaseException, which `except
Exception` misses: it would fail the whole worker group, or the server's parse, not one request)."""


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar (its JSON form) that accepts what spec asks for."""
    from llguidance import LLMatcher

    kind = spec.kind
    if kind == "json":
        return LLMatcher.grammar_from_json_schema(spec.json, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema(ANY_OBJECT, defaults=JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":  # Lark string literals read JSON's escapes
        # One terminal (the lexer's automaton), not an alternation of rules: llguidance's parser
        # holds at most 2000 items a row, and 2000 choices as rules failed at the first token.
        return LLMatcher.grammar_from_lark("start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                                 for c in spec.choice))
    return LLMatcher.grammar_from_lark(spec.grammar)


def grammar_problem(spec: StructuredOutput) -> str | None:
    """Why llguidance cannot match spec (an unknown JSON schema type, a regex that does not parse, a
    Lark rule never defined), or None when it can."""
    from llguidance import LLMatcher

    try:
        problem = LLMatcher.validate_grammar(grammar_text(spec))
    except NOT_THE_GRAMMARS:
        raise
    except BaseException as err:  # noqa: BLE001 - the library's own words (a panic's too) go back to the caller
        problem = f"{type(err).__name__}: {err}"
    return short_problem(problem) if problem.strip() else None


def check_structured_output(spec: StructuredOutput | None, name: str = "structured_output",
                            tokenizer=None) -> np.ndarray | None:
    """ValueError naming the spec and llguidance's reason when it cannot be matched. With
    `tokenizer` (a GrammarTokenizer, workers/structured/matchers.py) the first step's mask is
    computed too, and returned (int32 words: token t is bit t % 32 of word t // 32): a pattern no
    text matches (`[^\\s\\S]`) compiles, and fails only there."""
    if spec is None:
        return None
    problem, mask = grammar_problem(spec), None
    if problem is None and tokenizer is not None:
        problem, mask = first_step(spec, tokenizer)
    if problem is not None:
        raise ValueError(f"{name} ({spec.describe()}) cannot be used: {problem}")
    return mask


def allows(mask: np.ndarray, token: int) -> bool:
    """Whether a first step's mask (check_structured_output's) allows the token."""
    return 0 <= token < len(mask) * 32 and bool(int(mask[token // 32]) >> (token % 32) & 1)


def first_step(spec: StructuredOutput, tokenizer) -> tuple[str | None, np.ndarray | None]:
    """(why a matcher of spec fails, or None; its first step's mask where it takes one). It fails
    at its first token (no text can match it), or on the first token
    of one path (the lowest-numbered token its first step allows). The second finds grammars
    llguidance compiles but cannot go on with past their start: an object of more than 500
    optional properties passes its parser's 2,000 items a row after the opening brace, and a
    required property referring back to its own object its 50,000 items a step. Other paths and
    later tokens are not tried: a failure there still fails its request when it comes."""
    from workers.structured.matchers import GrammarRefused, MatcherFailed, error_of, matchers_own, start_matcher

    try:  # the tokenizer's own failure is not the grammar's: raised as it is
        grammar = start_matcher(tokenizer, spec)
    except GrammarRefused as err:  # llguidance refused the grammar itself: its reason
        return err.reason, None
    except MatcherFailed as err:  # llguidance panicked building it: this grammar's problem, not the server's
        return str(err), None
    mask = np.zeros(grammar.words, dtype=np.int32)
    try:
        grammar.write_mask(mask)
    except MatcherFailed as err:
        return str(err), None
    except ValueError as err:
        return f"no output can match it ({err})", None
    token = lowest_allowed(mask, but=tokenizer.get().eos_tokens)  # the end is no path on
    matcher = grammar.matcher  # fed directly: a constraint after a token starts with this step too
    if token is None:
        return None, mask
    try:
        if matchers_own(lambda: matcher.consume_token(token) and not matcher.is_stopped()):
            second = np.zeros_like(mask)  # held here: llguidance writes through the bare pointer
            matchers_own(lambda: matcher.unsafe_compute_mask_ptr(second.ctypes.data, second.nbytes))
    except MatcherFailed as err:
        return f"{err} after its first token", None
    if matcher.is_error():
        return f"its matcher fails after its first token ({error_of(matcher)})", None
    return None, mask


def lowest_allowed(mask: np.ndarray, but: Sequence[int] = ()) -> int | None:
    """The lowest token id a mask (32-bit words, token t bit t % 32 of word t // 32) allows, other
    than those in `but`."""
    bits = mask.view(np.uint32).copy()
    for token in but:
        if token < len(bits) * 32:
            bits[token // 32] &= np.uint32(0xFFFFFFFF ^ (1 << (token % 32)))
    words = np.flatnonzero(bits)
    if not len(words):
        return None
    word = int(bits[words[0]])
    return int(words[0]) * 32 + (word & -word).bit_length() - 1


OVERLAPPING_ONE_OF = ("oneOf whose branches can overlap is not supported: write anyOf (a value matching two "
                      "branches is then allowed), or make the branches exclusive (a property each requires with a "
                      "const of its own; a oneOf of number consts: write enum)")
"""What llguidance's oneOf refusal means here. Its own words advise its coerce_one_of option, which
a request cannot set (shardlib/structured_output.py refuses its "x-guidance" options key)."""

_IN_OUR_WORDS = {"coerce_one_of": OVERLAPPING_ONE_OF}
"""A word in one of llguidance's reasons -> the reason as this project gives it."""


def short_problem(text: str) -> str:
    """llguidance's report on one line: its first line and its `error:` lines (the rest draws the
    pattern with a caret under the place, or dumps the parser's state), each line that advises
    what a request cannot do in our words (_IN_OUR_WORDS). Every route to a reason comes here: the
    compile check (grammar_problem) and a matcher's error (matchers.error_of)."""
    lines = [line.strip() for line in text.strip().splitlines()]
    kept = [lines[0].rstrip(":")] + [line for line in lines[1:] if line.startswith("error:")]
    return "; ".join(_in_our_words(line) for line in kept)


def _in_our_words(line: str) -> str:
    return next((ours for word, ours in _IN_OUR_WORDS.items() if word in line), line)
