"""shardlib.presharded: round trip equals load_rank_shard; other settings are refused by name."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from safetensors.torch import load_file, save_file

from shardlib import presharded
from shardlib.atomic_dir import current_version
from shardlib.checkpoint import load_rank_shard
from shardlib.model_config import load_model_config
from shardlib.presharded import (MANIFEST, load_presharded, rank_file_name, read_manifest, save_presharded,
                                 verified_marker)
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


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_rank_files_get_the_mode_the_umask_allows(sources, tmp_path, umask):
    """safetensors writes 0600 whatever the umask: another user could not start from (or copy, as
    the refusal of an unwritable compiled directory advises) a compiled directory's weights."""
    config = load_model_config(sources["tied"])
    before = os.umask(umask)
    try:
        out = save_presharded(tmp_path / "p", sources["tied"], config, ShardLayout.for_model(config, 2))
    finally:
        os.umask(before)
    modes = {path.name: path.stat().st_mode & 0o777 for path in out.iterdir()}
    assert modes == {name: 0o666 & ~umask for name in modes}, modes


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


def test_a_copy_of_another_model_names_each_config_field_that_differs_and_its_source_first(llama_tp3, tmp_path):
    """The refusal gave two config hashes and advice to write the copy again; it now names the fields
    in which the model the copy was cut from (its manifest's source) differs, and passing that model
    as --model comes first. Where the source no longer holds the config the copy was cut from, or is
    gone, its fields would describe another model: the hashes are said as before."""
    out, config = llama_tp3
    deeper_dir = save_random_model(tmp_path / "deeper", "llama", "safetensors", num_heads=6, num_kv_heads=2,
                                   **{**SHAPE, "num_layers": 3})
    deeper = load_model_config(deeper_dir)
    layout = ShardLayout.for_model(deeper, 3)
    source = read_manifest(out)["source"]
    for msg in (_refusal(out, deeper, layout), _refusal_before_start(out, deeper, layout)):
        named = re.search(rf"\(the model it was cut from, {re.escape(source)}, differs from --model in (.*?)\)\. ", msg)
        assert named and named.group(1) == "num_hidden_layers: 2 in the copy's source, 3 in --model", msg
        assert msg.split(named.group(0))[1].startswith(f"Pass --model {source} (the model it was cut from) to load it"), msg
    moved, _, _ = _copy(llama_tp3, tmp_path)
    _edit_manifest(moved, lambda m: m.update(source=str(tmp_path / "gone")))
    edited = tmp_path / "edited"  # a source whose config.json was changed after the copy was cut
    shutil.copytree(source, edited)
    (edited / "config.json").write_text((deeper_dir / "config.json").read_text())
    stale, _, _ = _copy(llama_tp3, tmp_path / "stale")
    _edit_manifest(stale, lambda m: m.update(source=str(edited)))
    for copy in (moved, stale):
        msg = _refusal(copy, deeper, layout)
        assert "config_hash: expected" in msg and "differs from --model" not in msg and "Pass --model" not in msg, msg


def _refusal_before_start(out, config, layout, dtype=None) -> str:
    """What the driver's check (check_presharded_dir, before any process starts) says."""
    with pytest.raises(ValueError) as err:
        presharded.check_presharded_dir(out, config, layout, dtype)
    return str(err.value)


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
    with pytest.raises(ValueError, match=f"{victim}.*sha256"):  # same size: the first load's hash tells
        load_presharded(out, config, layout, 1)
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
    assert out.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == sorted(["p", current_version(out).name])
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
    with pytest.raises(ValueError, match=r"model-00002-.*\.safetensors"):
        save_presharded(tmp_path / "out", broken, config, layout)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "mine"]


# ---- a tampered directory is refused, naming the file --------------------------------------------
def _copy(llama_tp3, tmp_path):
    src, config = llama_tp3
    out = tmp_path / "copy"
    shutil.copytree(src, out)
    return out, config, ShardLayout.for_model(config, 3)


