"""A stand-in HTTP server in the test's own process, for scripts that take a --base-url."""
from __future__ import annotations

import contextlib
import http.server
import threading


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
