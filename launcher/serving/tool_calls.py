"""Function calling on /v1/chat/completions, as vLLM's server does it: the request's `tools` and
`tool_choice` checked; "none" (tools only shown to the chat template) and the forced kinds, a named
function or "required", whose output is constrained by a JSON schema through the structured-output
machinery and read back as tool calls; "auto" (the default with tools) needs a parser for the model's
own call format in its free text: taken on a server started with one (`--tool-call-parser hermes`,
`llama3_json`, `mistral`, `pythonic` or `qwen3_coder`: PARSER_READERS), refused otherwise, as vLLM
refuses it.
The conversation's own tool calls and tool results are checked and handed to the chat template as
vLLM hands them (each call's `arguments` JSON text parsed into an object).

Pure, as openai_protocol.py is: the request model calls check_tool_request, the app's ChatRender reads
each choice's text through a ToolCallReader.
"""

from __future__ import annotations

import importlib
import json
import re
import uuid
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from launcher.serving import openai_protocol as proto
from launcher.serving.call_json import is_text, loads_or_none, shape_or_none
from launcher.serving.null_means_default import NullMeansDefault
from shardlib.structured_output import StructuredOutput, closed_objects

FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"
"""OpenAI's rule for a function's name."""
_CHOICE_EXAMPLE = '{"type": "function", "function": {"name": "my_function"}}'


PARSER_READERS = {
    "hermes": ("launcher.serving.hermes_calls", "HermesCallReader"),
    "llama3_json": ("launcher.serving.llama_calls", "Llama3JsonCallReader"),
    "mistral": ("launcher.serving.mistral_calls", "MistralCallReader"),
    "pythonic": ("launcher.serving.pythonic_calls", "PythonicCallReader"),
    "qwen3_coder": ("launcher.serving.qwen3_coder_calls", "Qwen3CoderCallReader"),
}
"""Each tool-call parser's reader (module, class), by its name (server_settings.TOOL_CALL_PARSERS).
Imported when a request needs one: the readers import this module. A reader whose class says
`needs_tools` is also given the request's tools (qwen3_coder's values take their schemas' types)."""

PARSER_CALL_IDS = {
    "mistral": ("launcher.serving.mistral_calls", "new_mistral_call_id"),
}
"""The id maker (module, function) of each parser whose model's chat template checks the form of the
call ids sent back to it (Mistral's refuses any id but 9 letters and digits): a forced call on such
a server gets its ids too, as "auto" does. A parser not named here: new_call_id."""


def _auto_refused(by_default: bool) -> str:
    from launcher.serving.server_settings import TOOL_CALL_PARSERS, described

    default = " (the default with tools)" if by_default else ""
    return (f"tool_choice \"auto\"{default} is not supported by this server: it was started without a tool-call "
            f"parser to find calls in the model's free text (vLLM refuses it likewise without "
            f"--enable-auto-tool-choice); start it with `--tool-call-parser NAME` (builder argument "
            f"tool_call_parser) naming the format the model writes its calls in ({described(TOOL_CALL_PARSERS)}), "
            f"or send tool_choice \"required\" (the model must call one or more of the tools) or {_CHOICE_EXAMPLE} "
            f"(it must call that function), or \"none\" (tools shown to the model, text out)")


# ---- the request's tools -----------------------------------------------------------------------
class FunctionDefinition(NullMeansDefault):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict | None = None
    """A JSON schema of the arguments (an object's); none: any JSON object."""
    strict: bool | None = None
    """True: a forced call's arguments take no key but those the schema's objects name, unless an
    object says additionalProperties itself (shardlib.structured_output.closed_objects), as OpenAI's
    strict mode generates; they match the schema token by token either way."""


