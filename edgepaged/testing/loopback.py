"""A threaded HTTP server on loopback for the fakes tests pull from (hub.py, registry.py):
subclasses give `_handler()` (a BaseHTTPRequestHandler class); `with server:` serves."""
from __future__ import annotations

import threading
from http.server import ThreadingHTTPServer


class LoopbackServer:
    def __init__(self):
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def _handler(self):
        raise NotImplementedError

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
