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
        text = args.json_schema
        if not text.lstrip().startswith(("{", "[")):  # else the schema's own text
            text = _read(text, "--json-schema", "a file holding a JSON schema, or the schema's JSON text")
        return _made("--json-schema", lambda: StructuredOutput(json=text))
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
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{flag} {path!r} must be {what}: {err}") from None


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
