"""`corelaunch serve` as a subprocess of the benchmark: a free loopback port, wait for /health, stop.

Its output goes to a log file, and the tail of that file is in the error when it fails to start, so
a broken server says why instead of the benchmark hanging.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A port nobody listens on now, for the server to bind once Ray and the model have started:
    one outside the OS's ephemeral range, which outbound connections could take meanwhile
    (workers/net.py)."""
    from workers.net import free_port_for_a_late_bind

    return free_port_for_a_late_bind()


def healthy(base_url: str) -> bool:
    """GET {server}/health answers 200 (base_url ends in /v1; /health is at the server's root)."""
    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        with urllib.request.urlopen(f"{root}/health", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, http.client.HTTPException):
        # HTTPException: a port that answers with something other than HTTP (BadStatusLine) while the
        # server starts, or another process on it; asked again until the deadline, not a traceback
        return False


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


@contextlib.contextmanager
def corelaunch_server(serve_args: list[str], timeout_s: float):
    """Starts `python -m launcher serve --host 127.0.0.1 --port P <serve_args>`; yields
    (base_url, command) once /health answers 200; stops the server on exit."""
    port = free_port()
    command = [sys.executable, "-m", "launcher", "serve", "--host", "127.0.0.1", "--port", str(port), *serve_args]
    with server_process(command, f"http://127.0.0.1:{port}/v1", timeout_s) as base_url:
        yield base_url, command


@contextlib.contextmanager
def server_process(command: list[str], base_url: str, timeout_s: float, cwd: Path = REPO, poll_s: float = 0.5):
    """Runs `command` (from `cwd`, the repository root unless told) until /health answers 200
    (asked every poll_s), yields base_url, and stops it (SIGINT, then SIGKILL) on exit. Its output
    goes to a log whose tail is in the error when it exits or times out before it is healthy."""
    name = " ".join(command)
    with tempfile.TemporaryDirectory(prefix="corelaunch-serve-bench-") as tmp:
        log = Path(tmp) / "serve.log"
        with open(log, "wb") as out:
            # its own session: stopping it reaches the Ray processes it started too
            proc = subprocess.Popen(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            deadline = time.monotonic() + timeout_s
            while not healthy(base_url):
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited with code {proc.returncode} before it was healthy; "
                                       f"command: {name}\n{_tail(log)}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the server was not healthy after {timeout_s:.0f} s (GET "
                                       f"{base_url.removesuffix('/v1')}/health); raise --server-timeout if it "
                                       f"is still compiling; command: {name}\n{_tail(log)}")
                time.sleep(poll_s)
            yield base_url
        finally:
            _stop(proc)


def _stop(proc: subprocess.Popen, patience_s: float = 30) -> None:
    """SIGINT to the server (it shuts its Ray workers down), then SIGKILL to whatever of its process
    group is left (all of it when the server did not exit in time)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=patience_s)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=patience_s)
