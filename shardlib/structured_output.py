"""What a request's output must match (structured output): a JSON schema, any JSON object, a regular
expression, one of a list of strings, or a grammar. Pure: built and checked for shape where the
request is made (the driver API, the CLI, the OpenAI server); the grammar itself is compiled and
checked by workers/structured/grammars.py, and enforced token by token by the group's leader
(workers/structured/token_masks.py)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import unquote

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
    text = _json_text(parsed)
    parts = list(_schema_parts(parsed))
    _refuse_what_llguidance_misreads(parts)
    return _without_annotation_formats(text) if any(map(_annotation_format, parts)) else text


TOO_DEEP = "json schema is nested too deeply to use (past Python's recursion limit); flatten it"


def _json_text(schema: Mapping) -> str:
    try:
        return json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ValueError(f"json schema {_short(schema)} cannot be written as JSON ({err})") from None
    except RecursionError:  # a request body parsed it a few frames shallower: a 500, not a 400, before
        # (not shown: showing it recurses as deep)
        raise ValueError(TOO_DEEP) from None


EXACT_INTEGERS = 2 ** 53
"""llguidance reads a schema's numbers as 64-bit floats, exact only up to 2**53 in size: past it,
{"const": 9007199254740993} generated 9007199254740992 (finished "stop", the output outside the
schema)."""

_NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_VALUE_KEYWORDS = ("const", "enum")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
"""Keywords whose value maps names to schemas."""
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems", "items")
_SCHEMA_VALUES = ("items", "additionalProperties", "additionalItems", "not", "if", "then", "else", "contains",
                  "propertyNames", "unevaluatedProperties", "unevaluatedItems", "contentSchema")
PRIVATE_OPTIONS = "x-guidance"
"""llguidance's own options key in a schema: it would override the server's JSON options (lenient:
unsupported keywords silently ignored; whitespace_flexible: free whitespace back)."""


ENFORCED_FORMATS = frozenset(("date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid",
                              "uri"))
"""The string formats llguidance generates to (1.9's; tests/test_unenforced_schema_formats.py checks each still
compiles). It refuses any other ("Unknown format: password"), yet JSON Schema makes `format` an
annotation unless a validator opts in, and clients write others as a matter of course: OpenAPI's
byte, binary and password, pydantic's password (SecretStr), path and json-string. Those are left
out of the schema llguidance reads (_without_annotation_formats): the output is a plain string
there, as the schema allows."""


def _schema_parts(schema: Mapping, skip: tuple[str, ...] = ()):
    """Each schema in `schema` (itself first) with its path ("#/properties/a"). Walked by keyword,
    so a property named "const", "format" or "x-guidance" is a name, not a keyword, and values
    (const, enum, default, examples) are never entered; iterative, as a schema may nest as deep as
    json.dumps took it. skip: keywords whose schemas are not entered."""
    pending: list[tuple[object, str]] = [(schema, "#")]
    while pending:
        item, path = pending.pop()
        if not isinstance(item, Mapping):
            continue  # true/false, or a malformed part: llguidance's own check words it
        yield item, path
        for key, value in item.items():
            if key in skip:
                continue
            where = f"{path}/{key}"
            if key in _SCHEMA_MAPS and isinstance(value, Mapping):
                pending.extend((part, f"{where}/{name}") for name, part in value.items())
            elif key in _SCHEMA_LISTS and isinstance(value, list):
                pending.extend((part, f"{where}/{i}") for i, part in enumerate(value))
            elif key in _SCHEMA_VALUES:
                pending.append((value, where))


STRICT_CLOSED_BY = "additionalProperties"
"""The keyword strict mode closes an object with (false: no key but those it names)."""
_OPEN_OBJECT_KEYWORDS = (STRICT_CLOSED_BY, "unevaluatedProperties")
"""Either says for itself what an object does with the keys it does not name: strict leaves it."""


def closed_objects(schema: Mapping) -> dict:
    """A copy of `schema` with each object schema that does not say what it does with other keys
    (_OPEN_OBJECT_KEYWORDS) closed: "additionalProperties": false. What OpenAI's `strict: true` asks
    of a tool's parameters or a response_format's schema: only the keys the schema names, so
    arguments can go straight to a function (an open object let a small model add made-up keys).
    Every schema position is walked (properties, items, prefixItems, anyOf/oneOf/allOf, $defs and
    definitions, additionalProperties and patternProperties' schemas...), but not `not`, whose
    schema is negated: closing it would widen what is allowed. Schemas that describe one object
    together with others stay open (_kept_open): closed alone, each would refuse the others' keys.
    Nothing is added to a schema but that one keyword, so the copy is as large as the schema.
    The caller's schema is not changed."""
    owned = _owned_copy(schema)
    items = [item for item, _ in _schema_parts(owned, skip=("not",))]
    kept_open = _kept_open(owned, items)
    for item in items:
        if id(item) not in kept_open and _closes(item):
            item[STRICT_CLOSED_BY] = False
    return owned


def _owned_copy(schema: Mapping) -> dict:
    """A deep copy of a schema, through its JSON text: as deep as json.dumps takes it, without
    Python's recursion in copy.deepcopy."""
    return _read_back(_json_text(schema))


def _read_back(text: str) -> dict:
    """A schema's JSON text read into a copy of the caller's own."""
    try:
        return json.loads(text)
    except RecursionError:  # read a few frames deeper than the caller's schema was written
        raise ValueError(TOO_DEEP) from None


def _list_of(value) -> list:
    return value if isinstance(value, list) else []


def _is_object_schema(item: Mapping) -> bool:
    """An object schema: its type says so, or it has none and names properties."""
    kind = item.get("type")
    if kind is None:
        return "properties" in item
    return kind == "object" or (isinstance(kind, list) and "object" in kind)


_SAME_OBJECT = ("allOf", "anyOf", "oneOf")
"""Applicators whose schemas describe the very object their holder does (not a part of it)."""
_CONDITIONAL = ("if", "then", "else")
"""Keywords whose schemas describe the holder's object too, under a condition."""
_DEPENDENT = ("dependentSchemas", "dependencies")
"""Keywords mapping a key to a schema the holder's object must match where it has that key."""
_COMPOSED_BY = (*_SAME_OBJECT, "$ref")
"""Keywords that give a holder's keys from other schemas: such a holder is not closed itself."""


def _kept_open(root: dict, items: list) -> set[int]:
    """The ids of the schemas strict must not close, because each describes an object together with
    another schema that may name other keys, and JSON Schema checks additionalProperties against a
    schema's own properties alone (llguidance intersects them the same way): closed, each refuses
    the other's keys, and a required one makes the schema unsatisfiable. A schema composes where
    more than one of these name its object's keys: its own properties (or patternProperties),
    each allOf part, a $ref, anyOf's branches, oneOf's branches; or where it has conditional
    parts (if/then/else, dependentSchemas). Then it, and whatever it reaches by a local $ref or
    through those keywords, stays open, even where another place refers to it plainly. A pure
    union (Optional[Model]'s anyOf [{$ref}, {type null}]) or one allOf part alone (a $ref wrapped
    to carry a description) composes nothing: each branch, or the part, is the whole object."""
    kept: set[int] = set()
    for item in items:
        if _composes(item):
            _keep_open(item, root, kept)
    return kept


def _composes(item: Mapping) -> bool:
    own = "properties" in item or "patternProperties" in item
    describers = (int(own) + len(_list_of(item.get("allOf"))) + int("$ref" in item)
                  + sum(1 for keyword in ("anyOf", "oneOf") if _list_of(item.get(keyword))))
    return describers > 1 or any(keyword in item for keyword in (*_CONDITIONAL, *_DEPENDENT))


def _keep_open(schema, root: dict, kept: set[int]) -> None:
    """Add `schema` and what describes the same object with it (_kept_open) to `kept`; iterative,
    and each schema once, as references may go round (a recursive schema)."""
    pending = [schema]
    while pending:
        item = pending.pop()
        if not isinstance(item, Mapping) or id(item) in kept:
            continue
        kept.add(id(item))
        pending.extend(_referenced(item, root))
        for keyword in _SAME_OBJECT:
            pending.extend(_list_of(item.get(keyword)))
        pending.extend(item.get(keyword) for keyword in _CONDITIONAL)
        for keyword in _DEPENDENT:
            dependent = item.get(keyword)
            if isinstance(dependent, Mapping):  # draft 7's dependencies may map to key lists: skipped above
                pending.extend(dependent.values())


def _referenced(item: Mapping, root: dict) -> list:
    """The schema a local "$ref" ("#", "#/$defs/A", "#/definitions/A/properties/b") points to in
    `root`, as a one-item list; empty where there is none or it points outside the document."""
    ref = item.get("$ref")
    if not isinstance(ref, str) or not ref.startswith("#"):
        return []
    found = _pointed_to(root, ref[1:])
    if found is None and "%" in ref:  # a URI fragment may percent-encode its pointer
        found = _pointed_to(root, unquote(ref[1:]))
    return [] if found is None else [found]


def _pointed_to(root, pointer: str):
    """The value a JSON pointer ("" or "/a/0/b~1c") names in `root`, or None."""
    if pointer == "":
        return root
    if not pointer.startswith("/"):
        return None  # an anchor ("#name"): not followed
    here = root
    for token in pointer[1:].split("/"):
        token = token.replace("~1", "/").replace("~0", "~")  # RFC 6901's order: ~01 is "~1"
        if isinstance(here, Mapping) and token in here:
            here = here[token]
        elif isinstance(here, list) and token.isascii() and token.isdigit() and int(token) < len(here):
            here = here[int(token)]  # ASCII digits only: "¹" is a digit to str.isdigit, not to int()
        else:
            return None
    return here


def _closes(item: Mapping) -> bool:
    """Whether strict closes `item`: an object schema that says nothing of other keys itself and
    whose keys are its own (a $ref's target, allOf's parts or a union's branches give them
    otherwise, and are closed there where they compose nothing: closed here too, with no
    properties of its own, it allowed only {})."""
    if any(keyword in item for keyword in (*_OPEN_OBJECT_KEYWORDS, *_COMPOSED_BY)):
        return False
    return _is_object_schema(item)


def _refuse_what_llguidance_misreads(parts: list[tuple[Mapping, str]]) -> None:
    """ValueError for what llguidance would read otherwise than the schema says: an integer past
    2**53 under a number or value keyword (rounded), or its private "x-guidance" options. `parts`:
    the schema's _schema_parts."""
    for item, path in parts:
        if PRIVATE_OPTIONS in item:
            raise ValueError(f"json schema has \"{PRIVATE_OPTIONS}\" at {path}: it is llguidance's private options "
                             f"key, not a JSON Schema keyword (it would override the server's JSON options: "
                             f"lenient, whitespace); remove it")
        for key, value in item.items():
            if key in _NUMBER_KEYWORDS or key in _VALUE_KEYWORDS:
                _refuse_inexact(value, f"{path}/{key}", key)


def _annotation_format(part: tuple[Mapping, str]) -> bool:
    """Whether a schema part's "format" is a string llguidance does not enforce (ENFORCED_FORMATS):
    an annotation to leave out. A format that is not a string is left for llguidance to word."""
    value = part[0].get("format")
    return isinstance(value, str) and value not in ENFORCED_FORMATS


def _without_annotation_formats(text: str) -> str:
    """The schema's JSON text with each annotation format (_annotation_format) left out. Worked on a
    copy read back from the text: the caller's schema is not changed."""
    owned = _read_back(text)
    for item, _ in [part for part in _schema_parts(owned) if _annotation_format(part)]:
        del item["format"]
    return _json_text(owned)


def _refuse_inexact(value, path: str, keyword: str) -> None:
    """ValueError for an integer past 2**53 in size anywhere in a keyword's value (a const or enum
    value may be an object or array holding one)."""
    pending = [(value, path)]
    while pending:
        item, where = pending.pop()
        if isinstance(item, int) and not isinstance(item, bool) and abs(item) > EXACT_INTEGERS:
            raise ValueError(f"json schema's {keyword} at {where} holds {_short(item)}, an integer larger in size "
                             f"than 2**53 ({EXACT_INTEGERS}): llguidance reads numbers as 64-bit floats and "
                             f"would round it, so the output would not match the schema; use a string "
                             f"(\"type\": \"string\") for such values, or a bound within 2**53")
        if isinstance(item, Mapping):
            pending.extend((part, f"{where}/{name}") for name, part in item.items())
        elif isinstance(item, list):
            pending.extend((part, f"{where}/{i}") for i, part in enumerate(item))


def _choices(choice) -> tuple[str, ...]:
    if isinstance(choice, (str, bytes)) or not isinstance(choice, Sequence) or not choice:
        raise ValueError(f"choice={_short(choice)} must be a non-empty list of strings")
    for i, text in enumerate(choice):
        if not isinstance(text, str) or not text:
            raise ValueError(f"choice[{i}]={_short(text)} must be a non-empty string")
    return tuple(choice)
