"""`ray job submit -- corelaunch generate ...` against a running Ray cluster, for real.

The fixture starts its own Ray head (`ray start --head`) on free ports with its own temp dir and its
own auth token, so it cannot meet another Ray instance on this machine. It is stopped by the process
ids of that head (its temp dir is on each of their command lines, their children included), never
with `ray stop`, which stops every Ray process of every user session on the machine.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from workers.net import free_port_for_a_late_bind

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]


def late_bind_ports(count: int) -> list[int]:
    """`count` distinct ports below the ephemeral range: Ray's processes bind theirs seconds after
    `ray start` begins, meanwhile any outbound connection could take one from that range."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port_for_a_late_bind()
        if port not in ports:
            ports.append(port)
    return ports


def stop_processes_of(temp_dir: str, grace_s: float = 1.0) -> int:
    """Terminate every process whose command line names `temp_dir`, with its children; kill what is
    left after `grace_s` (gcs_server and the monitor can ignore SIGTERM for longer than that)."""
    import psutil

    me = os.getpid()
    roots = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.pid != me and any(temp_dir in arg for arg in (proc.info["cmdline"] or [])):
                roots.append(proc)
        except psutil.Error:
            continue
    procs = {p.pid: p for p in roots}
    for root in roots:
        try:
            procs.update({c.pid: c for c in root.children(recursive=True)})
        except psutil.Error:
            pass
    procs.pop(me, None)
    for proc in procs.values():
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(list(procs.values()), timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
    return len(procs)


@pytest.fixture(scope="module")
def ray_head():
    temp_dir = tempfile.mkdtemp(prefix="clrj", dir="/tmp")  # short: Ray's socket paths must stay short
    gcs, dashboard, client, agent, agent_grpc, env_agent, metrics, manager, objects = late_bind_ports(9)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", RAY_AUTH_MODE="token",
               RAY_AUTH_TOKEN=secrets.token_hex(32))
    command = [str(BIN / "ray"), "start", "--head", "--num-cpus", "2", "--disable-usage-stats",
               "--port", str(gcs), "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard),
               "--ray-client-server-port", str(client), "--dashboard-agent-listen-port", str(agent),
               "--dashboard-agent-grpc-port", str(agent_grpc), "--runtime-env-agent-port", str(env_agent),
               "--metrics-export-port", str(metrics), "--node-manager-port", str(manager),
               "--object-manager-port", str(objects), "--min-worker-port", "0", "--max-worker-port", "0",
               "--object-store-memory", str(256 * 2**20), "--temp-dir", temp_dir]
    try:
        started = subprocess.run(command, env=env, cwd=temp_dir, capture_output=True, text=True, timeout=180)
        assert started.returncode == 0, f"ray start failed:\n{started.stdout}\n{started.stderr}"
        yield {"address": f"http://127.0.0.1:{dashboard}", "env": env, "temp_dir": temp_dir}
    finally:
        stop_processes_of(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_ray_job_submit_runs_corelaunch_generate_on_the_cluster(ray_head):
    from shardlib.demo_model import ensure_demo_model

    model_dir = ensure_demo_model()
    # Job submission is the subject: --no-compile spares compiling graphs inside the job (the compiled
    # default of the same command is tested in tests/test_smollm2_e2e.py).
    submit = [str(BIN / "ray"), "job", "submit", "--address", ray_head["address"], "--",
              "corelaunch", "generate", "--model", str(model_dir), "--max-new-tokens", "8", "--json", "--quiet",
              "--no-compile", "The capital of France is"]
    job = subprocess.run(submit, env=ray_head["env"], cwd=ray_head["temp_dir"], capture_output=True, text=True,
                         timeout=400)
    log = job.stdout + job.stderr
    assert job.returncode == 0, log
    assert "succeeded" in log, log
    [line] = [ln for ln in job.stdout.splitlines() if ln.startswith('{"model"')]
    report = json.loads(line)
    assert report["outputs"][0]["text"].lstrip().startswith("Paris"), report
    assert report["replicas"] == 1 and report["backend"] == "cpu"
