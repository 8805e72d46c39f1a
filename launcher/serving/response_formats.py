"""Structured output as the OpenAI API asks for it (`response_format`) and as vLLM's extension does
(`structured_outputs`), made into the engine's StructuredOutput (shardlib/structured_output.py) and
checked by llguidance before anything runs."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from launcher.serving.null_means_default import NullMeansDefault
from shardlib.structured_output import StructuredOutput, closed_objects


class JsonSchemaFormat(NullMeansDefault):
    # the field is schema_ (pydantic's BaseModel has a `schema` method); the wire name, its alias,
    # is the only name taken (populate_by_name let "schema_" through as well)
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None
    """True: each object of the schema that does not say additionalProperties takes no key but those
    it names (shardlib.structured_output.closed_objects), as OpenAI's strict mode generates; the
    schema is enforced token by token either way."""


class ResponseFormat(NullMeansDefault):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(NullMeansDefault):
    """vLLM's extension, its fields as vLLM names them (grammar: in the Lark syntax llguidance reads)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's options beside them (its StructuredOutputsParams), taken here to be answered by name
    # (extra="forbid" gave them a bare "unknown parameter"): see STRUCTURED_OUTPUT_OPTIONS
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: Any = None
    structural_tag: Any = None


STRUCTURED_OUTPUT_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
                             "structural_tag")
"""vLLM's structured_outputs fields that are options, not a constraint. JSON is generated here with
one space after each `:` and `,` and no other whitespace (workers/structured/grammars.JSON_OPTIONS):
one of the texts vLLM's default, disable_any_whitespace false (any whitespace between tokens),
allows, so false is taken; true asks for no whitespace at all (`{"a":1}`: llguidance's separators
without whitespace_flexible, which this server's grammar refuses), so it is refused, as are the
others (_refused_option)."""


def _refused_option(options: StructuredOutputs) -> tuple[str, str] | None:
    """(param, why) for a vLLM option this server does not implement, or None."""
    if options.disable_any_whitespace:
        return ("structured_outputs.disable_any_whitespace", "structured_outputs.disable_any_whitespace true (JSON "
                "without any whitespace, {\"a\":1,\"b\":2}) is not supported here: JSON is generated with one space "
                "after each `:` and `,` and no other whitespace ({\"a\": 1, \"b\": 2}); leave it out or false")
    if options.whitespace_pattern is not None:
        return ("structured_outputs.whitespace_pattern", "structured_outputs.whitespace_pattern is not supported "
                "here: JSON is generated without free whitespace (one space after each `:` and `,`); leave it out")
    if options.structural_tag is not None:
        return ("structured_outputs.structural_tag", "structured_outputs.structural_tag is not supported here; "
                "leave it out, and constrain the whole output with json, regex, choice or grammar (or send tools)")
    if options.disable_additional_properties:
        return ("structured_outputs.disable_additional_properties", "structured_outputs.disable_additional_properties "
                "is not supported here: an object in the schema takes the keys it does not name unless it says "
                "\"additionalProperties\": false; write that into the schema's objects, and leave this out")
    return None


def requested_structure(response_format: ResponseFormat | None,
                        structured_outputs: StructuredOutputs | None) -> StructuredOutput | None:
    """The StructuredOutput a request asks for (None: plain text); ProtocolError naming the field
    and what is wrong with it, llguidance's reason included when it cannot compile the grammar."""
    from launcher.serving.openai_protocol import ProtocolError
    from workers.structured.grammars import grammar_problem

    if response_format is not None and response_format.type != "text" and structured_outputs is not None:
        raise ProtocolError("response_format and structured_outputs both ask for structured output; send one of "
                            "them", param="structured_outputs")
    if structured_outputs is not None:
        refused = _refused_option(structured_outputs)
        if refused is not None:
            raise ProtocolError(refused[1], param=refused[0])
        # by its wire names (json, not json_): StructuredOutput's own fields
        given = {name: value for name, value in structured_outputs.model_dump(by_alias=True, exclude_none=True,
                                                                              exclude=set(STRUCTURED_OUTPUT_OPTIONS))
                 .items() if value is not False}
        param = f"structured_outputs.{next(iter(given))}" if len(given) == 1 else "structured_outputs"
        try:
            spec = StructuredOutput(**given)
        except ValueError as err:
            raise ProtocolError(f"{param}: {err}", param=param) from None
    elif response_format is None or response_format.type == "text":
        if response_format is not None and response_format.json_schema is not None:
            raise ProtocolError("response_format.json_schema is only taken with type \"json_schema\"",
                                param="response_format.json_schema")
        return None
    else:
        spec, param = _openai_format(response_format)
    problem = grammar_problem(spec)
    if problem is not None:
        raise ProtocolError(f"{param} cannot be used for structured output: {problem}", param=param)
    return spec


def _openai_format(response_format: ResponseFormat) -> tuple[StructuredOutput, str]:
    from launcher.serving.openai_protocol import ProtocolError

    described = response_format.json_schema
    if response_format.type == "json_object":
        if described is not None:
            raise ProtocolError("response_format.json_schema is only taken with type \"json_schema\"; with "
                                "\"json_object\" any JSON object is generated", param="response_format.json_schema")
        return StructuredOutput(json_object=True), "response_format"
    if described is None:
        raise ProtocolError("response_format.json_schema is required with type \"json_schema\": {\"name\": ..., "
                            "\"schema\": {...}}", param="response_format.json_schema")
    if described.schema_ is None:
        raise ProtocolError("response_format.json_schema.schema is required: the JSON schema the output must "
                            "match (for any JSON object send {\"type\": \"json_object\"})",
                            param="response_format.json_schema.schema")
    param = "response_format.json_schema.schema"
    try:
        schema = closed_objects(described.schema_) if described.strict else described.schema_
        return StructuredOutput(json=schema), param
    except ValueError as err:
        raise ProtocolError(f"{param}: {err}", param=param) from None
