"""`--ray-address local` with a cluster recorded on the host (slow: starts a private Ray in a fresh
process). The record lives in a Ray temp dir of the test's own (RAY_TMPDIR), so no other test, and
no cluster of the host's, sees it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from shardlib.host_cpus import host_cpus

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]

CONNECT_LOCAL = textwrap.dedent("""
    import ray
    from launcher.cluster import ray_cluster
    connection = ray_cluster.connect("local", num_cpus=1)
    print(connection.started_here, ray.cluster_resources().get("CPU"), flush=True)
    second = ray_cluster.connect("local", num_cpus=1)  # another launch of this process: it shares the session
    print(ray_cluster.private_cluster("local"), ray_cluster.private_cluster(None), flush=True)
    for other in ("127.0.0.1:9", None):  # another cluster (None: the one recorded) was not joined but shared
        try:
            ray_cluster.connect(other)
        except Exception as err:
            print("already connected to a private Ray cluster it started" in str(err), flush=True)
    connection.close()  # which must not end it under the second (its workers lost their driver)
    print(second.started_here, ray.is_initialized(), flush=True)
    second.close()
    print(ray.is_initialized(), flush=True)
""")


def test_local_starts_a_private_ray_even_with_a_cluster_recorded_on_the_host():
    """Before the fix, ray.init(num_cpus=...) without an address read the record `ray start` leaves
    (ray_current_cluster), tried to join that cluster and refused num_cpus: `corelaunch serve`
    failed at start while another program's `ray start` cluster ran on the host. The recorded
    address here answers nothing, so joining it could not succeed either."""
    # a short directory: Ray's Unix socket paths live under it, and they have a length limit
    with tempfile.TemporaryDirectory(prefix="clray", dir="/tmp") as tmp:
        (Path(tmp) / "ray").mkdir()
        (Path(tmp) / "ray" / "ray_current_cluster").write_text("127.0.0.1:9\n")
        env = {**os.environ, "RAY_TMPDIR": tmp}
        env.pop("RAY_ADDRESS", None)
        out = subprocess.run([sys.executable, "-c", CONNECT_LOCAL], capture_output=True, text=True, timeout=180,
                             env=env, cwd=REPO)
        assert out.returncode == 0, out.stderr[-3000:]
        # a second launch asking for a cluster other than the shared one is refused (it ran on the
        # private one, and timed out placing its ranks there), and only "local" is that private one
        assert out.stdout.split() == ["True", "1.0", "True", "False", "True", "True", "True", "True", "False"]


PRIVATE_TO_START = "the private Ray cluster this launch would start (this host alone)"
HOST_CPUS = host_cpus()  # what the private cluster declares: affinity and cgroup quota counted


@pytest.mark.parametrize("options, words", [
    (["--cpus-per-rank", "64"], [f"{PRIVATE_TO_START} cannot place a TP group",
                                 f"Lower --cpus-per-rank (at most {HOST_CPUS}, the most CPUs a node has)"]),
    # --replicas auto would size the replicas before the refusal above: "room for none"
    (["--cpus-per-rank", "64", "--replicas", "auto"], [f"{PRIVATE_TO_START} cannot place a TP group (replicas=auto "
                                                       f"would find room for none)", "Lower --cpus-per-rank (at most"]),
    # one group fits, two never will: the first started and the second waited the timeout out (exit 3)
    (["--cpus-per-rank", str(HOST_CPUS), "--replicas", "2"],
     [f"{PRIVATE_TO_START} holds 1 TP group(s) of 1 rank(s) at {HOST_CPUS} CPU a rank (--cpus-per-rank), not "
      f"the 2 replicas asked (--replicas); lower --replicas to 1 or --cpus-per-rank, or use --replicas auto"]),
])
def test_a_private_cluster_too_small_for_the_groups_is_refused_without_waiting_for_placement(options, words):
    """A private Ray has no autoscaler: a group its one node cannot hold never will be placed. The
    launch waited out --placement-timeout first, then advised only a lower --tp; later it started
    Ray (and loaded the tokenizer) only to refuse: about 8 s on 2 cores. The node's CPUs are known
    before the start: no Ray session is started at all."""
    with tempfile.TemporaryDirectory(prefix="clray", dir="/tmp") as tmp:
        env = {**os.environ, "RAY_TMPDIR": tmp}
        env.pop("RAY_ADDRESS", None)
        out = subprocess.run([sys.executable, "-m", "launcher", "generate", "--ray-address", "local", "--tp", "1",
                              *options, "--placement-timeout", "3600", "--no-compile",
                              "--max-new-tokens", "2", "Hello"],
                             capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
        sessions = sorted(p.name for p in Path(tmp).rglob("session_*"))  # what each ray.init of a node writes
    assert out.returncode == 2, out.stderr[-3000:]
    assert all(w in out.stderr for w in words) and "nothing was started" in out.stderr, out.stderr[-3000:]
    assert not sessions, f"a Ray session was started before the refusal: {sessions}"


CONNECT_FOUND = textwrap.dedent("""
    import ray
    from launcher.cluster import ray_cluster
    connection = ray_cluster.connect(None)
    print(connection.started_here, ray.cluster_resources().get("CPU"), flush=True)
    second = ray_cluster.connect(None)  # another launch of this process, sharing the session
    connection.close()
    print(ray.is_initialized(), flush=True)
    second.close()  # the last one disconnects this process: a later launch goes where it is told
    print(ray.is_initialized(), flush=True)
    private = ray_cluster.connect("local", num_cpus=2)
    print(private.started_here, ray.cluster_resources().get("CPU"), flush=True)
    private.close()
