"""Exports that go back in: per-rank Kineto files that HTA and rankscope load with the same breakdowns,
a merged Chrome trace with launch -> kernel flows, folded stacks and speedscope of call paths."""

from __future__ import annotations

import gzip
import json
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from benchmarks.offline_vs_hta import hta_python
from rankscope.offline.analyze import analyze_paths
from rankscope.offline.exporters import (
    folded_stacks,
    kineto_trace,
    merged_chrome_trace,
    speedscope,
)
from rankscope.offline.kineto import load_trace

DATA = Path(__file__).resolve().parents[1] / "data"
SETS = ("hta_sampled2", "resnet_mi300_pyfn", "hta_nccl_meta_a100")
TABLES = ("temporal_breakdown", "comm_comp_overlap", "kernel_type_breakdown", "idle_time_breakdown", "top_kernels")

HTA_SCRIPT = r"""
import json, sys
from hta.trace_analysis import TraceAnalysis
out = {}
for d in sys.argv[1:]:
    a = TraceAnalysis(trace_dir=d)
    out[d] = json.loads(a.get_temporal_breakdown(visualize=False).to_json(orient="records"))
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every shared set exported rank by rank as Kineto JSON (gzipped, as torch writes them)."""
    root = tmp_path_factory.mktemp("kineto")
    out = {}
    for name in SETS:
        d = root / name
        d.mkdir()
        for f in sorted((DATA / name).glob("*.json.gz")):
            t = load_trace(f, extra_columns=True)
            doc = kineto_trace(t.events, t.metadata, t.time_unit)
            (d / f.name).write_bytes(gzip.compress(json.dumps(doc).encode(), compresslevel=1))
        out[name] = d
    return out


def test_kineto_export_has_flows_and_keeps_what_the_reader_reads(exported: dict[str, Path]) -> None:
    src = load_trace(DATA / "hta_nccl_meta_a100" / "nccl_data.json.gz", extra_columns=True)
    doc = json.loads(gzip.decompress((exported["hta_nccl_meta_a100"] / "nccl_data.json.gz").read_bytes()))
    assert doc["distributedInfo"] == src.metadata["distributedInfo"]
    starts = {e["id"] for e in doc["traceEvents"] if e["ph"] == "s"}
    ends = {e["id"] for e in doc["traceEvents"] if e["ph"] == "f"}
    assert starts and starts == ends                         # one arrow per launched kernel
    back = load_trace(exported["hta_nccl_meta_a100"] / "nccl_data.json.gz", extra_columns=True)
    cols = ["name", "cat", "ts_ns", "dur_ns", "stream", "correlation", "external_id", "step"]
    pd.testing.assert_frame_equal(back.events[cols].astype(str), src.events[cols].astype(str))
    assert back.events["args"].tolist() == src.events["args"].tolist()   # collective metadata survives


@pytest.mark.parametrize("name", SETS)
def test_rankscope_breakdowns_of_exports_equal_the_originals(exported: dict[str, Path], name: str) -> None:
    for hta in (True, False):
        a = analyze_paths(DATA / name, hta_compatible=hta, workers=1, diagnose=False)
        b = analyze_paths(exported[name], hta_compatible=hta, workers=1, diagnose=False)
        for key in TABLES:
            assert a[key] == b[key], (name, hta, key)


def test_hta_loads_the_exports_with_the_originals_temporal_breakdown(exported: dict[str, Path]) -> None:
    """HTA 0.5 itself (in the benchmarks' HTA virtualenv) on the originals and on the exports."""
    dirs = []
    for name in SETS:
        dirs += [str(DATA / name), str(exported[name])]
    out = subprocess.run([str(hta_python()), "-c", HTA_SCRIPT, *dirs], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])
    for name in SETS:
        orig, back = res[str(DATA / name)], res[str(exported[name])]
        assert orig and back == orig, (name, orig, back)


def test_merged_chrome_trace_has_a_process_per_rank_and_flows() -> None:
    traces = {t.rank: t.events for t in (load_trace(f) for f in sorted((DATA / "hta_sampled2").glob("*.json.gz")))}
    doc = merged_chrome_trace(traces, job="j")
    names = {e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "process_name"}
    assert {"rank 0", "rank 1"} <= names and any(n.startswith("rank 1 GPU") for n in names)
    flows = [e for e in doc["traceEvents"] if e["ph"] in ("s", "f")]
    by_id: dict[int, list[str]] = {}
    for e in flows:
        by_id.setdefault(e["id"], []).append(e["ph"])
    assert by_id and all(sorted(v) == ["f", "s"] for v in by_id.values())
    assert {i >> 40 for i in by_id} == {0, 1}                # flow ids never collide across ranks
    gpu_pids = {e["pid"] for e in doc["traceEvents"] if e["ph"] == "f"}
    host_pids = {e["pid"] for e in doc["traceEvents"] if e["ph"] == "s"}
    assert gpu_pids.isdisjoint(host_pids)


def test_folded_stacks_and_speedscope_of_call_paths() -> None:
    fn = pd.DataFrame({"rank": [0, 0, 1, 0], "category": ["python", "python", "python", "cpu_op"],
                       "name": ["main;train", "main;train;step fn", "main;train", "aten::mm"],
                       "exclusive_ns": [2_000_000, 3_000_600, 4_000_000, 9_000_000]})
    assert folded_stacks(fn) == "rank_0;main;train 2000\nrank_0;main;train;step_fn 3001\nrank_1;main;train 4000\n"
    assert folded_stacks(fn, by_rank=False) == "main;train 6000\nmain;train;step_fn 3001\n"
    doc = speedscope(fn)
    frames = [f["name"] for f in doc["shared"]["frames"]]
    assert frames == ["main", "train", "step fn"]
    assert [p["name"] for p in doc["profiles"]] == ["rank 0", "rank 1"]
    assert doc["profiles"][0]["samples"] == [[0, 1], [0, 1, 2]] and doc["profiles"][0]["weights"] == [2_000_000, 3_000_600]
    with pytest.raises(ValueError, match="lack columns"):
        folded_stacks(pd.DataFrame({"rank": [0]}))


def test_exports_fold_rankscope_frames_into_the_users_caller() -> None:
    wrapper = "producers/collectives.py(54): _rankscope_timed_collective"
    torch_call = "torch/distributed/distributed_c10d.py(2000): all_reduce"
    fn = pd.DataFrame({"rank": [0, 0, 0, 0], "category": ["python"] * 4,
                       "name": ["main;train", f"main;train;{wrapper}", f"main;train;{wrapper};{torch_call}",
                                "producers/tracer.py(1): step"],
                       "exclusive_ns": [2_000_000, 1_000_000, 4_000_000, 5_000_000]})
    folded = folded_stacks(fn)
    assert folded == ("rank_0;main;train 3000\n"
                      "rank_0;main;train;torch/distributed/distributed_c10d.py(2000):_all_reduce 4000\n")
    doc = speedscope(fn)
    assert [f["name"] for f in doc["shared"]["frames"]] == ["main", "train", torch_call]
    assert doc["profiles"][0]["samples"] == [[0, 1], [0, 1, 2]]
    assert doc["profiles"][0]["weights"] == [3_000_000, 4_000_000]