def _edit_manifest(out, edit):
    manifest = json.loads((out / MANIFEST).read_text())
    edit(manifest)
    (out / MANIFEST).write_text(json.dumps(manifest))


def _record_file(out, rank):
    """Make the manifest's size and sha256 of rank's file match its (altered) content."""
    path = out / rank_file_name(rank, 3)

    def edit(manifest):
        manifest["files"][rank].update(bytes=path.stat().st_size,
                                       sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    _edit_manifest(out, edit)


def test_a_manifest_listing_no_file_for_a_rank_is_refused_with_the_fix(llama_tp3, tmp_path):
    out, config, layout = _copy(llama_tp3, tmp_path)
    _edit_manifest(out, lambda manifest: manifest["files"].pop(2))
    for check in (lambda: presharded.check_presharded_dir(out, config, layout),
                  lambda: load_presharded(out, config, layout, 2)):
        with pytest.raises(ValueError) as err:
            check()
        assert str(err.value) == f"{out / MANIFEST} lists no file for rank 2; {presharded._WRITE_HINT}"


def test_a_rank_pointed_at_another_ranks_file_is_refused(llama_tp3, tmp_path):
    """The ranks' shards share one shape: a manifest whose entries for ranks 0 and 1 were swapped
    (or whose files were renamed into each other's places, sizes and hashes recorded) passed every
    check, and each rank loaded the other's weights: wrong tokens, exit 0."""
    out, config, layout = _copy(llama_tp3, tmp_path)

    def swap_ranks(manifest):
        manifest["files"][0]["rank"], manifest["files"][1]["rank"] = 1, 0
    _edit_manifest(out, swap_ranks)
    with pytest.raises(ValueError, match=rf"{re.escape(str(out / rank_file_name(1, 3)))} is listed in its manifest.json "
                                         rf"for rank 0 of 3, but it is not that rank's file \(its name "
                                         rf"{rank_file_name(1, 3)}, its header rank 1 of 3"):
        load_presharded(out, config, layout, 0)

    out, config, layout = _copy(llama_tp3, tmp_path / "renamed")
    first, second = out / rank_file_name(0, 3), out / rank_file_name(1, 3)
    first.rename(out / "moved")
    second.rename(first)
    (out / "moved").rename(second)
    _record_file(out, 0)
    _record_file(out, 1)
    with pytest.raises(ValueError, match=r"for rank 0 of 3, but it is not that rank's file .*its header rank 1 of 3"):
        load_presharded(out, config, layout, 0)
    assert load_presharded(llama_tp3[0], config, layout, 0)  # the written directory itself loads


@pytest.mark.parametrize("where", ["dotdot", "absolute", "symlink"])
def test_a_file_outside_the_directory_is_refused(llama_tp3, tmp_path, where):
    out, config, layout = _copy(llama_tp3, tmp_path)
    outside = tmp_path / "other" / "rank0.safetensors"
    outside.parent.mkdir()
    shutil.copy(out / rank_file_name(0, 3), outside)  # a valid rank file: only its place is wrong
    name = {"dotdot": "../other/rank0.safetensors", "absolute": str(outside), "symlink": "link.safetensors"}[where]
    if where == "symlink":
        (out / name).symlink_to(outside)
    _edit_manifest(out, lambda m: m["files"][0].update(file=name))
    with pytest.raises(ValueError) as err:
        load_presharded(out, config, layout, 0)
    msg = str(err.value)
    assert str(out / MANIFEST) in msg and repr(name) in msg and "refused" in msg
    assert ("outside" if where == "symlink" else "not a path inside") in msg


def test_flipped_bytes_are_caught_by_the_first_load_and_a_verified_file_is_not_hashed_again(
        llama_tp3, tmp_path, monkeypatch):
    out, config, layout = _copy(llama_tp3, tmp_path)
    victim = out / rank_file_name(2, 3)
    good = victim.read_bytes()
    data = bytearray(good)
    data[len(data) // 2] ^= 0x01  # one bit inside a tensor: size and header unchanged
    victim.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"{victim} does not match the sha256"):
        load_presharded(out, config, layout, 2)
    assert not verified_marker(victim).exists()

    victim.write_bytes(good)
    hashed = []
    real_sha256 = presharded._sha256
    monkeypatch.setattr(presharded, "_sha256", lambda path: hashed.append(path) or real_sha256(path))
    load_presharded(out, config, layout, 2)
    assert hashed == [victim]  # the first load hashes and records it
    marker = verified_marker(victim)
    recorded = json.loads(marker.read_text())
    st = victim.stat()
    assert recorded["sha256"] == hashlib.sha256(good).hexdigest() == read_manifest(out)["files"][2]["sha256"]
    assert (recorded["bytes"], recorded["mtime_ns"], recorded["inode"]) == (st.st_size, st.st_mtime_ns, st.st_ino)
    before = marker.stat().st_mtime_ns, marker.read_text()

    load_presharded(out, config, layout, 2)
    assert hashed == [victim]  # the marker vouched for it: no second hash
    assert (marker.stat().st_mtime_ns, marker.read_text()) == before

    victim.write_bytes(bytes(data))  # changed after verification: the marker no longer fits
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with its mtime put back (ctime moved)
    with pytest.raises(ValueError, match=f"{victim} does not match the sha256"):
        load_presharded(out, config, layout, 2)
    assert not marker.exists()


@pytest.mark.parametrize("planted", ["symlink-at-the-old-temporary-name", "fifo-as-marker"])
def test_a_planted_marker_name_is_neither_written_through_nor_waited_on(llama_tp3, tmp_path, planted):
    """The marker was written through a fixed temporary name (a symlink planted there had the
    marker's JSON written into its target) and read with a plain open (a FIFO planted as the marker
    held the load for ever). Whoever can write the directory can rewrite the manifest anyway, but
    not other files of the loading user's, nor hang the load."""
    import multiprocessing

    out, config, layout = _copy(llama_tp3, tmp_path)
    marker = verified_marker(out / rank_file_name(0, 3))
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    marker.unlink(missing_ok=True)  # an earlier test's load may have verified the copied file
    if planted == "symlink-at-the-old-temporary-name":  # the pid is the loading process's: this one's
        marker.with_name(f"{marker.name}.{os.getpid()}.tmp").symlink_to(victim)
    else:
        os.mkfifo(marker)
    loading = multiprocessing.get_context("fork").Process(target=load_presharded, args=(out, config, layout, 0))
    if planted == "symlink-at-the-old-temporary-name":
        load_presharded(out, config, layout, 0)  # in this process: the pid in the planted name is ours
    else:
        loading.start()
        loading.join(60)
        hung = loading.is_alive()
        if hung:
            loading.kill()
        assert not hung and loading.exitcode == 0, "the load waited on the planted marker"
    assert victim.read_text() == "keep me"


@pytest.mark.parametrize("recorded", [False, True], ids=["manifest-as-written", "manifest-rewritten"])
def test_a_file_saved_in_another_dtype_is_refused(llama_tp3, tmp_path, recorded):
    out, config, layout = _copy(llama_tp3, tmp_path)
    victim = out / rank_file_name(1, 3)
    save_file({k: v.half() for k, v in load_file(victim).items()}, victim)
    if recorded:  # size and sha256 fit: only the dtype check can tell
        _record_file(out, 1)
    with pytest.raises(ValueError) as err:
        load_presharded(out, config, layout, 1, dtype="float32")
    msg = str(err.value)
    assert msg.startswith(f"{victim}: ") and re.search(r"tensor '[\w.]+' has dtype float16, expected float32", msg)


def test_a_tensor_of_another_shape_is_refused(llama_tp3, tmp_path):
    out, config, layout = _copy(llama_tp3, tmp_path)
    victim = out / rank_file_name(0, 3)
    tensors = load_file(victim)
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].clone()
    save_file(tensors, victim)
    _record_file(out, 0)
    with pytest.raises(ValueError) as err:
        load_presharded(out, config, layout, 0)
    assert str(victim) in str(err.value) and "tensor 'model.norm.weight' has shape (47,), expected (48,)" in str(err.value)


