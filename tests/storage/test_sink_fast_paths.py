"""The sink's rows of the high-rate kinds: hw samples, worker stats, and beats (whose fast path gives
the rows and state of the split pair)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from rankscope.protocol.envelope import Envelope, decode, encode
from rankscope.protocol.errors import WireError
from rankscope.storage.columns import TABLE_COLUMNS, Columns
from rankscope.storage.convert import Batch, RowBuilder
from rankscope.storage.rows import hw_columns, stats_tuples
from rankscope.topics import Topic


def _env(kind: str, body: dict[str, Any]) -> Envelope:
    return Envelope(kind=kind, job="j", rank=3, host="h", pid=7, seq=1, sent_ns=10, body=body)


def test_a_hopper_ranks_samples_make_a_row_per_sample_and_metric() -> None:
    # Five samples as a rank sends them; on local rank 0 each sample is a GPU entry and a host entry.
    from benchmarks.loadgen import _hw_body
    for local_rank in (0, 3):
        body = _hw_body(10**18, local_rank, True, samples=5)
        cols = Columns(TABLE_COLUMNS["hw_samples"])
        hw_columns(decode(encode(_env("hw", body))), cols)
        assert cols.rows == 5 * (21 + (9 if local_rank == 0 else 0))
        assert all(type(v) is float for v in cols.data["value"])


def test_stats_tuples_are_the_worker_stats_columns_in_order() -> None:
    entry = {"rank": 1, "ts_ns": 5, "step": 2, "window_steps": 3, "median_step_ns": 4, "p95_step_ns": 5,
             "median_busy_ns": 6, "median_comm_ns": 7, "busy_z": 1, "state": "running"}
    e = decode(encode(_env("stats", {"ranks": [entry, {**entry, "rank": 2, "busy_z": 0.5, "cpu_wait": 0.25}]})))
    names = TABLE_COLUMNS["worker_stats"]
    assert stats_tuples(e) == [
        tuple({"job": "j", **entry, "busy_z": float(entry["busy_z"]), "cpu_wait_share": -1.0}[c] for c in names),
        tuple({"job": "j", **entry, "rank": 2, "busy_z": 0.5, "cpu_wait_share": 0.25}[c] for c in names)]
    assert type(stats_tuples(e)[0][names.index("busy_z")]) is float
    with pytest.raises(WireError, match="cpu_wait=1.5 is not a share"):
        decode(encode(_env("stats", {"ranks": [{**entry, "cpu_wait": 1.5}]})))


class CheckedBeats(RowBuilder):
    """Every beat through split_beat and the checked per-kind paths."""

    def _beat(self, env: Envelope, batch: Batch) -> bool:
        return False


def test_beat_fast_path_gives_the_rows_and_state_of_the_split_pair() -> None:
    rng = random.Random(3)
    fast, checked = RowBuilder(), CheckedBeats()
    b_fast, b_checked = Batch(started_at=0), Batch(started_at=0)
    for i in range(3000):
        rank = rng.randrange(6)
        job = rng.choice(["a", "b"])
        sent = 1_000_000 + rng.randrange(200) * 1000      # out of order across ranks and jobs
        n = rng.choice([0, 1, 1, 1, 3])
        first = rng.randrange(50)
        steps = list(range(first, first + n))
        body = {"step": steps, "start_ns": [s * 10 for s in steps], "end_ns": [s * 10 + 7 for s in steps],
                "comm_ns": [rng.randrange(9) for _ in steps], "hb_step": first + n - 1 if n else rng.randrange(50),
                "since_step_s": rng.choice([0.5, 1, 2.25]), "dropped": rng.randrange(3),
                "world_size": rng.choice([-1, 8, 8, 16]), "local_rank": rng.choice([-1, rank]),
                "stacks": rng.choice([None, None, [{"thread": "MainThread", "frames": ["f.py:1 g"]}]])}
        env = Envelope(kind="beat", job=job, rank=rank, host=rng.choice(["", "h1", "h2"]),
                       pid=rng.choice([7, 7, 7, 8]), seq=i, sent_ns=sent, body=body)
        data = encode(env)
        fast.add(Topic.STEPS, data, b_fast)
        checked.add(Topic.STEPS, data, b_checked)
        assert fast.ranks == checked.ranks and fast.jobs == checked.jobs, i
    assert b_fast.rows == b_checked.rows and b_fast.ranks == b_checked.ranks and b_fast.jobs == b_checked.jobs
    assert {t: c.data for t, c in b_fast.tables.items()} == {t: c.data for t, c in b_checked.tables.items()}
