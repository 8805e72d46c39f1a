"""A StructuredOutput as the grammar llguidance matches, and the check of that grammar.

llguidance compiles JSON schemas, regular expressions and Lark grammars lazily, token by token, so
a request's grammar costs nothing before its first step; its checks need no tokenizer, so the
driver refuses a bad schema or pattern before the request is submitted."""

from __future__ import annotations

import json

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
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False)
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
    return _short_problem(problem) if problem.strip() else None


def check_structured_output(spec: StructuredOutput | None, name: str = "structured_output") -> None:
    """ValueError naming the spec and llguidance's reason when it cannot be matched."""
    if spec is None:
        return
    problem = grammar_problem(spec)
    if problem is not None:
        raise ValueError(f"{name} ({spec.describe()}) cannot be used: {problem}")


def _short_problem(text: str) -> str:
    """llguidance's report on one line: its first line and its `error:` lines (the rest draws the
    pattern with a caret under the place)."""
    lines = [line.strip() for line in text.strip().splitlines()]
    return "; ".join([lines[0].rstrip(":")] + [line for line in lines[1:] if line.startswith("error:")])