@pytest.mark.parametrize("field, edit", [
    ("tp_degree", lambda m: m.update(tp_degree="3")),
    ("format_version", lambda m: m.update(format_version=True)),
    ("pad_q_heads", lambda m: m.update(pad_q_heads="false")),  # a launch read it as bool("false"): padded
    ("dtype", lambda m: m.update(dtype=None)),
    ("files", lambda m: m.update(files={"rank": 0})),
    ("files[1]", lambda m: m["files"].__setitem__(1, "rank-00001-of-00003.safetensors")),
    ("files[0].file", lambda m: m["files"][0].update(file=7)),
    ("files[0].bytes", lambda m: m["files"][0].update(bytes="83344")),
    ("files[2].rank", lambda m: m["files"][2].pop("rank")),
    ("files[2].rank", lambda m: m["files"][2].update(rank=1)),
    ("files[0].sha256", lambda m: m["files"][0].update(sha256="not a digest")),
    ("files[0].tensors", lambda m: m["files"][0].update(tensors=[])),
    ("files[0].tensors['model.norm.weight'].shape",
     lambda m: m["files"][0]["tensors"]["model.norm.weight"].update(shape=["48"])),
])
def test_a_malformed_manifest_field_is_a_value_error_naming_it(llama_tp3, tmp_path, field, edit):
    out, config, layout = _copy(llama_tp3, tmp_path)
    _edit_manifest(out, edit)
    for read in (lambda: read_manifest(out), lambda: load_presharded(out, config, layout, 0)):
        with pytest.raises(ValueError) as err:
            read()
        assert str(out / MANIFEST) in str(err.value) and f"field {field!r}" in str(err.value)


