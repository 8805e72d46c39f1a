"""A launch from a --presharded directory written by save_presharded (a link to a hidden versioned
sibling) keeps to the version it checked at start: every rank and every restart loads it, and a
save_presharded into the same directory meanwhile leaves it in place until the launch ends."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from launcher.api import Launcher
from launcher.cli.serve_command import hold_the_pinned_version
from launcher.errors import LaunchError, WorkerDied
from shardlib.atomic_dir import current_version, in_use
from shardlib.model_config import load_model_config
from shardlib.presharded import save_presharded
from shardlib.sharding import ShardLayout
from tests.model_factory import build_random_model, save_model
from tests.test_fault_tolerance import PROMPTS, greedy_ignoring_eos


def write_copy(out: Path, model_dir: Path, tp: int = 2) -> None:
    config = load_model_config(model_dir)
    save_presharded(out, model_dir, config, ShardLayout.for_model(config, tp), dtype="float32")


def test_a_restart_loads_the_version_checked_at_start_not_a_rewrite(tmp_path, in_process_cluster):
    """A restarted group re-read the link, and served whatever save_presharded had switched it to
    meanwhile (another fine-tune of the same config): one replica silently answered from other
    weights. It now loads the version the start checked, held until the launch ends."""
    model = build_random_model("llama", seed=3, num_heads=4, num_kv_heads=2)
    model_dir = save_model(model, tmp_path / "m")
    other_dir = save_model(build_random_model("llama", seed=11, num_heads=4, num_kv_heads=2), tmp_path / "tuned")
    copy = tmp_path / "pre"
    write_copy(copy, model_dir)
    started_on = current_version(copy)
    expected = [greedy_ignoring_eos(model, p, 8) for p in PROMPTS]
    with Launcher(model=str(model_dir), presharded_dir=str(copy), max_restarts=2, compile=False,
                  progress=False) as launcher:
        assert launcher.config.presharded_dir == str(started_on)
        write_copy(copy, other_dir)  # same config, other weights: the link now names a new version
        assert current_version(copy) != started_on
        assert started_on.is_dir() and in_use(started_on), "the running launch's version was removed"
        launcher._group.fail_next(WorkerDied("rank 1 (in-process) died while trying to finish the request"))
        out = launcher.generate(PROMPTS, max_new_tokens=8, ignore_eos=True)
        [after] = launcher.replica_status()
    assert after["restarts"] == 1 and after["load_source"] == ["presharded"]
    assert [r.token_ids for r in out] == expected, "the restarted group loaded the rewritten copy"
    assert not in_use(started_on)  # released at shutdown: the next write may remove it


def test_a_copy_rewritten_between_the_check_and_the_pin_is_refused(tmp_path, monkeypatch):
    """The version pinned is the one checked: a save_presharded landing between the two is said,
    not loaded unchecked."""
    import launcher.api as api

    model_dir = save_model(build_random_model("llama", seed=3, num_heads=4, num_kv_heads=2), tmp_path / "m")
    copy = tmp_path / "pre"
    write_copy(copy, model_dir)
    real_pin = api.Launcher._pin_presharded_version

    def rewritten_first(self, checked):
        write_copy(copy, model_dir)  # a second writer finishes while the launch is being checked
        return real_pin(self, checked)

    monkeypatch.setattr(api.Launcher, "_pin_presharded_version", rewritten_first)
    with pytest.raises(LaunchError, match="was written again while this launch checked it"):
        Launcher(model=str(model_dir), presharded_dir=str(copy), compile=False, progress=False).prepare()


def test_a_plain_presharded_directory_is_used_as_given(tmp_path):
    """A directory that is no link (copied by hand, or written by an older release) has no version to pin."""
    import shutil

    model_dir = save_model(build_random_model("llama", seed=3, num_heads=4, num_kv_heads=2), tmp_path / "m")
    write_copy(tmp_path / "pre", model_dir)
    plain = tmp_path / "plain"
    shutil.copytree(current_version(tmp_path / "pre"), plain)
    launcher = Launcher(model=str(model_dir), presharded_dir=str(plain), compile=False, progress=False).prepare()
    assert launcher.config.presharded_dir == str(plain)


def test_a_refusal_at_the_pinned_versions_load_names_the_path_given(tmp_path):
    """The ranks load the pinned `.NAME.v-...` version: their refusals named that hidden folder,
    a path the user never typed, while the link given still named it."""
    from shardlib.presharded import load_presharded

    model_dir = save_model(build_random_model("llama", seed=3, num_heads=4, num_kv_heads=2), tmp_path / "m")
    copy = tmp_path / "pre"
    write_copy(copy, model_dir)
    config = load_model_config(model_dir)
    with pytest.raises(ValueError) as refused:
        load_presharded(current_version(copy), config, ShardLayout.for_model(config, 2), 0, dtype="bfloat16")
    assert str(copy) in str(refused.value) and ".v-" not in str(refused.value), refused.value


def test_a_server_pins_the_version_once_for_every_replica_and_each_holds_it(tmp_path):
    """`corelaunch serve --presharded DIR`: each Serve replica built its own Launcher and pinned
    whatever the link named when it started, so a rewrite left replicas (those Serve starts later
    included) serving different weights. The server pins it once; a replica handed that version
    keeps to it and holds it."""
    from launcher.serving.server_settings import settings_from_args

    model_dir = save_model(build_random_model("llama", seed=3, num_heads=4, num_kv_heads=2), tmp_path / "m")
    copy = tmp_path / "pre"
    write_copy(copy, model_dir)
    pinned = current_version(copy)
    settings = settings_from_args({"model": str(model_dir), "presharded_dir": str(copy), "tp": 2})
    assert settings.launch["presharded_dir"] == str(pinned)
    held = hold_the_pinned_version(settings.launch)  # as `corelaunch serve` holds it while it runs
    try:
        write_copy(copy, model_dir)  # rewritten after the server started: a later replica still gets `pinned`
        assert current_version(copy) != pinned and pinned.is_dir()
        replica = Launcher(**{**settings.launch, "compile": False, "progress": False}).prepare()
        assert replica.config.presharded_dir == str(pinned) and replica._presharded_version == str(pinned)
        replica._hold_pinned_version()
        try:
            assert replica._version_hold is not None and in_use(pinned)
        finally:
            replica._release_version_hold()
    finally:
        os.close(held)