class Tool(NullMeansDefault):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: str = "function"
    """Left out, "function" (vLLM's default); any other kind is refused."""
    function: FunctionDefinition

    def template_form(self) -> dict:
        """The tool as chat templates take it (`tools=` of apply_chat_template): OpenAI's own shape."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


_TOOL_RULES = {
    "type": "\"function\" (the only kind of tool)",
    "function": "an object {\"name\", \"description\", \"parameters\", \"strict\"}",
    "function.name": "a string of 1 to 64 letters, digits, _ or -",
    "function.description": "a string",
    "function.parameters": "a JSON schema (an object)",
    "function.strict": "true or false (true: the parameters' objects take no keys but those they name, unless "
                       "they say additionalProperties)",
}


def _parse_tools(raw: list) -> list[Tool]:
    """`tools` as Tool models; ProtocolError naming the first bad field, e.g. tools.2.function.name."""
    if not raw:
        raise proto.ProtocolError("tools must not be an empty list (as vLLM and OpenAI refuse it): send at least one "
                                  "tool, or leave tools out", param="tools")
    if len(raw) > proto.MAX_TOOLS:
        raise proto.ProtocolError(f"tools has {len(raw)} tools; at most {proto.MAX_TOOLS} are allowed", param="tools")
    tools = []
    for i, item in enumerate(raw):
        try:
            tools.append(Tool.model_validate(item))
        except ValidationError as err:
            raise _nested_error(err.errors()[0], f"tools.{i}", _TOOL_RULES,
                                "a tool, {\"type\": \"function\", \"function\": {\"name\": ...}}") from None
        if tools[-1].type != "function":
            raise proto.ProtocolError(f"tools.{i}.type ({proto._short(tools[-1].type)}) must be {_TOOL_RULES['type']}",
                                      param=f"tools.{i}.type")
    names = [tool.function.name for tool in tools]
    for i, name in enumerate(names):
        if name in names[:i]:  # a call would not say which of the two it meant
            raise proto.ProtocolError(f"tools.{i}.function.name ({name!r}) is the name of tools.{names.index(name)} "
                                      f"too; each tool needs its own name", param=f"tools.{i}.function.name")
    proto.check_utf8(json.dumps([tool.template_form() for tool in tools], ensure_ascii=False), "tools")
    return tools


def template_tools(raw: list) -> list[dict]:
    """`tools` checked, as the chat template takes them (/tokenize's chat form: no call is made)."""
    return [tool.template_form() for tool in _parse_tools(raw)]


def _nested_error(error: dict, where: str, rules: dict, whole: str) -> proto.ProtocolError:
    """A pydantic error inside one list item (a tool, a message's tool call) named by its path."""
    loc = [str(part) for part in error["loc"] if str(part) not in proto._UNION_BRANCH_TAGS]
    inner = ".".join(loc)
    param = f"{where}.{inner}" if inner else where
    if not loc:
        return proto.ProtocolError(f"{where} ({proto._short(error.get('input'))}) must be {whole}", param=where)
    if error["type"] == "extra_forbidden":
        holder = ".".join([where, *loc[:-1]])
        return proto.ProtocolError(f"unknown key {proto.clip(loc[-1])!r} in {holder}; it must be "
                                   f"{rules.get('.'.join(loc[:-1]), whole)}", param=proto.clip(param))
    rule = rules.get(inner, whole)
    if error["type"] == "missing":
        return proto.ProtocolError(f"{param} is required: {rule}", param=param)
    return proto.ProtocolError(f"{param} ({proto._short(error.get('input'))}) must be {rule}", param=param)


# ---- tool_choice -------------------------------------------------------------------------------
class _NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str


class _NamedToolChoice(NullMeansDefault):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: str = "function"
    function: _NamedFunction


@dataclass(frozen=True)
class ToolUse:
    """What a chat request asks of its tools, checked."""

    tools: list[dict] = field(default_factory=list)
    """The tools as the chat template takes them (empty: none sent)."""
    forced: str | None = None
    """"required", or the name of the one function a named tool_choice forces; None: no call is made
    ("none", or no tools)."""
    structure: StructuredOutput | None = None
    """The output's JSON schema when a call is forced."""
    parser: str | None = None
    """tool_choice "auto": the format the server reads calls from the free text in (a PARSER_READERS name)."""
    parallel_tool_calls: bool = True
    """False: "auto" keeps the first call it reads (vLLM's rule; "required" asks for one call)."""
    id_parser: str | None = None
    """A forced call: the server's tool-call parser, whose ids the calls get (PARSER_CALL_IDS)."""

    def reader(self):
        """A fresh reader of one choice's text as tool calls (a ToolCallReader, or for "auto" the
        parser's reader, which has the same interface), None when the text is only text."""
        if self.parser is not None:
            reader_class = _imported(PARSER_READERS[self.parser])
            if reader_class.needs_tools:
                return reader_class(self.parallel_tool_calls, tools=self.tools)
            return reader_class(self.parallel_tool_calls)
        return None if self.forced is None else ToolCallReader(self.forced, call_id_maker(self.id_parser))


def call_id_maker(parser: str | None):
    """The function that makes a new call id on a server with this tool-call parser (PARSER_CALL_IDS;
    new_call_id for any other, or none)."""
    return _imported(PARSER_CALL_IDS[parser]) if parser in PARSER_CALL_IDS else new_call_id


def _imported(entry: tuple[str, str]):
    """A (module, name) of the tables above, imported when called: the parsers' modules import this one."""
    module, name = entry
    return getattr(importlib.import_module(module), name)


def check_tool_request(request, tool_call_parser: str | None = None) -> ToolUse:
    """The request's tools, tool_choice and parallel_tool_calls checked (vLLM's rules), as a ToolUse;
    ProtocolError naming the field. Called once the request's own structured output is known
    (request._structure): a forced call cannot be combined with it, "auto" can (vLLM allows it).
    tool_call_parser: the server's (server_settings.TOOL_CALL_PARSERS); None: "auto" is refused."""
    tools = _parse_tools(request.tools) if request.tools is not None else []
    choice = request.tool_choice
    if choice is None:  # vLLM's default: "auto" with tools, "none" without
        choice, default = ("auto" if tools else "none"), True
    else:
        default = False
    if choice == "none":
        return ToolUse([tool.template_form() for tool in tools])
    if not tools:
        raise proto.ProtocolError(f"tool_choice ({proto._short(choice)}) needs tools: send the functions the model may "
                                  f"call as tools, or leave tool_choice out", param="tool_choice")
    if choice == "auto":
        if tool_call_parser is None:
            raise proto.ProtocolError(_auto_refused(default), param="tool_choice")
        return ToolUse([tool.template_form() for tool in tools], parser=tool_call_parser,
                       parallel_tool_calls=request.parallel_tool_calls)
    if isinstance(choice, str) and choice != "required":
        raise proto.ProtocolError(f"tool_choice ({proto._short(choice)}) must be {proto.FIELD_RULES['tool_choice']}",
                                  param="tool_choice")
    if request._structure is not None:  # two schemas for one output
        raise proto.ProtocolError(f"tool_choice ({proto._short(choice)}) constrains the output to tool calls, and "
                                  f"{request.structure_param()} asks for a structured output too; send one of them",
                                  param="tool_choice")
    if choice == "required":
        forced, structure = "required", _required_structure(tools, request.parallel_tool_calls)
    else:
        forced = _named(choice, tools)
        index = next(i for i, tool in enumerate(tools) if tool.function.name == forced)
        where = f"tools.{index}.function.parameters"
        structure = _checked_structure(named_schema(tools[index], where), where)
    return ToolUse([tool.template_form() for tool in tools], forced, structure, id_parser=tool_call_parser)


def _required_structure(tools: list[Tool], parallel_tool_calls: bool) -> StructuredOutput:
    """required_schema's StructuredOutput, checked; where llguidance cannot read it, the tool it
    cannot read is named (each checked alone only then: 128 tools took 48 ms of the event loop)."""
    try:
        return _checked_structure(required_schema(tools, parallel_tool_calls), "tools")
    except proto.ProtocolError:
        for i, tool in enumerate(tools):
            where = f"tools.{i}.function.parameters"
            _checked_structure(named_schema(tool, where), where)
        raise


def _named(choice: dict, tools: list[Tool]) -> str:
    """The function a named tool_choice names, one of `tools`. Its type is checked first: another
    kind of choice (OpenAI's "allowed_tools", "custom") has no "function", and saying that it must
    have one sent the client the wrong way."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    if isinstance(kind, str) and kind != "function":
        raise proto.ProtocolError(_other_choice_type(kind), param="tool_choice.type")
    try:
        named = _NamedToolChoice.model_validate(choice)
    except ValidationError as err:
        raise _nested_error(err.errors()[0], "tool_choice", {"function.name": "a string, one of the tools' names"},
                            _CHOICE_EXAMPLE) from None
    if named.type != "function":
        raise proto.ProtocolError(f"tool_choice.type ({proto._short(named.type)}) must be \"function\"",
                                  param="tool_choice.type")
    names = [tool.function.name for tool in tools]
    if named.function.name not in names:
        raise proto.ProtocolError(f"tool_choice.function.name ({proto._short(named.function.name)}) names no function "
                                  f"of tools; it must be one of {proto._short(names)}",
                                  param="tool_choice.function.name")
    return named.function.name


def _other_choice_type(kind: str) -> str:
    """The refusal of a tool_choice object of another type than "function", with what to send."""
    instead = (" (to allow only some of the tools, send only those as tools, with tool_choice \"auto\" or "
               "\"required\")" if kind == "allowed_tools" else "")
    return (f"tool_choice.type ({proto._short(kind)}) must be \"function\": this server forces a call by "
            f"name only, {_CHOICE_EXAMPLE}; or send tool_choice \"required\" (a call of any of the tools), "
            f"\"auto\" or \"none\"{instead}")


def _parameters_or_any_object(parameters: dict | None) -> dict:
    """A function without parameters (or with an empty schema) still takes a JSON object, as vLLM's."""
    return parameters if parameters else {"type": "object", "properties": {}}


def named_schema(tool: Tool, where: str) -> dict:
    """The schema of a forced call's arguments (a named tool_choice's output, a "required" call's
    "parameters"): the function's parameters (any object without), closed by `strict: true`
    (closed_objects); `where` names the parameters in a 400."""
    parameters = _parameters_or_any_object(tool.function.parameters)
    if not tool.function.strict:
        return parameters
    try:
        return closed_objects(parameters)
    except ValueError as err:  # a schema nested past what can be copied: named as the grammar's check names it
        raise proto.ProtocolError(f"{where}: {err}", param=where) from None


def required_schema(tools: list[Tool], parallel_tool_calls: bool = True) -> dict:
    """The output schema of tool_choice "required", as vLLM builds it: a JSON array of at least one
    {"name": <a tool's name>, "parameters": <its arguments>} (at most one without parallel calls).
    Each tool's `$defs` (and draft 7's `definitions`) move to the array's root, where their references
    now point; a reference to the tool's own root is refused (_refuse_root_references).
    One difference: no key but those two is allowed in a call (vLLM's schema allows any, which its
    reading ignores; a small model filled its whole budget with made-up keys after the parameters)."""
    items, defs, owners = [], {}, {}
    for i, tool in enumerate(tools):
        parameters = dict(named_schema(tool, f"tools.{i}.function.parameters"))
        _refuse_root_references(parameters, f"tools.{i}.function.parameters")
        for section in _DEFINITIONS:
            own = parameters.pop(section, {})
            if not isinstance(own, dict):
                raise proto.ProtocolError(f"tools.{i}.function.parameters.{section} must be an object (of named "
                                          f"schemas)", param=f"tools.{i}.function.parameters")
            for name, schema in own.items():
                held = defs.setdefault(section, {})
                if name in held and held[name] != schema:
                    raise proto.ProtocolError(_shared_definition_clash(tools, owners[section, name], i, section, name),
                                              param=f"tools.{i}.function.parameters")
                held[name] = schema
                owners.setdefault((section, name), i)
        items.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                     "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    schema.update(defs)
    return schema


_DEFINITIONS = ("$defs", "definitions")
"""Where a schema keeps its named parts (draft 2019+ and draft 7): moved to the array's root."""


def _shared_definition_clash(tools: list[Tool], first: int, later: int, section: str, name: str) -> str:
    """The refusal of two tools' definitions of one name that differ in the "required" schema.
    Where they were sent alike, strict (closed_objects) made them differ: said so, as a client sees
    two identical definitions and would not know what to rename."""
    sent_apart = _sent_differently(tools[first], tools[later], section, name)
    if sent_apart is not None:  # this one, or one it refers to (a definition met later)
        section, name = sent_apart
        return (f"tools.{later}.function.parameters.{section}.{name} differs from tools.{first}'s {section}.{name}; "
                f"the tools' definitions share one namespace here, so give them different names")
    where = f"tools.{later}.function.parameters.{section}.{name}"
    strict = [bool(tools[i].function.strict) for i in (first, later)]
    if strict[0] != strict[1]:
        closing, open_one = (first, later) if strict[0] else (later, first)
        return (f"{where}: strict: true closes it in tools.{closing} but not in tools.{open_one}; give them "
                f"different names, or make both tools strict or neither")
    return (f"{where}: strict: true closes it in one of tools.{first} and tools.{later} and leaves it open in the "
            f"other, which uses it beside other keys of the same object (an allOf part, a $ref beside "
            f"properties, a branch of an object with properties of its own); give them different names")


def _sent_differently(one: Tool, other: Tool, section: str, name: str) -> tuple[str, str] | None:
    """(section, name) of a definition both tools send under one name but not alike: this one
    first, then any other (the one met first may differ only by what strict did to a definition it
    refers to, which differs as sent); None where every shared one was sent alike."""
    if _sent_definition(one, section, name) != _sent_definition(other, section, name):
        return section, name
    for shared_section in _DEFINITIONS:
        mine = (one.function.parameters or {}).get(shared_section)
        theirs = (other.function.parameters or {}).get(shared_section)
        if not isinstance(mine, dict) or not isinstance(theirs, dict):
            continue
        for shared in mine.keys() & theirs.keys():
            if mine[shared] != theirs[shared]:
                return shared_section, shared
    return None


def _sent_definition(tool: Tool, section: str, name: str):
    """A tool's named definition as the client sent it (before strict closed it)."""
    parameters = tool.function.parameters or {}
    named = parameters.get(section)
    return named.get(name) if isinstance(named, dict) else None


def _refuse_root_references(parameters: dict, where: str) -> None:
    """ProtocolError for a $ref into the tool's own root other than its named parts ("#", a
    recursive schema, or "#/properties/..."): in the "required" schema the root is the array of
    calls, so such a reference would point somewhere else (a named tool_choice keeps it as is)."""
    pending = [parameters]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if isinstance(ref, str) and ref.startswith("#") and not ref.startswith(
                    tuple(f"#/{section}/" for section in _DEFINITIONS)):
                raise proto.ProtocolError(f"{where} refers to its own root ($ref {proto.clip(ref)!r}), which "
                                          f"tool_choice \"required\" cannot keep (its schema's root is "
                                          f"the array of calls): move the part into $defs, or name the "
                                          f"function in tool_choice", param=where)
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)


