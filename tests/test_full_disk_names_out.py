"""A write of the pre-sharded weights that the filesystem refuses (a full disk, a file size limit, a
quota) is an OSError naming the file: safetensors raises its own SafetensorError, so `corelaunch
compile` (and a --presharded-cache copy, written by the same function) ended in a traceback, exit 1,
instead of its "could not write --out" refusal, exit 2. Proved with a real file size limit
(RLIMIT_FSIZE, SIGXFSZ ignored so the write fails with EFBIG instead of killing the process)."""

from __future__ import annotations

import errno
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.model_factory import build_random_model, save_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_model(build_random_model(seed=3), tmp_path_factory.mktemp("model"))


def _weights_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


def _file_size_limit(limit: int):
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # kept across exec: the write fails, EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_save_presharded_raises_the_os_error_naming_the_file(tmp_path, model_dir):
    """In a child process (the limit is the process's): the refusal is an OSError, errno EFBIG,
    naming the rank file inside the version written beside --out."""
    out, limit = tmp_path / "p", _weights_bytes(model_dir) // 2
    code = f"""
import sys
from shardlib.atomic_dir import out_dir_failure
from shardlib.model_config import load_model_config
from shardlib.planner import plan
from shardlib.presharded import save_presharded
config = load_model_config({str(model_dir)!r})
try:
    save_presharded({str(out)!r}, {str(model_dir)!r}, config, plan(config, tp=1).layout())
except OSError as err:
    print(err.errno, err.filename, out_dir_failure({str(out)!r}, err) is not None, sep="|")
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          preexec_fn=_file_size_limit(limit))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    number, filename, names_out = done.stdout.strip().split("|")
    assert int(number) == errno.EFBIG and names_out == "True", done.stdout
    assert Path(filename).name.startswith("rank-") and Path(filename).parent.name.startswith(".p.v-"), filename
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == []  # the unfinished version removed


IN_PROCESS_CLI = ("import sys, pytest\n"
                  "from tests.in_process_cluster import use_in_process_groups\n"
                  "use_in_process_groups(pytest.MonkeyPatch())  # no Ray: its own files are under the limit too\n"
                  "from launcher.cli import main\n"
                  "sys.exit(main(sys.argv[1:]))\n")


def test_compile_over_a_file_size_limit_names_out_and_exits_2(tmp_path, model_dir):
    out = tmp_path / "cf"
    done = subprocess.run([sys.executable, "-c", IN_PROCESS_CLI, "compile", "--model", str(model_dir), "--out",
                           str(out), "--buckets", "16", "--quiet"], cwd=REPO, capture_output=True, text=True,
                          timeout=300, preexec_fn=_file_size_limit(_weights_bytes(model_dir) // 2))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith(f"corelaunch compile: could not write --out {out} ([Errno {errno.EFBIG}] "
                                  f"{os.strerror(errno.EFBIG)}"), done.stderr
    assert not out.exists()


@pytest.mark.parametrize("words", ['Error while serializing: I/O error: No space left on device (os error 28)',
                                   'IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'])
def test_both_forms_of_safetensors_write_error_become_an_os_error(words, tmp_path, monkeypatch):
    """safetensors 0.5 and later quote the errno as "(os error N)"; earlier releases, which the
    dependency's floor allows, print the Rust error's debug form."""
    from safetensors import SafetensorError

    from shardlib import presharded

    def full(*args, **kwargs):
        raise SafetensorError(words)
    monkeypatch.setattr(presharded, "save_file", full)
    with pytest.raises(OSError) as raised:
        presharded._save_rank_file({}, tmp_path / "rank.safetensors", {})
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(tmp_path / "rank.safetensors")
