"""Queries started when the browser asks for the Job page: what runs, in what order, how long a
result serves, what a failure leaves, and who may start them (a fake query runner and a manual clock;
the real server's use is in the browser tests, whose pages go through it)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import pandas as pd
import pytest

from rankscope.clock import ManualClock
from rankscope.config import Settings
from rankscope.dashboard import job_queries, session_cookie
from rankscope.dashboard.prefetch import KEEP_S, JobPagePrefetch, Prefetcher, may_see_pages

JOBS = pd.DataFrame({"job": ["big", "small"], "world_size": [10_000, 4]})


class Runner:
    """Answers queries as the store would, records them, and can hold or fail one."""

    def __init__(self, fail: str = "") -> None:
        self.ran: list[tuple[str, dict]] = []
        self.fail = fail
        self.release = threading.Event()
        self.release.set()

    def __call__(self, dsn: str, name: str, kwargs: dict) -> pd.DataFrame:
        self.release.wait(10)
        self.ran.append((name, kwargs))
        if name == self.fail:
            raise RuntimeError("the store did not answer")
        return JOBS if name == "jobs" else pd.DataFrame({"query": [name]})


@pytest.fixture
def cfg(tmp_path) -> Settings:
    return replace(Settings(), clickhouse_dsn=f"chdb://{tmp_path}/store", data_dir=str(tmp_path))


def started(prefetcher: Prefetcher) -> None:
    prefetcher.pool.submit(lambda: None).result(10)     # the worker has run what was queued before


def test_the_job_pages_first_queries_run_in_its_order_and_serve_it(cfg):
    run, clock = Runner(), ManualClock()
    p = Prefetcher(run, clock.monotonic)
    assert p.start_job_page(cfg, "big")
    started(p)
    want = [("jobs", {})] + job_queries.first_queries(cfg, "big", 10_000)
    assert run.ran == want and want[-1][0] == "step_time_heatmaps"
    for name, kwargs in want:
        got = p.result(cfg.store_dsn, name, kwargs)
        assert got is not None and (name == "jobs" or list(got["query"]) == [name])
    got = p.result(cfg.store_dsn, "jobs", {})
    got.loc[0, "job"] = "changed"                         # each read is a copy
    assert p.result(cfg.store_dsn, "jobs", {}).loc[0, "job"] == "big"
    assert p.result(cfg.store_dsn, "path_seconds", {"job": "big"}) is None     # not started here
    assert p.result(cfg.store_dsn, "ranks", {"roles": ["training"]}) is None   # unhashable arguments


def test_a_small_job_has_no_heatmaps_and_a_second_request_starts_nothing(cfg):
    run, clock = Runner(), ManualClock()
    p = Prefetcher(run, clock.monotonic)
    assert p.start_job_page(cfg, "small")
    started(p)
    assert [n for n, _ in run.ran] == ["jobs", "ranks", "alerts"]
    assert not p.start_job_page(cfg, "small")
    clock.advance(KEEP_S + 0.1)
    assert p.result(cfg.store_dsn, "ranks", job_queries.ranks_args(cfg, "small")) is None   # too old
    assert p.start_job_page(cfg, "small")
    started(p)
    assert len(run.ran) == 6


def test_a_page_waits_for_a_query_under_way(cfg):
    run, clock = Runner(), ManualClock()
    run.release.clear()
    p = Prefetcher(run, clock.monotonic)
    p.start_job_page(cfg, "big")
    got: list = []
    reader = threading.Thread(target=lambda: got.append(p.result(cfg.store_dsn, "ranks", job_queries.ranks_args(cfg, "big"))))
    reader.start()
    reader.join(0.2)
    assert reader.is_alive() and not got                  # the ranks query has not run yet
    run.release.set()
    reader.join(10)
    assert list(got[0]["query"]) == ["ranks"]


@pytest.mark.parametrize("failing", ["jobs", "ranks"])
def test_a_failed_query_leaves_the_page_to_run_it(cfg, failing):
    run, clock = Runner(fail=failing), ManualClock()
    p = Prefetcher(run, clock.monotonic)
    p.start_job_page(cfg, "big")
    started(p)
    ranks = p.result(cfg.store_dsn, "ranks", job_queries.ranks_args(cfg, "big"))
    if failing == "jobs":      # the world size unknown: the ranks and alerts run, the heatmaps do not
        assert p.result(cfg.store_dsn, "jobs", {}) is None and list(ranks["query"]) == ["ranks"]
        assert [n for n, _ in run.ran] == ["jobs", "ranks", "alerts"]
    else:
        assert ranks is None and p.result(cfg.store_dsn, "jobs", {}) is not None
        assert p.start_job_page(cfg, "big")               # nothing left claimed: a new request starts again


def test_only_a_request_that_could_see_the_page_starts_queries(cfg):
    assert may_see_pages(cfg, "", 1e9)                    # no password
    locked = replace(cfg, dashboard_password="pw")
    name = session_cookie.cookie_name(locked.dashboard_port)
    key = session_cookie.dashboard_key("pw", locked.dashboard_secret, locked.data_dir)
    assert not may_see_pages(locked, "", 1e9)
    assert not may_see_pages(locked, f"{name}=123.abc", 1e9)
    assert not may_see_pages(locked, f"{name}={session_cookie.sign(key, 100)}", 1e9)   # expired
    assert may_see_pages(locked, f"other=1; {name}={session_cookie.sign(key, 2 * 10**9)}", 1e9)


def test_the_middleware_starts_the_job_page_only(cfg, monkeypatch):
    calls: list[str] = []

    class Recorder(Prefetcher):
        def start_job_page(self, cfg, job):
            calls.append(job)
            return True

    async def app(scope, receive, send):
        await send({"type": "done"})

    monkeypatch.setenv("RANKSCOPE_CLICKHOUSE_DSN", cfg.store_dsn)
    middleware = JobPagePrefetch(app, prefetcher=Recorder(Runner()))

    def request(method: str, path: str, query: bytes) -> list:
        sent: list = []

        async def send(m):
            sent.append(m)

        scope = {"type": "http", "method": method, "path": path, "query_string": query, "headers": []}
        asyncio.run(middleware(scope, None, send))
        return sent

    assert request("GET", "/job", b"job=big&x=1") == [{"type": "done"}]
    request("GET", "/prefix/job", b"job=j%202")
    request("GET", "/alerts", b"job=big")
    request("POST", "/job", b"job=big")
    request("GET", "/job", b"")
    assert calls == ["big", "j 2"]
