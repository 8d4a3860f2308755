"""A real HTTP server on 127.0.0.1 in a thread that records the JSON bodies POSTed to it: the
webhook end of the ``rankscope alerts --webhook`` tests."""

from __future__ import annotations

import json
import threading
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class WebhookServer:
    """Answers each POST with the next status of ``statuses`` (then 200); records the bodies it
    answered with a 2xx in :attr:`received`, every request's path in :attr:`paths`."""

    def __init__(self, statuses: list[int] | None = None) -> None:
        self.statuses: deque[int] = deque(statuses or [])
        self.received: list[Any] = []
        self.paths: list[str] = []
        self.headers: list[dict[str, str]] = []
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with server._lock:
                    status = server.statuses.popleft() if server.statuses else 200
                    server.paths.append(self.path)
                    server.headers.append(dict(self.headers))
                    if 200 <= status < 300:
                        server.received.append(json.loads(body))
                self.send_response(status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.httpd.server_address[1])
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def bodies(self) -> list[Any]:
        with self._lock:
            return list(self.received)

    def __enter__(self) -> WebhookServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)
