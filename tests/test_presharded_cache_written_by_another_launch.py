"""A --presharded-cache copy another launch (another process) is writing: this launch's writer waited
on the copy's lock without a timeout, so its shutdown waited (up to CACHE_WRITE_WAIT_S, 600 s) for a
copy it was not writing, then said the copy "was still being written". It now leaves the copy to
the launch writing it, says so, and its shutdown does not wait."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.artifacts.presharded_cache import CacheWriter, cache_dir, cache_root, is_ready
from shardlib.model_config import load_model_config
from shardlib.sharding import ShardLayout
from tests.model_factory import build_random_model, save_model

HOLD_S = 600  # killed when the test ends: longer than any start on a loaded host


@pytest.fixture
def model(tmp_path):
    model_dir = save_model(build_random_model("llama", hidden_size=16, intermediate_size=32, num_layers=1,
                                              num_heads=2, num_kv_heads=1), tmp_path / "m")
    return model_dir, load_model_config(model_dir)


def _another_launch_writing(copy: Path) -> subprocess.Popen:
    """A process holding the copy's lock, as a launch writing the copy holds it (the real filelock)."""
    holder = subprocess.Popen([sys.executable, "-c", f"from filelock import FileLock; import time\n"
                                                     f"with FileLock({str(copy) + '.lock'!r}):\n"
                                                     f"    print('held', flush=True); time.sleep({HOLD_S})"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_the_writer_leaves_a_copy_another_launch_is_writing_and_says_so(tmp_path, model):
    model_dir, config = model
    layout = ShardLayout.for_model(config, 1)
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    copy = cache_dir(root, model_dir, config, layout, "float32")
    holder = _another_launch_writing(copy)
    try:
        notes: list[str] = []
        writer = CacheWriter(copy, model_dir, config, layout, "float32", note=notes.append).start()
        writer.join(10)
        assert not writer.writing, "the writer waited for the other launch's lock"
        assert writer.error is None and not is_ready(copy) and not writer.ready
        assert notes == [f"another launch is writing the pre-sharded cache copy {copy}; this one leaves it to that "
                         f"launch and loads from the checkpoint until the copy is there"], notes
    finally:
        holder.kill()
        holder.wait()


def test_a_stale_copy_another_launch_is_replacing_is_not_ready(tmp_path, model):
    """Given way to another launch, the writer wrote nothing: the copy there (here cut short, as one
    cut from other weights would be) was called ready, and a group restart pinned it."""
    from launcher.artifacts.presharded_cache import unusable

    model_dir, config = model
    layout = ShardLayout.for_model(config, 1)
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    copy = cache_dir(root, model_dir, config, layout, "float32")
    first = CacheWriter(copy, model_dir, config, layout, "float32").start()
    first.join(60)
    assert first.ready
    shard = next(copy.glob("rank-*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-8])
    assert unusable(copy, model_dir) is not None
    holder = _another_launch_writing(copy)
    try:
        writer = CacheWriter(copy, model_dir, config, layout, "float32").start()
        writer.join(10)
        assert not writer.writing and writer.error is None and is_ready(copy)
        assert not writer.ready
    finally:
        holder.kill()
        holder.wait()


def test_a_launchs_shutdown_does_not_wait_for_another_launchs_copy(tmp_path, model, monkeypatch, capfd):
    from launcher.api import LaunchConfig, Launcher
    from tests.in_process_cluster import use_in_process_groups

    use_in_process_groups(monkeypatch)
    model_dir, config = model
    monkeypatch.setenv("CORELAUNCH_CACHE", str(tmp_path / "cl"))
    root = cache_root(None)
    root.mkdir(parents=True, mode=0o700)
    copy = cache_dir(root, model_dir, config, ShardLayout.for_model(config, 1), "float32")
    holder = _another_launch_writing(copy)
    try:
        launcher = Launcher(LaunchConfig(model=str(model_dir), compile=False, presharded_cache=True, tp=1))
        launcher.start()
        try:
            assert launcher.generate([[1, 2]], max_new_tokens=2)[0].token_ids
        finally:
            began = time.monotonic()
            launcher.shutdown()
            took = time.monotonic() - began
        assert holder.poll() is None  # still holding: the shutdown did not outlast it
        assert took < 10, f"shutdown took {took:.1f} s, waiting for the other launch's copy"
        err = capfd.readouterr().err
        assert f"another launch is writing the pre-sharded cache copy {copy}" in err, err
        assert "still being written" not in err, err
    finally:
        holder.kill()
        holder.wait()
