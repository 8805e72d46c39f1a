"""`corelaunch serve`'s start-up probe of GET /health reaches the server itself, whatever proxy the
environment names: urlopen's default opener honours http_proxy (and skips 127.0.0.1 only where
no_proxy names it), so on a host with a proxy set the command waited out --ready-timeout (900 s),
said "did not answer 200" and shut a healthy server down."""

from __future__ import annotations

import http.server
import socket
import threading
import time
import urllib.request

import pytest


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the stdlib's name
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def healthy_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
def dead_proxy(monkeypatch):
    """http_proxy naming a port that refuses connections, as a fresh process sees it: urlopen's
    default opener reads the proxies once, when first used, so the cached one is dropped."""
    with socket.socket() as refusing:  # bound, not listening: connections to it are refused
        refusing.bind(("127.0.0.1", 0))
        proxy = f"http://127.0.0.1:{refusing.getsockname()[1]}"
        for name in ("http_proxy", "HTTP_PROXY"):
            monkeypatch.setenv(name, proxy)
        for name in ("no_proxy", "NO_PROXY"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setattr(urllib.request, "_opener", None)
        yield proxy


def test_the_health_probe_ignores_http_proxy(healthy_server, dead_proxy):
    from launcher.cli.serve_command import wait_healthy

    # the proxy is really in the way of a plain urlopen (else this test would prove nothing)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{healthy_server}/health", timeout=5)
    # no time left of --ready-timeout: one probe, which must reach the server
    assert wait_healthy("127.0.0.1", healthy_server, threading.Event(), time.monotonic(), 3.0) is None
