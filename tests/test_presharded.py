"""shardlib.presharded: round trip equals load_rank_shard; other settings are refused by name."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch

from shardlib.checkpoint import load_rank_shard
from shardlib.model_config import load_model_config
from shardlib.presharded import MANIFEST, load_presharded, rank_file_name, read_manifest, save_presharded
from shardlib.sharding import ShardLayout
from tests.model_factory import save_random_model

SHAPE = dict(hidden_size=48, intermediate_size=100, vocab_size=128, num_layers=2)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    return {
        "llama": save_random_model(root / "llama", "llama", "safetensors_sharded", num_heads=6, num_kv_heads=2, **SHAPE),
        "qwen2": save_random_model(root / "qwen2", "qwen2", "bin", num_heads=6, num_kv_heads=1, **SHAPE),
        "tied": save_random_model(root / "tied", "llama", "safetensors", num_heads=6, num_kv_heads=3,
                                  tie_word_embeddings=True, **SHAPE),
    }


@pytest.fixture(scope="module")
def llama_tp3(sources, tmp_path_factory):
    """A pre-sharded llama at TP 3 (convert_to_mha), shared by the refusal tests."""
    config = load_model_config(sources["llama"])
    layout = ShardLayout.for_model(config, 3)
    return save_presharded(tmp_path_factory.mktemp("pre") / "llama-tp3", sources["llama"], config, layout), config


@pytest.mark.parametrize("model,tp,strategy,dtype", [
    ("llama", 3, "convert_to_mha", None),
    ("llama", 2, "shard", "bfloat16"),
    ("qwen2", 2, "replicate_to_tp", None),
    ("qwen2", 3, "replicate_to_tp", "float16"),
    ("tied", 3, "shard", None),
])
def test_round_trip_equals_load_rank_shard(sources, tmp_path, model, tp, strategy, dtype):
    config = load_model_config(sources[model])
    layout = ShardLayout.for_model(config, tp, strategy)
    out = save_presharded(tmp_path / "pre", sources[model], config, layout, dtype=dtype)
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST] + [rank_file_name(r, tp) for r in range(tp)]
    for rank in range(tp):
        got = load_presharded(out, config, layout, rank, dtype=dtype, verify_sha256=True)
        want = load_rank_shard(sources[model], config, layout, rank, dtype=dtype)
        assert got.keys() == want.keys()
        for name in want:
            assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), (name, rank)


def test_manifest_records_settings_sizes_and_hashes(llama_tp3):
    out, config = llama_tp3
    manifest = read_manifest(out)
    assert manifest["format_version"] == 1 and manifest["config_hash"] == config.config_hash()
    assert (manifest["model_type"], manifest["tp_degree"], manifest["kv_strategy"], manifest["dtype"]) == \
        ("llama", 3, "convert_to_mha", "float32")
    assert manifest["corelaunch_version"]
    for rank, entry in enumerate(manifest["files"]):
        path = out / entry["file"]
        assert entry["rank"] == rank and entry["file"] == rank_file_name(rank, 3)
        assert entry["bytes"] == path.stat().st_size
        assert entry["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


def test_progress_counts_every_tensor_of_every_rank(sources, tmp_path):
    config = load_model_config(sources["tied"])
    calls = []
    save_presharded(tmp_path / "p", sources["tied"], config, ShardLayout.for_model(config, 3),
                    progress=lambda name, done, total: calls.append((name, done, total)))
    assert [c[1] for c in calls] == list(range(1, len(calls) + 1)) and calls[-1][2] == len(calls)
    assert calls[0][0].startswith("rank 0: ") and calls[-1][0].startswith("rank 2: ")


# ---- refusals --------------------------------------------------------------------------------
def _refusal(out, config, layout, rank=0, dtype=None) -> str:
    with pytest.raises(ValueError) as err:
        load_presharded(out, config, layout, rank, dtype=dtype)
    msg = str(err.value)
    assert str(out) in msg and "save_presharded" in msg and "original checkpoint" in msg
    return msg


def test_other_tp_degree_is_refused(llama_tp3):
    out, config = llama_tp3
    msg = _refusal(out, config, ShardLayout.for_model(config, 2, "convert_to_mha"))
    differences = msg.split(". Re-run")[0]
    assert "tp_degree: expected 2, found 3" in differences and "kv_strategy" not in differences


def test_other_strategy_is_refused(llama_tp3, sources, tmp_path):
    out, config = llama_tp3
    other = save_presharded(tmp_path / "tp2", sources["llama"], config, ShardLayout.for_model(config, 2, "shard"))
    msg = _refusal(other, config, ShardLayout.for_model(config, 2, "convert_to_mha"))
    differences = msg.split(". Re-run")[0]
    assert "kv_strategy: expected 'convert_to_mha', found 'shard'" in differences and "tp_degree" not in differences


def test_other_model_is_refused(llama_tp3, sources):
    out, _ = llama_tp3
    qwen = load_model_config(sources["qwen2"])
    msg = _refusal(out, qwen, ShardLayout.for_model(qwen, 3, "convert_to_mha"))
    assert "config_hash: expected" in msg and "model_type: expected 'qwen2', found 'llama'" in msg


def test_other_dtype_is_refused(llama_tp3):
    out, config = llama_tp3
    msg = _refusal(out, config, ShardLayout.for_model(config, 3), dtype="bf16")
    assert "dtype: expected 'bfloat16', found 'float32'" in msg


def test_directory_without_manifest(tmp_path, llama_tp3):
    _, config = llama_tp3
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}.*{MANIFEST}"):
        load_presharded(tmp_path, config, ShardLayout.for_model(config, 3), 0)


def test_corrupt_manifest_and_damaged_files(llama_tp3, tmp_path):
    src, config = llama_tp3
    layout = ShardLayout.for_model(config, 3)
    out = tmp_path / "copy"
    shutil.copytree(src, out)
    victim = out / rank_file_name(1, 3)
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF  # same size, different bytes: only the hash can tell
    victim.write_bytes(bytes(data))
    assert load_presharded(out, config, layout, 1)  # size check alone passes
    with pytest.raises(ValueError, match=f"{victim}.*sha256"):
        load_presharded(out, config, layout, 1, verify_sha256=True)
    victim.write_bytes(bytes(data[:-8]))
    with pytest.raises(ValueError, match=f"{victim}.*truncated"):
        load_presharded(out, config, layout, 1)
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=str(victim)):
        load_presharded(out, config, layout, 1)
    (out / MANIFEST).write_text("{oops")
    with pytest.raises(ValueError, match=f"{MANIFEST}.*not valid JSON"):
        read_manifest(out)
    (out / MANIFEST).write_text(json.dumps({"format_version": 1}))
    with pytest.raises(ValueError, match="config_hash"):
        read_manifest(out)


# ---- writing ---------------------------------------------------------------------------------
def test_save_replaces_a_presharded_dir_and_leaves_no_temp(sources, tmp_path):
    config = load_model_config(sources["llama"])
    out = tmp_path / "p"
    save_presharded(out, sources["llama"], config, ShardLayout.for_model(config, 3))
    save_presharded(out, sources["llama"], config, ShardLayout.for_model(config, 2, "shard"))
    assert read_manifest(out)["tp_degree"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p"]
    assert not (out / rank_file_name(2, 3)).exists()


def test_save_refuses_a_foreign_directory_and_cleans_up_on_failure(sources, tmp_path):
    config = load_model_config(sources["llama"])
    layout = ShardLayout.for_model(config, 3)
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=str(foreign)):
        save_presharded(foreign, sources["llama"], config, layout)
    assert (foreign / "notes.txt").read_text() == "keep me"
    broken = tmp_path / "broken"
    shutil.copytree(sources["llama"], broken)
    next(broken.glob("model-00002-*.safetensors")).write_bytes(b"\x00" * 10)
    with pytest.raises(ValueError):
        save_presharded(tmp_path / "out", broken, config, layout)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "mine"]
