"""shardlib.manifest: every directory corelaunch writes fails alike on a broken manifest."""

from __future__ import annotations

import pytest

from launcher.artifacts import compiled_dir
from shardlib import presharded
from shardlib.manifest import read_manifest_json

HINT = "run the writer again"


def read(directory):
    return read_manifest_json(directory, what="a test directory", required=("a", "b"), write_hint=HINT)


def test_a_complete_manifest_is_returned(tmp_path):
    (tmp_path / "manifest.json").write_text('{"a": 1, "b": [2], "extra": true}')
    assert read(tmp_path) == {"a": 1, "b": [2], "extra": True}


@pytest.mark.parametrize("content, error, words", [
    (None, FileNotFoundError, "is not a test directory: it has no manifest.json"),
    ("{not json", ValueError, "is not valid JSON"),
    ('{"a": 1}', ValueError, "lacks b"),
    ("[1, 2]", ValueError, "lacks a, b"),
])
def test_a_broken_manifest_names_the_path_and_the_fix(tmp_path, content, error, words):
    if content is not None:
        (tmp_path / "manifest.json").write_text(content)
    with pytest.raises(error) as info:
        read(tmp_path)
    assert words in str(info.value) and str(tmp_path) in str(info.value) and HINT in str(info.value)


def test_each_directory_kind_says_how_to_write_itself(tmp_path):
    with pytest.raises(FileNotFoundError, match="corelaunch compile --model MODEL --tp N"):
        compiled_dir.read_manifest(tmp_path)
    with pytest.raises(FileNotFoundError, match="save_presharded"):
        presharded.read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text('{"format_version": 1}')
    with pytest.raises(ValueError, match="lacks config_hash, tp_degree"):
        compiled_dir.read_manifest(tmp_path)
    with pytest.raises(ValueError, match="lacks config_hash, model_type"):
        presharded.read_manifest(tmp_path)


COMPILED = {"format_version": 1, "config_hash": "abc", "tp_degree": 2, "kv_strategy": "shard", "dtype": "float32",
            "backend": "cpu", "buckets": {"context": [16], "token": [32], "batch": [1, 2]}, "versions": {},
            "granularity": None, "compile_s": 3}


@pytest.mark.parametrize("field, value", [
    ("tp_degree", "2"), ("tp_degree", 2.0), ("format_version", False), ("dtype", 16), ("versions", ["torch"]),
    ("buckets", [16]), ("buckets.token", 32), ("buckets.batch[1]", "2"), ("granularity", 3), ("compile_s", "3"),
])
def test_a_malformed_field_is_a_value_error_naming_it(tmp_path, field, value):
    import json

    manifest = json.loads(json.dumps(COMPILED))
    if field.startswith("buckets."):
        name, _, index = field.removeprefix("buckets.").partition("[")
        if index:
            manifest["buckets"][name][int(index[:-1])] = value
        else:
            manifest["buckets"][name] = value
    else:
        manifest[field] = value
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError) as info:
        compiled_dir.read_manifest(tmp_path)
    assert f"{tmp_path / 'manifest.json'}: field {field!r} must be" in str(info.value)
    assert "corelaunch compile" in str(info.value)


def test_a_well_typed_compiled_manifest_is_read(tmp_path):
    import json

    (tmp_path / "manifest.json").write_text(json.dumps(COMPILED))
    assert compiled_dir.read_manifest(tmp_path) == COMPILED