""")


def test_the_recorded_cluster_is_joined_with_token_authentication_as_ray_joins_it_and_left_on_close():
    """Every ray.init() of a private cluster writes ~/.ray/auth_token, and a later `ray start --head`
    then runs with token authentication. corelaunch joined the cluster it found recorded by its
    address, for which Ray never turns authentication on, and failed with "no Ray cluster answered
    ... run `ray stop`", where a plain ray.init() joined."""
    import secrets

    with tempfile.TemporaryDirectory(prefix="clray", dir="/tmp") as tmp:
        home = Path(tmp) / "home"
        (home / ".ray").mkdir(parents=True)
        (home / ".ray" / "auth_token").write_text(secrets.token_hex(32))
        env = {**os.environ, "RAY_TMPDIR": tmp, "HOME": str(home)}
        for name in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
            env.pop(name, None)
        from workers.net import free_port_for_a_late_bind

        gcs = free_port_for_a_late_bind()  # Ray binds them seconds later: none from the ephemeral range
        client = free_port_for_a_late_bind()
        while client == gcs:
            client = free_port_for_a_late_bind()
        head = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
                                 f"--port={gcs}", f"--ray-client-server-port={client}", "--num-cpus=1",
                                 "--include-dashboard=false", "--disable-usage-stats"],
                                env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            wait_for_the_recorded_cluster(head, tmp)
            out = subprocess.run([sys.executable, "-c", CONNECT_FOUND], capture_output=True, text=True,
                                 timeout=180, env=env, cwd=REPO)
            assert out.returncode == 0, out.stderr[-3000:]
            # joined (not started), then, once closed, a private cluster where "local" asked for one
            # (the first session stayed open and "local" ran on the joined cluster)
            assert out.stdout.split() == ["False", "1.0", "True", "False", "True", "2.0"]
            assert head.poll() is None  # the joined cluster was left running
        finally:
            stop_a_blocking_head(head)


def wait_for_the_recorded_cluster(head: subprocess.Popen, tmp: str, timeout_s: float = 120) -> None:
    """Until `ray start --head` (RAY_TMPDIR tmp) has recorded its cluster, as a started one does."""
    record = Path(tmp) / "ray" / "ray_current_cluster"
    deadline = time.monotonic() + timeout_s
    while not record.is_file():
        assert head.poll() is None and time.monotonic() < deadline, "ray start --head did not come up"
        time.sleep(0.5)


