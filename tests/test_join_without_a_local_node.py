"""`--ray-address HOST:PORT` of a cluster none of whose nodes runs on this machine. Its GCS answers
corelaunch's probe, then Ray's driver looks for a raylet of that cluster on its own host, retries
for GCS_SERVER_REQUEST_TIMEOUT_SECONDS (60 s) and fails: corelaunch said "no Ray cluster answered"
(contradicting the probe) and dropped Ray's reason, and Ctrl-C meanwhile was held to the end and
then lost (exit 2, not 130).

The cluster here is a head of the test's own whose raylet is killed: its GCS stays up, and no
node of it is left on this machine, as for a driver on a machine outside the cluster."""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from launcher.cluster import ray_cluster

REPO = Path(__file__).resolve().parent.parent


def _group_members(pgid: int) -> dict[int, str]:
    """pid -> command line of each process in process group pgid."""
    members = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) == pgid:
                members[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ProcessLookupError):  # gone meanwhile
            pass
    return members


def _kill_group(pgid: int) -> None:
    """SIGKILL process group pgid, gone already or not."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _kill_raylet(pgid: int) -> None:
    """SIGKILL the raylet of the head in group pgid, and wait until it is gone (its GCS stays up)."""
    raylets = [pid for pid, cmdline in _group_members(pgid).items() if cmdline.split(" ")[0].endswith("/raylet")]
    assert len(raylets) == 1, _group_members(pgid)
    os.kill(raylets[0], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{raylets[0]}").exists() and Path(f"/proc/{raylets[0]}/cmdline").read_bytes():
        assert time.monotonic() < deadline, "the raylet outlived SIGKILL"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def nodeless_cluster():
    """(address, env): a head's GCS, on ports and in a temp dir of its own, with no raylet left, and
    the environment to join it with (its token authentication, its temp dir)."""
    from workers.net import free_port_for_a_late_bind

    # a short directory: Ray's Unix socket paths live under it, and they have a length limit
    with tempfile.TemporaryDirectory(prefix="joinray", dir="/tmp") as tmp:
        env = {**os.environ, "RAY_TMPDIR": tmp, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        env.pop("RAY_ADDRESS", None)
        gcs = free_port_for_a_late_bind()  # Ray binds them seconds later: none from the ephemeral range
        client = free_port_for_a_late_bind()
        while client == gcs:
            client = free_port_for_a_late_bind()
        # not --block: `ray start --block` stops the whole cluster once one of its processes dies
        head = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--head", f"--port={gcs}",
                                 f"--temp-dir={tmp}/ray", f"--ray-client-server-port={client}", "--num-cpus=1",
                                 "--include-dashboard=false", "--disable-usage-stats"],
                                env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            out, _ = head.communicate(timeout=180)
            assert head.returncode == 0, out[-3000:]
            _kill_raylet(head.pid)  # the group outlives `ray start` itself, its leader
            yield f"127.0.0.1:{gcs}", env
        finally:
            _kill_group(head.pid)  # the head's GCS and whatever else of it is left: its group only
            head.wait()


def generate(address: str, env: dict, request_timeout_s: int) -> subprocess.Popen:
    """`corelaunch generate` joining address, with Ray's driver looking for a node of it on this
    machine for request_timeout_s (its 60 s by default)."""
    return subprocess.Popen([sys.executable, "-m", "launcher", "generate", "--ray-address", address, "--no-compile",
                             "--seq-len", "512", "--max-new-tokens", "2", "Hi"],
                            env={**env, "RAY_gcs_server_request_timeout_seconds": str(request_timeout_s)},
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _finish(run: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """run's stdout and stderr once it exits; its group killed whatever happens."""
    try:
        return run.communicate(timeout=timeout)
    finally:
        _kill_group(run.pid)
        run.wait()


@pytest.mark.slow
def test_a_cluster_with_no_node_on_this_machine_is_refused_as_such(nodeless_cluster):
    address, env = nodeless_cluster
    run = generate(address, env, request_timeout_s=5)
    _, err = _finish(run, timeout=240)
    assert run.returncode == 2, err[-3000:]
    assert "runs none of its nodes" in err and address in err, err[-3000:]
    assert "ray job submit" in err and "--ray-address local" in err, err[-3000:]
    assert "no Ray cluster answered" not in err, err[-3000:]


@pytest.mark.slow
def test_ctrl_c_while_ray_looks_for_a_node_here_exits_130_at_once(nodeless_cluster):
    address, env = nodeless_cluster
    run = generate(address, env, request_timeout_s=30)
    try:
        # the tokenizer is loaded just before Ray is joined; then ray.init looks for a node for 30 s
        for line in run.stderr:
            if "loading tokenizer" in line:
                break
        time.sleep(2)
        assert run.poll() is None, "generate exited before Ctrl-C"
        os.killpg(run.pid, signal.SIGINT)  # as a terminal sends it, to the whole group
        interrupted_at = time.monotonic()
    finally:
        _, err = _finish(run, timeout=120)
    assert run.returncode == 130, err[-3000:]
    assert time.monotonic() - interrupted_at < 15, "Ctrl-C was held until ray.init gave up"


def test_a_ray_without_the_node_lookup_holds_ctrl_c_throughout(monkeypatch):
    """The hold handler looked Ray's private function up at each Ctrl-C: a Ray without it would have
    raised AttributeError from inside ray.init, stranding a private start the hold exists to keep."""
    import ray._private.services as services

    assert ray_cluster._inside(sys._getframe(), sys._getframe().f_code)
    assert ray_cluster._node_lookup_code() is services.get_node_to_connect_for_driver.__code__
    monkeypatch.delattr(services, "get_node_to_connect_for_driver")
    assert ray_cluster._node_lookup_code() is None


@pytest.mark.parametrize("init_fails", [False, True])
def test_a_failing_shutdown_after_a_held_ctrl_c_still_ends_in_the_interrupt(monkeypatch, init_fails):
    """The shutdown after a held Ctrl-C, unguarded, replaced the interrupt (exit 130) with its own
    error, whether ray.init had returned or failed."""
    import ray

    def init(**_options):
        os.kill(os.getpid(), signal.SIGINT)  # held by _init's handler until ray.init is back
        time.sleep(0.05)
        if init_fails:
            raise ConnectionError("Failed to connect to Ray cluster")

    def shutdown():
        raise RuntimeError("the shutdown failed too")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", shutdown)
    with pytest.raises(KeyboardInterrupt):
        ray_cluster._init(address="127.0.0.1:1")
