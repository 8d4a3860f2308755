"""Both stages at job sizes where rows are sampled: 10,000 ranks over 4 shards (no Kafka).

The summaries and alerts stay bounded, and the rules still name the planted slow, dead and hung
ranks from histograms and sampled rows."""

from __future__ import annotations

import random

import msgpack

from rankscope.config import Settings
from rankscope.protocol.envelope import Envelope
from rankscope.protocol.errors import WireError
from rankscope.protocol.shard import MAX_SUMMARY_BYTES
from rankscope.stream_processors.pipeline import TwoStage
from rankscope.stream_processors.shard import ShardJob
from rankscope.stream_processors.shard_summary import ShardSummary, hist_bin, hist_quantile

S = Settings(hang_min_s=10, dead_after_s=6, straggler_window=20, straggler_min_steps=8, straggler_z=4,
             straggler_min_rel=0.25, straggler_persist=3)
N = 10_000
STEP_NS = 1_000_000_000
HANG = ["train.py:10 <module>", "train.py:40 train", "train.py:20 hang_forever"]
WAIT = ["train.py:10 <module>", "train.py:42 train", "torch/distributed/distributed_c10d.py:2501 all_reduce"]


def beat(rank: int, step: int | None, hb_step: int, since: float, t: float, busy_ns: int, stacks=None) -> Envelope:
    steps = [] if step is None else [step]
    start = [int((t - 1) * 1e9)] if steps else []
    return Envelope(kind="beat", job="big", rank=rank, host=f"n{rank // 8}", pid=10_000 + rank, seq=hb_step + 1,
                    sent_ns=int(t * 1e9),
                    body={"step": steps, "start_ns": start, "end_ns": [a + STEP_NS for a in start],
                          "comm_ns": [STEP_NS - busy_ns] * len(steps), "hb_step": hb_step, "since_step_s": since,
                          "dropped": 0, "world_size": N, "local_rank": rank % 8,
                          "stacks": None if stacks is None else [{"thread": "MainThread", "frames": stacks}]})


def encoded_size(summary: ShardSummary) -> int:
    return len(msgpack.packb(summary.to_body(), use_bin_type=True))


def test_ten_thousand_ranks_slow_dead_and_hung_are_named_within_bounds():
    rng = random.Random(1)
    job = TwoStage("big", shards=4)
    t0 = 1_000_000.0
    alerts = []
    sizes = []
    slow, dead, hung = 4321, 777, 9001
    for sec in range(60):
        t = t0 + sec
        for r in range(N):
            if r == dead and sec >= 25:
                continue
            busy = int(0.6e9 * (1 + rng.gauss(0, 0.03)) * (1.6 if r == slow and sec >= 5 else 1.0))
            if sec < 45:
                job.apply(beat(r, sec, sec, 0.0, t, busy), t, S)
            else:   # rank 9001 hangs at 45 s; the others wait in all_reduce a second later
                since = sec - 44.0
                frames = HANG if r == hung else WAIT
                job.apply(beat(r, None, 44, since, t, busy, frames if since > 3 else None), t, S)
        for sj in job.shards.values():
            sizes.append(encoded_size(sj.summary(t, S)))
        alerts += job.scan(t, S)
    assert max(sizes) < MAX_SUMMARY_BYTES, max(sizes)
    assert all(len(a.to_json()) < 64 * 1024 for a in alerts)
    opened = {a.kind: a for a in alerts if a.status == "open"}
    assert opened["slow_rank"].ranks == [slow], opened["slow_rank"].summary
    assert opened["dead_rank"].ranks == [dead], opened["dead_rank"].summary
    assert opened["hang"].ranks == [hung], opened["hang"].summary
    assert "hang_forever" in opened["hang"].summary
    waiting = [g for g in opened["hang"].stack_groups if g.waiting_in_collective]
    assert waiting and waiting[0].count > 1000 and len(waiting[0].ranks) <= 32
    assert sorted(k for k in opened) == ["dead_rank", "hang", "slow_rank"]
    assert [a.kind for a in alerts if a.status == "open"].count("slow_rank") == 1


def test_summary_validation_and_histograms():
    sj = ShardJob("j", 0)
    sj.apply(beat(1, 0, 0, 0.0, 100.0, 500_000_000), 100.0, S)
    body = sj.summary(100.0, S).to_body()
    again = ShardSummary.from_body(msgpack.unpackb(msgpack.packb(body), strict_map_key=False))
    assert again.rows[0].rank == 1 and again.agg["ranks"] == 1
    for broken in ({**body, "rows": [[1, 2]]}, {**body, "agg": {**body["agg"], "live": "x"}}):
        try:
            ShardSummary.from_body(broken)
        except WireError as e:
            assert e.reason == "bad_body"
        else:
            raise AssertionError("accepted a broken summary")
    hist = {hist_bin(v): 1 for v in (1e6, 2e6, 3e6)}
    assert abs(hist_quantile(hist, 0.5) - 2e6) / 2e6 < 0.03