# ---- the output path always names a complete directory ------------------------------------------
KILLED_WRITER = """
import importlib, os, signal, sys
atomic_dir = importlib.import_module("shardlib.atomic_dir")
presharded = importlib.import_module("shardlib.presharded")
from shardlib.model_config import load_model_config
from shardlib.sharding import ShardLayout

out, src, when = sys.argv[1:4]
def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
if when == "complete":  # every file written, before fsync and the swap
    atomic_dir.fsync_tree = die
else:  # after the first rank's file
    real_save = presharded.save_file
    presharded.save_file = lambda *args, **kwargs: (real_save(*args, **kwargs), die())
config = load_model_config(src)
presharded.save_presharded(out, src, config, ShardLayout.for_model(config, 2, "shard"))
"""


def _loads_completely(out, config, layout):
    manifest = read_manifest(out)
    assert manifest["tp_degree"] == layout.tp_degree
    for rank in range(layout.tp_degree):
        assert load_presharded(out, config, layout, rank, verify_sha256=True)


def test_a_writer_killed_midway_leaves_the_old_directory_and_its_leftovers_are_swept(sources, tmp_path):
    config = load_model_config(sources["llama"])
    tp3 = ShardLayout.for_model(config, 3)
    out = save_presharded(tmp_path / "p", sources["llama"], config, tp3)
    for when, complete in (("complete", True), ("partial", False)):
        proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(out), str(sources["llama"]), when],
                                cwd=Path(__file__).resolve().parents[1], stderr=subprocess.PIPE, text=True)
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == -signal.SIGKILL, stderr
        _loads_completely(out, config, tp3)  # still the complete TP-3 directory
        # what the killed writer left (the one before it was swept by this writer: its pid was dead)
        [left] = [p for p in tmp_path.iterdir() if p.name not in ("p", current_version(out).name)]
        assert left.name.startswith(".p.v-") and f"-{proc.pid}-" in left.name
        assert (left / MANIFEST).is_file() == complete

    tp2 = ShardLayout.for_model(config, 2, "shard")
    save_presharded(out, sources["llama"], config, tp2)  # the next write sweeps it
    _loads_completely(out, config, tp2)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["p", current_version(out).name])


