"""The rank-side reader of PyTorch's Flight Recorder: NCCL-shaped synthetic dumps (tests/fr_dumps.py),
and a real gloo process group in a subprocess (the recorder is switched on before the group is made)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

from rankscope.producers.collective_log import CollectiveLog, enable_recorder, merge, merge_dumps
from rankscope.protocol.collectives import MAX_RECORDS, validate
from tests.fr_dumps import ModelledJob


def reader_for(job: ModelledJob, rank: int, ring: int = 128) -> CollectiveLog:
    return CollectiveLog(4, dump=lambda: job.dump(rank, ring), ready=lambda: True)


def test_enable_recorder_keeps_what_the_user_set() -> None:
    env: dict[str, str] = {}
    assert enable_recorder(env, 128) == {"TORCH_FR_BUFFER_SIZE": "128", "TORCH_NCCL_ENABLE_TIMING": "1"}
    user = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_ENABLE_TIMING": "0"}
    assert enable_recorder(user, 128) == {} and user["TORCH_NCCL_ENABLE_TIMING"] == "0"
    assert enable_recorder({}, 0) == {}
    assert enable_recorder({}, 64, timing=False) == {"TORCH_FR_BUFFER_SIZE": "64"}


def test_nccl_records_per_group_with_durations_states_and_only_new_entries() -> None:
    job = ModelledJob(compute_ns={0: 5_000_000, 1: 5_000_000, 2: 20_000_000, 3: 5_000_000})
    for s in range(3):
        job.run_step(s)
    log = reader_for(job, 2)
    groups = {g["pg"]: g for g in log.read() or []}
    validate(list(groups.values()))
    assert sorted(groups) == ["0", "2"]              # rank 2 is in the default group and tp group 2
    g = groups["0"]
    assert g["seq"] == [1, 2, 3] and g["size"] == 4 and g["ops"] == ["all_reduce bfloat16[4096]"]
    assert g["last"] == [3, 3, 3]
    assert all(d == 200_000 for d in g["dur_ns"])    # the slow rank waits least: only the transfer
    assert all(d > 15_000_000 for d in (reader_for(job, 0).read() or [])[0]["dur_ns"])
    job.run_step(3)
    again = {g["pg"]: g for g in log.read() or []}
    assert again["0"]["seq"] == [4] and again["2"]["seq"] == [4]   # entries already read are not sent again


def test_a_full_ring_between_reads_counts_the_gap_and_p2p_is_left_out() -> None:
    job = ModelledJob(compute_ns={r: 1_000_000 for r in range(4)})
    job.run_step(0)
    log = reader_for(job, 0, ring=4)
    log.read()
    for s in range(1, 6):
        job.run_step(s)
    job.entries[0].append({**job.entries[0][-1], "record_id": 99, "is_p2p": True})
    groups = log.read() or []
    assert sum(len(g["seq"]) for g in groups) == 3 and log.gaps > 0
    assert 99 not in [s for g in groups for s in g["seq"]]


def test_merge_keeps_order_remaps_ops_and_takes_the_newest_state() -> None:
    a = [{"pg": "0", "size": 4, "seq": [1], "op": [0], "reach_ns": [10], "dur_ns": [-1], "ops": ["x"], "last": [1, -1, 1]}]
    b = [{"pg": "0", "size": 4, "seq": [2, 3], "op": [0, 1], "reach_ns": [20, 30], "dur_ns": [-1, 5],
          "ops": ["y", "x"], "last": [3, -1, 2]},
         {"pg": "1", "size": 2, "seq": [], "op": [], "reach_ns": [], "dur_ns": [], "ops": [], "last": [0, -1, 0]}]
    out = {g["pg"]: g for g in merge(a, b)}
    assert out["0"]["seq"] == [1, 2, 3] and [out["0"]["ops"][i] for i in out["0"]["op"]] == ["x", "y", "x"]
    assert out["0"]["last"] == [3, -1, 2] and "1" in out
    validate(list(out.values()))
    many = [{**a[0], "seq": list(range(MAX_RECORDS)), "op": [0] * MAX_RECORDS, "reach_ns": [0] * MAX_RECORDS,
             "dur_ns": [0] * MAX_RECORDS}]
    assert len(merge(many, b)[0]["seq"]) == MAX_RECORDS


def test_collect_and_take_hand_over_between_threads() -> None:
    job = ModelledJob(compute_ns={r: 1_000_000 for r in range(4)})
    log = reader_for(job, 1)
    job.run_step(0)
    log.collect()
    job.run_step(1)
    log.collect()
    taken = {g["pg"]: g for g in log.take() or []}
    assert taken["0"]["seq"] == [1, 2] and log.take() is None


def test_an_unreadable_recorder_turns_records_off_once_and_never_raises(caplog) -> None:
    caplog.set_level(logging.INFO, logger="rankscope.collectives")
    calls = []

    def broken() -> dict:
        calls.append(1)
        raise RuntimeError("no recorder in this build")

    log = CollectiveLog(4, dump=broken, ready=lambda: True)
    assert log.read() is None and log.read() is None
    assert len(calls) == 1 and "no recorder in this build" in log.off_reason
    assert sum("collective records off" in r.getMessage() for r in caplog.records) == 1
    garbage = CollectiveLog(4, dump=lambda: {"entries": [{"record_id": 0, "process_group": 5}]}, ready=lambda: True)
    assert garbage.read() is None and garbage.off_reason.startswith("unreadable")


SCRIPT = textwrap.dedent('''
    import json, os, sys, threading, time
    import torch, torch.distributed as dist
    from rankscope.producers.collective_log import CollectiveLog, enable_recorder
    enable_recorder(os.environ, 64)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % int(sys.argv[1]), rank=0, world_size=1)
    log = CollectiveLog(1)
    t = torch.ones(8)
    def stream():   # issued from another thread, async, as the modelled GPU's stream does
        for _ in range(3):
            w = dist.all_reduce(t, async_op=True)
            w.wait()
    th = threading.Thread(target=stream); th.start(); th.join()
    dist.all_reduce(torch.ones(2, 3, dtype=torch.float64))
    print(json.dumps(log.read()))
    dist.destroy_process_group()
''')


def test_both_recorders_are_read_each_with_its_own_record_ids() -> None:
    """An NCCL training group (ProcessGroupNCCL's recorder) beside a gloo group (the generic one): the
    two rings number their records independently, so a record id already read in one must not hide
    the other's entries; an entry both recorders hold is sent once."""
    nccl = ModelledJob(compute_ns={r: 5_000_000 for r in range(4)})
    for s in range(3):
        nccl.run_step(s)

    def gloo_dump(n: int) -> dict:
        return {"entries": [{"record_id": i, "process_group": ["7", "gloo_meta"], "collective_seq_id": i + 1,
                             "profiling_name": "gloo:broadcast", "input_sizes": [[4]], "input_dtypes": ["Long"],
                             "time_created_ns": 1_700_000_000_000_000_000 + i} for i in range(n)],
                "pg_status": {"7": {"last_enqueued_collective": n, "last_started_collective": -1,
                                    "last_completed_collective": n}}}

    calls = {"gloo": 1}
    log = CollectiveLog(4, dump=lambda: merge_dumps([gloo_dump(calls["gloo"]), nccl.dump(0, 128)]),
                        ready=lambda: True)
    groups = {g["pg"]: g for g in log.read() or []}
    validate(list(groups.values()))
    assert groups["7"]["seq"] == [1] and groups["7"]["last"] == [1, -1, 1]
    assert groups["0"]["seq"] == [1, 2, 3] and all(d > 0 for d in groups["0"]["dur_ns"])
    calls["gloo"] = 2
    nccl.run_step(3)
    again = {g["pg"]: g for g in log.read() or []}
    assert again["7"]["seq"] == [2] and again["0"]["seq"] == [4] and log.gaps == 0
    same = nccl.dump(0, 128)
    merged = merge_dumps([same, nccl.dump(0, 128)])
    assert len(merged["entries"]) == len(same["entries"])   # one recorder read twice: nothing doubled


def test_a_real_gloo_group_is_read(tmp_path) -> None:
    from tests.integration.helpers import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_FR")}
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(free_port())], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    groups = json.loads(out.stdout.strip().splitlines()[-1])
    validate(groups)
    g = groups[0]
    assert g["pg"] == "0" and g["size"] == 1 and g["seq"] == [1, 2, 3, 4]
    assert [g["ops"][i] for i in g["op"]] == ["all_reduce float32[8]"] * 3 + ["all_reduce float64[2,3]"]
    assert g["last"][0] == 4 and g["dur_ns"] == [-1] * 4          # gloo times nothing on the device
    assert g["reach_ns"] == sorted(g["reach_ns"]) and g["reach_ns"][0] > 1e18


DUMP_SCRIPT = textwrap.dedent('''
    import json, os, sys
    import torch, torch.distributed as dist
    from rankscope.producers.collective_log import bounded_dump, enable_recorder, full_dump_json
    enable_recorder(os.environ, 64)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % int(sys.argv[1]), rank=0, world_size=1)
    for _ in range(40):
        dist.all_reduce(torch.ones(8))
    text = full_dump_json()
    small, truncated = bounded_dump(text, 6000)
    print(json.dumps({"whole": json.loads(text), "small": json.loads(small), "truncated": truncated}))
    dist.destroy_process_group()
''')


def test_the_full_dump_is_the_recorders_json_and_bounded_drops_the_oldest_entries() -> None:
    from tests.integration.helpers import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_FR")}
    out = subprocess.run([sys.executable, "-c", DUMP_SCRIPT, str(free_port())], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    whole, small = got["whole"], got["small"]
    assert {"version", "pg_status", "entries"} <= set(whole) and len(whole["entries"]) == 40
    assert got["truncated"] and 0 < len(small["entries"]) < 40
    assert small["entries"][-1]["collective_seq_id"] == whole["entries"][-1]["collective_seq_id"]
