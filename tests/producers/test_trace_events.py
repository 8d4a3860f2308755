"""Trace-window conversion: a real CPU torch.profiler window in-process (small MLP, Python stacks), then
columnar records, the on-rank summary and byte-budgeted chunks; synthetic GPU/collective events for
what a CPU-only machine cannot record."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile, schedule

from rankscope.producers.trace_events import (
    ANNOTATION,
    CATEGORIES,
    PYTHON,
    chunk,
    chunk_columns,
    detect_clock_offset_ns,
    exclusive_times,
    experimental_config,
    extract_raw,
    path_strings,
    summarize,
    summary_body,
    to_columnar,
)
from rankscope.protocol.envelope import Envelope, decode, encode

FIRST_STEP = 100
pytestmark = pytest.mark.filterwarnings("ignore:Profiler won't be using warmup")


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def _record(with_schedule: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 32)
    _train_step(model, opt, x)  # warm up outside the window
    kw: dict[str, Any] = {"schedule": schedule(wait=0, warmup=0, active=2, repeat=1)} if with_schedule else {}
    prof = profile(activities=[ProfilerActivity.CPU], with_stack=True, record_shapes=True,
                   experimental_config=experimental_config(), **kw)
    bounds = []
    wall0 = time.time_ns()
    prof.start()
    for i in range(2):
        a = time.time_ns()
        _train_step(model, opt, x)
        bounds.append((FIRST_STEP + i, a, time.time_ns()))
        prof.step()
    prof.stop()
    wall1 = time.time_ns()
    return {"prof": prof, "bounds": bounds, "wall": (wall0, wall1)}


@pytest.fixture(scope="module")
def window() -> dict[str, Any]:
    """A 2-step window with a schedule (so ProfilerStep#N annotations exist), converted."""
    rec = _record(with_schedule=True)
    t0 = time.perf_counter()
    events = extract_raw(rec["prof"])
    t1 = time.perf_counter()
    col = to_columnar(events, "w-test", FIRST_STEP)
    t2 = time.perf_counter()
    rec.update(events=events, col=col, extract_s=t1 - t0, columnar_s=t2 - t1)
    return rec


def _name_of(col: dict[str, Any], i: int, py: dict[int, str]) -> str:
    ev = col["events"]
    return py[int(ev["path"][i])] if ev["category"][i] == PYTHON else col["names"][int(ev["name"][i])]


# ----------------------------------------------------------------------------------------------
# Real profiler window
# ----------------------------------------------------------------------------------------------

def test_extract_and_columnar_on_a_real_window(window: dict[str, Any]) -> None:
    events, col = window["events"], window["col"]
    n = len(events)
    ev = col["events"]
    assert n == len(ev["category"]) > 100
    cats = {CATEGORIES[c] for c in ev["category"].tolist()}
    assert {"cpu_op", "python", "annotation"} <= cats
    # Wall clock: every event lies inside the window measured with time.time_ns().
    w0, w1 = window["wall"]
    assert w0 <= ev["start_ns"].min() and (ev["start_ns"] + ev["dur_ns"]).max() <= w1
    assert (np.diff(ev["start_ns"]) >= 0).all()
    # Host events have thread ids and no device; python events have call paths.
    assert (ev["device"] == -1).all() and (ev["tid"] > 0).all()
    py = ev["category"] == PYTHON
    assert (ev["path"][py] >= 0).all() and (ev["path"][~py] == -1).all()
    # Python frames and the ops they call share a thread id, so they nest (exclusive time needs it).
    assert set(ev["tid"][py].tolist()) <= set(ev["tid"][ev["category"] == 4].tolist())
    print(f"\nevents per step (with stacks): {n / 2:.0f}; extract {1e6 * window['extract_s'] / n:.2f} us/event, "
          f"to_columnar {1e6 * window['columnar_s'] / n:.2f} us/event")


def test_profiler_steps_are_assigned(window: dict[str, Any]) -> None:
    col = window["col"]
    ev = col["events"]
    assert (col["first_step"], col["last_step"]) == (FIRST_STEP, FIRST_STEP + 1)
    marks = {}
    for i in np.flatnonzero(ev["category"] == ANNOTATION):
        name = col["names"][ev["name"][i]]
        if name.startswith("ProfilerStep#"):
            marks[int(ev["step"][i])] = (int(ev["start_ns"][i]), int(ev["start_ns"][i] + ev["dur_ns"][i]))
    assert sorted(marks) == [FIRST_STEP, FIRST_STEP + 1]
    assert col["start_ns"] == marks[FIRST_STEP][0] and col["end_ns"] == marks[FIRST_STEP + 1][1]
    for s, (a, b) in marks.items():
        inside = (ev["start_ns"] >= a) & (ev["start_ns"] < b)
        assert (ev["step"][inside] == s).all()
        assert ((ev["category"] == 4) & inside).sum() > 20  # cpu ops of the step
    unassigned = ev["start_ns"][ev["step"] == -1]
    for a, b in marks.values():  # -1 only outside every step (before, after, or between two steps)
        assert not ((unassigned >= a) & (unassigned < b)).any()
    # The same window without a schedule has no ProfilerStep marks: the tracer's step bounds are used.
    rec = _record(with_schedule=False)
    col2 = to_columnar(extract_raw(rec["prof"]), "w2", None, step_bounds=rec["bounds"])
    steps = set(col2["events"]["step"].tolist())
    assert {FIRST_STEP, FIRST_STEP + 1} <= steps
    assert (col2["first_step"], col2["last_step"]) == (FIRST_STEP, FIRST_STEP + 1)


def test_python_call_paths_follow_parent_links(window: dict[str, Any]) -> None:
    col = window["col"]
    paths = col["paths"]
    strings = path_strings(col["names"], paths)
    for pid, (parent, name_idx) in enumerate(paths):
        assert parent < pid  # parents are interned first
        leaf = col["names"][name_idx]
        if parent >= 0:
            assert strings[pid] == f"{strings[parent]};{leaf}"
        else:
            assert strings[pid] == leaf
    assert len(set(strings.values())) == len(paths)  # interned: one id per distinct path
    step_paths = [s for s in strings.values() if s.endswith("_train_step")]
    assert step_paths, "the test's own frame is missing from the python call paths"
    assert any("forward" in s and s.startswith(step_paths[0]) for s in strings.values())
    assert not any(" at 0x" in n for n in col["names"])


def _reference_self_times(col: dict[str, Any]) -> np.ndarray:
    """Plain stack walk per thread: duration minus direct children (the definition)."""
    ev = col["events"]
    cat, start, dur, tid = (ev[k].tolist() for k in ("category", "start_ns", "dur_ns", "tid"))
    prio = {PYTHON: 0, 5: 1, 4: 2}
    out = np.zeros(len(cat), dtype=np.int64)
    by_tid: dict[int, list[int]] = defaultdict(list)
    for i in range(len(cat)):
        if cat[i] != ANNOTATION and dur[i] > 0:
            by_tid[tid[i]].append(i)
    for rows in by_tid.values():
        rows.sort(key=lambda i: (start[i], -(start[i] + dur[i]), prio.get(cat[i], 3)))
        stack: list[int] = []
        children = defaultdict(int)
        for i in rows:
            while stack and start[stack[-1]] + dur[stack[-1]] <= start[i]:
                stack.pop()
            if stack:
                p = stack[-1]
                children[p] += max(0, min(start[i] + dur[i], start[p] + dur[p]) - start[i])
            stack.append(i)
        for i in rows:
            out[i] = max(0, dur[i] - children[i])
    return out


def test_summary_totals_and_exclusive_times(window: dict[str, Any]) -> None:
    col = window["col"]
    ev = col["events"]
    s = summarize(col)
    n = len(ev["category"])
    py = path_strings(col["names"], col["paths"])
    raw_total: dict[tuple[str, str], int] = defaultdict(int)
    raw_count: dict[tuple[str, str], int] = defaultdict(int)
    for i in range(n):
        key = (CATEGORIES[ev["category"][i]], _name_of(col, i, py))
        raw_total[key] += int(ev["dur_ns"][i])
        raw_count[key] += 1
    got = {(c, nm): (cnt, tot) for c, nm, cnt, tot in zip(s["category"], s["name"], s["count"], s["total_ns"],
                                                        strict=True)}
    assert got == {k: (raw_count[k], raw_total[k]) for k in raw_total}
    assert s["window_ns"] == col["end_ns"] - col["start_ns"] > 0
    for i in range(len(s["name"])):
        assert 0 <= s["exclusive_ns"][i] <= s["total_ns"][i]
        assert 0 <= s["median_ns"][i] <= s["p95_ns"][i] <= s["max_ns"][i]
    # Exclusive time per event against a plain stack walk (host events, annotations excluded).
    excl = exclusive_times(col)
    ref = _reference_self_times(col)
    nest = (ev["category"] != ANNOTATION) & (ev["dur_ns"] > 0)
    assert np.array_equal(excl[nest], ref[nest])
    # Per thread, the self times of the top-level work never exceed the thread's busy span.
    assert excl.sum() <= ev["dur_ns"].sum()
    # A python path threshold drops small paths only, and the kept set is prefix-closed.
    s2 = summarize(col, python_min_frac=0.01)
    kept_py = {nm for c, nm in zip(s2["category"], s2["name"], strict=True) if c == "python"}
    assert s2["python_paths_dropped"] > 0 and kept_py
    for p in kept_py:
        parts = p.split(";")
        assert all(";".join(parts[:k]) in kept_py for k in range(1, len(parts)))


def test_chunks_roundtrip_through_the_wire(window: dict[str, Any]) -> None:
    col = window["col"]
    ev = col["events"]
    n = len(ev["category"])
    bodies, truncated, sent = chunk(col, byte_budget=10_000_000, max_chunk_bytes=8_000)
    assert not truncated and sent == n and len(bodies) > 1
    py = path_strings(col["names"], col["paths"])
    got: list[tuple[Any, ...]] = []
    total_bytes = 0
    for k, body in enumerate(bodies):
        data = encode(Envelope(kind="trace", job="j", rank=0, host="h", pid=1, seq=k, sent_ns=1, body=body))
        total_bytes += len(msgpack.packb(body, use_bin_type=True))
        assert len(msgpack.packb(body, use_bin_type=True)) <= 8_000
        b = decode(data).body
        assert (b["chunk"], b["chunks"], b["events_total"], b["events_sent"]) == (k, len(bodies), n, n)
        e = chunk_columns(b)
        t = b["t0_ns"]
        bpy = path_strings(b["names"], b["paths"])
        for j in range(len(e["category"])):
            t += int(e["start_delta_ns"][j])
            name = bpy[int(e["path"][j])] if e["path"][j] >= 0 else b["names"][e["name"][j]]
            got.append((b["categories"][e["category"][j]], name, t, int(e["dur_ns"][j]), int(e["step"][j]),
                        b["tids"][e["tid"][j]]))
    want = [(CATEGORIES[ev["category"][i]], _name_of(col, i, py), int(ev["start_ns"][i]), int(ev["dur_ns"][i]),
             int(ev["step"][i]), int(ev["tid"][i])) for i in range(n)]
    assert got == want
    print(f"\nmsgpack bytes/event: {total_bytes / n:.1f} (chunks of <= 8 kB: {len(bodies)})")


def test_small_budget_truncates_python_first_and_says_so(window: dict[str, Any]) -> None:
    col = window["col"]
    ev = col["events"]
    n = len(ev["category"])
    n_py = int((ev["category"] == PYTHON).sum())
    full, _, _ = chunk(col, 10_000_000, max_chunk_bytes=4_000)
    full_bytes = sum(len(msgpack.packb(b, use_bin_type=True)) for b in full)
    counts = {c: int((ev["category"] == CATEGORIES.index(c)).sum()) for c in CATEGORIES}
    partial_python = 0
    for frac in (0.3, 0.5, 0.7, 0.9):
        budget = int(full_bytes * frac)
        bodies, truncated, sent = chunk(col, budget, max_chunk_bytes=4_000)
        assert truncated and 0 < sent < n
        assert sum(len(msgpack.packb(b, use_bin_type=True)) for b in bodies) <= budget
        kept = [b["categories"][c] for b in bodies for c in chunk_columns(b)["category"]]
        assert len(kept) == sent
        k = {c: kept.count(c) for c in CATEGORIES}
        # Tiers: python goes first, then cpu ops; ProfilerStep marks and annotations stay.
        if k["python"]:
            assert all(k[c] == counts[c] for c in CATEGORIES if c != "python")
            partial_python += 1
        if k["cpu_op"] < counts["cpu_op"]:
            assert k["python"] == 0
        assert k["annotation"] == counts["annotation"]
        dropped = {c: counts[c] - k[c] for c in CATEGORIES if counts[c] > k[c]}
        for b in bodies:
            assert b["truncated"] is True and b["events_total"] == n and b["events_sent"] == sent
            assert b["dropped"] == dropped
    assert partial_python, "no budget kept part of the python events"
    # A budget below the non-python events drops cpu ops too but keeps the ProfilerStep marks.
    bodies, truncated, sent = chunk(col, 600)
    names = [b["names"][i] for b in bodies for i in chunk_columns(b)["name"]]
    assert truncated and sum(1 for x in names if x.startswith("ProfilerStep#")) == 2
    assert all(b["dropped"].get("python") == n_py for b in bodies)
    assert sum(len(msgpack.packb(b, use_bin_type=True)) for b in bodies) <= 600
    # The summary body carries the window fields the sink needs.
    body = summary_body(col, summarize(col), events_sent=sent, truncated=truncated)
    env = decode(encode(Envelope(kind="summary", job="j", rank=0, host="h", pid=1, seq=0, sent_ns=1, body=body)))
    assert env.body["truncated"] is True and env.body["events_total"] == n
    assert (env.body["first_step"], env.body["last_step"]) == (FIRST_STEP, FIRST_STEP + 1)


def test_garbage_is_rejected_clearly() -> None:
    with pytest.raises(TypeError, match="torch.profiler.profile"):
        extract_raw(object())
    with pytest.raises(TypeError):
        extract_raw(None)
    never_started = profile(activities=[ProfilerActivity.CPU])
    with pytest.raises((ValueError, TypeError)):
        extract_raw(never_started)
    with pytest.raises(ValueError, match="event 1"):
        to_columnar([{"type": "cpu_op", "name": "a", "start_ns": 1, "dur_ns": 1}, {"nope": 1}], "w", 0)
    with pytest.raises(ValueError, match="non-integer"):
        to_columnar([{"type": "cpu_op", "name": "a", "start_ns": "x", "dur_ns": 1}], "w", 0)
    with pytest.raises(ValueError):
        chunk(to_columnar([], "w", 0), 0)


# ----------------------------------------------------------------------------------------------
# Synthetic events: GPU, collectives, clocks, scale
# ----------------------------------------------------------------------------------------------

T = 1_700_000_000_000_000_000


def test_gpu_collectives_memcpy_and_exclusive_time() -> None:
    events = [
        {"type": "user_annotation", "name": "ProfilerStep#7", "start_ns": T, "dur_ns": 1000, "tid": 10},
        {"type": "cpu_op", "name": "aten::mm", "start_ns": T + 10, "dur_ns": 100, "tid": 10, "corr": 5},
        {"type": "cuda_runtime", "name": "cudaLaunchKernel", "start_ns": T + 20, "dur_ns": 30, "tid": 10, "corr": 900},
        {"type": "cpu_op", "name": "c10d::allreduce_", "start_ns": T + 200, "dur_ns": 50, "tid": 10, "corr": 4},
        {"type": "cpu_op", "name": "record_param_comms", "start_ns": T + 205, "dur_ns": 40, "tid": 10, "corr": 6,
         "meta": {"Collective name": "allreduce", "In msg nelems": 1024, "Out msg nelems": 1024, "dtype": "Float",
                  "Group size": 2, "Process Group Name": "0"}},
        {"type": "user_annotation", "name": "gloo:all_reduce", "start_ns": T + 210, "dur_ns": 20, "tid": 11,
         "shapes": [[64, 64]], "dtypes": ["float"]},
        # GPU: a kernel launched in step 7 that runs after the step's CPU range ends.
        {"type": "kernel", "name": "sm90_gemm", "start_ns": T + 900, "dur_ns": 400, "device": 0, "stream": 7,
         "corr": 900, "linked": 5, "meta": {"grid": [8, 1, 1], "block": [128, 1, 1]}},
        {"type": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", "start_ns": T + 1100, "dur_ns": 400,
         "device": 0, "stream": 20, "corr": 901, "linked": 6,
         "meta": {"Collective name": "allreduce", "In msg nelems": 1024, "dtype": "Float", "Group size": 2}},
        {"type": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "start_ns": T + 1600, "dur_ns": 100,
         "device": 0, "stream": 7, "bytes": 4096, "corr": 902},
        {"type": "gpu_user_annotation", "name": "nccl:all_reduce", "start_ns": T + 1000, "dur_ns": 800, "device": 0,
         "stream": 20},
    ]
    col = to_columnar(events, "w", 7)
    ev = col["events"]
    by_name = {col["names"][ev["name"][i]]: i for i in range(len(events))}
    cat = {k: CATEGORIES[ev["category"][i]] for k, i in by_name.items()}
    assert cat["record_param_comms"] == cat["gloo:all_reduce"] == cat["c10d::allreduce_"] == "collective"
    assert cat["ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)"] == "collective"
    assert (cat["sm90_gemm"], cat["Memcpy HtoD (Pinned -> Device)"], cat["cudaLaunchKernel"]) == (
        "kernel", "memcpy", "runtime")
    assert cat["nccl:all_reduce"] == "annotation"  # a GPU-side range mirroring the NCCL kernel: a marker
    attrs = {k: ev["attrs"][i] for k, i in by_name.items()}
    assert attrs["gloo:all_reduce"] == {"op": "allreduce", "in_nelems": 4096, "dtype": "float"}
    assert attrs["record_param_comms"]["op"] == "allreduce" and attrs["record_param_comms"]["pg"] == "0"
    assert attrs["c10d::allreduce_"] == {"op": "allreduce"}
    assert attrs["ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)"]["group_size"] == 2
    assert attrs["Memcpy HtoD (Pinned -> Device)"] == {"kind": "HtoD"}
    assert attrs["sm90_gemm"] == {"grid": [8, 1, 1], "block": [128, 1, 1]}
    nbytes = {k: int(ev["bytes"][i]) for k, i in by_name.items()}
    assert (nbytes["gloo:all_reduce"], nbytes["record_param_comms"], nbytes["Memcpy HtoD (Pinned -> Device)"]) == (
        16384, 4096, 4096)
    step = {k: int(ev["step"][i]) for k, i in by_name.items()}
    assert step["sm90_gemm"] == 7 and step["ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)"] == 7
    assert step["Memcpy HtoD (Pinned -> Device)"] == -1  # no launching op, starts after the step
    excl = exclusive_times(col)
    x = {k: int(excl[i]) for k, i in by_name.items()}
    # GPU: gemm [900,1300) overlaps nccl [1100,1500): each alone 200; memcpy alone all 100.
    assert (x["sm90_gemm"], x["ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)"], x["Memcpy HtoD (Pinned -> Device)"]) == (
        200, 200, 100)
    # Host: mm 100 minus its runtime child 30; the c10d op 50 minus its child record_param_comms 40.
    assert (x["aten::mm"], x["cudaLaunchKernel"], x["gloo:all_reduce"]) == (70, 30, 20)
    assert (x["c10d::allreduce_"], x["record_param_comms"]) == (10, 40)
    # Host annotation: ProfilerStep time with nothing else on its thread: 1000 - mm 100 - c10d 50.
    assert x["ProfilerStep#7"] == 1000 - 100 - 50
    # GPU annotation [1000,1800): time without GPU work = 800 - [1000,1500) - [1600,1700).
    assert x["nccl:all_reduce"] == 200


def test_detect_clock_offset() -> None:
    assert detect_clock_offset_ns(T + 5, wall_ns=T, mono_ns=10**12) == 0
    assert detect_clock_offset_ns(10**12 + 5, wall_ns=T, mono_ns=10**12) == T - 10**12
    with pytest.raises(ValueError):
        detect_clock_offset_ns(5 * 10**17, wall_ns=T, mono_ns=10**12)


def _synthetic(n_steps: int, per_step: int, seed: int = 0) -> list[dict[str, Any]]:
    """Nested host events (python frames -> ops -> runtime) plus GPU kernels on 2 streams."""
    rng = np.random.default_rng(seed)
    out: list[dict[str, Any]] = []
    t = T
    py_id = 0
    for s in range(n_steps):
        step_start, mark = t, len(out)
        out.append({"type": "user_annotation", "name": f"ProfilerStep#{s}", "start_ns": t, "dur_ns": 0, "tid": 1})
        k = 0
        while k < per_step:
            frame_len = int(rng.integers(2_000, 20_000))
            py_id += 1
            root = py_id
            out.append({"type": "python_function", "name": f"train.py({k % 13}): f{k % 13}", "start_ns": t,
                        "dur_ns": frame_len, "tid": 1, "py_id": root, "py_parent": -1})
            py_id += 1
            out.append({"type": "python_function", "name": f"model.py({k % 7}): g{k % 7}", "start_ns": t + 10,
                        "dur_ns": frame_len - 20, "tid": 1, "py_id": py_id, "py_parent": root})
            op_t = t + 20
            for j in range(3):
                corr = len(out) + 1
                out.append({"type": "cpu_op", "name": f"aten::op{j}", "start_ns": op_t, "dur_ns": 500, "tid": 1,
                            "corr": corr})
                out.append({"type": "cuda_runtime", "name": "cudaLaunchKernel", "start_ns": op_t + 100,
                            "dur_ns": 200, "tid": 1, "corr": 10**6 + corr})
                out.append({"type": "kernel", "name": f"kernel{j}", "start_ns": op_t + 300 + int(rng.integers(0, 5000)),
                            "dur_ns": int(rng.integers(100, 3000)), "device": 0, "stream": 7 + j % 2,
                            "corr": 10**6 + corr, "linked": corr})
                op_t += 600
            k += 11
            t += frame_len + 50
        out[mark]["dur_ns"] = t - step_start
    return out


def test_summarize_100k_events_is_fast() -> None:
    events = _synthetic(n_steps=4, per_step=25_000)
    assert len(events) >= 100_000
    t0 = time.perf_counter()
    col = to_columnar(events, "big", 0)
    t1 = time.perf_counter()
    s = summarize(col)
    t2 = time.perf_counter()
    bodies, truncated, sent = chunk(col, 64_000_000)
    t3 = time.perf_counter()
    n = len(events)
    packed = sum(len(msgpack.packb(b, use_bin_type=True)) for b in bodies)
    print(f"\n{n} synthetic events: to_columnar {1e6 * (t1 - t0) / n:.2f} us/event, summarize {1e3 * (t2 - t1):.0f} ms, "
          f"chunk {1e3 * (t3 - t2):.0f} ms ({len(bodies)} chunks, {packed / n:.1f} bytes/event)")
    assert not truncated and sent == n
    assert sum(s["count"]) == n
    assert t2 - t1 < 5.0  # measured ~0.1-0.3 s on 2 slow cores; generous for loaded CI machines
    ev = col["events"]
    assert set(ev["step"].tolist()) == {0, 1, 2, 3}
    excl = exclusive_times(col)
    nest = (ev["device"] < 0) & (ev["category"] != ANNOTATION) & (ev["dur_ns"] > 0)
    assert np.array_equal(excl[nest], _reference_self_times(col)[nest])


def test_compact_call_paths_expand_to_the_plain_summary(window: dict[str, Any]) -> None:
    import msgpack

    from rankscope.call_paths import expand_call_paths

    col = window["col"]
    plain = summarize(col)
    compact = summarize(col, compact_paths=True)
    assert any(";" in n for n in plain["name"])
    assert all(n == "" for n, p in zip(compact["name"], compact["path"], strict=True) if p >= 0)
    assert expand_call_paths(compact) == plain
    assert expand_call_paths(plain) is plain                  # nothing to expand
    assert len(msgpack.packb(compact)) < len(msgpack.packb(plain)) / 2
    dropped = summarize(col, python_min_frac=0.05, compact_paths=True)   # the table keeps only what is used
    assert len(dropped["call_paths"]["paths"]) < len(compact["call_paths"]["paths"])
    assert expand_call_paths(dropped) == summarize(col, python_min_frac=0.05)


class _OldKinetoEvent:
    """A KinetoEvent as torch before 2.13 exposes it: no activity type, no Python ids."""

    def __init__(self, e: Any) -> None:
        self._e = e

    def name(self) -> str:
        return str(self._e.name())


class _OldTorchProfiler:
    """A stopped profiler whose KinetoEvents are of the older shape; ``events()`` is torch's own."""

    def __init__(self, prof: Any) -> None:
        real = prof.profiler.kineto_results
        self.events = prof.events
        self.profiler = type("P", (), {"kineto_results": type("R", (), {
            "events": staticmethod(lambda: [_OldKinetoEvent(e) for e in real.events()]),
            "trace_start_ns": staticmethod(real.trace_start_ns)})()})()


def test_an_older_torchs_events_are_read_through_function_events(window: dict[str, Any]) -> None:
    """Seen on a lent GPU (torch 2.11): KinetoEvent had no ``activity_type`` and every window failed.
    Such a torch's window is read from ``prof.events()``: the same ops at the same wall times."""
    old = extract_raw(_OldTorchProfiler(window["prof"]))
    col_old, col_new = to_columnar(old, "w-old", FIRST_STEP), window["col"]

    def op_starts(col: dict[str, Any]) -> dict[str, list[int]]:
        ev, out = col["events"], defaultdict(list)
        for i in np.flatnonzero(ev["category"] == 4):
            out[col["names"][int(ev["name"][i])]].append(int(ev["start_ns"][i]))
        return {k: sorted(v) for k, v in out.items()}

    a, b = op_starts(col_old), op_starts(col_new)
    assert len(old) > 100 and "aten::addmm" in a
    for name in ("aten::addmm", "aten::mm"):
        assert len(a[name]) == len(b[name])
        assert max(abs(x - y) for x, y in zip(a[name], b[name], strict=True)) <= 1_000   # µs rounding
    w0, w1 = window["wall"]
    assert w0 <= col_old["events"]["start_ns"].min() <= col_old["events"]["start_ns"].max() <= w1


def test_an_older_torchs_function_events_are_typed_by_name() -> None:
    """torch 2.11's FunctionEvents on a GPU (seen on a lent H200): no activity type, every step named
    ``ProfilerStep*``, runtime calls and copies told apart only by name."""
    from types import SimpleNamespace

    from rankscope.producers.trace_extract import RawEvents
    from rankscope.producers.trace_function_events import from_function_events

    def fe(name: str, start_us: float, dur_us: float, device: str = "CPU", **kw: Any) -> Any:
        return SimpleNamespace(name=name, device_type=SimpleNamespace(name=device), id=1, device_index=0,
                               device_resource_id=7, linked_correlation_id=0,
                               time_range=SimpleNamespace(start=start_us, elapsed_us=lambda d=dur_us: d), **kw)

    events = from_function_events([
        fe("ProfilerStep*", 100.0, 50.0, is_user_annotation=True), fe("ProfilerStep*", 0.0, 90.0, is_user_annotation=True),
        fe("aten::mm", 1.0, 5.0), fe("cudaLaunchKernel", 2.0, 1.0), fe("cuMemcpyHtoDAsync_v2", 3.0, 1.0),
        fe("Memcpy HtoD (Pinned -> Device)", 4.0, 2.0, device="CUDA"), fe("Memset (Device)", 5.0, 1.0, device="CUDA"),
        fe("ampere_sgemm_128x64_tn", 6.0, 9.0, device="CUDA"),
        fe("ProfilerStep*", 2.0, 60.0, device="CUDA", is_user_annotation=True)], base_ns=10**18)
    by_name = {e["name"]: e for e in events}
    # The host's steps are numbered in order; the device's copy of a step's range is no step of its own.
    assert [e["name"] for e in events if e["name"].startswith("ProfilerStep")] == [
        "ProfilerStep#0", "ProfilerStep*", "ProfilerStep#1"]
    assert by_name["ProfilerStep#1"]["start_ns"] == 10**18 + 100_000
    assert {n: by_name[n]["type"] for n in ("aten::mm", "cudaLaunchKernel", "cuMemcpyHtoDAsync_v2",
                                            "Memcpy HtoD (Pinned -> Device)", "Memset (Device)",
                                            "ampere_sgemm_128x64_tn")} == {
        "aten::mm": "cpu_op", "cudaLaunchKernel": "cuda_runtime", "cuMemcpyHtoDAsync_v2": "cuda_runtime",
        "Memcpy HtoD (Pinned -> Device)": "gpu_memcpy", "Memset (Device)": "gpu_memset",
        "ampere_sgemm_128x64_tn": "kernel"}
    col = to_columnar(RawEvents.from_dicts(events), "w-old", FIRST_STEP)
    cats = {CATEGORIES[c] for c in col["events"]["category"].tolist()}
    assert {"runtime", "memcpy", "memset", "kernel", "cpu_op"} <= cats
