"""The load generator (benchmarks/loadgen.py) against the real broker: what it sends is the real
wire format, keyed as ranks key it, small, and shows the faults it plants."""

from __future__ import annotations

import uuid
from collections import Counter, defaultdict
from typing import Any

import pytest
from confluent_kafka import Consumer, TopicPartition

from benchmarks.loadgen import HANG_FRAMES, WAIT_FRAMES, LoadConfig, run
from rankscope.config import Settings
from rankscope.protocol.envelope import Envelope, decode, rank_key
from rankscope.storage.columns import TABLE_COLUMNS, Columns
from rankscope.storage.rows import hw_columns
from rankscope.topics import Topic

pytestmark = pytest.mark.kafka


def read_all(settings: Settings, topic: Topic, expected: int) -> list[tuple[bytes, bytes]]:
    """Every (key, value) of ``topic``, reading until ``expected`` messages came (or 60 s of silence)."""
    name = topic.name_for(settings)
    c = Consumer({"bootstrap.servers": settings.bootstrap, "group.id": f"test-{uuid.uuid4().hex}",
                  "enable.auto.commit": False, "auto.offset.reset": "earliest"})
    try:
        parts = c.list_topics(name, timeout=30).topics[name].partitions
        c.assign([TopicPartition(name, p, 0) for p in parts])
        out: list[tuple[bytes, bytes]] = []
        idle = 0
        while len(out) < expected and idle < 60:
            batch = c.consume(1000, 1.0)
            idle = 0 if batch else idle + 1
            for m in batch:
                assert m.error() is None, m.error()
                out.append((m.key(), m.value()))
        return out
    finally:
        c.close()


def by_rank(envs: list[Envelope]) -> dict[int, list[Envelope]]:
    out: dict[int, list[Envelope]] = defaultdict(list)
    for e in envs:
        out[e.rank].append(e)
    for lst in out.values():
        lst.sort(key=lambda e: e.seq)
    return out


def check_ranks_consistent(ranks: dict[int, list[Envelope]]) -> None:
    for r, envs in ranks.items():
        assert len({e.pid for e in envs}) == 1 and len({e.host for e in envs}) == 1
        seqs = [e.seq for e in envs]
        assert seqs == sorted(set(seqs)), f"rank {r}: seq not strictly increasing"
        assert [e.sent_ns for e in envs] == sorted(e.sent_ns for e in envs)


