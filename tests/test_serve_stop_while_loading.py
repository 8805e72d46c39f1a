"""A stop signal to `corelaunch serve` while its replica still loads the model ends it within
seconds, leaving nothing running. Before, the command deleted the Serve application first, as it
does to let clients' requests finish once the server is up; Serve cannot stop a replica whose
constructor still runs, and waited out its graceful shutdown (20 s): 24.8 s from SIGTERM to the
exit. Before the ready line no client has a request in flight, so nothing is waited for."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.test_hardening_e2e import alive, clean_env, command_line, session_processes

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])

LOADING = "✓ connecting to Ray"
"""The replica's progress line just before its TP group starts loading the model (about 10 s of
the built-in SmolLM2 on 2 cores)."""
LOADED = "✓ starting"


# exclusive: it times the exit and watches the session's processes
@pytest.mark.slow
@pytest.mark.exclusive
def test_sigterm_while_the_model_loads_exits_within_seconds_leaving_nothing():
    serve = subprocess.Popen([sys.executable, "-m", "launcher", "serve", "--tp", "1", "--no-compile", "--port",
                              _free_port(), "--ingress", "direct"], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
                             start_new_session=True)
    lines: list[str] = []
    loading = threading.Event()

    def read_stderr() -> None:
        for line in serve.stderr:
            lines.append(line)
            if LOADING in line and "ServeReplica" in line:
                loading.set()

    threading.Thread(target=read_stderr, daemon=True).start()
    try:
        deadline = time.monotonic() + 240
        while not loading.wait(0.2):
            assert serve.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
        at_signal = "".join(lines)
        signalled = time.monotonic()
        serve.send_signal(signal.SIGTERM)
        serve.wait(60)
        took_s = time.monotonic() - signalled
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()
    said = "".join(lines)
    assert LOADED not in at_signal, f"the model had loaded before the signal:\n{said[-3000:]}"
    assert "corelaunch: serving" not in serve.stdout.read()
    assert serve.returncode == 0, said[-3000:]
    print(f"exit {took_s:.1f} s after the signal")
    assert took_s < 6.0, f"SIGTERM while the model loaded took {took_s:.1f} s to end the command"
    deadline = time.monotonic() + 20
    while [p for p in session_processes(serve.pid) if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [command_line(p) for p in session_processes(serve.pid) if alive(p)] == []