def stop_a_blocking_head(head: subprocess.Popen) -> None:
    """Stop a `ray start --head --block` run in its own session. --block: ending it stops the cluster
    it started. Only `ray start` itself first: it drains the node through the GCS, which a SIGTERM to
    the whole group had already stopped, so the drain waited out its 30 s before shutting down anyway."""
    os.kill(head.pid, signal.SIGTERM)
    try:
        head.wait(60)
    except subprocess.TimeoutExpired:
        pass
    try:  # and whatever of it is left in its session
        os.killpg(head.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


INTERRUPTED_CONNECT = textwrap.dedent("""
    import os, signal, sys, threading
    from launcher.cluster import ray_cluster
    threading.Timer(float(sys.argv[1]), lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    try:
        ray_cluster.connect("local", num_cpus=1)
        print("connected", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
""")


def test_ctrl_c_while_a_private_cluster_starts_leaves_nothing_running():
    """Ctrl-C inside ray.init left a node no ray.shutdown() could reach, and no connection to close:
    Ray's dashboard and runtime-env agents outlived the command by a minute or more."""
    with tempfile.TemporaryDirectory(prefix="clray", dir="/tmp") as tmp:
        env = {**os.environ, "RAY_TMPDIR": tmp}
        env.pop("RAY_ADDRESS", None)
        for delay in ("1.0", "2.0"):  # inside ray.init's start of the node's processes, on 2 cores
            out = subprocess.run([sys.executable, "-c", INTERRUPTED_CONNECT, delay], capture_output=True, text=True,
                                 timeout=180, env=env, cwd=REPO)
            assert out.returncode == 0 and out.stdout.split() in (["interrupted"], ["connected"]), out.stderr[-2000:]
            # a shutdown stops them within seconds, longer on a loaded machine; the bug left them a minute or more
            left = _gone_within(f"RAY_TMPDIR={tmp}", 20.0)
            assert not left, f"processes of the interrupted start still running: {left}"


def _gone_within(variable: str, seconds: float) -> list[str]:
    """[] once two reads 0.2 s apart in a row find no process with `variable` (one alone could fall
    between a process's fork and the exec that sets its environment), else what is left at `seconds`."""
    deadline, empty_reads = time.monotonic() + seconds, 0
    while True:
        left = _processes_with(variable)
        empty_reads = 0 if left else empty_reads + 1
        if empty_reads == 2 or time.monotonic() >= deadline:
            return left
        time.sleep(0.2)


def _processes_with(variable: str) -> list[str]:
    """The processes whose environment holds `variable` (NAME=VALUE): Ray's agents rename
    themselves (ray::DashboardAgent), so their command lines name no path of the test's."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and variable.encode() in (proc / "environ").read_bytes().split(b"\0"):
                command = (proc / "cmdline").read_bytes().replace(b"\0", b" ")[:80].decode(errors="replace")
                found.append(f"{proc.name} {command}")
        except OSError:  # gone meanwhile, or another user's
            continue
    return found


# One private start serves three tests (each a Ray start-up of its own before: about 15 s apiece on
# 2 cores): started from a thread that then ends, in a home directory of the test's own, then asked
# for its dashboard agent's ports.
STARTED_FROM_A_THREAD_THAT_ENDS = textwrap.dedent("""
    import json, threading, time
    import psutil
    import ray
    from launcher.cluster import ray_cluster
    connections = []
    starter = threading.Thread(target=lambda: connections.append(ray_cluster.connect("local", num_cpus=1)))
    starter.start()
    starter.join()
    time.sleep(1)  # the starter thread is gone
    assert not ray_cluster.private_cluster_dying(within_s=4.0), ray._private.worker._global_node.dead_processes()
    assert ray.get(ray.remote(lambda: 41 + 1).remote(), timeout=120) == 42
    print("alive after its starter ended", flush=True)
    raylet = psutil.Process(ray._private.worker._global_node.all_processes["raylet"][0].process.pid)
    deadline, ports = time.monotonic() + 60, None
    while time.monotonic() < deadline:  # the agent binds its HTTP port a few seconds after the start
        agents = [p for p in raylet.children(recursive=True) if p.cmdline()[:1] == ["ray::DashboardAgent"]]
        ports = sorted({c.laddr.port for a in agents for c in a.net_connections("tcp") if c.status == "LISTEN"})
        if len(ports) >= 2:  # its gRPC and HTTP servers
            break
        time.sleep(0.5)
    print(json.dumps(ports), flush=True)
    connections[0].close()
""")


@pytest.fixture(scope="module")
def started_from_a_thread(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    out = subprocess.run([sys.executable, "-c", STARTED_FROM_A_THREAD_THAT_ENDS], cwd=REPO, capture_output=True,
                         text=True, timeout=300, env={**env, "HOME": str(home)})
    return out, home


def test_a_private_cluster_started_from_a_thread_outlives_that_thread(started_from_a_thread):
    """Ray starts a private cluster's processes with PR_SET_PDEATHSIG, sent when the parent thread
    exits: a Launcher started on a worker thread lost its GCS and raylet within seconds of that
    thread ending, and Ray then killed the whole process, unable to reach its GCS."""
    out, _ = started_from_a_thread
    assert out.returncode == 0 and "alive after its starter ended" in out.stdout, out.stderr[-3000:]


def test_a_private_start_leaves_rays_token_readable_by_its_owner_alone(started_from_a_thread):
    """Ray writes ~/.ray/auth_token with the umask's mode (0644): any local user who could enter the
    home directory could read it and call the private cluster's servers with it."""
    out, home = started_from_a_thread
    assert out.returncode == 0, out.stderr[-3000:]
    token = home / ".ray" / "auth_token"
    assert token.exists() and oct(token.stat().st_mode & 0o777) == oct(0o600)
    # and its folder, made before the start, so the token is never readable by others even while written
    assert oct((home / ".ray").stat().st_mode & 0o777) == oct(0o700)


def test_a_private_clusters_dashboard_agent_leaves_rays_default_port_free(started_from_a_thread):
    """It took Ray's fixed 52365: a cluster the user then started on this host (`ray start --head`)
    found the port taken, disabled its agent's HTTP service, and refused every `ray job submit`."""
    out, _ = started_from_a_thread
    assert out.returncode == 0, out.stderr[-3000:]
    ports = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(ports) >= 2 and 52365 not in ports, ports


def test_the_logs_folder_named_is_this_sessions_not_the_newest_on_the_host(ray_session):
    """Messages sent users to /tmp/ray/session_latest/logs: on a host where other Ray sessions run,
    the newest session's, not necessarily the one this process started."""
    from launcher.cluster.ray_cluster import logs_dir

    folder = Path(logs_dir())
    session = Path(ray_session._private.worker._global_node.get_session_dir_path())
    assert "session_latest" not in folder.parts and folder.parent == session and folder.is_dir()
    assert any(folder.glob("raylet*"))  # the session's own raylet logs there
