"""A page's first queries, started when the browser asks for the page's HTML.

From that request until the page's script runs, the browser loads and runs Streamlit's scripts and
connects: ~0.4 s on the benchmark machine, with the server idle. The web server (server.py) starts
the Job page's first queries (job_queries.first_queries) for ``/job?job=J`` then, on a thread of its
own, so that the script finds them done or under way (ui.query asks :meth:`Prefetcher.result`
first). Each result serves the page's script runs for :data:`KEEP_S` after it was read from the
store; a failed query leaves nothing, and the page runs it again and shows what went wrong.

Queries start only for a request that could see the page: no dashboard password, or a valid
sign-in cookie (session_cookie.py).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Hashable, MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor
from http.cookies import CookieError, SimpleCookie
from typing import Any
from urllib.parse import parse_qs

from rankscope.config import ConfigError, Settings
from rankscope.dashboard import job_queries, queries, session_cookie

log = logging.getLogger(__name__)

KEEP_S = 3.0           # a result serves the page this long after it was read
WAIT_S = 60.0          # the longest a page waits for a query started for it

Key = tuple[str, str, tuple[tuple[str, Hashable], ...]]


def key_of(dsn: str, name: str, kwargs: dict[str, Any]) -> Key:
    return dsn, name, tuple(sorted(kwargs.items()))


class Prefetcher:
    """Queries started ahead of a page, by key (DSN, query name, arguments), on one worker thread.

    ``run(dsn, name, kwargs)`` runs one query (by default ``queries.<name>`` on the shared store);
    ``clock`` gives monotonic seconds."""

    def __init__(self, run: Callable[[str, str, dict[str, Any]], Any] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.run = run or run_query
        self.clock = clock
        self.lock = threading.Lock()
        self.started: dict[Key, Future[Any]] = {}
        self.done_at: dict[Key, float] = {}
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rankscope-prefetch")

    def result(self, dsn: str, name: str, kwargs: dict[str, Any]) -> Any | None:
        """A copy of the result started for this query, after waiting for it; None when none was
        started, it is older than :data:`KEEP_S`, or it failed."""
        key = key_of(dsn, name, kwargs)
        try:
            hash(key)
        except TypeError:      # arguments such as lists: never started here
            return None
        with self.lock:
            self._expire()
            future = self.started.get(key)
        if future is None:
            return None
        try:
            return copy.deepcopy(future.result(timeout=WAIT_S))
        except Exception:  # the page runs the query itself and says what went wrong
            return None

    def start_job_page(self, cfg: Settings, job: str) -> bool:
        """Start the Job page's first queries for ``job`` unless they are under way or fresh; True
        when started."""
        dsn = cfg.store_dsn
        with self.lock:
            self._expire()
            ranks = self._claim(key_of(dsn, "ranks", job_queries.ranks_args(cfg, job)))
            if ranks is None:
                return False
            jobs = self._claim(key_of(dsn, "jobs", {}))
        self.pool.submit(self._job_page, cfg, job, ranks, jobs)
        return True

    def _claim(self, key: Key) -> Future[Any] | None:
        """A new future for ``key``, which the caller fills; None when one is under way or fresh."""
        if key in self.started:
            return None
        future: Future[Any] = Future()
        self.started[key] = future
        return future

    def _job_page(self, cfg: Settings, job: str, ranks: Future[Any], jobs: Future[Any] | None) -> None:
        dsn = cfg.store_dsn
        jobs_key = key_of(dsn, "jobs", {})
        claimed = [(key_of(dsn, "ranks", job_queries.ranks_args(cfg, job)), ranks)]
        if jobs is not None:
            claimed.append((jobs_key, jobs))
        try:
            if jobs is not None:
                self._fill(jobs_key, jobs, dsn, "jobs", {})
            with self.lock:
                known = self.started.get(jobs_key)
            world = job_queries.world_of(known.result(timeout=WAIT_S), job) if known is not None else 0
            for name, kwargs in job_queries.first_queries(cfg, job, world):
                key = key_of(dsn, name, kwargs)
                with self.lock:
                    future = ranks if name == "ranks" else self._claim(key)
                if future is None or future.done():
                    continue
                claimed.append((key, future))
                self._fill(key, future, dsn, name, kwargs)
        except Exception as e:
            log.debug("prefetching the Job page of %s failed: %s", job, e)
        finally:
            for key, future in claimed:      # a page never waits on a query nobody runs
                if not future.done():
                    with self.lock:
                        if self.started.get(key) is future:
                            self.started.pop(key)
                    future.set_exception(RuntimeError("not prefetched"))

    def _fill(self, key: Key, future: Future[Any], dsn: str, name: str, kwargs: dict[str, Any]) -> None:
        try:
            value = self.run(dsn, name, kwargs)
        except Exception as e:
            log.debug("prefetching %s failed: %s", name, e)
            with self.lock:
                self.started.pop(key, None)
            future.set_exception(e)
            return
        with self.lock:
            self.done_at[key] = self.clock()
        future.set_result(value)

    def _expire(self) -> None:
        now = self.clock()
        for key, at in list(self.done_at.items()):
            if now - at > KEEP_S:
                self.done_at.pop(key)
                self.started.pop(key, None)


def run_query(dsn: str, name: str, kwargs: dict[str, Any]) -> Any:
    from rankscope.storage.store import open_store

    return getattr(queries, name)(open_store(dsn), **kwargs)


PREFETCHER = Prefetcher()

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]


def may_see_pages(cfg: Settings, cookie_header: str, now: float) -> bool:
    """True when no dashboard password is set, or ``cookie_header`` holds a valid sign-in cookie."""
    if not cfg.dashboard_password:
        return True
    try:
        cookies = SimpleCookie(cookie_header)
    except CookieError:
        return False
    morsel = cookies.get(session_cookie.cookie_name(cfg.dashboard_port))
    if morsel is None:
        return False
    key = session_cookie.dashboard_key(cfg.dashboard_password, cfg.dashboard_secret, cfg.data_dir)
    return bool(session_cookie.verify(key, morsel.value, now))


class JobPagePrefetch:
    """ASGI middleware: a GET of the Job page (``/job?job=J``) starts its first queries."""

    def __init__(self, app: ASGIApp, prefetcher: Prefetcher | None = None, page_path: str = "job") -> None:
        self.app = app
        self.prefetcher = prefetcher or PREFETCHER
        self.page_path = page_path

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope.get("type") == "http" and scope.get("method") == "GET" \
                and str(scope.get("path", "")).rstrip("/").rsplit("/", 1)[-1] == self.page_path:
            job = parse_qs(bytes(scope.get("query_string", b"")).decode("latin-1")).get("job")
            if job:
                self._start(scope, job[0])
        await self.app(scope, receive, send)

    def _start(self, scope: Scope, job: str) -> None:
        try:
            cfg = Settings.from_env()
        except ConfigError:
            return      # the page says what is wrong
        headers = dict(scope.get("headers", []))
        if may_see_pages(cfg, headers.get(b"cookie", b"").decode("latin-1"), time.time()):
            self.prefetcher.start_job_page(cfg, job)
