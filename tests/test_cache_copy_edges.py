"""launcher.artifacts.presharded_cache: a damaged copy written again, a long model folder name, and
the version of the copy a launch's ranks load."""

from __future__ import annotations

from pathlib import Path

from launcher.artifacts.presharded_cache import CacheWriter, cache_dir, unusable
from shardlib.atomic_dir import current_version, in_use, sibling_name_too_long
from shardlib.model_config import load_model_config
from shardlib.sharding import ShardLayout
from tests.model_factory import build_random_model, save_model


def _model(where: Path):
    model_dir = save_model(build_random_model("llama", num_heads=4, num_kv_heads=2), where)
    config = load_model_config(model_dir)
    return model_dir, config, ShardLayout.for_model(config, 2)


def _write(copy: Path, model_dir: Path, config, layout, force: bool = False) -> CacheWriter:
    writer = CacheWriter(copy, model_dir, config, layout, "float32", force=force).start()
    writer.join(60)
    return writer


def test_a_copy_whose_manifest_is_damaged_is_written_again(tmp_path):
    """unusable() said the manifest could not be read and the launch said it would write the copy
    again, but save_presharded refused the folder as "not a pre-sharded checkpoint" at every launch."""
    model_dir, config, layout = _model(tmp_path / "m")
    copy = cache_dir(tmp_path / "cache", model_dir, config, layout, "float32")
    assert _write(copy, model_dir, config, layout).ready
    damaged = current_version(copy)
    manifest = damaged / "manifest.json"
    manifest.chmod(0o644)
    manifest.write_text(manifest.read_text()[:50])
    assert "its manifest or files cannot be read" in unusable(copy, model_dir)

    writer = _write(copy, model_dir, config, layout)
    assert writer.error is None and writer.ready
    assert unusable(copy, model_dir) is None
    assert current_version(copy) != damaged and not damaged.exists()  # nothing held it: removed


def test_a_user_folder_without_a_manifest_is_still_refused(tmp_path):
    """The writer replaces only a link atomic_dir made: a plain folder of someone's files stays."""
    model_dir, config, layout = _model(tmp_path / "m")
    copy = cache_dir(tmp_path / "cache", model_dir, config, layout, "float32")
    copy.mkdir(parents=True)
    (copy / "notes.txt").write_text("mine")
    writer = _write(copy, model_dir, config, layout)
    assert isinstance(writer.error, FileExistsError), writer.error
    assert (copy / "notes.txt").read_text() == "mine"


def test_a_long_model_folder_name_still_gives_a_writable_copy(tmp_path):
    """The cache name held the whole folder name: at 205 characters, atomic_dir's versioned sibling
    passed the 255-byte limit, every write failed and every launch read the checkpoint."""
    model_dir, config, layout = _model(tmp_path / ("m" * 205))
    copy = cache_dir(tmp_path / "cache", model_dir, config, layout, "float32")
    assert sibling_name_too_long(copy, "v") is None and sibling_name_too_long(copy, "lnk") is None
    writer = _write(copy, model_dir, config, layout)
    assert writer.error is None and writer.ready


def test_two_long_names_that_differ_only_at_the_end_get_two_copies(tmp_path):
    """The name is cut; the key (from the resolved path) still tells the checkpoints apart."""
    first, config, layout = _model(tmp_path / ("m" * 100 + "a"))
    second, _, _ = _model(tmp_path / ("m" * 100 + "b"))
    root = tmp_path / "cache"
    assert cache_dir(root, first, config, layout, "float32") != cache_dir(root, second, config, layout, "float32")


