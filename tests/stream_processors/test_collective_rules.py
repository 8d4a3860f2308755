"""The rules on collective records: NCCL-shaped Flight Recorder dumps (tests/fr_dumps.py) of four
ranks with several process groups, read by the rank-side reader, through both processor stages.
Every rank's host shows the same step times and no time blocked in collectives, as on GPUs."""

from __future__ import annotations

from rankscope.config import Settings
from rankscope.producers.collective_log import CollectiveLog
from rankscope.protocol.envelope import Envelope
from rankscope.stream_processors.collective_arrivals import CollectiveLedger, ShardCollectives, behind
from rankscope.stream_processors.pipeline import TwoStage
from tests.fr_dumps import ModelledJob

S = Settings(hang_min_s=10, hang_factor=8, dead_after_s=6, straggler_window=20, straggler_min_steps=8,
             straggler_persist=3, straggler_min_s=1.0, straggler_min_slow_steps=20)
WAIT = [{"thread": "MainThread", "frames": ["train.py:10 <module>", "train.py:30 train",
                                            "torch/cuda/__init__.py:900 synchronize"]}]


class Ranks:
    """Four ranks of a modelled job, each with its reader, sending beats as the tracer does."""

    def __init__(self, job: ModelledJob) -> None:
        self.job = job
        self.logs = {r: CollectiveLog(4, dump=lambda r=r: job.dump(r), ready=lambda: True) for r in range(4)}
        self.seq = 0
        self.step = -1

    def beats(self, steps: int, since_s: float = 0.0, stacks: list | None = None) -> list[Envelope]:
        first = self.step + 1
        for s in range(first, first + steps):
            self.job.run_step(s)
        self.step += steps
        ends = self.job.step_end_ns
        out = []
        for r in range(4):
            self.seq += 1
            sl = list(range(first, first + steps))
            body = {"step": sl, "start_ns": [ends[s - 1] if s else self.job.t0_ns for s in sl],
                    "end_ns": [ends[s] for s in sl], "comm_ns": [0] * steps, "hb_step": self.step,
                    "since_step_s": since_s, "dropped": 0, "world_size": 4, "local_rank": r, "stacks": stacks}
            coll = self.logs[r].read()
            if coll:
                body["coll"] = coll
            out.append(Envelope(kind="beat", job="j", rank=r, host="h", pid=100 + r, seq=self.seq,
                                sent_ns=ends[-1], body=body))
        return out


def run(job: ModelledJob, seconds: int, steps_per_s: int = 40) -> tuple[TwoStage, list, Ranks]:
    two = TwoStage(job="j")
    ranks = Ranks(job)
    alerts = []
    for _ in range(seconds):
        for env in ranks.beats(steps_per_s):
            two.apply(env, ranks.job.step_end_ns[-1] / 1e9, S)
        alerts += two.scan(ranks.job.step_end_ns[-1] / 1e9, S)
    return two, alerts, ranks


def test_a_slow_device_is_named_with_its_group_and_collective() -> None:
    _, alerts, _ = run(ModelledJob(compute_ns={0: 5_000_000, 1: 5_000_000, 2: 20_000_000, 3: 5_000_000}), 6)
    slow = [a for a in alerts if a.kind == "slow_rank" and a.status == "open"]
    assert len(slow) == 1 and slow[0].ranks == [2], [a.summary for a in alerts]
    d = slow[0].details
    assert d["process_group"] in ("0", "2") and d["collective"] == "all_reduce bfloat16[4096]", d
    assert "all_reduce in process group" in slow[0].summary
    assert [a for a in alerts if a.kind != "slow_rank"] == []


def test_a_healthy_modelled_job_raises_nothing() -> None:
    _, alerts, _ = run(ModelledJob(compute_ns={0: 5_000_000, 1: 5_100_000, 2: 5_050_000, 3: 4_950_000}), 8)
    assert alerts == [], [a.summary for a in alerts]


def test_a_stopped_device_is_the_only_rank_the_hang_names() -> None:
    job = ModelledJob(compute_ns={r: 5_000_000 for r in range(4)}, stop_rank=1, stop_step=120)
    two, alerts, ranks = run(job, 3)
    assert alerts == []
    now = job.step_end_ns[-1] / 1e9
    for env in ranks.beats(1):                # step 120: rank 1's device never reaches its collective
        two.apply(env, now, S)
    for _ in range(15):                       # every host waits at its sync for 15 s
        now += 1.0
        for env in ranks.beats(0, since_s=now - job.step_end_ns[-2] / 1e9, stacks=WAIT):
            two.apply(env, now, S)
        alerts += two.scan(now, S)
    hang = [a for a in alerts if a.kind == "hang"]
    assert hang and hang[-1].ranks == [1], [a.summary for a in alerts]
    coll = hang[-1].details["collective"]
    assert coll["process_group"] == "0" and coll["op"] == "all_reduce bfloat16[4096]" and coll["reached"] == {"1": 120}
    assert "never reached" in hang[-1].summary


