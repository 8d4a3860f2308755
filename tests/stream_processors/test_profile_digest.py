"""Profile digests: a rank's training-thread shares per call path, carried bounded in the shard
summaries, and the slow-rank alert naming the call paths where the slow rank spends more of its
time than its peers' median, replayed through both stages without Kafka."""

from __future__ import annotations

import json

import msgpack
import pytest

from rankscope.alert_schema import validate as validate_alert
from rankscope.protocol.envelope import Envelope
from rankscope.protocol.errors import WireError
from rankscope.protocol.profile import ProfileBody, validate
from rankscope.protocol.shard import MAX_SUMMARY_BYTES
from rankscope.stream_processors import profile_digest as pd_
from rankscope.stream_processors.shard import ShardJob
from rankscope.stream_processors.shard_summary import ShardSummary
from tests.stream_processors.test_slow_rule import Job, S, opened

TRAIN = "train.py:10 train"
STEP = "train.py:20 step"
EXTRA = "train.py:30 tokenize_captions"
GETITEM = "data.py:5 __getitem__"


def body(counts: dict[tuple[str, ...], int], ticks: int = 100, role: str = "training", t1_ns: int = 2_000) -> ProfileBody:
    """A profile message body of one role: each call path (outermost first) with its samples."""
    names: list[str] = []
    paths: list[list[int]] = []
    index: dict[tuple[str, ...], int] = {}
    for frames in counts:
        for i in range(1, len(frames) + 1):
            key = frames[:i]
            if key in index:
                continue
            if frames[i - 1] not in names:
                names.append(frames[i - 1])
            index[key] = len(paths)
            paths.append([index[key[:-1]] if i > 1 else -1, names.index(frames[i - 1])])
    return validate({"t0_ns": 1_000, "t1_ns": t1_ns, "hz": 20.0, "ticks": ticks, "roles": [role],
                     "names": names, "paths": paths, "path": [index[f] for f in counts], "role": [0] * len(counts),
                     "count": list(counts.values()), "other": [0]})


def test_a_digest_is_the_training_threads_share_of_its_most_sampled_paths():
    b = body({(TRAIN, STEP): 60, (TRAIN, EXTRA): 30, (TRAIN,): 10})
    assert pd_.digest(b) == {f"{TRAIN};{STEP}": 0.6, f"{TRAIN};{EXTRA}": 0.3, TRAIN: 0.1}
    assert list(pd_.digest(b, top=1)) == [f"{TRAIN};{STEP}"]
    deep = tuple(f"m.py:{i} f{i}" for i in range(40))
    (path,) = pd_.digest(body({deep: 5}))
    assert path.split(";") == list(deep[-pd_.MAX_FRAMES:])
    # A DataLoader worker's message has no training thread: no digest, the rank's stays.
    assert pd_.digest(body({(GETITEM,): 50}, role="dataloader")) == {}


def test_packed_digests_round_trip_within_their_budget_and_bad_ones_are_refused():
    digests = {r: (1_000 + r, {f"{TRAIN};{STEP}": 0.5, f"{TRAIN};f{r}": 0.25}) for r in range(50)}
    packed, sent = pd_.pack(digests)
    assert sent == list(range(50)) and pd_.unpack(packed) == digests
    assert len(packed["names"]) == 51          # the shared path once
    small, sent = pd_.pack(digests, max_chars=200)
    assert 1 <= len(sent) < 50 and set(pd_.unpack(small)) == set(sent)
    for bad in ({"names": [1], "ranks": []}, {"names": ["a"], "ranks": [[0, 1, [1], [500]]]},
                {"names": ["a"], "ranks": [[0, 1, [0], [1001]]]}, {"names": ["a"], "ranks": [[0, 1, [0], []]]}, []):
        with pytest.raises(ValueError):
            pd_.unpack(bad)


def test_the_path_only_the_slow_rank_calls_is_named_against_the_peers_median():
    common = {f"{TRAIN};{STEP}": 0.6}
    shares = {0: common, 2: common, 3: {**common, f"{TRAIN};{EXTRA}": 0.01},
              1: {f"{TRAIN};{STEP}": 0.45, f"{TRAIN};{EXTRA}": 0.4}}
    (top,) = pd_.above_peers(shares, [1])
    assert top == {"function": EXTRA, "path": f"{TRAIN};{EXTRA}", "share": 0.4, "peers_median_share": 0.0,
                   "added_share": 0.4}
    assert pd_.above_peers(shares, [0]) == []          # no path above its peers
    assert pd_.above_peers(shares, [7]) == [] and pd_.above_peers({1: shares[1]}, [1]) == []


