"""Edges of connecting to Ray (launcher/cluster/ray_cluster.py): two launches connecting from two
threads at once, RAY_ADDRESS=local, addresses with no host or an unbracketed IPv6 host, and the
SIGTERM handler's baseline of the private Ray's processes already gone.

The cases that need a private Ray share one, started in a fresh process (its own RAY_TMPDIR, so
no other test's Ray and no cluster of the host's is seen), which reports what it observed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


# ---- without Ray started ------------------------------------------------------------------------

def test_ray_address_local_in_the_environment_is_a_private_cluster(monkeypatch):
    """RAY_ADDRESS=local is Ray's own word for a new local instance: it was read as a cluster to
    join, so the private Ray started with Ray's dashboard, its agent on the fixed port, no num_cpus,
    and --nodes 2 was planned on this one host."""
    import ray

    from launcher.api import LaunchConfig
    from launcher.cli.serve_command import cluster_not_joined
    from launcher.cluster import ray_cluster
    from launcher.launch_plan import refuse_nodes_on_a_private_cluster

    monkeypatch.setenv("RAY_ADDRESS", "local")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh process
    assert ray_cluster.asked_cluster(None)[0] is None
    assert ray_cluster.private_cluster(None) is True
    assert ray_cluster.on_this_host(None) is True
    assert cluster_not_joined() is None
    with pytest.raises(ValueError, match=r"nodes \(2\): with no cluster to join, the launch starts a private Ray"):
        refuse_nodes_on_a_private_cluster(LaunchConfig(tp=2, nodes=2, compile=False))
    # an address given outright still wins over the environment's, as in Ray
    assert ray_cluster.asked_cluster("10.0.0.5:6379") == ("10.0.0.5:6379", "--ray-address")
    assert ray_cluster.private_cluster("10.0.0.5:6379") is False
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")  # any other value is still a cluster to join
    assert ray_cluster.asked_cluster(None) == ("10.0.0.5:6379", "RAY_ADDRESS")
    assert ray_cluster.on_this_host(None) is False


@pytest.mark.parametrize("address", ["ray://", "ray://:10001", "ray://[]:10001"])
def test_ray_client_without_a_host_is_refused_as_such(address, monkeypatch):
    """It was accepted, then refused as Ray Client "to another machine ()"."""
    from launcher.api import LaunchConfig
    from launcher.cluster import ray_cluster
    from launcher.errors import LaunchError

    with pytest.raises(ValueError, match=rf"ray_address \('{re.escape(address)}'\) names no host: .*ray://host:port"):
        LaunchConfig(ray_address=address)
    assert ray_cluster.remote_ray_client(address) is None  # never "" for a machine's name
    monkeypatch.setattr("ray.is_initialized", lambda: False)
    monkeypatch.setattr("ray.init", lambda *a, **k: pytest.fail("ray.init was called"))
    with pytest.raises(LaunchError, match=r"names no host.*\(from --ray-address\)"):
        ray_cluster.connect(address)


@pytest.mark.parametrize("address", ["2001:db8::5", "::1:6379", "fe80::1", "2001:db8::5:6379",
                                     "ray://2001:db8::5:10001"])
def test_an_ipv6_host_without_brackets_is_refused_naming_the_form(address):
    """Split at its last colon, 2001:db8::5 passed as host 2001:db8: and port 5."""
    from launcher.api import LaunchConfig
    from launcher.cluster import ray_cluster

    message = ray_cluster.malformed_address(address)
    assert message is not None and "write an IPv6 host in brackets: [2001:db8::5]:6379" in message, message
    assert repr(address) in message
    with pytest.raises(ValueError, match=r"write an IPv6 host in brackets"):
        LaunchConfig(ray_address=address)


@pytest.mark.parametrize("address", ["[::1]:6379", "[2001:db8::5]:6379", "10.0.0.5:6379", "head:6379",
                                     "ray://head", "ray://head:10001", "ray://[::1]:10001", "local"])
def test_the_forms_taken_are_still_taken(address):
    from launcher.cluster import ray_cluster

    assert ray_cluster.malformed_address(address) is None


@pytest.mark.parametrize("address", ["[::1", "[::1]6379", "[]:6379"])
def test_broken_brackets_are_refused(address):
    """"[::1" passed as host "[:" and port 1."""
    from launcher.cluster import ray_cluster

    assert "must be the head's host:port" in (ray_cluster.malformed_address(address) or "")


# ---- one private Ray, in a fresh process ---------------------------------------------------------

SHARED_PRIVATE_RAY = textwrap.dedent("""
    import json, os, signal, threading, time
    import ray
    from ray._private import ray_constants
    from launcher import termination
    from launcher.cluster import ray_cluster

    seen = {}
    node_of = ray_cluster._ray_node

    def kill_and_wait(kind):
        node = node_of()
        pid = node.all_processes[kind][0].process.pid
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while pid not in {p.pid for _, p in node.dead_processes()} and time.monotonic() < deadline:
            time.sleep(0.05)
        return pid

    # One of the private Ray's own processes dies while it starts (a dashboard or log monitor that
    # crashed on its own): it is gone before any signal comes.
    init = ray_cluster._init
    def init_with_one_process_gone(**options):
        init(**options)
        if "died_at_start" not in seen:
            seen["died_at_start"] = kill_and_wait(ray_constants.PROCESS_TYPE_LOG_MONITOR)
    ray_cluster._init = init_with_one_process_gone

    results, barrier = {}, threading.Barrier(2)
    def launch(name):
        barrier.wait()
        try:
            results[name] = ray_cluster.connect("local", num_cpus=1)
        except BaseException as err:
            results[name] = f"{type(err).__name__}: {err}"[:300]
    threads = [threading.Thread(target=launch, args=(name,)) for name in "AB"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    connections = [c for c in results.values() if isinstance(c, ray_cluster.RayConnection)]
    seen["connected"] = sorted(n for n, c in results.items() if isinstance(c, ray_cluster.RayConnection))
    seen["errors"] = sorted(str(c) for c in results.values() if not isinstance(c, ray_cluster.RayConnection))
    seen["started_here"] = [c.started_here for c in connections]
    seen["users"] = ray_cluster._OWN_SESSION["users"]
    if len(connections) == 2:
        seen["put_get"] = ray.get(ray.put(1), timeout=60)
        # a plain `kill PID` of this process: the process that died at start is no sign of a group signal
        seen["going_for_a_death_at_start"] = termination._ray_going(0.3)
        os.environ["RAY_ADDRESS"] = "local"  # a third launch, told "local" by the environment: shared
        try:
            third = ray_cluster.connect(None)
            seen["env_local_started_here"] = third.started_here
            seen["users_with_env_local"] = ray_cluster._OWN_SESSION["users"]
            third.close()
        except Exception as err:
            seen["env_local_error"] = f"{type(err).__name__}: {err}"[:300]
        del os.environ["RAY_ADDRESS"]
        kill_and_wait(ray_constants.PROCESS_TYPE_MONITOR)  # one gone now, as a group signal does
        seen["going_for_a_death_now"] = termination._ray_going(0.3)
    for connection in connections:
        connection.close()
    seen["initialized_after_closes"] = ray.is_initialized()
    print("SEEN " + json.dumps(seen), flush=True)
""")


@pytest.fixture(scope="module")
def shared_private_ray() -> dict:
    """What SHARED_PRIVATE_RAY saw (one private Ray start, some 10 s on 2 cores)."""
    # a short directory: Ray's Unix socket paths live under it, and they have a length limit
    with tempfile.TemporaryDirectory(prefix="rayedge", dir="/tmp") as tmp:
        env = {**os.environ, "RAY_TMPDIR": tmp, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")}
        env.pop("RAY_ADDRESS", None)
        child = subprocess.Popen([sys.executable, "-c", SHARED_PRIVATE_RAY], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env, cwd=REPO, start_new_session=True)
        try:
            out, err = child.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            out, err = "", "timed out"
        finally:
            # whatever of Ray's a failed run left in the group this test started
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            child.wait()
    lines = [line for line in out.splitlines() if line.startswith("SEEN ")]
    assert lines, f"exit {child.returncode}: {err[-3000:]}"
    return json.loads(lines[-1][len("SEEN "):])


@pytest.mark.slow
def test_two_threads_connecting_at_once_share_one_private_ray(shared_private_ray):
    """Both saw no session: the second ray.init failed with a bare AssertionError, and its clean-up's
    ray.shutdown() stopped the first launch's private Ray under it."""
    seen = shared_private_ray
    assert seen["connected"] == ["A", "B"] and seen["errors"] == [], seen
    assert seen["started_here"] == [True, True] and seen["users"] == 2, seen
    assert seen["put_get"] == 1
    assert seen["initialized_after_closes"] is False


@pytest.mark.slow
def test_ray_address_local_shares_the_private_session(shared_private_ray):
    """RAY_ADDRESS=local was a cluster to join, "not the private one" this process had started."""
    seen = shared_private_ray
    assert seen.get("env_local_started_here") is True, seen
    assert seen["users_with_env_local"] == 3


@pytest.mark.slow
def test_a_ray_process_gone_at_start_is_no_sign_of_a_group_signal(shared_private_ray):
    """The CLI's SIGTERM handler took any private Ray process that had exited for the signal reaching
    the whole group, and exited 143 without stopping the ranks or Ray; one that exits later still
    counts."""
    seen = shared_private_ray
    assert isinstance(seen.get("died_at_start"), int), seen
    assert seen["going_for_a_death_at_start"] is False, seen
    assert seen["going_for_a_death_now"] is True, seen


# ---- the program's own Ray session ---------------------------------------------------------------

def test_a_launch_asking_for_another_cluster_than_the_programs_own_session_is_refused(ray_session):
    """A program that ran ray.init() itself: a launch given another cluster's host:port joined the
    program's session silently and ran there. Its own cluster, however its host is written, and no
    address or "local", still join it."""
    from launcher.cluster import ray_cluster
    from launcher.errors import LaunchError

    if ray_cluster._OWN_SESSION["users"] > 0:
        pytest.skip("a launch of this process still holds a session it opened")
    own = ray_session.get_runtime_context().gcs_address
    with pytest.raises(LaunchError, match=rf"already connected to the Ray cluster at '{re.escape(own)}' \(a Ray "
                                          rf"session the program opened itself\).*asks for '192.0.2.55:6379' "
                                          rf"\(--ray-address\).*ray.shutdown\(\)"):
        ray_cluster.connect("192.0.2.55:6379")
    port = own.rpartition(":")[2]
    for same in (own, f"localhost:{port}", f"127.0.0.1:{port}", None, "local"):
        connection = ray_cluster.connect(same)
        assert (connection.started_here, connection.joined_here) == (False, False), same
        connection.close()  # the program's own session: left open
    assert ray_session.is_initialized()


# ---- a GCS with token authentication, answered by a gRPC server that checks the token ----------

TOKEN_CHECKING_GCS = textwrap.dedent("""
    import os, sys, time
    from concurrent.futures import ThreadPoolExecutor
    import grpc
    from launcher.cluster import ray_cluster

    def cluster_id(request, context):
        if dict(context.invocation_metadata()).get("authorization") != "Bearer the-clusters-token":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "InvalidAuthToken: Authentication token is missing or incorrect")
        return b""

    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "ray.rpc.NodeInfoGcsService", {"GetClusterId": grpc.unary_unary_rpc_method_handler(cluster_id)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    import ray
    ray.init = lambda *a, **k: sys.exit("ray.init was called")  # the probe alone decides here
    started = time.monotonic()
    try:
        ray_cluster.connect(f"127.0.0.1:{port}")
    except Exception as err:
        print(f"{time.monotonic() - started:.1f}", type(err).__name__, err, flush=True)
    os.environ["RAY_AUTH_TOKEN"] = "the-clusters-token"
    print("right token:", ray_cluster._unreachable(f"127.0.0.1:{port}", token=ray_cluster._token_metadata()))
""")


@pytest.mark.parametrize("variables, named", [
    ({"RAY_AUTH_TOKEN": "another-token"}, "from RAY_AUTH_TOKEN"),
    ({"RAY_AUTH_TOKEN_PATH": "FILE"}, "from the file RAY_AUTH_TOKEN_PATH names (FILE)"),
])
def test_a_wrong_token_is_refused_at_once_naming_its_source(variables, named, tmp_path):
    """The probe sent no token, so the GCS's refusal was ignored and ray.init retried for some 20 s,
    printed 20 lines of Ray's warnings, and said no Ray cluster answered. A fresh process: Ray's
    token loader caches the token process-wide (the test session's Ray uses it)."""
    token_file = tmp_path / "token"
    token_file.write_text("another-token")
    env = {**os.environ, "RAY_AUTH_MODE": "token", "HOME": str(tmp_path)}
    for name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(name, None)
    env.update({k: str(token_file) if v == "FILE" else v for k, v in variables.items()})
    out = subprocess.run([sys.executable, "-c", TOKEN_CHECKING_GCS], capture_output=True, text=True, timeout=120,
                         env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    refused, right = out.stdout.splitlines()
    seconds, kind, message = refused.split(" ", 2)
    assert kind == "LaunchError" and float(seconds) < 5, refused
    assert "refused this launch's token (" + named.replace("FILE", str(token_file)) in message, message
    assert "RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH names, else ~/.ray/auth_token" in message
    assert "use the cluster's token" in message and "ray stop" not in message, message
    assert right == "right token: None"