def test_a_write_failing_after_its_files_are_complete_changes_nothing(sources, tmp_path, monkeypatch):
    from shardlib import atomic_dir

    config = load_model_config(sources["llama"])
    tp3 = ShardLayout.for_model(config, 3)
    out = save_presharded(tmp_path / "p", sources["llama"], config, tp3)
    before = sorted(p.name for p in tmp_path.iterdir())

    def fail(version):
        assert (version / MANIFEST).is_file()  # complete, not yet swapped in
        raise OSError("disk gone")
    monkeypatch.setattr(atomic_dir, "fsync_tree", fail)
    with pytest.raises(OSError, match="disk gone"):
        save_presharded(out, sources["llama"], config, ShardLayout.for_model(config, 2, "shard"))
    _loads_completely(out, config, tp3)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_launch_takes_the_layout_its_presharded_weights_were_cut_for(llama_tp3, sources, ray_tripwire):
    """With --tp auto the planner's own degree was refused only after Ray and every rank had
    started, advising to write the directory again; as --compiled does, the launch takes the
    directory's layout, and a contradicting option is refused before anything starts."""
    from launcher.api import Launcher

    directory, _ = llama_tp3
    common = dict(model=str(sources["llama"]), presharded_dir=str(directory), progress=False)
    launcher = Launcher(**common).prepare()
    assert (launcher.plan.tp_degree, launcher.config.kv_strategy) == (3, "convert_to_mha")
    with pytest.raises(ValueError, match=rf"pre-sharded checkpoint {re.escape(str(directory))} was cut for another "
                                         rf"layout than this launch asks: --tp 2 \(it was written for 3\); "
                                         rf"--dtype bfloat16 \(it was written for float32\); drop those options"):
        Launcher(**common, tp=2, dtype="bfloat16").prepare()
    with pytest.raises(ValueError, match=r"--kv-strategy replicate_to_tp \(it was written for convert_to_mha\)"):
        Launcher(**common, tp=3, kv_strategy="replicate_to_tp").prepare()


def test_a_serve_replicas_cpu_share_is_sized_for_the_copys_tp_degree(llama_tp3, sources, monkeypatch, ray_tripwire):
    """The share was planned from the raw settings (--tp auto: the planner's own degree), while the
    replica's Launcher ran the copy's TP 3: 3 ranks at the share of fewer never fit."""
    from launcher.cluster import placement
    from launcher.cluster.resources import cpu_rank_resources
    from launcher.serving import openai_app

    node = placement.NodeInfo(node_id="n", address="127.0.0.1", total={"CPU": 4.0}, free={"CPU": 4.0})
    monkeypatch.setattr(placement, "alive_nodes", lambda: [node])
    launch = dict(model=str(sources["llama"]), presharded_dir=str(llama_tp3[0]), progress=False)
    assert openai_app._cpus_per_rank(launch, 1) == cpu_rank_resources(3, [4.0]).num_cpus == 1


