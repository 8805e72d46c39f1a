"""A weights file damaged inside a compiled-model directory: the advice was "copy it again or write
the pre-sharded checkpoint again", a checkpoint no user of --compiled wrote. Its fix is the
directory copied again (cp -rL) or compiled again into the same --out."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from shardlib.model_config import load_model_config
from shardlib.presharded import check_presharded_dir, load_presharded, save_presharded
from shardlib.sharding import ShardLayout
from tests.model_factory import build_random_model, save_model
from tests.test_compile_cli import fake_compiled_dir

RANK_FILE = "rank-00000-of-00001.safetensors"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    model_dir = save_model(build_random_model("llama", hidden_size=16, intermediate_size=32, num_layers=1,
                                              num_heads=2, num_kv_heads=1), tmp_path_factory.mktemp("m"))
    config = load_model_config(model_dir)
    return model_dir, config, ShardLayout.for_model(config, 1)


def _compiled(tmp_path: Path, model) -> Path:
    model_dir, config, layout = model
    compiled = fake_compiled_dir(tmp_path / "c", model_dir)
    shutil.rmtree(compiled / "weights")
    save_presharded(compiled / "weights", model_dir, config, layout, dtype="float32")
    return compiled


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))


def _compile_fix(compiled: Path) -> str:
    return (f"copy the compiled directory {compiled} again (cp -rL: links followed), or run "
            f"`corelaunch compile --out {compiled}` again with the options it was compiled with")


def test_a_corrupt_weights_file_of_a_compiled_directory_names_its_copy_or_compile(tmp_path, model):
    _, config, layout = model
    compiled = _compiled(tmp_path, model)
    _flip_a_byte(compiled / "weights" / RANK_FILE)
    with pytest.raises(ValueError) as refused:
        load_presharded(compiled / "weights", config, layout, 0, "float32")
    assert str(refused.value).endswith(f"it is corrupt; {_compile_fix(compiled)}"), str(refused.value)
    assert "pre-sharded checkpoint" not in str(refused.value)


def test_a_truncated_weights_file_of_a_compiled_directory_names_its_copy_or_compile(tmp_path, model):
    _, config, layout = model
    compiled = _compiled(tmp_path, model)
    rank_file = compiled / "weights" / RANK_FILE
    rank_file.write_bytes(rank_file.read_bytes()[:-10])
    with pytest.raises(ValueError) as refused:
        check_presharded_dir(compiled / "weights", config, layout, "float32")
    assert str(refused.value).endswith(f"truncated or modified; {_compile_fix(compiled)}"), str(refused.value)


def test_a_plain_presharded_checkpoint_keeps_its_advice_and_a_caller_may_give_its_own(tmp_path, model):
    model_dir, config, layout = model
    copy = save_presharded(tmp_path / "pre", model_dir, config, layout, dtype="float32") or tmp_path / "pre"
    _flip_a_byte(copy / RANK_FILE)
    with pytest.raises(ValueError, match="copy it again or write the pre-sharded checkpoint again$"):
        load_presharded(copy, config, layout, 0, "float32")
    with pytest.raises(ValueError, match="it is corrupt; fetch it from the bucket again$"):
        load_presharded(copy, config, layout, 0, "float32", fix="fetch it from the bucket again")


def _rewritten_with_an_extra_tensor(directory: Path) -> None:
    """The rank file re-saved with one tensor more and its manifest entry rewritten to match (size,
    sha256, tensors): only the config's own shard shapes can tell."""
    import hashlib
    import json

    import torch
    from safetensors.torch import load_file, save_file

    rank_file = directory / RANK_FILE
    save_file({**load_file(rank_file), "extra.weight": torch.zeros(2)}, rank_file)
    manifest = json.loads((directory / "manifest.json").read_text())
    [entry] = manifest["files"]
    entry.update(bytes=rank_file.stat().st_size, sha256=hashlib.sha256(rank_file.read_bytes()).hexdigest())
    entry["tensors"]["extra.weight"] = {"dtype": "float32", "shape": [2]}
    (directory / "manifest.json").write_text(json.dumps(manifest))


def test_a_shard_that_disagrees_with_the_config_names_the_directorys_own_fix(tmp_path, model):
    """Told "write the pre-sharded checkpoint again" for a compiled directory too."""
    model_dir, config, layout = model
    compiled = _compiled(tmp_path, model)
    _rewritten_with_an_extra_tensor(compiled / "weights")
    with pytest.raises(ValueError) as refused:
        load_presharded(compiled / "weights", config, layout, 0, "float32")
    assert "does not hold rank 0's shard for this config: tensor 'extra.weight' is unexpected" in str(refused.value)
    assert str(refused.value).endswith(f"; {_compile_fix(compiled)}"), str(refused.value)
    copy = save_presharded(tmp_path / "pre", model_dir, config, layout, dtype="float32") or tmp_path / "pre"
    _rewritten_with_an_extra_tensor(copy)
    with pytest.raises(ValueError, match="is unexpected; copy it again or write the pre-sharded checkpoint again$"):
        load_presharded(copy, config, layout, 0, "float32")


def test_a_missing_weights_file_of_a_compiled_directory_names_its_copy_or_compile(tmp_path, model):
    """A compiled directory whose rank file is gone was told to "write it again", a pre-sharded
    checkpoint no user of --compiled wrote; the load and the driver's check both name its own fix."""
    _, config, layout = model
    compiled = _compiled(tmp_path, model)
    (compiled / "weights" / RANK_FILE).unlink()
    for refuse in (lambda: load_presharded(compiled / "weights", config, layout, 0, "float32"),
                   lambda: check_presharded_dir(compiled / "weights", config, layout, "float32")):
        with pytest.raises(FileNotFoundError) as refused:
            refuse()
        assert str(refused.value).endswith(f"{RANK_FILE} named in its manifest.json is missing; "
                                           f"{_compile_fix(compiled)}"), str(refused.value)


def test_a_missing_file_of_a_plain_presharded_checkpoint_names_the_whole_directory(tmp_path, model):
    model_dir, config, layout = model
    copy = save_presharded(tmp_path / "pre", model_dir, config, layout, dtype="float32") or tmp_path / "pre"
    (copy / RANK_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="is missing; copy the whole directory again or write the "
                                                "pre-sharded checkpoint again$"):
        load_presharded(copy, config, layout, 0, "float32")
    with pytest.raises(FileNotFoundError, match="is missing; fetch it from the bucket again$"):
        check_presharded_dir(copy, config, layout, "float32", fix="fetch it from the bucket again")
