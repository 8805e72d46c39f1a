"""launcher.artifacts.presharded_cache: what the cache key follows."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from launcher.artifacts.presharded_cache import cache_dir
from shardlib.model_config import load_model_config
from shardlib.sharding import ShardLayout
from tests.model_factory import save_random_model

SHAPE = dict(hidden_size=48, intermediate_size=100, vocab_size=128, num_layers=2, num_heads=6, num_kv_heads=2)


def _touch(path: Path) -> None:
    """A new modification time, as a rewrite of the file gives it."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


@pytest.mark.parametrize("fmt", ["safetensors", "safetensors_sharded"])
def test_the_key_follows_config_and_weight_files_not_tokenizer_or_generation_files(tmp_path, fmt):
    """Every top-level *.json was in the key: an edit of tokenizer_config.json wrote another full
    copy of the model beside the first, which nothing removed."""
    model_dir = save_random_model(tmp_path / "m", "llama", fmt, **SHAPE)
    config = load_model_config(model_dir)
    layout = ShardLayout.for_model(config, 3)
    root = tmp_path / "cache"
    key = cache_dir(root, model_dir, config, layout, "float32")
    for name, text in (("tokenizer_config.json", '{"model_max_length": 8}'), ("tokenizer.json", "{}"),
                       ("generation_config.json", '{"temperature": 0.5}'), ("special_tokens_map.json", "{}")):
        (model_dir / name).write_text(text)
        assert cache_dir(root, model_dir, config, layout, "float32") == key, name
    weights = sorted(p for p in model_dir.iterdir() if p.suffix == ".safetensors")
    assert (len(weights) > 1) == (fmt == "safetensors_sharded")  # (the sharded checkpoint's files are in its index)
    changed = [*weights, model_dir / "config.json"] + (
        [model_dir / "model.safetensors.index.json"] if fmt == "safetensors_sharded" else [])
    for path in changed:
        _touch(path)
        now = cache_dir(root, model_dir, config, layout, "float32")
        assert now != key, path.name
        key = now
