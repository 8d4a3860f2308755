"""A straggler below the processors' cost gate is shown as slow on the Job page's rank table, with
no alert; turns taken by every rank are not (real chDB store)."""

from __future__ import annotations

from rankscope.dashboard import queries as q
from rankscope.dashboard.queries.jobs import last_arrival_steps
from rankscope.last_arrivals import steps_from_records

MS = 1_000_000


def insert_steps(store, job: str, last_of, n_steps: int = 300, n_ranks: int = 4, lead_ms: float = 0.5) -> None:
    cols = {c: [] for c in ("job", "rank", "step", "start_ns", "end_ns", "duration_ns", "comm_ns", "busy_ns", "host",
                            "pid", "seq")}
    for s in range(n_steps):
        start = 10**18 + s * 100 * MS
        for r in range(n_ranks):
            arrival = start + 50 * MS + (int(lead_ms * MS) if r == last_of(s) else r * 1000)
            end = start + 100 * MS
            for c, v in (("job", job), ("rank", r), ("step", s), ("start_ns", start), ("end_ns", end),
                         ("duration_ns", end - start), ("comm_ns", end - arrival), ("busy_ns", arrival - start),
                         ("host", "h"), ("pid", 100 + r), ("seq", s)):
                cols[c].append(v)
    store.insert_columns("steps", cols)


def test_a_cheap_straggler_is_watched_and_shown_slow_without_an_alert(empty_store):
    insert_steps(empty_store, "cheap", lambda s: 1 if s % 5 < 3 else s % 4)
    insert_steps(empty_store, "fair", lambda s: s % 4)
    watch = q.slow_watch(empty_store, "cheap", 4)
    assert list(watch) == [1] and watch[1][1] < 0.01       # costs under 1% of the job's time
    assert q.slow_watch(empty_store, "fair", 4) == {}
    rows = q.ranks(empty_store, "cheap", dead_after_s=10**9)
    assert q.alerts(empty_store, job="cheap").empty
    assert dict(zip(rows["rank"], rows["state"], strict=True)) == {0: "running", 1: "slow", 2: "running", 3: "running"}


def test_the_store_reduces_steps_as_the_processors_do(empty_store):
    """Last arrival, its rank (the higher rank among equal arrivals), its step time and its lead
    over the second arrival, step by step, as rankscope.last_arrivals reduces the same records."""
    insert_steps(empty_store, "ties", lambda s: s % 3, n_steps=40, n_ranks=5, lead_ms=0.004)   # as late as rank 4
    insert_steps(empty_store, "lead", lambda s: (s * 7) % 5, n_steps=40, n_ranks=5)
    for job in ("ties", "lead"):
        records = empty_store.query_rows(
            f"SELECT rank, step, start_ns, end_ns, comm_ns FROM {empty_store.database}.steps WHERE job = {{j:String}}",
            {"j": job})
        assert last_arrival_steps(empty_store, job, 5) == steps_from_records(records, 5), job
    assert last_arrival_steps(empty_store, "ties", 6) == []    # no step has 6 ranks