def test_the_named_function_is_where_the_slow_ranks_path_leaves_its_peers():
    # The slow rank runs the peers' compute function again, from a function of its own: that
    # function is named, not the compute both run.
    compute = "train.py:54 compute"
    shares = {r: {f"{TRAIN};{compute}": 0.6} for r in (0, 2, 3)}
    shares[1] = {f"{TRAIN};{compute}": 0.2, f"{TRAIN};{EXTRA};{compute}": 0.7}
    (top,) = pd_.above_peers(shares, [1])
    assert top["function"] == EXTRA and top["path"] == f"{TRAIN};{EXTRA};{compute}"
    # The same code, run longer: its innermost frame.
    shares[1] = {f"{TRAIN};{compute}": 0.9}
    (top,) = pd_.above_peers(shares, [1])
    assert top["function"] == compute and top["added_share"] == 0.3
    # Ten thousand peers: the medians come from an even spread of MAX_PEERS of them.
    many = {r: {f"{TRAIN};{compute}": 0.6} for r in range(10_000)}
    many[1] = {f"{TRAIN};{EXTRA};{compute}": 0.7}
    (top,) = pd_.above_peers(many, [1])
    assert top["function"] == EXTRA and top["peers_median_share"] == 0.0


def test_a_shard_sends_each_ranks_newest_digest_once_and_the_wire_keeps_it():
    sj = ShardJob("j", 0)
    sj.add_profile(1, 2_000, {TRAIN: 0.5})
    sj.add_profile(1, 1_000, {STEP: 0.5})              # an older interval arriving late
    first = sj.summary(10.0, S)
    assert first.profiles == {1: (2_000, {TRAIN: 0.5})}
    back = ShardSummary.from_body(msgpack.unpackb(msgpack.packb(first.to_body()), strict_map_key=False))
    assert back.profiles == first.profiles
    assert sj.summary(11.0, S).profiles == {}
    body_ = first.to_body()
    body_["profiles"]["ranks"][0][2] = [5]
    with pytest.raises(WireError):
        ShardSummary.from_body(body_)
    # Ten thousand ranks' digests: a summary stays within its bound, the rest go in the next ones.
    for r in range(10_000):
        sj.add_profile(r, 3_000, {f"{TRAIN};f{r % 300};" + "x" * 100: 0.5})
    sizes, seen = [], set()
    for t in range(100):
        s = sj.summary(20.0 + t, S)
        sizes.append(len(msgpack.packb(s.to_body())))
        seen |= set(s.profiles)
        if not sj.profiles_unsent:
            break
    assert seen == set(range(10_000)) and max(sizes) < MAX_SUMMARY_BYTES


def profile_env(rank: int, b: ProfileBody) -> Envelope:
    return Envelope(kind="profile", job="j", rank=rank, host="h", pid=100 + rank, seq=1, sent_ns=0,
                    body={k: getattr(b, k) for k in ProfileBody.__dataclass_fields__})


def test_the_slow_rank_alert_names_the_function_only_that_rank_calls():
    job = Job(seed=5)
    noise = job.noisy(0.15)
    t1 = 0
    for _ in range(30):   # 30 x 100 steps; each rank's profile every 100 steps
        job.run(100, lambda r, s: int(noise(r, s) * (1.5 if r == 1 else 1)))
        t1 = int(job.now_s() * 1e9)
        for rank in range(4):
            counts = {(TRAIN, STEP): 60, (TRAIN, EXTRA): 30} if rank == 1 else {(TRAIN, STEP): 85}
            for shard in job.mon.shards.values():
                if rank in shard.ranks:
                    shard.add_profile(rank, t1, pd_.digest(body(counts, t1_ns=t1)))
    slow = [a for a in job.alerts if a.kind == "slow_rank"]
    assert [a.ranks for a in opened(slow)] == [[1]]
    named = [a for a in slow if "profile" in a.details]
    assert named, [a.summary for a in slow]
    top = named[0].details["profile"][0]
    assert top["function"] == EXTRA and top["share"] == 0.3 and top["peers_median_share"] == 0.0
    assert f"30% of its time in {EXTRA}" in named[0].summary
    validate_alert(json.loads(named[0].to_json()))


def test_a_profile_that_names_a_path_later_is_published_as_an_update():
    job = Job(seed=5)
    noise = job.noisy(0.15)
    job.run(2000, lambda r, s: int(noise(r, s) * (1.5 if r == 1 else 1)))
    (first,) = opened(job.alerts)
    assert "profile" not in first.details
    t1 = int(job.now_s() * 1e9)
    for shard in job.mon.shards.values():
        for rank in shard.ranks:
            counts = {(TRAIN, STEP): 60, (TRAIN, EXTRA): 30} if rank == 1 else {(TRAIN, STEP): 85}
            shard.add_profile(rank, t1, pd_.digest(body(counts, t1_ns=t1)))
    later = job.run(200, lambda r, s: int(noise(r, s) * (1.5 if r == 1 else 1)))
    updates = [a for a in later if a.kind == "slow_rank"]
    assert updates and updates[0].status == "update" and updates[0].alert_id == first.alert_id
    assert updates[0].details["profile"][0]["function"] == EXTRA