def test_v2_beats_keyed_by_rank_and_show_the_hang(fresh_topics: Settings) -> None:
    job, n, hang_rank, dead_rank = "lg-v2", 64, 3, 40
    cfg = LoadConfig(ranks=n, duration_s=6.0, procs=2, job=job, hang_at=1.5, hang_rank=hang_rank,
                     dead_at=2.5, dead_rank=dead_rank, exit=True, summary_ranks=2, summary_at=1.0)
    out = run(cfg, fresh_topics)
    msgs = out["messages"]
    assert msgs["beat"] > 0 and msgs["hw"] > 0 and msgs["summary"] == 2 and msgs["exit"] == n - 1
    assert out["unflushed"] == 0 and not out["errors"]

    raw = read_all(fresh_topics, Topic.STEPS, msgs["beat"] + msgs["exit"])
    assert len(raw) == msgs["beat"] + msgs["exit"]
    envs = []
    for key, value in raw:
        assert len(value) < 8 * 1024, f"{len(value)}-byte message"   # far under 64 KB
        e = decode(value)                                            # every message is valid wire format
        assert e.v == 2 and e.job == job and e.kind in ("beat", "exit")
        assert key == rank_key(job, e.rank)
        envs.append(e)
    ranks = by_rank(envs)
    assert set(ranks) == set(range(n))
    check_ranks_consistent(ranks)

    hang = out["faults"]["hang"]
    assert hang["rank"] == hang_rank and hang["last_step"] >= 0
    for r, lst in ranks.items():
        beats = [e for e in lst if e.kind == "beat"]
        steps = [s for e in beats for s in e.body["step"]]
        assert steps == list(range(len(steps))), f"rank {r}: steps not each reported once, in order"
        for e in beats:
            b = e.body
            assert b["world_size"] == n and b["local_rank"] == r % 8 and b["dropped"] == 0
            assert all(c >= 0 for c in b["comm_ns"])
            assert all(a < z for a, z in zip(b["start_ns"], b["end_ns"], strict=True))
        if r == dead_rank:
            assert lst[-1].sent_ns < out["faults"]["dead"]["at_ns"]      # silent from dead-at on, no exit
            assert all(e.kind == "beat" for e in lst)
            continue
        assert lst[-1].kind == "exit" and lst[-1].body["reason"] == "completed"
        last = hang["last_step"] if r == hang_rank else hang["others_last_step"]
        assert steps[-1] == last
        reported_last = next(i for i, e in enumerate(beats) if last in e.body["step"])
        frozen = beats[reported_last + 1:]   # every beat after the one carrying the last step
        assert len(frozen) >= 2
        assert all(e.body["hb_step"] == last and not e.body["step"] for e in frozen)   # hb_step frozen
        since = [e.body["since_step_s"] for e in frozen]
        assert since == sorted(since) and since[-1] > since[0]                         # since_step_s growing
        if r == hang_rank:
            assert since[-1] > fresh_topics.stall_stack_min_s
            stacked = [e for e in frozen if e.body["stacks"]]
            assert stacked and all(e.body["since_step_s"] > fresh_topics.stall_stack_min_s for e in stacked)
            assert stacked[-1].body["stacks"][0]["frames"] == HANG_FRAMES
        for e in frozen:
            if e.body["stacks"]:
                assert e.body["stacks"][0]["frames"] == (HANG_FRAMES if r == hang_rank else WAIT_FRAMES)
    # The culprit is the one rank at the lowest step; everyone else waits one step on.
    last_steps = {r: ranks[r][-1].body["step"] for r in ranks if r != dead_rank}
    assert min(last_steps.values()) == hang["last_step"]
    assert [r for r, s in last_steps.items() if s == hang["last_step"]] == [hang_rank]

    hw = read_all(fresh_topics, Topic.HW, msgs["hw"])
    assert len(hw) == msgs["hw"]
    # A sample per beat, sent every hw_send_s as the ranks send them: up to that many samples a
    # heartbeat apart, the last one taken when the message was sent.
    hw_every = round(fresh_topics.hw_send_s / fresh_topics.heartbeat_s)
    assert hw_every > 1
    samples = Counter()
    hb_ns = int(fresh_topics.heartbeat_s * 1e9)
    for key, value in hw:
        e = decode(value)
        assert e.kind == "hw" and key == rank_key(job, e.rank) and len(value) < 64 * 1024
        local = e.rank % 8
        per_sample = (local, -1) if local == 0 else (local,)   # local rank 0 adds the host's entry
        ts, devices = e.body["ts_ns"], e.body["device"]
        k, rest = divmod(len(ts), len(per_sample))
        assert rest == 0 and 1 <= k <= hw_every and len(devices) == len(ts) and ts[-1] == e.sent_ns
        assert devices == list(per_sample) * k
        sample_ts = ts[::len(per_sample)]
        assert ts == [t for t in sample_ts for _ in per_sample]
        assert all(b - a == hb_ns for a, b in zip(sample_ts, sample_ts[1:], strict=False))
        # The rows the sink stores: what a Hopper rank's sampler sends (21 GPU metrics) and, on local
        # rank 0, the host's 9.
        rows = Columns(TABLE_COLUMNS["hw_samples"])
        hw_columns(e, rows)
        assert rows.rows == k * (21 + (9 if local == 0 else 0))
        samples[e.rank] += k
    assert out["hw_rows_per_s"] == (n * 21 + n // 8 * 9) / fresh_topics.heartbeat_s
    beats = Counter(e.rank for e in envs if e.kind == "beat")
    assert all(beats[r] - hw_every < samples[r] <= beats[r] for r in beats)
    assert len(hw) < len([e for e in envs if e.kind == "beat"]) / 2
    summaries = read_all(fresh_topics, Topic.SUMMARIES, 2)
    assert sorted(decode(v).rank for _, v in summaries) == [0, 1]
    assert all(k == job.encode() for k, _ in summaries)


def test_v1_steps_and_heartbeats_keyed_by_job(fresh_topics: Settings) -> None:
    job, n = "lg-v1", 16
    out = run(LoadConfig(ranks=n, duration_s=3.0, procs=1, job=job, wire="v1", hw=False), fresh_topics)
    msgs: dict[str, Any] = out["messages"]
    assert set(msgs) == {"steps", "heartbeat"} and msgs["heartbeat"] >= n
    raw = read_all(fresh_topics, Topic.STEPS, msgs["steps"] + msgs["heartbeat"])
    assert len(raw) == msgs["steps"] + msgs["heartbeat"]
    envs = [decode(v) for _, v in raw]
    assert all(k == job.encode() for k, _ in raw)
    assert all(e.v == 1 and e.kind in ("steps", "heartbeat") for e in envs)
    ranks = by_rank(envs)
    assert set(ranks) == set(range(n))
    check_ranks_consistent(ranks)
    for lst in ranks.values():
        steps = [s for e in lst if e.kind == "steps" for s in e.body["step"]]
        assert steps == list(range(len(steps))) and steps
        hb = [e.body for e in lst if e.kind == "heartbeat"]
        assert all(h["world_size"] == n and h["stacks"] is None for h in hb)
