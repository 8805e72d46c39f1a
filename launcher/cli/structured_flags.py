"""`corelaunch generate`'s structured-output flags: what every output must match."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_structured_flags(p: argparse.ArgumentParser) -> None:
    group = p.add_mutually_exclusive_group()
    group.add_argument("--json-schema", metavar="FILE|JSON",
                       help="every output is one JSON value this schema accepts (a file holding the schema, or "
                            "the schema's JSON text)")
    group.add_argument("--json-object", action="store_true", help="every output is a JSON object")
    group.add_argument("--regex", metavar="PATTERN", help="every output matches this regular expression, whole")
    group.add_argument("--choice", action="append", metavar="TEXT",
                       help="every output is exactly one of these strings (repeat the flag for each)")
    group.add_argument("--grammar", metavar="FILE", help="every output matches this Lark grammar (start: ...)")


def structured_output(args: argparse.Namespace):
    """The StructuredOutput the flags ask for (None: plain text); ValueError naming the flag."""
    from shardlib.structured_output import StructuredOutput

    if args.json_schema is not None:
        text, named = args.json_schema, "--json-schema"
        if not text.lstrip().startswith(("{", "[")):  # else the schema's own text
            text = _read(text, "--json-schema", "a file holding a JSON schema, or the schema's JSON text")
            named = f"--json-schema {args.json_schema!r}"  # its errors name the file, not only the flag
        _check_json(text, named, from_file=named != "--json-schema")
        return _made(named, lambda: StructuredOutput(json=text))
    if args.json_object:
        return StructuredOutput(json_object=True)
    if args.regex is not None:
        return _made("--regex", lambda: StructuredOutput(regex=args.regex))
    if args.choice:
        return _made("--choice", lambda: StructuredOutput(choice=args.choice))
    if args.grammar is not None:
        grammar = _read(args.grammar, "--grammar", "a file holding a Lark grammar")
        return _made("--grammar", lambda: StructuredOutput(grammar=grammar))
    return None


def _read(path: str, flag: str, what: str) -> str:
    try:
        # utf-8-sig: a byte-order mark (Windows editors write one) was refused as "Unexpected UTF-8 BOM"
        return Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:  # UTF-16 and the like: the codec's words alone named no fix
        raise ValueError(f"{flag} {path!r} is not UTF-8 text ({err.reason} at byte {err.start}); save it as "
                         f"UTF-8") from None
    except OSError as err:
        raise ValueError(f"{flag} {path!r} must be {what}: {err}") from None


def _check_json(text: str, named: str, from_file: bool) -> None:
    """ValueError in the command line's words for schema text that is not JSON (the driver API's
    said "give a JSON object, or a mapping": a mapping is no thing a command line can give)."""
    import json

    if from_file and not text.strip():
        raise ValueError(f"{named} is an empty file; it must hold a JSON schema such as {{\"type\": \"object\"}}")
    shown = "" if from_file else f" {text[:60]!r}{'...' if len(text) > 60 else ''}"
    try:
        json.loads(text)
    except ValueError as err:
        fix = ("fix the file, or pass the schema's JSON text" if from_file else
               "pass a JSON schema object such as '{\"type\": \"object\"}', or a file holding one")
        raise ValueError(f"{named}{shown} is not valid JSON ({err}); {fix}") from None
    except RecursionError:  # json.loads' own limit: a traceback otherwise
        raise ValueError(f"{named} is nested too deeply to read (past Python's recursion limit); flatten it") from None
    # not an object: StructuredOutput's own refusal, prefixed with `named` by _made


def _made(flag: str, make):
    """make()'s StructuredOutput, checked by llguidance now (before any start-up); ValueError naming
    the flag."""
    from workers.structured.grammars import check_structured_output

    try:
        spec = make()
    except ValueError as err:
        raise ValueError(f"{flag}: {err}") from None
    check_structured_output(spec, name=flag)
    return spec
