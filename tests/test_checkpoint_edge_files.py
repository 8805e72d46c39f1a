"""Checkpoints whose files hold more, or less, than they seem to: a pickled tied head that is another
matrix, a tensor stored again in a second shard, links into a Hugging Face cache's blobs/ that were
left behind, a cache folder passed for its snapshot, a config.json without a required field. Each
ran with weights transformers does not use, or was refused without saying what to do."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardlib.checkpoint_files import check_checkpoint, find_checkpoint
from shardlib.model_config import load_model_config
from tests.model_factory import build_random_model, save_model

EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"


def _check(model_dir: Path) -> None:
    check_checkpoint(model_dir, load_model_config(model_dir))


def _set_config(model_dir: Path, **fields) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, **fields}))


# ---- a pickled tied head -----------------------------------------------------------------------
def test_a_pickled_tied_head_that_is_another_matrix_is_refused(tmp_path):
    """Safetensors' stored head was compared with the embedding; a pickle's was dropped unread and the
    model ran tied, while transformers used the stored head: other tokens, no word of why."""
    model_dir = save_model(build_random_model("llama"), tmp_path / "m", "bin")  # an untied head of its own
    _set_config(model_dir, tie_word_embeddings=True)
    with pytest.raises(ValueError, match=rf"tie_word_embeddings=true, but .*pytorch_model\.bin stores a {HEAD} "
                                         rf"\(F32 \[128, 64\]\) that is not a copy of {EMBED}.*Set tie_word_embeddings "
                                         rf"to false to use the stored head, or remove {HEAD}"):
        _check(model_dir)


def test_a_pickled_tied_head_that_copies_the_embedding_passes(tmp_path):
    model_dir = save_model(build_random_model("llama", tie_word_embeddings=True), tmp_path / "m", "bin")
    state = torch.load(model_dir / "pytorch_model.bin", weights_only=True)
    assert HEAD not in state  # the factory leaves a tied head out: store a copy, as some savers do
    torch.save({**state, HEAD: state[EMBED].clone()}, model_dir / "pytorch_model.bin")
    _check(model_dir)


# ---- a tensor stored in two shards -------------------------------------------------------------
def _sharded_with_stray_copy(tmp_path: Path, fmt: str, stray_in: str, same_values: bool) -> tuple[Path, str, str]:
    """A sharded checkpoint whose first (stray_in="first") or last shard holds a second copy of a tensor
    the index maps to another shard; returns (directory, tensor, the stray copy's file name)."""
    model_dir = save_model(build_random_model("llama"), tmp_path / "m", fmt)
    ckpt = find_checkpoint(model_dir)
    stray_file = ckpt.files[0] if stray_in == "first" else ckpt.files[-1]
    name = next(n for n, path in ckpt.weight_map.items() if path != stray_file and n != HEAD)
    load, save = ((load_file, lambda d, p: save_file(d, p, metadata={"format": "pt"})) if fmt.startswith("safetensors")
                  else (lambda p: torch.load(p, weights_only=True), torch.save))
    source = load(ckpt.weight_map[name])[name]
    tensors = load(stray_file)
    tensors[name] = source.clone() if same_values else source + 1.0
    save(tensors, stray_file)
    return model_dir, name, stray_file.name


@pytest.mark.parametrize("fmt", ["safetensors_sharded", "bin_sharded"])
@pytest.mark.parametrize("stray_in", ["first", "last"])
def test_a_tensor_stored_again_with_other_values_in_another_shard_is_refused(tmp_path, fmt, stray_in):
    """corelaunch read the copy the index names, transformers the other one (the later file's): the
    check's reference and the served model had different weights, silently."""
    model_dir, name, stray = _sharded_with_stray_copy(tmp_path, fmt, stray_in, same_values=False)
    with pytest.raises(ValueError) as refused:
        _check(model_dir)
    message = str(refused.value)
    mapped = find_checkpoint(model_dir).weight_map[name].name
    assert f"tensor {name!r} is stored in both {mapped} and {stray}" in message
    assert f"remove the stray copy from {stray}, or point the index at the copy you want" in message


def test_a_second_copy_with_the_same_values_passes(tmp_path):
    model_dir, _, _ = _sharded_with_stray_copy(tmp_path, "safetensors_sharded", "last", same_values=True)
    _check(model_dir)


# ---- links into a cache's blobs/ left behind ---------------------------------------------------
def _dangling(path: Path) -> str:
    os.symlink("../../blobs/0123abcd", path)
    return "../../blobs/0123abcd"


def test_a_dangling_weights_link_is_named_as_one(tmp_path):
    """A cache snapshot copied without blobs/: "no Hugging Face checkpoint ... the directory holds:
    model.safetensors", about the file it said was not there."""
    model_dir = save_model(build_random_model("llama"), tmp_path / "models--org--tiny" / "snapshots" / "abc")
    (model_dir / "model.safetensors").unlink()
    target = _dangling(model_dir / "model.safetensors")
    with pytest.raises(FileNotFoundError) as refused:
        _check(model_dir)
    message = str(refused.value)
    assert f"model.safetensors is a symlink to {target}, which does not exist" in message
    assert "`cp -rL SNAPSHOT DIR`" in message and "`hf download org/tiny --local-dir DIR`" in message


def test_a_dangling_shard_link_is_named_as_one(tmp_path):
    model_dir = save_model(build_random_model("llama"), tmp_path / "m", "safetensors_sharded")
    shard = find_checkpoint(model_dir).files[-1]
    shard.unlink()
    _dangling(shard)
    with pytest.raises(FileNotFoundError, match=rf"{shard.name} is a symlink to .*which does not exist.*"
                                                r"`hf download REPO_ID --local-dir DIR`"):
        _check(model_dir)


def test_a_dangling_config_link_is_named_as_one(tmp_path):
    model_dir = save_model(build_random_model("llama"), tmp_path / "m")
    (model_dir / "config.json").unlink()
    _dangling(model_dir / "config.json")
    with pytest.raises(FileNotFoundError, match=r"config\.json is a symlink to \.\./\.\./blobs/0123abcd, which "
                                                r"does not exist \(a Hugging Face cache snapshot copied without "
                                                r"its blobs\)"):
        load_model_config(model_dir)


def test_the_listing_of_a_folder_without_weights_marks_dangling_links(tmp_path):
    model_dir = save_model(build_random_model("llama"), tmp_path / "m")
    (model_dir / "model.safetensors").unlink()
    _dangling(model_dir / "tokenizer.json")
    with pytest.raises(FileNotFoundError, match=r"the directory holds: .*tokenizer\.json \(a symlink to nothing\)"):
        find_checkpoint(model_dir)


# ---- a cache folder for its snapshot -----------------------------------------------------------
def test_a_hub_cache_folder_names_the_snapshot_to_pass(tmp_path):
    repo = tmp_path / "models--org--tiny"
    save_model(build_random_model("llama"), repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    with pytest.raises(FileNotFoundError, match=r"is a Hugging Face cache folder, not a model directory: pass the "
                                                rf"snapshot refs/main points to, {repo / 'snapshots' / 'abc123'}$"):
        load_model_config(repo)


# ---- a required field left out -----------------------------------------------------------------
def test_a_missing_required_field_names_the_file_and_where_its_value_is(tmp_path):
    model_dir = save_model(build_random_model("llama"), tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    del config["intermediate_size"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as refused:
        load_model_config(model_dir)
    message = str(refused.value)
    assert message.startswith(f"{model_dir / 'config.json'} lacks required field(s) ['intermediate_size']")
    assert "add each with the value in the original model's config.json" in message
    assert "intermediate_size: the rows of an MLP's gate_proj.weight" in message