def _checked_structure(schema: dict, param: str) -> StructuredOutput:
    """The schema as the engine's StructuredOutput, checked by llguidance now (a 400 naming `param`)."""
    from workers.structured.grammars import grammar_problem

    try:
        spec = StructuredOutput(json=schema)
    except ValueError as err:
        raise proto.ProtocolError(f"{param}: {err}", param=param) from None
    problem = grammar_problem(spec)
    if problem is not None:
        raise proto.ProtocolError(f"{param} cannot be used to constrain a tool call: {problem}", param=param)
    return spec


# ---- the conversation's tool calls and tool results ---------------------------------------------
class _CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: str


class _MessageToolCall(NullMeansDefault):
    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    type: str = "function"
    function: _CalledFunction


_CALL_RULES = {
    "id": "a string (the id a tool message's tool_call_id answers)",
    "type": "\"function\"",
    "function": "an object {\"name\", \"arguments\"}",
    "function.name": "a string",
    "function.arguments": "a string: the call's arguments as JSON text (an object)",
}


def template_tool_calls(calls: list, index: int) -> list[dict]:
    """An assistant message's tool_calls as chat templates take them (vLLM's form): each call's
    arguments parsed from JSON text into an object ({} for text that encodes none, as vLLM reads
    it). ProtocolError naming messages.N.tool_calls.M... where a call itself is malformed."""
    out = []
    for j, item in enumerate(calls):
        where = f"messages.{index}.tool_calls.{j}"
        try:
            call = _MessageToolCall.model_validate(item)
        except ValidationError as err:
            raise _nested_error(err.errors()[0], where, _CALL_RULES,
                                "a tool call, {\"id\", \"type\": \"function\", \"function\": {\"name\", "
                                "\"arguments\"}}") from None
        if call.type != "function":
            raise proto.ProtocolError(f"{where}.type ({proto._short(call.type)}) must be \"function\"",
                                      param=f"{where}.type")
        proto.check_utf8(call.id, f"{where}.id")
        proto.check_utf8(call.function.name, f"{where}.function.name")
        out.append({"id": call.id, "type": "function",
                    "function": {"name": call.function.name,
                                 "arguments": _arguments_object(call.function.arguments)}})
    return out


