"""Serve's loopback query endpoint: read-only SQL for other processes while serve holds the embedded store.

chDB lets one process open a data directory. While ``rankscope serve`` holds it, ``rankscope sql``
and ``rankscope export`` send their statements here instead of opening the store.

Server (:class:`QueryEndpoint`, a daemon thread in serve): HTTP on 127.0.0.1 and a free port only.
``POST /query`` with ``Authorization: Bearer <token>`` and a JSON body ``{"sql", "parameters",
"max_rows", "timeout_s", "max_bytes"}`` runs the statement through the guard
(:mod:`rankscope.storage.readonly`) and answers an Arrow IPC stream (header ``X-Rankscope-Truncated: 0|1``);
errors answer JSON ``{"kind": "refused"|"store"|"request"|"auth", "error": "..."}`` with status
400, 502, 400 or 401. The port and a random token are written to ``<data_dir>/run/query.json``,
created 0600, so only the user who runs serve can read them and query; the file is removed on stop.

Client (:func:`endpoint_for`, :class:`EndpointStore`): read that file, check that its serve
process is alive and holds the same DSN, and send statements there.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pandas as pd

from rankscope.sql_guard import DEFAULT_MAX_BYTES, DEFAULT_MAX_ROWS, DEFAULT_TIMEOUT_S, SqlRefused
from rankscope.storage.readonly import SqlResult, run_readonly_arrow
from rankscope.storage.store import Store, StoreError

log = logging.getLogger(__name__)

ENDPOINT_FILE = "query.json"
MAX_REQUEST_BYTES = 1 << 20
ARROW_STREAM = "application/vnd.apache.arrow.stream"


def endpoint_path(data_dir: str | Path) -> Path:
    return Path(data_dir) / "run" / ENDPOINT_FILE


class QueryEndpoint:
    """The server side; ``start()`` binds 127.0.0.1:<free port> and writes the endpoint file."""

    def __init__(self, store: Store, data_dir: str | Path) -> None:
        self.store = store
        self.path = endpoint_path(data_dir)
        self.token = secrets.token_urlsafe(32)
        self.httpd: ThreadingHTTPServer | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> QueryEndpoint:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="rankscope-query-endpoint", daemon=True)
        self.thread.start()
        _write_private(self.path, json.dumps({"port": self.port, "token": self.token, "pid": os.getpid(),
                                              "dsn": self.store.dsn}))
        log.info("query endpoint on http://127.0.0.1:%d (token in %s)", self.port, self.path)
        return self

    @property
    def port(self) -> int:
        assert self.httpd is not None
        return int(self.httpd.server_address[1])

    def stop(self) -> None:
        try:
            info = json.loads(self.path.read_text())
            if info.get("token") == self.token:
                self.path.unlink()
        except (OSError, ValueError):
            pass
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()

    def answer(self, body: dict[str, Any]) -> tuple[int, str, bytes, dict[str, str]]:
        """(status, content type, payload, extra headers) for one request body."""
        import pyarrow as pa

        try:
            sql = body["sql"]
            params = body.get("parameters") or None
            max_rows = int(body.get("max_rows") or DEFAULT_MAX_ROWS)
            timeout_s = float(body.get("timeout_s") or DEFAULT_TIMEOUT_S)
            max_bytes = int(body.get("max_bytes") or DEFAULT_MAX_BYTES)
            if not isinstance(sql, str) or (params is not None and not isinstance(params, dict)):
                raise TypeError("sql must be a string and parameters an object")
            table, truncated = run_readonly_arrow(self.store, sql, max_rows, timeout_s, params, max_bytes)
        except SqlRefused as e:
            return _error(400, "refused", str(e))
        except StoreError as e:
            return _error(502, "store", str(e))
        except (KeyError, TypeError, ValueError) as e:
            return _error(400, "request", f"bad request: {type(e).__name__}: {e}")
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        return 200, ARROW_STREAM, sink.getvalue().to_pybytes(), {"X-Rankscope-Truncated": str(int(truncated))}


def _error(status: int, kind: str, msg: str) -> tuple[int, str, bytes, dict[str, str]]:
    return status, "application/json", json.dumps({"kind": kind, "error": msg}).encode(), {}


def _handler(endpoint: QueryEndpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            if self.path != "/query":
                return self._send(*_error(404, "request", f"no such path {self.path}"))
            auth = self.headers.get("Authorization", "")
            if not hmac.compare_digest(auth.encode(), f"Bearer {endpoint.token}".encode()):
                return self._send(*_error(401, "auth", "missing or wrong token"))
            try:
                n = int(self.headers.get("Content-Length", "0"))
                if not 0 < n <= MAX_REQUEST_BYTES:
                    raise ValueError(f"body of {n} bytes")
                body = json.loads(self.rfile.read(n))
                if not isinstance(body, dict):
                    raise ValueError("the body is not a JSON object")
            except ValueError as e:
                return self._send(*_error(400, "request", f"bad request: {e}"))
            self._send(*endpoint.answer(body))

        def _send(self, status: int, ctype: str, payload: bytes, headers: dict[str, str]) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(payload)))
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("query endpoint: " + fmt, *args)

    return Handler


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, readable by this user only (0600 from creation on)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


# Client ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Endpoint:
    port: int
    token: str
    pid: int
    dsn: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/query"


def endpoint_for(data_dir: str | Path, dsn: str) -> Endpoint | None:
    """The live serve endpoint of ``dsn`` under ``data_dir``, or None (no file, another DSN, process gone)."""
    try:
        info = json.loads(endpoint_path(data_dir).read_text())
        ep = Endpoint(int(info["port"]), str(info["token"]), int(info["pid"]), str(info["dsn"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if ep.dsn != dsn:
        return None
    try:
        os.kill(ep.pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return ep


def query(ep: Endpoint, sql: str, parameters: dict[str, Any] | None = None, max_rows: int = DEFAULT_MAX_ROWS,
          timeout_s: float = DEFAULT_TIMEOUT_S, max_bytes: int = DEFAULT_MAX_BYTES) -> SqlResult:
    """Run a guarded statement in the serve process. Raises SqlRefused (the guard said no) or StoreError."""
    import time

    import pyarrow as pa

    body = json.dumps({"sql": sql, "parameters": parameters, "max_rows": max_rows, "timeout_s": timeout_s,
                       "max_bytes": max_bytes}).encode()
    req = urllib.request.Request(ep.url, data=body, method="POST", headers={
        "Authorization": f"Bearer {ep.token}", "Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout_s + 60) as r:
            payload, truncated = r.read(), r.headers.get("X-Rankscope-Truncated") == "1"
    except urllib.error.HTTPError as e:
        try:
            err = json.loads(e.read())
        except ValueError:
            err = {"kind": "store", "error": f"HTTP {e.code}"}
        if err.get("kind") == "refused":
            raise SqlRefused(err.get("error", "refused")) from None
        raise StoreError(f"serve's query endpoint: {err.get('error')}") from None
    except OSError as e:
        raise StoreError(f"serve's query endpoint {ep.url} did not answer: {e}") from e
    frame = pa.ipc.open_stream(payload).read_all().to_pandas()
    return SqlResult(sql, frame, truncated, round(time.perf_counter() - t0, 3))


class EndpointStore:
    """A read-only Store look-alike (``query_df``, ``query_rows``) whose statements run in serve.

    Every statement goes through the guard on the other side; a truncated answer raises StoreError
    (the dashboard's queries carry their own LIMIT and must never get silently partial rows).
    """

    embedded = True

    def __init__(self, ep: Endpoint, database: str = "rankscope", max_rows: int = 100_000_000,
                 timeout_s: float = 600.0, max_bytes: int = 16 << 30) -> None:
        self.ep, self.dsn, self.database = ep, ep.dsn, database
        self.max_rows, self.timeout_s, self.max_bytes = max_rows, timeout_s, max_bytes

    def query_df(self, sql: str, parameters: dict[str, Any] | None = None,
                 settings: dict[str, Any] | None = None) -> pd.DataFrame:
        try:
            res = query(self.ep, sql, parameters, self.max_rows, self.timeout_s, self.max_bytes)
        except SqlRefused as e:
            raise StoreError(f"serve refused the statement: {e}") from e
        if res.truncated:
            raise StoreError(f"the answer was over {self.max_rows} rows or {self.max_bytes} bytes")
        return res.frame

    def query_rows(self, sql: str, parameters: dict[str, Any] | None = None,
                   settings: dict[str, Any] | None = None) -> list[tuple]:
        return list(self.query_df(sql, parameters).itertuples(index=False, name=None))

    def close(self) -> None:
        pass


def open_read_store(dsn: str, data_dir: str | Path) -> tuple[Any, Any]:
    """A store to read from and the call that releases it: serve's endpoint when serve holds ``dsn``'s
    embedded directory, else :func:`rankscope.storage.store.open_store` (a ClickHouse server DSN goes straight
    to the server). Raises StoreLocked/StoreError as ``open_store`` does."""
    from rankscope.storage.store import close_store, open_store

    if dsn.startswith("chdb://"):
        ep = endpoint_for(data_dir, dsn)
        if ep is not None:
            return EndpointStore(ep), lambda: None
    store = open_store(dsn)
    return store, lambda: close_store(dsn)
