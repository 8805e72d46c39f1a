"""What a request's output must match (structured output): a JSON schema, any JSON object, a regular
expression, one of a list of strings, or a grammar. Pure: built and checked for shape where the
request is made (the driver API, the CLI, the OpenAI server); the grammar itself is compiled and
checked by workers/structured/grammars.py, and enforced token by token by the group's leader
(workers/structured/token_masks.py)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shardlib.config_fields import show as _short

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one of the fields is given."""

    json: str | Mapping | None = None
    """A JSON schema (a mapping, or its JSON text): the output is one JSON value it accepts. Kept
    as JSON text (the params stay hashable); its properties keep their order, which is the order
    they are generated in."""
    json_object: bool = False
    """Any JSON object (OpenAI's JSON mode)."""
    regex: str | None = None
    """The whole output matches this regular expression (Rust regex syntax: no look-around or
    back-references)."""
    choice: Sequence[str] | None = None
    """The output is exactly one of these strings. Kept as a tuple."""
    grammar: str | None = None
    """A context-free grammar in the Lark syntax llguidance reads (`start: ...`)."""
    after_token: int | None = None
    """Not a kind: the constraint starts once this token has been generated (a thinking model's end
    of thinking, `</think>`), the text before it free; the structured part is then the whole rest
    of the output. None: from the first token."""

    def __post_init__(self) -> None:
        given = self._given()
        if len(given) != 1:
            raise ValueError(f"structured output names {' and '.join(given) if given else 'nothing'}; give exactly "
                             f"one of json (a JSON schema), json_object=True, regex, choice or grammar")
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object={self.json_object!r} must be True or False")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name}={_short(value)} must be a non-empty string")
        if self.choice is not None:
            object.__setattr__(self, "choice", _choices(self.choice))
        if self.after_token is not None and (not isinstance(self.after_token, int) or isinstance(self.after_token, bool)
                                             or self.after_token < 0):
            raise ValueError(f"after_token={_short(self.after_token)} must be a token id (an integer >= 0), or None")

    def _given(self) -> list[str]:
        return [name for name in KINDS if getattr(self, name) not in (None, False)]

    @property
    def kind(self) -> str:
        """The field given: "json", "json_object", "regex", "choice" or "grammar"."""
        return self._given()[0]

    def describe(self) -> str:
        """A short description for messages: the kind and the start of its value."""
        value = getattr(self, self.kind)
        return self.kind if value is True else f"{self.kind} {_short(value)}"


def _schema_text(schema) -> str:
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except ValueError as err:
            raise ValueError(f"json schema {_short(schema)} is not valid JSON ({err}); give a JSON object, or a "
                             f"mapping") from None
    else:
        parsed = schema
    if not isinstance(parsed, Mapping):
        raise ValueError(f"json schema {_short(parsed)} must be a JSON object (a mapping such as "
                         f"{{\"type\": \"object\", \"properties\": ...}}); for any JSON object use json_object=True")
    try:
        return json.dumps(parsed, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ValueError(f"json schema {_short(parsed)} cannot be written as JSON ({err})") from None
    except RecursionError:  # a request body parsed it a few frames shallower: a 500, not a 400, before
        # (not shown: showing it recurses as deep)
        raise ValueError("json schema is nested too deeply to use (past Python's recursion limit); "
                         "flatten it") from None


def _choices(choice) -> tuple[str, ...]:
    if isinstance(choice, (str, bytes)) or not isinstance(choice, Sequence) or not choice:
        raise ValueError(f"choice={_short(choice)} must be a non-empty list of strings")
    for i, text in enumerate(choice):
        if not isinstance(text, str) or not text:
            raise ValueError(f"choice[{i}]={_short(text)} must be a non-empty string")
    return tuple(choice)
