"""A StructuredOutput as the grammar llguidance matches, and the check of that grammar.

llguidance compiles JSON schemas, regular expressions and Lark grammars lazily, token by token, so
a request's grammar costs little before its first step. Its compile check needs no tokenizer (the
OpenAI front end's 400s); the driver also takes the first step with its own tokenizer, which finds
a pattern no text matches, before the request is submitted."""

from __future__ import annotations

import json

import numpy as np

from shardlib.structured_output import StructuredOutput

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON is generated without free whitespace (one space after each `:` and `,`, none elsewhere): with
whitespace allowed anywhere, a small model can fill its whole budget with newlines inside a value
that is still valid JSON."""

ANY_OBJECT = '{"type": "object"}'


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
    except Exception as err:  # noqa: BLE001 - the library's own words go back to the caller
        problem = f"{type(err).__name__}: {err}"
    return short_problem(problem) if problem.strip() else None


def check_structured_output(spec: StructuredOutput | None, name: str = "structured_output", tokenizer=None) -> None:
    """ValueError naming the spec and llguidance's reason when it cannot be matched. With
    `tokenizer` (a GrammarTokenizer, workers/structured/matchers.py) the first step's mask is
    computed too: a pattern no text matches (`[^\\s\\S]`) compiles, and fails only there."""
    if spec is None:
        return
    problem = grammar_problem(spec)
    if problem is None and tokenizer is not None:
        problem = first_step_problem(spec, tokenizer)
    if problem is not None:
        raise ValueError(f"{name} ({spec.describe()}) cannot be used: {problem}")


def first_step_problem(spec: StructuredOutput, tokenizer) -> str | None:
    """Why a matcher of spec fails at its first token (no text can match it), or None."""
    from workers.structured.matchers import GrammarRefused, start_matcher

    try:  # the tokenizer's own failure is not the grammar's: raised as it is
        grammar = start_matcher(tokenizer, spec)
    except GrammarRefused as err:  # llguidance refused the grammar itself: its reason
        return err.reason
    try:
        grammar.write_mask(np.zeros(grammar.words, dtype=np.int32))
    except ValueError as err:
        return f"no output can match it ({err})"
    return None


def short_problem(text: str) -> str:
    """llguidance's report on one line: its first line and its `error:` lines (the rest draws the
    pattern with a caret under the place, or dumps the parser's state)."""
    lines = [line.strip() for line in text.strip().splitlines()]
    return "; ".join([lines[0].rstrip(":")] + [line for line in lines[1:] if line.startswith("error:")])
