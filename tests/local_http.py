"""A stand-in HTTP server in the test's own process, for scripts that take a --base-url."""
from __future__ import annotations

import contextlib
import http.server
import threading


class QuietHandler(http.server.BaseHTTPRequestHandler):
    """A request handler that writes no access log and sends whole bodies."""

    def send_body(self, status: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler]):
    """Serve `handler` on a free local port in a thread; yields the server's /v1 URL and stops it on
    leaving."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()
