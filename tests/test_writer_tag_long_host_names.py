"""Writer tags of long host names (shardlib/process_alive.py). The host part was the name's first 32
characters: the pods of one Kubernetes workload (raycluster-kuberay-workergroup-worker-8lz2x and
...-q7k4m) had one tag, so one pod's sweep of an --out on shared storage took the other pod's live
compile for its own, saw the pid gone, and deleted the folder still being written."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from shardlib import atomic_dir
from shardlib.process_alive import writer_may_run, writer_tag

THIS_POD = "raycluster-kuberay-workergroup-worker-8lz2x"
OTHER_POD = "raycluster-kuberay-workergroup-worker-q7k4m"


@pytest.fixture(scope="module")
def gone_pid() -> int:
    """A pid no process here has (one that has exited): what a sweep on this pod sees of the other
    pod's live writer."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _tag_on(monkeypatch, host: str) -> str:
    monkeypatch.setattr(socket, "gethostname", lambda: host)
    return writer_tag()


def test_two_pods_of_one_workload_get_different_tags_of_bounded_length(monkeypatch):
    mine, other = _tag_on(monkeypatch, THIS_POD), _tag_on(monkeypatch, OTHER_POD)
    mine_host, other_host = mine.rsplit("-", 1)[0], other.rsplit("-", 1)[0]
    assert mine_host != other_host
    assert len(mine_host) <= 32 and mine_host.startswith("raycluster_kuberay_work"), mine_host


def test_a_short_host_name_keeps_the_tag_earlier_releases_wrote(monkeypatch):
    """Folders written before the change, on such a host, are still told this host's."""
    assert _tag_on(monkeypatch, "ip-10-0-3-17.ec2.internal").rsplit("-", 1)[0] == "ip_10_0_3_17_ec2_internal"


def test_a_sweep_on_one_pod_leaves_the_other_pods_folder_being_written(tmp_path, monkeypatch, gone_pid):
    other = _tag_on(monkeypatch, OTHER_POD)
    writing = tmp_path / f".out.v-{other.rsplit('-', 1)[0]}-{gone_pid}-deadbeef"
    writing.mkdir()
    (writing / "rank-00000-of-00001.safetensors").write_text("half")
    _tag_on(monkeypatch, THIS_POD)
    assert writer_may_run(writing.name.removeprefix(".out.v-"))
    assert atomic_dir.sweep_stale(tmp_path / "out") == []
    assert writing.is_dir()


def test_a_folder_tagged_by_the_earlier_cut_is_left_to_its_age(tmp_path, monkeypatch, gone_pid):
    """The earlier tag of a long name (its first 32 characters) cannot tell this pod from another
    with the same start: such a writer counts as another host's, swept only once it is old."""
    _tag_on(monkeypatch, THIS_POD)
    earlier = THIS_POD.replace("-", "_")[:32]
    folder = tmp_path / f".out.v-{earlier}-{gone_pid}-0123abcd"
    folder.mkdir()
    assert atomic_dir.sweep_stale(tmp_path / "out") == []
    assert atomic_dir.sweep_stale(tmp_path / "out", now=time.time() + atomic_dir.STALE_AFTER_S + 60) == [folder]


def test_this_pods_own_dead_writer_is_still_swept_at_once(tmp_path, monkeypatch, gone_pid):
    mine = _tag_on(monkeypatch, THIS_POD)
    folder = tmp_path / f".out.v-{mine.rsplit('-', 1)[0]}-{gone_pid}-0123abcd"
    folder.mkdir()
    assert atomic_dir.sweep_stale(tmp_path / "out") == [folder]
