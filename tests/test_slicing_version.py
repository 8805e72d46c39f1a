"""The slicing version (shardlib.sharding.SLICING_VERSION): a pre-sharded copy holds the slices the
code of its day cut, so a change to slice contents that keeps every shape served stale copies. The
manifest records the version, a load refuses a copy cut by another, and the pre-sharded cache's key
holds it, so a bump writes a new copy."""

from __future__ import annotations

import json
import shutil

import pytest

from launcher.artifacts.presharded_cache import cache_dir, unusable
from shardlib import presharded, sharding
from shardlib.model_config import load_model_config
from shardlib.presharded import MANIFEST, load_presharded, read_manifest, save_presharded
from shardlib.sharding import ShardLayout
from tests.model_factory import save_random_model

SHAPE = dict(hidden_size=48, intermediate_size=100, vocab_size=128, num_layers=2, num_heads=6, num_kv_heads=2)
TP = 2


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(model dir, pre-sharded copy, config, layout), the copy cut by this code's slicing version."""
    root = tmp_path_factory.mktemp("slicing")
    model_dir = save_random_model(root / "llama", "llama", "safetensors", **SHAPE)
    config = load_model_config(model_dir)
    layout = ShardLayout.for_model(config, TP)
    return model_dir, save_presharded(root / "copy", model_dir, config, layout), config, layout


def _copy_with(written, tmp_path, edit):
    model_dir, src, config, layout = written
    out = tmp_path / "copy"
    shutil.copytree(src, out)
    manifest = json.loads((out / MANIFEST).read_text())
    edit(manifest)
    (out / MANIFEST).write_text(json.dumps(manifest))
    return out


def test_the_manifest_records_the_slicing_version(written):
    _, out, _, _ = written
    assert read_manifest(out)["slicing_version"] == sharding.SLICING_VERSION


def test_a_copy_cut_by_another_slicing_version_is_refused_naming_both_and_the_fix(written, tmp_path):
    model_dir, _, config, layout = written
    other = sharding.SLICING_VERSION + 1
    out = _copy_with(written, tmp_path, lambda m: m.update(slicing_version=other))
    refusals = []
    for refuse in (lambda: load_presharded(out, config, layout, 0),
                   lambda: presharded.check_presharded_dir(out, config, layout)):  # the driver's check
        with pytest.raises(ValueError) as err:
            refuse()
        refusals.append(str(err.value))
    for message in refusals:
        assert str(out) in message, message
        assert f"cut by slicing version {other}, but this corelaunch slices by version {sharding.SLICING_VERSION}" \
            in message, message
        assert "Write the copy again" in message and "original checkpoint" in message, message
    # a cache copy cut by another version is loaded around and written again
    assert f"slicing version {other}" in unusable(out, model_dir)


def test_a_manifest_written_before_the_version_was_recorded_counts_as_version_1(written, tmp_path, monkeypatch):
    _, _, config, layout = written
    out = _copy_with(written, tmp_path, lambda m: m.pop("slicing_version"))
    assert presharded.UNRECORDED_SLICING_VERSION == 1
    monkeypatch.setattr(sharding, "SLICING_VERSION", 1)  # (this code's version, until the first bump)
    assert load_presharded(out, config, layout, 1)  # existing copies keep loading
    monkeypatch.setattr(sharding, "SLICING_VERSION", 2)
    with pytest.raises(ValueError, match="cut by slicing version 1, but this corelaunch slices by version 2"):
        presharded.check_presharded_dir(out, config, layout)


def test_a_bump_refuses_the_copies_cut_before_it_and_records_itself_in_new_ones(written, tmp_path, monkeypatch):
    model_dir, out, config, layout = written
    bumped = sharding.SLICING_VERSION + 1
    monkeypatch.setattr(sharding, "SLICING_VERSION", bumped)
    with pytest.raises(ValueError, match=f"slicing version {bumped - 1}, but this corelaunch slices by version {bumped}"):
        load_presharded(out, config, layout, 0)
    fresh = save_presharded(tmp_path / "fresh", model_dir, config, layout)
    assert read_manifest(fresh)["slicing_version"] == bumped
    assert load_presharded(fresh, config, layout, 0)


def test_the_cache_key_follows_the_slicing_version(written, tmp_path, monkeypatch):
    model_dir, _, config, layout = written
    keys = []
    for version in (1, 2, 3):
        monkeypatch.setattr(sharding, "SLICING_VERSION", version)
        keys.append(cache_dir(tmp_path, model_dir, config, layout, "float32"))
    assert len(set(keys)) == 3, keys