def _arguments_object(arguments: str) -> dict:
    """A call's arguments text as the object it encodes, {} where it encodes none ("", text that is not
    JSON, JSON that is no object, and what no call's JSON is here: NaN or a number beyond a double's
    range, an integer past Python's digit limit, nesting past call_json.MAX_DEPTH), as vLLM reads
    them: such text lives in the conversation's history (a call cut short by max_tokens comes back so
    from this server too), and refusing it would refuse every later turn of the conversation. A lone
    surrogate escape in a string ("\\ud83d", which this server's own answers write back escaped:
    call_json) reaches the template as that escape's text, as no UTF-8 prompt can carry the
    character itself."""
    parsed = loads_or_none(arguments)
    return _surrogates_as_escapes(parsed) if isinstance(parsed, dict) else {}


_SURROGATE = re.compile("[\ud800-\udfff]")
"""A lone surrogate in a decoded str (json's decoder joins a written pair into one character)."""


def _surrogates_as_escapes(value: object) -> object:
    """The decoded value with each lone surrogate in its strings and keys written as its JSON escape
    text (\\ud83d). Walked with a stack of its own (loads_or_none caps the nesting at MAX_DEPTH)."""
    def escaped(text: str) -> str:
        return _SURROGATE.sub(lambda found: f"\\u{ord(found.group()):04x}", text) if not is_text(text) else text

    root = [value]
    pending = [(root, 0)]
    while pending:
        holder, key = pending.pop()
        item = holder[key]
        if isinstance(item, str):
            holder[key] = escaped(item)
        elif isinstance(item, dict):
            holder[key] = item = {escaped(k): inner for k, inner in item.items()}
            pending.extend((item, k) for k in item)
        elif isinstance(item, list):
            pending.extend((item, i) for i in range(len(item)))
    return root[0]


