"""Stage one's rolling per-rank statistics: the busy-time z score that the dashboard shows."""

from __future__ import annotations

from rankscope.config import Settings
from rankscope.protocol.envelope import Envelope
from rankscope.stream_processors.shard import ShardJob, busy_z_scores

S = Settings(straggler_window=20, straggler_min_steps=8)
STEP_NS = 100_000_000


def beat(rank: int, n: int, busy_ns: int) -> Envelope:
    steps = list(range(n))
    start = [i * STEP_NS for i in steps]
    return Envelope("beat", "j", rank, "h", 100 + rank, 1, 0,
                    {"step": steps, "start_ns": start, "end_ns": [a + STEP_NS for a in start],
                     "comm_ns": [STEP_NS - busy_ns] * n, "hb_step": n - 1, "since_step_s": 0.0, "dropped": 0,
                     "world_size": 8, "local_rank": rank, "stacks": None})


def test_stats_rows_carry_each_ranks_busy_z_against_the_shards_ranks():
    sj = ShardJob("j", 0)
    for r in range(8):
        sj.apply(beat(r, 20, (60 + r % 3) * 1_000_000 if r != 5 else 90_000_000), 10.0, S)
    [rows] = sj.stats_chunks(10.0, S)
    z = {row["rank"]: row["busy_z"] for row in rows}
    assert z[5] > 4 and all(abs(v) < 1.5 for r, v in z.items() if r != 5), z


def test_busy_z_needs_three_ranks_and_floors_its_scale():
    assert busy_z_scores({0: 10, 1: 20}) == {}
    z = busy_z_scores({0: 1_000_000, 1: 1_000_000, 2: 1_000_000, 3: 1_100_000})
    assert z[3] == 2.0 and z[0] == 0.0     # MAD 0: scale = 5% of the median


def test_stats_rows_say_when_each_ranks_last_step_ended():
    sj = ShardJob("j", 0)
    sj.apply(beat(0, 20, 60_000_000), 10.0, S)
    [rows] = sj.stats_chunks(10.0, S)
    assert rows[0]["step"] == 19 and rows[0]["step_end_ns"] == 20 * STEP_NS