def test_a_broken_presharded_dir_is_refused_before_any_start(llama_tp3, sources, tmp_path, ray_tripwire):
    """A manifest cut short, a rank's file missing or truncated: named only once Ray and every rank
    had started (after "connecting to Ray"); the planning now says what the ranks' load would."""
    import shutil

    from launcher.api import Launcher
    from shardlib.presharded import rank_file_name

    directory, _ = llama_tp3
    damages = {"manifest cut short": (lambda d: (d / "manifest.json").write_text((d / "manifest.json").read_text()[:300]),
                                      "is not valid JSON"),
               "a rank's file missing": (lambda d: (d / rank_file_name(2, 3)).unlink(),
                                         f"{rank_file_name(2, 3)} named in its manifest.json is missing"),
               "a rank's file truncated": (lambda d: (d / rank_file_name(1, 3)).write_bytes(
                   (d / rank_file_name(1, 3)).read_bytes()[:-10]), "truncated or modified")}
    for name, (damage, words) in damages.items():
        broken = tmp_path / name.replace(" ", "-").replace("'", "")
        shutil.copytree(directory.resolve(), broken)
        damage(broken)
        with pytest.raises((ValueError, FileNotFoundError), match=re.escape(words)):
            Launcher(model=str(sources["llama"]), presharded_dir=str(broken), progress=False).prepare()


@pytest.mark.parametrize("field, value", [("tp_degree", 0), ("tp_degree", -2), ("kv_strategy", "bogus"),
                                          ("moe_sharding", "bogus")])
@pytest.mark.parametrize("tp", ["auto", 3])
def test_a_layout_value_no_save_writes_is_refused_naming_the_manifest_field(llama_tp3, sources, tmp_path, field,
                                                                            value, tp):
    """The launch takes the manifest's layout into its own settings: "tp_degree": 0 was refused as
    `--tp (0) must be a positive integer`, a flag nobody passed, and with --tp 3 as another layout
    than asked, advising to drop the options. The manifest's field is named, with the fix."""
    from launcher.api import LaunchConfig
    from launcher.launch_plan import plan_launch, with_artifact_settings
    from launcher.progress import Progress

    out, _, _ = _copy(llama_tp3, tmp_path)
    _edit_manifest(out, lambda manifest: manifest.update({field: value}))
    with pytest.raises(ValueError) as err:
        config = with_artifact_settings(LaunchConfig(model=str(sources["llama"]), presharded_dir=str(out), tp=tp))
        plan_launch(config, Progress(False))
    assert f"{out / MANIFEST}: field {field!r}" in str(err.value) and repr(value) in str(err.value)
    assert presharded._WRITE_HINT in str(err.value)


def test_the_flags_a_copy_was_written_with_are_taken_again_where_padding_adds_nothing(llama_tp3, sources, tmp_path,
                                                                                      ray_tripwire):
    """--pad-q-heads at a TP degree that divides the heads pads nothing, so the copy (and a compiled
    directory) records it off; a launch with the very flags it was written with was refused as
    asking for padded heads, and writing it again could not help."""
    from launcher.api import LaunchConfig, Launcher
    from launcher.artifacts import compiled_dir
    from tests.test_compile_cli import fake_compiled_dir

    directory, config = llama_tp3  # 6 heads at TP 3: nothing to pad
    written = save_presharded(tmp_path / "padded-flag", sources["llama"], config,
                              ShardLayout.for_model(config, 3, pad_q_heads=True))
    assert read_manifest(written)["pad_q_heads"] is False
    launcher = Launcher(model=str(sources["llama"]), presharded_dir=str(written), pad_q_heads=True, progress=False)
    assert launcher.prepare().plan.tp_degree == 3
    root = fake_compiled_dir(tmp_path / "c", sources["llama"], tp_degree=3, pad_q_heads=False)
    compiled_dir.apply_compiled_dir(LaunchConfig(compiled_dir=str(root), pad_q_heads=True))  # taken too
    padding = fake_compiled_dir(tmp_path / "c4", sources["llama"], tp_degree=4, pad_q_heads=False)
    with pytest.raises(ValueError, match=r"launch: pad_q_heads: compiled without it, asked for"):  # 6 heads at 4: it pads
        compiled_dir.apply_compiled_dir(LaunchConfig(compiled_dir=str(padding), pad_q_heads=True))