def control_token_key(value, path: str, control: re.Pattern) -> tuple[str, str] | None:
    """(path, key) of the first object key inside `value` (tools, a call's parsed arguments) that holds
    a control token: chat templates write keys unmarked (transformers' sanitizing marks string
    values only), so such a key would reach the model as a real control token, a forged turn.
    Walked with a stack of its own: a schema may nest deeper than Python's recursion limit."""
    pending = [(value, path)]
    while pending:
        item, where = pending.pop()
        if isinstance(item, dict):
            for key, inner in item.items():
                if isinstance(key, str) and control.search(key):
                    return where, key
                pending.append((inner, f"{where}.{key}"))
        elif isinstance(item, list):
            pending.extend((inner, f"{where}.{i}") for i, inner in enumerate(item))
    return None


# ---- the generated text as tool calls ----------------------------------------------------------
def new_call_id() -> str:
    """vLLM's default tool call id: "chatcmpl-tool-" and 16 random hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().int & (2 ** 64 - 1):016x}"


def tool_call(name: str, arguments: str, index: int | None = None, call_id: str | None = None) -> dict:
    """One tool_calls entry with a new id (new_call_id's, unless `call_id` is given: a parser whose
    model's chat template checks the ids' form makes its own); `index` for a streamed one (its place
    among the choice's)."""
    call = {"id": call_id or new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
    return call if index is None else {"index": index, **call}


class SentCalls:
    """The calls a stream has sent: each call's first entry (its id, type, name and first piece of
    arguments) and its arguments as the pieces sent, joined only when read (appending to one string
    copied a long argument at every piece)."""

    def __init__(self) -> None:
        self._first: list[dict] = []
        self._pieces: list[list[str]] = []

    def __len__(self) -> int:
        return len(self._first)

    def record(self, entry: dict) -> None:
        """A streamed entry: a new call (it has an id), or more arguments of the call at its index."""
        if "id" in entry:
            self._first.append({**entry, "function": dict(entry["function"])})
            self._pieces.append([entry["function"]["arguments"]])
        else:
            self._pieces[entry["index"]].append(entry["function"]["arguments"])

    def calls(self) -> list[dict]:
        """Each sent call as its first entry with the arguments sent so far."""
        return [{**call, "function": {"name": call["function"]["name"], "arguments": "".join(pieces)}}
                for call, pieces in zip(self._first, self._pieces)]


def required_calls(text: str, make_id=new_call_id) -> list[dict]:
    """The calls a "required" choice's text holds: none when it is not one whole JSON array (cut
    short by max_tokens or a stop string, as vLLM reads it, or holding what no call's JSON is here:
    NaN or a number beyond a double's range, nesting past call_json.MAX_DEPTH); else the calls the
    stream sends fed the whole text (launcher/serving/required_calls_stream.py), each call's
    arguments its "parameters" text as the model wrote it, so the whole answer and the stream say the
    same. An integer of any length is kept as written (Python's decoder refused one past 4300
    digits, which the output's grammar allows: the call was lost, though the stream had sent it).
    vLLM writes the arguments back with json.dumps: the same JSON, spaced as json.dumps spaces it.
    make_id: a new call's id."""
    from launcher.serving.required_calls_stream import RequiredCallsStream  # it imports this module

    if not isinstance(shape_or_none(text), list):
        return []
    stream = RequiredCallsStream(make_id=make_id)
    stream.feed(text)
    return stream.sent


class ToolCallReader:
    """One choice's generated text read as tool calls, streamed (delta) or whole (push, then message).

    Named function: the text is the call's arguments; streamed as it comes (the first piece carries
    the call's id, type and name, the later ones only arguments, as vLLM streams them). "required":
    the text is a JSON array of calls, read once it is whole; streamed, each call goes out once its
    name is known and its arguments as they are written (launcher/serving/required_calls_stream.py).
    make_id: a new call's id, whole and streamed (call_id_maker: the server's parser's form)."""

    def __init__(self, forced: str, make_id=new_call_id):
        self.forced, self.text, self._make_id = forced, [], make_id
        self._named_id: str | None = None
        self._calls: list[dict] | None = None
        self._required_stream = None
        """Streamed "required": the RequiredCallsStream reading it (made at the first delta)."""

    def delta(self, text: str, finished: bool) -> dict:
        """The chunk's delta for this piece of the text: {"tool_calls": [...]}, or {}."""
        self.text.append(text)
        if self.forced == "required":
            if self._required_stream is None:
                from launcher.serving.required_calls_stream import RequiredCallsStream  # it imports this module

                self._required_stream = RequiredCallsStream(make_id=self._make_id)
            pieces = self._required_stream.feed(text)
        else:
            pieces = self._named_pieces(text)
        return {"tool_calls": pieces} if pieces else {}

    def push(self, text: str, finished: bool) -> list:
        """Keep a piece of a text read whole (message, once it has all come)."""
        self.text.append(text)
        return []

    def _named_pieces(self, text: str) -> list[dict]:
        """A named call's streamed tool_calls entries for this piece of the text ([] for none)."""
        if self._named_id is None:
            so_far = "".join(self.text)
            if not so_far.strip():  # whitespace alone is no call (calls() says the same at the end)
                return []
            self._named_id = self._make_id()
            return [{"index": 0, "id": self._named_id, "type": "function",
                     "function": {"name": self.forced, "arguments": so_far}}]
        return [{"index": 0, "function": {"arguments": text}}] if text else []

    def calls(self) -> list[dict]:
        """The calls the client was given: a streamed "required" choice's as sent (their ids and the
        arguments as written), else the whole text's (made once: their ids stay the same)."""
        if self._required_stream is not None:
            return self._required_stream.sent
        if self._calls is None:
            text = "".join(self.text)
            if self.forced == "required":
                self._calls = required_calls(text, self._make_id)
            elif text.strip():  # nothing generated: no call (vLLM's rule)
                # the id its stream sent, where it was streamed
                self._calls = [tool_call(self.forced, text, call_id=self._named_id or self._make_id())]
            else:
                self._calls = []
        return self._calls

    def finish_reason(self, finish: str | None) -> str | None:
        """"tool_calls" for "required" calls the text ended on by itself ("stop"), as vLLM and OpenAI
        say it (streamed: calls sent, as vLLM's stream says it); a named call keeps "stop" (OpenAI's
        rule), and "length" stays "length"."""
        if finish == "stop" and self.forced == "required" and self.calls():
            return "tool_calls"
        return finish

    def message(self) -> dict:
        """The choice's message: content null beside the calls, as OpenAI answers a message that
        holds only tool calls (a client tells a call from an answer by it); "" where no call was
        made (nothing generated)."""
        calls = self.calls()
        return {"role": "assistant", "content": None, "tool_calls": calls} if calls else \
            {"role": "assistant", "content": ""}

