"""How `corelaunch serve` words a --port it cannot listen on.

- With direct ingress, a failed deploy was blamed on "another process" whenever --port was bound
  afterwards, though this server's own replica may hold it: past --ready-timeout (it binds once
  the model is loaded, shortly before serve.run returns) the command printed "cannot listen ...
  Address already in use ... another process took it" and exited 2 instead of naming the timeout
  (exit 1); and a replica failing for a reason of its own lost that reason the same way. The
  command's flow runs here with a stand-in for Ray Serve and a listening socket on --port.
- EACCES (a port below 1024 without root) was told to "pass a --host this machine has"."""

from __future__ import annotations

import argparse
import errno
import logging
import socket
import sys
import threading
import types

import pytest

from launcher.cli import serve_command

_SERVE_FAILED = RuntimeError("Deploying application corelaunch failed: Failed to update the deployments "
                             "['OpenAIServer'].")


def _failed_status(exception_line: str):
    """serve.status() as Serve gives it when every start of the replica failed with `exception_line`."""
    message = ("The deployment failed to start 3 times in a row. See controller logs for details. Error:\n"
               "Traceback (most recent call last):\n  File \"replica.py\", line 1, in initialize\n    start()\n"
               f"{exception_line}\n")
    deployment = types.SimpleNamespace(status="DEPLOY_FAILED", message=message)
    app = types.SimpleNamespace(deployments={"OpenAIServer": deployment})
    return types.SimpleNamespace(applications={serve_command.APP_NAME: app})


@pytest.fixture
def held_port():
    """--port, bound and listening: the replica (or another process) holding it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture
def serve_with(monkeypatch):
    """Runs serve_command._serve_on with direct ingress against a stand-in Serve whose run() is
    `deploy` and whose status() is `status`; returns (exit code, stderr). No Ray starts."""
    import ray

    from launcher.cluster import ray_cluster
    from launcher.serving.ingress import IngressPlan

    released = threading.Event()  # lets a run() still "loading" end with the test
    monkeypatch.setattr(ray_cluster, "connect", lambda *a, **k: types.SimpleNamespace(close_for_exit=lambda: True))
    monkeypatch.setattr(ray_cluster, "dead_private_processes", lambda: frozenset())
    monkeypatch.setattr(ray_cluster, "private_cluster_dying", lambda **k: False)
    monkeypatch.setattr(ray_cluster, "logs_dir", lambda: "/tmp/ray/session_latest/logs")
    monkeypatch.setattr(serve_command, "ingress_plan",
                        lambda args, mode: IngressPlan("direct", args.port, args.port + 1, {}))
    openai_app = types.ModuleType("launcher.serving.openai_app")
    openai_app.application = lambda settings: "the application"
    monkeypatch.setitem(sys.modules, "launcher.serving.openai_app", openai_app)
    monkeypatch.setattr(logging.getLogger("ray.serve"), "filters", [])  # direct ingress adds one

    def run_it(port: int, deploy, status, capsys) -> tuple[int, str]:
        fake = types.SimpleNamespace(start=lambda **k: None, run=lambda *a, **k: deploy(released),
                                     status=status, delete=lambda name: None, shutdown=lambda: None)
        monkeypatch.setattr(ray, "serve", fake, raising=False)
        args = argparse.Namespace(host="127.0.0.1", port=port, quiet=False, ready_timeout=0.5)
        try:
            code = serve_command._serve_on(args, types.SimpleNamespace(served_model_name="m"), "direct", sys.stdout)
        finally:
            released.set()
        return code, capsys.readouterr().err

    return run_it


def _still_loading(released: threading.Event) -> None:
    released.wait(30)


def _raises(released: threading.Event) -> None:
    raise _SERVE_FAILED


def test_the_ready_timeout_is_named_though_the_replica_holds_the_port(serve_with, held_port, capsys):
    code, err = serve_with(held_port, _still_loading, lambda: _failed_status("unused"), capsys)
    assert (code, "another process" in err) == (1, False), err
    assert "the model was not loaded within --ready-timeout 0.5 s" in err


def test_a_replica_failing_for_its_own_reason_is_named_by_it(serve_with, held_port, capsys):
    status = lambda: _failed_status("ValueError: the checkpoint's shard 3 is damaged")  # noqa: E731
    code, err = serve_with(held_port, _raises, status, capsys)
    assert (code, "another process" in err) == (1, False), err
    assert "the server failed to start: ValueError: the checkpoint's shard 3 is damaged" in err


@pytest.mark.parametrize("exception_line", [
    "RuntimeError: Failed to bind to address '127.0.0.1:8000'.",
    # what a real run's status said (tests/test_openai_server.py::test_a_port_taken_while_the_server_starts_is_named)
    "ray.serve._private.node_port_manager.NoAvailablePortError: No available ports on node a549b1 for "
    "RequestProtocol.HTTP protocol.",
])
def test_a_replica_that_could_not_bind_names_the_port_taken(serve_with, held_port, capsys, exception_line):
    code, err = serve_with(held_port, _raises, lambda: _failed_status(exception_line), capsys)
    assert code == 2, err
    assert (f"cannot listen on 127.0.0.1:{held_port} (Address already in use); pass a free --port, or stop what "
            f"holds it (it was free when this server started, and another process took it") in err


def test_without_serves_word_the_port_held_decides(serve_with, held_port, capsys):
    def no_status():
        raise ConnectionError("the controller is gone")

    code, err = serve_with(held_port, _raises, no_status, capsys)
    assert code == 2 and "another process took it" in err, err


def test_a_port_that_needs_root_says_so(monkeypatch):
    class _Refused:
        def __init__(self, *args):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def setsockopt(self, *args):
            pass

        def bind(self, address):
            raise OSError(errno.EACCES, "Permission denied")

    # this process may be root (which binds any port): the bind's refusal is given, not provoked
    monkeypatch.setattr(serve_command, "socket", types.SimpleNamespace(**{
        name: getattr(socket, name) for name in ("AF_INET", "SOCK_STREAM", "SOL_SOCKET", "SO_REUSEADDR")},
        socket=_Refused))
    with pytest.raises(OSError) as refused:
        serve_command.check_port_free("127.0.0.1", 80)
    message = str(refused.value)
    assert message.startswith("cannot listen on 127.0.0.1:80 (Permission denied); "), message
    assert "below 1024 need root or CAP_NET_BIND_SERVICE" in message and "--port of 1024 or above" in message
    assert "--host" not in message


def test_other_bind_errors_keep_their_fixes():
    assert serve_command.bind_error_fix(OSError(errno.EADDRINUSE, "x")) == "pass a free --port, or stop what holds it"
    assert "pass a --host this machine has" in serve_command.bind_error_fix(OSError(errno.EADDRNOTAVAIL, "x"))