def test_a_mismatched_collective_names_the_odd_rank_and_both_shapes() -> None:
    _, alerts, _ = run(ModelledJob(compute_ns={r: 5_000_000 for r in range(4)}, odd_rank=3, odd_step=50), 3)
    mm = [a for a in alerts if a.kind == "collective_mismatch"]
    assert len(mm) == 1 and mm[0].ranks == [3], [a.summary for a in alerts]
    assert mm[0].details["op"] == "all_reduce bfloat16[1,4096]" and mm[0].details["peer_op"] == "all_reduce bfloat16[4096]"
    assert mm[0].details["seq"] == 51


def test_a_mismatch_inside_one_shard_names_the_minority() -> None:
    job = ModelledJob(compute_ns={r: 5_000_000 for r in range(4)}, odd_rank=0, odd_step=2)
    two = TwoStage(job="j", shards=1)
    ranks = Ranks(job)
    alerts = []
    for _ in range(3):
        for env in reversed(ranks.beats(10)):      # the odd rank's beat is folded last
            two.apply(env, job.step_end_ns[-1] / 1e9, S)
        alerts += two.scan(job.step_end_ns[-1] / 1e9, S)
    mm = [a for a in alerts if a.kind == "collective_mismatch"]
    assert len(mm) == 1 and mm[0].ranks == [0], [a.summary for a in alerts]


def test_a_ledger_waits_for_every_shard_and_skips_a_collective_one_shard_lost() -> None:
    led = CollectiveLedger("0")
    row = lambda seq, late, rank: [seq, late, rank, -1, 1000 * seq, 7]  # noqa: E731
    led.add(0, {"rows": [row(1, 10, 0), row(2, 30, 0)], "passed": 2, "members": 1, "labels": {}, "mismatches": []})
    assert led.complete([0, 1]) == []            # shard 1 has not passed anything yet
    led.add(1, {"rows": [row(2, 20, 1)], "passed": 2, "members": 1, "labels": {}, "mismatches": []})
    closed = led.complete([0, 1])
    assert [(s.step, s.rank, s.saving_ns) for s in closed] == [(2, 0, 10)]   # seq 1 had no row from shard 1


def test_behind_names_only_live_ranks_at_the_lowest_reached() -> None:
    entries = {"0": [{"reached_max": 9, "lowest": [[0, 9], [1, 7]]}, {"reached_max": 9, "lowest": [[2, 8], [3, 7]]}]}
    assert behind(entries, {0, 1, 2, 3}) == {"0": {"seq": 9, "op": "", "ranks": {1: 7, 3: 7}}}
    assert behind(entries, {0, 2}) == {"0": {"seq": 9, "op": "", "ranks": {2: 8}}}
    assert behind({"0": [{"reached_max": 5, "lowest": [[0, 5], [1, 5]]}]}, {0, 1}) == {}


def test_a_restarted_rank_counts_its_collectives_again() -> None:
    sc = ShardCollectives()
    g = {"pg": "0", "size": 2, "seq": [5], "op": [0], "reach_ns": [1], "dur_ns": [-1], "ops": ["x"], "last": [5, -1, 5]}
    sc.add(Envelope(kind="beat", job="j", rank=0, host="h", pid=1, seq=1, sent_ns=1, body={"coll": [g]}))
    sc.add(Envelope(kind="beat", job="j", rank=0, host="h", pid=2, seq=1, sent_ns=2,
                    body={"coll": [{**g, "seq": [1], "last": [1, -1, 1]}]}))
    assert sc.groups["0"].seen[0] == 1 and sc.groups["0"].reached[0] == 1


def test_a_slow_devices_cost_is_not_diluted_by_the_collectives_between_reads() -> None:
    """Ranks read only their recorder's newest entries every few seconds (a ring of 64, read every
    3 s), so the collectives in a summary come in windows with gaps in their sequence numbers. The
    cost share is the rank's lead over the time those collectives cover: before, each gap's time
    counted too, and a 4x-slow device in the detection benchmark cost "5.7%" while it made the job
    1.6x slower; a 3x one from mid-run was never named."""
    job = ModelledJob(compute_ns={0: 5_000_000, 1: 5_000_000, 2: 20_000_000, 3: 5_000_000})
    ranks = Ranks(job)
    ranks.logs = {r: CollectiveLog(4, dump=lambda r=r: job.dump(r, 8), ready=lambda: True) for r in range(4)}
    two = TwoStage(job="j")
    alerts = []
    for _ in range(8):
        for env in ranks.beats(40):                     # 40 steps a read, 8 entries of 3 groups kept
            two.apply(env, job.step_end_ns[-1] / 1e9, S)
        alerts += two.scan(job.step_end_ns[-1] / 1e9, S)
    slow = [a for a in alerts if a.kind == "slow_rank" and a.status == "open"]
    assert len(slow) == 1 and slow[0].ranks == [2], [a.summary for a in alerts]
    # Rank 2 reaches each step's collectives 15 ms after its peers, in steps of ~20 ms.
    assert slow[0].details["cost_share"]["2"] > 0.5, slow[0].details
