"""shardlib.checkpoint_files: an index that does not fit its files is named, not its files."""

from __future__ import annotations

import json
import re

import pytest

from shardlib.checkpoint_files import check_checkpoint
from shardlib.model_config import load_model_config
from tests.model_factory import build_random_model, save_model

SHAPE = dict(hidden_size=48, intermediate_size=100, vocab_size=128, num_layers=2, num_heads=4, num_kv_heads=2)


def _model(tmp_path, fmt: str):
    model_dir = save_model(build_random_model("llama", **SHAPE), tmp_path / fmt, fmt)
    return model_dir, load_model_config(model_dir)


def test_a_safetensors_index_naming_pickles_names_the_index(tmp_path):
    """A .bin named by model.safetensors.index.json was called "not a valid safetensors file (header
    too large) ... probably truncated or corrupt: download it again": the files were whole, the index
    was of the other format."""
    model_dir, config = _model(tmp_path, "bin_sharded")
    own_index, index = model_dir / "pytorch_model.bin.index.json", model_dir / "model.safetensors.index.json"
    index.write_text(own_index.read_text())
    own_index.unlink()
    named = sorted(set(json.loads(index.read_text())["weight_map"].values()))[0]
    with pytest.raises(ValueError) as err:
        check_checkpoint(model_dir, config)
    message = str(err.value)
    assert f"names {named!r}" in message and f"download {index.name} again" in message
    assert own_index.name in message and "truncated" not in message


def test_a_pickle_index_naming_safetensors_files_still_loads(tmp_path):
    """torch.load reads safetensors files: a pytorch_model.bin.index.json naming them is not refused."""
    from shardlib.checkpoint import load_rank_shard
    from shardlib.sharding import ShardLayout

    model_dir, config = _model(tmp_path, "safetensors_sharded")
    (model_dir / "model.safetensors.index.json").rename(model_dir / "pytorch_model.bin.index.json")
    check_checkpoint(model_dir, config)
    assert load_rank_shard(model_dir, config, ShardLayout.for_model(config, 1), 0)


@pytest.mark.parametrize("fmt", ["safetensors_sharded", "bin_sharded"])
def test_a_tensor_the_index_omits_but_a_file_holds_names_the_index(tmp_path, fmt):
    """It was called missing: "the checkpoint is incomplete", while only the index was."""
    model_dir, config = _model(tmp_path, fmt)
    (index,) = model_dir.glob("*.index.json")
    raw = json.loads(index.read_text())
    name = "model.norm.weight"
    holder = raw["weight_map"].pop(name)
    index.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=re.escape(f"checkpoint index {index} omits tensor {name!r}, which {holder} "
                                                   f"holds")) as err:
        check_checkpoint(model_dir, config)
    assert f"download {index.name} again" in str(err.value)


def test_a_tensor_no_file_holds_is_still_missing(tmp_path):
    """The index is blamed only where a file holds the tensor: one truly absent is missing as before."""
    from safetensors.torch import load_file, save_file

    model_dir, config = _model(tmp_path, "safetensors_sharded")
    (index,) = model_dir.glob("*.index.json")
    raw = json.loads(index.read_text())
    name = "model.norm.weight"
    holder = model_dir / raw["weight_map"].pop(name)
    index.write_text(json.dumps(raw))
    tensors = load_file(holder)
    del tensors[name]
    save_file(tensors, holder, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"is missing 1 tensor.*{re.escape(repr(name))}"):
        check_checkpoint(model_dir, config)