def test_the_ranks_load_a_held_version_of_the_copy_not_its_link(tmp_path):
    """Handed the link, the ranks of one group loaded two versions when another launcher wrote the
    copy again between their loads (or one found the old version deleted)."""
    from launcher.api import Launcher

    model_dir, config, layout = _model(tmp_path / "m")
    copy = cache_dir(tmp_path / "cache", model_dir, config, layout, "float32")
    assert _write(copy, model_dir, config, layout).ready
    launcher = Launcher(model=str(model_dir), tp=2, presharded_cache=True, progress=False, compile=False,
                        presharded_cache_dir=str(tmp_path / "cache")).prepare()
    try:
        pinned = current_version(copy).absolute()
        assert launcher._make_load_spec().presharded_dir == str(pinned)
        assert in_use(pinned)

        assert _write(copy, model_dir, config, layout, force=True).ready  # another launcher's rewrite
        assert current_version(copy).absolute() != pinned
        assert pinned.is_dir() and unusable(pinned, model_dir) is None  # what the ranks were handed stays
    finally:
        launcher._release_version_hold()
    assert not in_use(pinned)


def test_a_launch_that_loads_from_the_copy_says_so(tmp_path, capsys):
    """It loaded from the copy without a word, as if from --model."""
    from launcher.api import Launcher

    model_dir, config, layout = _model(tmp_path / "m")
    copy = cache_dir(tmp_path / "cache", model_dir, config, layout, "float32")
    assert _write(copy, model_dir, config, layout).ready
    capsys.readouterr()
    launcher = Launcher(model=str(model_dir), tp=2, presharded_cache=True, progress=True, compile=False,
                        presharded_cache_dir=str(tmp_path / "cache")).prepare()
    try:
        assert launcher._make_load_spec().presharded_dir is not None
    finally:
        launcher._release_version_hold()
    assert (f"loading the ranks' shards from the pre-sharded cache {copy} (a copy of {model_dir} an earlier "
            f"launch wrote)") in " ".join(capsys.readouterr().err.split())


def test_a_mixed_dtype_checkpoint_saved_without_a_dtype_is_refused_naming_the_dtypes(tmp_path):
    """save_presharded(dtype=None) recorded "mixed" and wrote a whole copy every launch refused."""
    import pytest
    import torch
    from safetensors.torch import load_file, save_file

    from shardlib.presharded import save_presharded

    model_dir, config, layout = _model(tmp_path / "m")
    weights = model_dir / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.bfloat16)
    save_file(tensors, weights, metadata={"format": "pt"})
    out = tmp_path / "pre"
    with pytest.raises(ValueError, match=r"several dtypes \(bfloat16, float32\).*pass dtype="):
        save_presharded(out, model_dir, config, layout)
    assert not out.exists() and not list(tmp_path.glob(".pre.*"))  # nothing half written left
    assert save_presharded(out, model_dir, config, layout, dtype="float32") == out  # the fix it names


def test_each_cache_version_a_launch_pins_stays_held_until_it_lets_go_of_all(tmp_path, monkeypatch):
    """Restarts pin on their own threads: each pin let go of the one hold slot and took it again, so
    a group restarted onto a new version let go of the version another was still loading, and
    two pins at once left one descriptor open after shutdown."""
    import os
    import threading
    from types import SimpleNamespace

    import pytest

    import shardlib.atomic_dir as atomic_dir
    from launcher.api import Launcher

    versions = [tmp_path / ".c.v-1", tmp_path / ".c.v-2"]
    for version in versions:
        version.mkdir()
    linked = [versions[0]]
    monkeypatch.setattr(atomic_dir, "current_version", lambda path: linked[0])
    opened = []

    def hold(version):
        opened.append(os.open(version, os.O_RDONLY))
        return opened[-1]

    monkeypatch.setattr(atomic_dir, "hold_version", hold)
    launch = SimpleNamespace(_cache_lock=threading.Lock(), _cache_holds={}, _version_hold=None)
    assert Launcher._pin_cache_version(launch, tmp_path / "c") == versions[0]
    assert Launcher._pin_cache_version(launch, tmp_path / "c") == versions[0]  # held once
    linked[0] = versions[1]  # written again by another launcher
    assert Launcher._pin_cache_version(launch, tmp_path / "c") == versions[1]
    assert sorted(launch._cache_holds) == sorted(str(v) for v in versions)  # the first still held
    Launcher._release_version_hold(launch)
    assert launch._cache_holds == {}
    for fd in opened:
        with pytest.raises(OSError):
            os.fstat(fd)  # closed
