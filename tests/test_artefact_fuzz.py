"""Property-based checks (hypothesis) of what a load reads from disk: a mutated safetensors header
in a checkpoint, and a mutated pre-sharded manifest, give a clean ValueError or FileNotFoundError
or a correct load (every tensor equal to the unmutated load's), never another exception, never
wrong weights, and never a hang. A few examples run in the fast lane;
the slow lane runs 500 of each."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardlib.checkpoint import load_rank_shard
from shardlib.model_config import load_model_config
from shardlib.presharded import MANIFEST, load_presharded, save_presharded
from shardlib.sharding import ShardLayout
from tests.model_factory import save_random_model

CLEAN_ERRORS = (ValueError, FileNotFoundError)
FAST, SLOW = 25, 500


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_random_model(tmp_path_factory.mktemp("fuzz-model"), "llama", num_layers=1)


@pytest.fixture(scope="module")
def presharded_dir(model_dir, tmp_path_factory):
    config = load_model_config(model_dir)
    return save_presharded(tmp_path_factory.mktemp("fuzz-pre") / "p", model_dir, config,
                           ShardLayout.for_model(config, 2))


@pytest.fixture(scope="module")
def reference_shards(model_dir, presharded_dir):
    """The unmutated loads: rank 0 at TP 1 from the checkpoint, and at TP 2 from the pre-sharded copy."""
    config = load_model_config(model_dir)
    return (load_rank_shard(model_dir, config, ShardLayout.for_model(config, 1), 0),
            load_presharded(presharded_dir, config, ShardLayout.for_model(config, 2), 0))


def assert_same_shard(loaded: dict, reference: dict, what: str) -> None:
    """A mutation the loader accepted must not have changed what it returns."""
    assert sorted(loaded) == sorted(reference), f"{what}: loaded {sorted(loaded)}"
    for name, tensor in reference.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), f"{what}: {name} differs"


def only_weights(model_dir):
    [weights] = sorted(model_dir.glob("*.safetensors"))
    return weights


# ---- safetensors headers -------------------------------------------------------------------------
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                          max_size=3),
                           max_leaves=8)


def header_mutation():
    """(how, argument): rewrite one tensor entry's field, flip a header byte, or lie about the
    header's length."""
    return st.one_of(
        st.tuples(st.just("field"), st.tuples(st.sampled_from(["dtype", "shape", "data_offsets"]), JSON_VALUES)),
        st.tuples(st.just("byte"), st.tuples(st.integers(0, 10_000), st.integers(0, 255))),
        st.tuples(st.just("length"), st.integers(0, 2**64 - 1)),
    )


def mutate_header(raw: bytes, how: str, argument) -> bytes:
    (length,) = struct.unpack("<Q", raw[:8])
    header, body = raw[8:8 + length], raw[8 + length:]
    if how == "length":
        return struct.pack("<Q", argument) + raw[8:]
    if how == "byte":
        position, value = argument
        data = bytearray(header)
        data[position % len(data)] = value
        return struct.pack("<Q", len(data)) + bytes(data) + body
    field, value = argument
    parsed = json.loads(header)
    name = sorted(k for k in parsed if k != "__metadata__")[0]
    parsed[name][field] = value
    data = json.dumps(parsed).encode()
    return struct.pack("<Q", len(data)) + data + body


def check_header_mutation(model_dir, reference, tmp_path_factory, how, argument):
    copy = tmp_path_factory.mktemp("hdr")
    for item in model_dir.iterdir():
        shutil.copy(item, copy / item.name)
    weights = only_weights(copy)
    weights.write_bytes(mutate_header(weights.read_bytes(), how, argument))
    config = load_model_config(copy)
    try:
        loaded = load_rank_shard(copy, config, ShardLayout.for_model(config, 1), 0)
    except CLEAN_ERRORS:
        pass
    else:
        assert_same_shard(loaded, reference, f"header mutation {how} {argument!r}")
    shutil.rmtree(copy)


@settings(max_examples=FAST, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutation=header_mutation())
def test_a_mutated_safetensors_header_is_refused_cleanly(model_dir, reference_shards, tmp_path_factory, mutation):
    check_header_mutation(model_dir, reference_shards[0], tmp_path_factory, *mutation)


@pytest.mark.slow
@settings(max_examples=SLOW, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutation=header_mutation())
def test_many_mutated_safetensors_headers_are_refused_cleanly(model_dir, reference_shards, tmp_path_factory,
                                                             mutation):
    check_header_mutation(model_dir, reference_shards[0], tmp_path_factory, *mutation)


# ---- pre-sharded manifests -----------------------------------------------------------------------
def manifest_mutation():
    """(path into the manifest, new value): a top-level field, or a field of one file entry."""
    top = st.sampled_from(["format_version", "config_hash", "tp_degree", "kv_strategy", "dtype", "files"])
    entry = st.sampled_from(["rank", "file", "bytes", "sha256", "tensors"])
    return st.one_of(
        st.tuples(st.tuples(top), JSON_VALUES),
        st.tuples(st.tuples(st.just("files"), st.integers(0, 1), entry), JSON_VALUES),
        st.tuples(st.tuples(st.just("files"), st.integers(0, 1), st.just("file")),
                  st.sampled_from(["../x.safetensors", "/etc/passwd", "rank-1.safetensors", "", "."])),
    )


def check_manifest_mutation(model_dir, presharded_dir, reference, tmp_path_factory, path, value):
    copy = tmp_path_factory.mktemp("man") / "p"
    shutil.copytree(presharded_dir, copy, symlinks=False)
    manifest = json.loads((copy / MANIFEST).read_text())
    target = manifest
    for key in path[:-1]:
        target = target[key] if isinstance(target, dict) else target[key % len(target)]
    if isinstance(target, dict):
        target[path[-1]] = value
    (copy / MANIFEST).write_text(json.dumps(manifest))
    config = load_model_config(model_dir)
    try:
        loaded = load_presharded(copy, config, ShardLayout.for_model(config, 2), 0)
    except CLEAN_ERRORS:
        pass
    else:
        assert_same_shard(loaded, reference, f"manifest mutation {path} = {value!r}")
    shutil.rmtree(copy.parent)


@settings(max_examples=FAST, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutation=manifest_mutation())
def test_a_mutated_manifest_is_refused_cleanly(model_dir, presharded_dir, reference_shards, tmp_path_factory,
                                               mutation):
    check_manifest_mutation(model_dir, presharded_dir, reference_shards[1], tmp_path_factory, *mutation)


@pytest.mark.slow
@settings(max_examples=SLOW, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutation=manifest_mutation())
def test_many_mutated_manifests_are_refused_cleanly(model_dir, presharded_dir, reference_shards, tmp_path_factory,
                                                   mutation):
    check_manifest_mutation(model_dir, presharded_dir, reference_shards[1], tmp_path_factory, *mutation)
