"""The JSON value of a qwen3_coder parameter (launcher/serving/qwen3_coder_calls.py): the model writes
every value as bare text, and the request's tool schema says what it was meant to be, as vLLM 0.32
converts it (tool_parsers/utils.py's extract_types_from_schema and coerce_to_schema_type, used by
its parser engine's type correction):

- the types a parameter's schema names: its "type" (a name or a list), the kinds of its "enum"
  values, and those of its anyOf/oneOf/allOf branches; a schema or branch naming none: "string". Common aliases ("int",
  "float", "bool", "str", "list", "dict", ...) count as the JSON Schema names.
- tried in the order null ("null" in any case), integer (Python's int()), number (a finite float,
  written as an integer when it is whole), boolean ("true"/"1", "false"/"0", any case, spaces
  around), object and array (any JSON value the text is); string: the text as written.
- none of those fitting (or only unknown types named): the JSON value the text is, else the text.
- a parameter the call's tool does not describe (no such tool, no "properties", a key not in them,
  a schema that is not an object) stays text.

JSON that nests past call_json.MAX_DEPTH, or holds a number no JSON can write (1e999, NaN), is no
value here (the text is kept), as vLLM keeps the text where the value is not finite.
"""

from __future__ import annotations

import json
import math

from launcher.serving.call_json import too_deep

_ALIASES = {
    "str": "string", "text": "string", "varchar": "string", "char": "string", "enum": "string",
    "int": "integer", "int32": "integer", "int64": "integer", "uint": "integer", "uint32": "integer",
    "uint64": "integer", "long": "integer", "short": "integer", "unsigned": "integer",
    "float": "number", "float32": "number", "float64": "number", "double": "number",
    "bool": "boolean", "dict": "object", "arr": "array", "list": "array", "sequence": "array",
}
"""Type names models' tool schemas use for the JSON Schema ones (vLLM's _TYPE_ALIASES)."""

_TRIED_BEFORE_STRING = ("null", "integer", "number", "boolean", "object", "array")
"""The types tried, in vLLM's order, before "string" keeps the text."""

_NOT_JSON = object()


def schema_types(schema: object) -> set[str]:
    """The type names `schema` allows (the module's doc), lower-cased and aliases resolved. As vLLM's
    recursion reads it, a schema or branch naming no type (and having no branches) allows "string".
    Walked with a stack of its own: a schema may nest its branches past Python's recursion limit."""
    types: set[str] = set()
    pending = [schema]
    while pending:
        item = pending.pop()
        own: set[str] = set()
        branches = []
        if isinstance(item, dict):
            named = item.get("type")
            own.update(t for t in (named if isinstance(named, list) else [named]) if isinstance(t, str))
            if isinstance(item.get("enum"), list):
                own.update(kind for kind in map(_json_type, item["enum"]) if kind is not None)
            for key in ("anyOf", "oneOf", "allOf"):
                if isinstance(item.get(key), list):
                    branches += item[key]
        types |= own if own or branches else {"string"}
        pending += branches
    return {_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in types}


def _json_type(value: object) -> str | None:
    """The JSON Schema type of an enum value (bool before int: True is an int in Python)."""
    for kind, name in ((type(None), "null"), (bool, "boolean"), (int, "integer"), (float, "number"),
                       (str, "string"), (list, "array"), (dict, "object")):
        if isinstance(value, kind):
            return name
    return None


def _json_or_not(text: str) -> object:
    """The JSON value the text is, _NOT_JSON where there is none JSON can write back (bad JSON, an
    integer past Python's digit limit, nesting past MAX_DEPTH, a number no JSON writes)."""
    if too_deep(text):
        return _NOT_JSON
    try:
        value = json.loads(text)
        json.dumps(value, allow_nan=False)  # inf or NaN anywhere in it: no JSON value (vLLM's check)
    except (ValueError, RecursionError):
        return _NOT_JSON
    return value


def _as(kind: str, text: str) -> object:
    """The text as a value of one type, _NOT_JSON where it is not one (vLLM's coerce_to_schema_type)."""
    if kind == "null":
        return None if text.lower() == "null" else _NOT_JSON
    if kind == "integer":
        try:
            return int(text)
        except ValueError:
            return _NOT_JSON
    if kind == "number":
        try:
            number = float(text)
        except ValueError:
            return _NOT_JSON
        if not math.isfinite(number):
            return _NOT_JSON
        return int(number) if number == int(number) else number
    if kind == "boolean":
        return {"true": True, "1": True, "false": False, "0": False}.get(text.strip().lower(), _NOT_JSON)
    return _json_or_not(text)  # object, array: any JSON value, as vLLM takes it


def coerced(text: str, types: set[str]) -> object:
    """A parameter's text as the first of `types` it reads as (the module's doc)."""
    for kind in _TRIED_BEFORE_STRING:
        if kind in types and (value := _as(kind, text)) is not _NOT_JSON:
            return value
    if "string" in types:
        return text
    value = _json_or_not(text)
    return text if value is _NOT_JSON else value


class ToolSchemas:
    """The request's tools (as the chat template takes them) by name: each parameter's schema."""

    def __init__(self, tools: list[dict] | None):
        self._by_name: dict[str, dict] = {}
        for tool in tools or []:
            function = tool.get("function") or {}
            parameters = function.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            self._by_name.setdefault(function.get("name"), properties if isinstance(properties, dict) else {})

    def properties(self, name: str) -> dict:
        """The parameters' schemas of the tool named `name` ({} for a tool not sent)."""
        return self._by_name.get(name, {})

    @staticmethod
    def stays_text(schema: object) -> bool:
        """Whether any text is a value of this parameter as written (it can stream as it comes)."""
        if not isinstance(schema, dict):
            return True
        types = schema_types(schema)
        return "string" in types and not types.intersection(_TRIED_BEFORE_STRING)

    @staticmethod
    def value(text: str, schema: object) -> object:
        """The parameter's value: its text converted to the type its schema names (the module's doc)."""
        return coerced(text, schema_types(schema)) if isinstance(schema, dict) else text
