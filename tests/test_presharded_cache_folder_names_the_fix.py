"""A --presharded-cache folder others may write to is not used (its copy could be anyone's weights):
a folder the user made with umask 002 (mode 775) was never used, and the note named the mode but
not what to do about it."""

from __future__ import annotations

import os
import subprocess

import pytest

from launcher.artifacts.presharded_cache import cache_dir, untrusted
from shardlib.model_config import load_model_config
from shardlib.sharding import ShardLayout
from tests.model_factory import build_random_model, save_model


@pytest.fixture
def copy(tmp_path):
    model_dir = save_model(build_random_model("llama", hidden_size=16, intermediate_size=32, num_layers=1,
                                              num_heads=2, num_kv_heads=1), tmp_path / "m")
    config = load_model_config(model_dir)
    folder = tmp_path / "cache"
    folder.mkdir()
    return cache_dir(folder, model_dir, config, ShardLayout.for_model(config, 1), "float32")


def test_a_group_writable_folder_names_chmod_and_the_other_way_out(copy):
    copy.parent.chmod(0o775)
    assert untrusted(copy) == (
        f"the cache folder ({copy.parent}): it is writable by group or others (mode 775); `chmod go-w {copy.parent}`, "
        f"or pass a folder only you can write (presharded_cache_dir, or CORELAUNCH_CACHE for the default; a missing "
        f"one is created 0700)")
    subprocess.run(["chmod", "go-w", str(copy.parent)], check=True)  # the fix, as the note gives it
    assert untrusted(copy) is None


@pytest.mark.skipif(os.getuid() != 0, reason="handing a folder to another user needs root")
def test_another_users_folder_is_not_told_to_chmod(copy):
    os.chown(copy.parent, 65533, 65533)
    why = untrusted(copy)
    assert "owned by uid 65533" in why and "chmod" not in why and why.endswith("a missing one is created 0700)"), why
