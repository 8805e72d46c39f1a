"""A launch joining a token-authenticated cluster (`ray start --head` under RAY_AUTH_MODE=token) with
another token than the cluster's: it was said as "no Ray cluster answered" after some 20 s and 20
lines of Ray's warnings, with fixes that did not apply (and, for the cluster `ray start` recorded,
advice to run `ray stop`, which stops every Ray process of the user). Slow: starts a real head, in a
Ray temp dir and a HOME of the test's own, so no other Ray session sees it or its token."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from tests.test_ray_connect_e2e import stop_a_blocking_head, wait_for_the_recorded_cluster
from tests.test_ray_job import BIN, late_bind_ports

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]

CONNECT = textwrap.dedent("""
    import sys, time
    import ray
    from launcher.cluster import ray_cluster
    asked = None if sys.argv[1] == "recorded" else sys.argv[1]
    if sys.argv[2:] == ["unprobed"]:  # as for a TLS GCS, which the probe leaves to ray.init
        ray_cluster._unreachable = lambda *args, **kwargs: None
    started = time.monotonic()
    try:
        connection = ray_cluster.connect(asked)
        print("JOINED", ray.cluster_resources().get("CPU"), flush=True)
        connection.close()
    except Exception as err:
        print("REFUSED", f"{time.monotonic() - started:.1f}", type(err).__name__, str(err).replace("\\n", " | "), flush=True)
""")


@pytest.fixture(scope="module")
def token_head():
    """(the GCS address, the environment of a launch on this host without a token, the cluster's
    token) of a one-CPU head started with token authentication."""
    with head_with_a_token(num_cpus=1) as head:
        yield head


@contextlib.contextmanager
def head_with_a_token(num_cpus: int):
    """`ray start --head --num-cpus num_cpus` with token authentication, in a Ray temp dir and HOME
    of its own: (its GCS address, a launch's environment without the token, the token)."""
    with tempfile.TemporaryDirectory(prefix="tkray", dir="/tmp") as tmp:  # short: Ray's socket paths live under it
        home = Path(tmp) / "home"
        home.mkdir()
        token = secrets.token_hex(32)
        env = {k: v for k, v in os.environ.items()
               if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
        env.update(RAY_TMPDIR=tmp, HOME=str(home), PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
        gcs, client, agent, agent_grpc, runtime_env, metrics, manager, objects = late_bind_ports(8)
        head = subprocess.Popen(
            [str(BIN / "ray"), "start", "--head", "--block", "--num-cpus", str(num_cpus), "--disable-usage-stats",
             "--include-dashboard", "false", "--port", str(gcs), "--ray-client-server-port", str(client),
             "--dashboard-agent-listen-port", str(agent), "--dashboard-agent-grpc-port", str(agent_grpc),
             "--runtime-env-agent-port", str(runtime_env), "--metrics-export-port", str(metrics),
             "--node-manager-port", str(manager), "--object-manager-port", str(objects),
             "--min-worker-port", "0", "--max-worker-port", "0", "--object-store-memory", str(128 * 2**20)],
            env={**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}, cwd=tmp, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_for_the_recorded_cluster(head, tmp)
            yield f"127.0.0.1:{gcs}", env, token
        finally:
            stop_a_blocking_head(head)


def launch(env: dict, *args: str) -> str:
    out = subprocess.run([sys.executable, "-c", CONNECT, *args], capture_output=True, text=True, timeout=200,
                         env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def refusal(line: str) -> tuple[float, str]:
    """(seconds to the refusal, its message) of a REFUSED line."""
    said, seconds, kind, message = line.split(" ", 3)
    assert (said, kind) == ("REFUSED", "LaunchError"), line
    return float(seconds), message


def test_a_wrong_token_for_an_address_given_is_refused_at_once(token_head):
    address, env, _ = token_head
    seconds, message = refusal(launch({**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)},
                                      address))
    assert seconds < 10, seconds  # ray.init retried for some 20 s
    assert f"the Ray cluster at {address!r} (--ray-address) refused this launch's token (from RAY_AUTH_TOKEN" in message
    assert "use the cluster's token" in message and "no Ray cluster answered" not in message, message


def test_a_wrong_token_for_the_recorded_cluster_is_refused_without_ray_stop(token_head):
    """No RAY_AUTH_MODE: Ray turns token authentication on for the cluster it finds recorded where a
    token is at hand, and so does the launch, before its probe."""
    address, env, _ = token_head
    seconds, message = refusal(launch({**env, "RAY_AUTH_TOKEN": secrets.token_hex(32)}, "recorded"))
    assert seconds < 10, seconds
    port = address.rpartition(":")[2]  # recorded under the host's own address
    assert re.search(rf"the Ray cluster at '[^']+:{port}' \(the cluster `ray start` recorded on this machine\) "
                     rf"refused this launch's token \(from RAY_AUTH_TOKEN", message), message
    assert "ray stop" not in message, message


def test_ray_inits_own_refusal_of_a_wrong_token_is_named_as_one(token_head):
    """Where the probe does not tell (a TLS GCS), ray.init's InvalidAuthToken is read as the token."""
    address, env, _ = token_head
    _, message = refusal(launch({**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)},
                                address, "unprobed"))
    assert "refused this launch's token (from RAY_AUTH_TOKEN" in message and "InvalidAuthToken" in message, message
    assert message.endswith("(Ray: InvalidAuthToken: Authentication token is missing or incorrect)"), message
    assert "no Ray cluster answered" not in message and "ray stop" not in message, message


def test_the_clusters_own_token_joins(token_head):
    """The probe sends the token: the right one passes it."""
    address, env, token = token_head
    assert launch({**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}, address) == "JOINED 1.0"
