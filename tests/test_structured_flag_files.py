"""`corelaunch generate --json-schema FILE|JSON`: a schema file read as editors write it (a UTF-8
byte-order mark included), and its errors in the command line's words, naming the file they are in."""

from __future__ import annotations

import json

import pytest

from launcher.cli import build_parser, main
from launcher.cli.structured_flags import structured_output


def schema_from(value: str):
    return structured_output(build_parser().parse_args(["generate", "--json-schema", value, "Hi"]))


def refusal(value: str) -> str:
    with pytest.raises(ValueError) as refused:
        schema_from(value)
    return str(refused.value)


def test_a_schema_file_with_a_utf8_byte_order_mark_is_read(tmp_path):
    """Windows editors begin UTF-8 files with a BOM: it was refused as "Unexpected UTF-8 BOM"."""
    path = tmp_path / "schema.json"
    path.write_bytes(b'\xef\xbb\xbf{"type": "object"}')
    assert json.loads(schema_from(str(path)).json) == {"type": "object"}


def test_a_schema_file_that_is_not_json_is_refused_naming_the_file(tmp_path):
    """It said "--json-schema: json schema '{...' is not valid JSON (...); give a JSON object, or a
    mapping": no file named, and a Python mapping no command line can give."""
    path = tmp_path / "schema.json"
    path.write_text('{"type": "object"')
    message = refusal(str(path))
    assert message == (f"--json-schema {str(path)!r} is not valid JSON (Expecting ',' delimiter: line 1 column 18 "
                       f"(char 17)); fix the file, or pass the schema's JSON text"), message


@pytest.mark.parametrize("content, said", [
    ("[1, 2]", ": json schema [1, 2] must be a JSON object"),
    ('"object"', ": json schema 'object' must be a JSON object"),
    ("", " is an empty file; it must hold a JSON schema such as"),
    ("   \n", " is an empty file; it must hold a JSON schema such as"),
])
def test_a_schema_file_without_a_schema_object_is_refused_naming_the_file(tmp_path, content, said, capsys,
                                                                          ray_tripwire):
    """As the command prints it: the driver API's json_object=True said as the flag --json-object."""
    path = tmp_path / "schema.json"
    path.write_text(content)
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path / "no-model"), "--json-schema", str(path), "Hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"corelaunch generate: --json-schema {str(path)!r}{said}"), err
    assert "json_object" not in err, err


def test_a_schema_file_in_another_encoding_is_refused_with_the_fix(tmp_path):
    path = tmp_path / "schema.json"
    path.write_text('{"type": "object"}', encoding="utf-16")
    assert refusal(str(path)) == f"--json-schema {str(path)!r} is not UTF-8 text (invalid start byte at byte 0); save it as UTF-8"


def test_schema_text_that_is_not_json_is_quoted_back_with_a_cli_fix():
    message = refusal('{"type": "object"')
    assert message == ("--json-schema '{\"type\": \"object\"' is not valid JSON (Expecting ',' delimiter: line 1 "
                       "column 18 (char 17)); pass a JSON schema object such as '{\"type\": \"object\"}', or a file "
                       "holding one"), message
