"""Serve's proxy (`corelaunch serve --ingress proxy`) binds --port with SO_REUSEPORT (Ray Serve's
SERVE_SOCKET_REUSE_PORT_ENABLED, on by default), so another listener that sets it too and binds
the port after the command's own check, before Serve's proxy (a second server started at the same
moment), shared the port without a word: 11 of 20 requests went to the other one, and the command
printed its ready line. It now counts the port's listeners once the proxy has bound it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from launcher.serving.ingress import listeners_on
from tests.test_hardening_e2e import alive, clean_env, command_line, session_processes
from workers.net import free_port_for_a_late_bind

REPO = Path(__file__).resolve().parents[1]


def _listener(host: str, port: int = 0) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen()
    return sock


def test_the_listeners_of_a_port_are_counted_where_they_take_the_hosts_connections():
    with _listener("127.0.0.1") as first:
        port = first.getsockname()[1]
        assert (listeners_on("127.0.0.1", port), listeners_on("0.0.0.0", port)) == (1, 1)
        assert listeners_on("10.255.255.1", port) == 0  # another address of the port: not the host's
        with _listener("127.0.0.1", port):  # the second one shares the port
            assert listeners_on("127.0.0.1", port) == 2
            assert listeners_on("localhost", port) == 2  # a name, as --host takes one
        with _listener("0.0.0.0", port):  # every interface's takes 127.0.0.1's connections too
            assert listeners_on("127.0.0.1", port) == 2
        assert listeners_on("127.0.0.1", port) == 1
        with socket.create_connection(("127.0.0.1", port)):  # a connection on the port is no listener
            assert listeners_on("127.0.0.1", port) == 1


def _raylet_up(sid: int) -> bool:
    return any("raylet" in command_line(p) for p in session_processes(sid))


@pytest.mark.slow
def test_a_listener_sharing_the_port_with_serves_proxy_is_refused_naming_the_port():
    port = free_port_for_a_late_bind()  # Serve's proxy binds it seconds later: none from the ephemeral range
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        serve = subprocess.Popen([sys.executable, "-m", "launcher", "serve", "--tp", "1", "--no-compile", "--quiet",
                                  "--port", str(port), "--ingress", "proxy"], cwd=REPO, stdout=out, stderr=err,
                                 env=clean_env(), start_new_session=True)
        other = None
        try:
            deadline = time.monotonic() + 120
            while not _raylet_up(serve.pid):  # past the port check, before Serve's proxy binds
                assert serve.poll() is None and time.monotonic() < deadline, (err.seek(0), err.read())[1]
                time.sleep(0.1)
            other = _listener("127.0.0.1", port)
            while serve.poll() is None:
                out.seek(0)
                assert "corelaunch: serving" not in out.read(), "the server started on a port it shares"
                assert time.monotonic() < deadline, "corelaunch serve neither refused nor started"
                time.sleep(0.5)
        finally:
            if serve.poll() is None:
                os.killpg(serve.pid, signal.SIGKILL)
                serve.wait()
            if other is not None:
                other.close()
        err.seek(0)
        said = err.read()
    assert serve.returncode == 2, said[-3000:]
    assert f"corelaunch serve: cannot listen on 127.0.0.1:{port} alone: another process listens there too" in said
    deadline = time.monotonic() + 20
    while [p for p in session_processes(serve.pid) if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [command_line(p) for p in session_processes(serve.pid) if alive(p)] == []
