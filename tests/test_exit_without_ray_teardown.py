"""`corelaunch serve` ends its private Ray by stopping the cluster's processes while the command's
own process is still whole, then exits without Ray's teardown of that process. Run first, that
teardown raced with the stopping processes' last calls: one answered after the driver's core worker
was gone made Ray end the process with status 1 ("The core worker has already been shutdown"),
whatever the command's code (a server stopped cleanly by SIGTERM failed CI so)."""

from __future__ import annotations

import glob
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.test_hardening_e2e import alive, clean_env

REPO = Path(__file__).parent.parent

ENDS_FOR_EXIT = """
import json, os, sys
from launcher.cluster import ray_cluster

connection = ray_cluster.connect("local")
import ray

node = ray._private.worker._global_node
pids = [info.process.pid for infos in node.all_processes.values() for info in infos]
session = node.get_session_dir_path()
left_out = connection.close_for_exit()
print(json.dumps({"pids": pids, "session": session, "left_out": left_out,
                  "flag": ray_cluster.teardown_left_to_exit(),
                  "own_excepthook": sys.excepthook is sys.__excepthook__}), flush=True)
os._exit(0)
"""


def test_a_private_cluster_alone_is_stopped_for_the_exit_without_the_drivers_teardown():
    run = subprocess.run([sys.executable, "-c", ENDS_FOR_EXIT], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env=clean_env())
    assert run.returncode == 0, run.stderr[-3000:]
    told = json.loads(run.stdout.strip().splitlines()[-1])
    assert told["left_out"] is True and told["flag"] is True
    # Ray's hook sent an uncaught error to the stopped GCS: 60 s, then an exit without the traceback
    assert told["own_excepthook"] is True
    assert told["pids"], "no Ray processes were recorded"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(alive(p) for p in _processes(told["pids"])):
        time.sleep(0.2)
    left = [p.pid for p in _processes(told["pids"]) if alive(p)]
    assert left == [], f"Ray processes still running 20 s after the exit: {left}"
    # the driver's core worker was never torn down: Ray logs its disconnect when it is
    [driver_log] = glob.glob(f"{told['session']}/logs/python-core-driver-*_{_driver_pid(told['session'])}.log")
    assert "Shutdown by ray.shutdown()" not in Path(driver_log).read_text()


def _processes(pids: list[int]) -> list[psutil.Process]:
    found = []
    for pid in pids:
        try:
            found.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return found


def _driver_pid(session: str) -> str:
    [log] = glob.glob(f"{session}/logs/python-core-driver-*.log")
    return log.rsplit("_", 1)[1].removesuffix(".log")


def test_a_joined_cluster_is_closed_as_usual(monkeypatch):
    """A cluster joined rather than started here: an ordinary close(), and the exit keeps Ray's teardown."""
    from launcher.cluster import ray_cluster

    closed = []
    monkeypatch.setattr(ray_cluster.RayConnection, "close", lambda self: closed.append(self))
    joined = ray_cluster.RayConnection(started_here=False, address="10.0.0.1:6379", joined_here=True)
    assert joined.close_for_exit() is False and closed == [joined]
    assert not ray_cluster.teardown_left_to_exit()


def exits_of_the_cli(monkeypatch, main) -> list[int]:
    """The codes cli.run() passed to os._exit, with `main` as the command and Ray left to the exit."""
    import launcher.cli as cli
    from launcher.cluster import ray_cluster

    exits = []

    def recorded_exit(code):
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(cli, "main", main)
    monkeypatch.setattr(cli.os, "_exit", recorded_exit)
    monkeypatch.setattr(ray_cluster, "_TEARDOWN_LEFT_TO_EXIT", _set_event())
    try:
        cli.run()
    except SystemExit:
        pass
    return exits


def test_the_cli_exits_without_the_interpreters_teardown_once_ray_was_left_to_it(monkeypatch):
    """With Ray left to the exit, a clean run ends through os._exit(0), not the interpreter's teardown."""
    assert exits_of_the_cli(monkeypatch, lambda: 0) == [0]


def test_an_error_after_ray_was_left_to_the_exit_prints_its_traceback_and_exits_at_once(monkeypatch, capsys):
    """An error escaping `corelaunch serve` after its Ray was stopped for the exit (its ready line
    written to a full disk, say) went to Ray's exception hook: 60 s of waiting on the stopped GCS,
    then an exit without the traceback."""
    def failing_main():
        raise OSError(28, "No space left on device")

    assert exits_of_the_cli(monkeypatch, failing_main) == [1]
    assert "OSError: [Errno 28] No space left on device" in capsys.readouterr().err


def test_a_system_exit_after_ray_was_left_to_the_exit_keeps_its_code(monkeypatch):
    """SystemExit(3) keeps its code through the os._exit path."""
    def exiting_main():
        raise SystemExit(3)

    assert exits_of_the_cli(monkeypatch, exiting_main) == [3]


def _set_event():
    import threading

    event = threading.Event()
    event.set()
    return event
