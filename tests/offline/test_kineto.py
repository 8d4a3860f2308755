"""Kineto reader: real multi-rank traces (tests/data/<set>/) plus small synthetic files for the
formats and failure modes the real ones do not cover."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from rankscope.offline.kineto import (
    CATEGORIES,
    TraceFormatError,
    concat_events,
    load_trace,
    load_traces,
)

DATA = Path(__file__).resolve().parents[1] / "data"
SETS = {
    "hta_sampled2": {"ranks": [0, 1], "steps": [551, 552], "device": None},
    "resnet_mi300_pyfn": {"ranks": [0], "steps": [15, 16, 17], "device": "AMD Instinct MI300X"},
    "hta_nccl_meta_a100": {"ranks": [0], "steps": [4, 5, 6], "device": "NVIDIA A100-PG509-200"},
}
COLUMNS = ["rank", "name", "cat", "raw_cat", "ph", "ts_ns", "dur_ns", "pid", "tid", "stream",
           "correlation", "external_id", "step", "args"]


def cpu(name: str, ts: float, dur: float, cat: str = "cpu_op", **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": 10, "tid": 10, "ts": ts, "dur": dur, "args": args}


def gpu(name: str, ts: float, dur: float, corr: int, stream: int = 7, cat: str = "kernel", **args: Any) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"stream": stream, "correlation": corr, "device": 0, **args}}


def write(path: Path, events: list[dict], gz: bool = False, **meta: Any) -> Path:
    text = json.dumps({"schemaVersion": 1, **meta, "traceEvents": events})
    if gz:
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


@pytest.fixture(scope="module")
def loaded() -> dict[str, dict]:
    return {s: load_traces(DATA / s) for s in SETS}


@pytest.mark.parametrize("name", list(SETS))
def test_real_traces_load_with_ranks_steps_and_schema(loaded: dict, name: str) -> None:
    traces = loaded[name]
    want = SETS[name]
    assert list(traces) == want["ranks"]
    for rank, t in traces.items():
        assert t.rank == rank and t.rank_source == "distributedInfo"
        assert t.time_unit == "us"
        assert t.steps == want["steps"]
        assert t.device_name == want["device"]
        df = t.events
        assert list(df.columns) == COLUMNS
        assert df["name"].dtype == "category" and df["cat"].dtype == "category"
        assert set(df["cat"].cat.categories) == set(CATEGORIES)
        assert df["ts_ns"].dtype == np.int64 and df["dur_ns"].dtype == np.int64
        assert (df["dur_ns"] >= 0).all()
        assert (df["rank"] == rank).all()
        gpu_work = df[df["cat"].isin(["kernel", "memcpy", "memset"])]
        assert len(gpu_work) > 0 and (gpu_work["stream"] >= 0).all() and (gpu_work["correlation"] >= 0).all()
        # GPU work inherits the step of its host launch
        assert set(gpu_work["step"]) >= set(want["steps"])
        # args only where there is collective metadata
        assert df["args"].notna().sum() < len(df) / 10


def test_float_microseconds_keep_nanosecond_precision(loaded: dict) -> None:
    df = loaded["resnet_mi300_pyfn"][0].events
    row = df[(df["ts_ns"] == 3743411222894405)]
    assert len(row) == 1
    assert row["cat"].iloc[0] == "kernel" and row["dur_ns"].iloc[0] == 3679


def test_integer_microseconds_scaled_to_ns(loaded: dict) -> None:
    df = loaded["hta_sampled2"][0].events
    assert (df["ts_ns"] % 1000 == 0).all()
    assert df["ts_ns"].min() >= 1682725897226747 * 1000


def test_amd_rocm_names_and_categories(loaded: dict) -> None:
    df = loaded["resnet_mi300_pyfn"][0].events
    by_name = df.drop_duplicates("name").set_index("name")["cat"].astype(str)
    assert by_name["hipLaunchKernel"] == "runtime"
    assert by_name["hipExtModuleLaunchKernel"] == "runtime"
    assert by_name["ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)"] == "kernel"
    assert by_name["train_ddp.py(184): <module>"] == "python"
    assert (df["cat"] == "python").sum() == 34405
    gpu_ann = df[df["raw_cat"] == "gpu_user_annotation"]
    assert (gpu_ann["cat"] == "annotation").all()
    # GPU-side ProfilerStep copies carry their own step
    copies = gpu_ann[gpu_ann["name"].astype(str).str.startswith("ProfilerStep#")]
    assert sorted(copies["step"]) == [15, 16, 17]


def test_collective_metadata(loaded: dict) -> None:
    df = loaded["hta_nccl_meta_a100"][0].events
    coll = df[df["cat"] == "collective"]
    names = set(coll["name"].astype(str))
    assert {"record_param_comms", "nccl:all_reduce", "c10d::allreduce_"} <= names
    rpc = coll[coll["name"] == "record_param_comms"].iloc[0]
    a = rpc["args"]
    assert a["collective"] == "allreduce" and a["dtype"] == "Float"
    assert a["pg_ranks"] == [0, 1] and a["group_size"] == 2
    assert a["in_msg_bytes"] == a["in_msg_nelems"] * 4
    kern = df[(df["cat"] == "kernel") & df["args"].notna()]
    assert len(kern) == 21
    assert all(str(n).startswith("ncclKernel_") for n in kern["name"])


def test_plain_json_equals_gzip(tmp_path: Path) -> None:
    src = DATA / "hta_sampled2" / "sampled_rank-1.json.gz"
    plain = tmp_path / "copy.json"
    plain.write_bytes(gzip.decompress(src.read_bytes()))
    a, b = load_trace(src).events, load_trace(plain).events
    pd.testing.assert_frame_equal(a.drop(columns="args"), b.drop(columns="args"))
    # gzip is recognised by content, whatever the suffix
    misnamed = tmp_path / "gz_without_suffix.json"
    shutil.copy(src, misnamed)
    assert len(load_trace(misnamed).events) == len(a)


def test_minimal_trace_without_flows_or_metadata(tmp_path: Path) -> None:
    events = [
        cpu("ProfilerStep#1", 100, 50, cat="user_annotation"),
        cpu("aten::mm", 101, 10),
        cpu("cudaLaunchKernel", 102, 2, cat="cuda_runtime", correlation=5),
        gpu("sgemm", 110, 20, corr=5),
        {"ph": "i", "name": "marker", "pid": 10, "tid": 10, "ts": 120, "s": "t"},
        {"ph": "M", "name": "process_name", "pid": 10, "args": {"name": "python"}},
        "not an event",
    ]
    t = load_trace(write(tmp_path / "plain.json", events))
    assert t.rank == 0 and t.rank_source == "default"
    assert t.stats["skipped_events"] == 1
    df = t.events.set_index(t.events["name"].astype(str))
    assert df.loc["sgemm", "step"] == 1 and df.loc["sgemm", "correlation"] == 5
    assert df.loc["marker", "ph"] == "i" and df.loc["marker", "dur_ns"] == 0
    assert df.loc["cudaLaunchKernel", "cat"] == "runtime"


def test_json_array_format_even_without_closing_bracket(tmp_path: Path) -> None:
    p = tmp_path / "array.json"
    p.write_text(json.dumps([cpu("aten::add", 1, 2), cpu("aten::mul", 4, 2)])[:-1] + ",\n")
    assert len(load_trace(p).events) == 2


@pytest.mark.parametrize(
    ("filename", "rank"),
    [("job_rank-3.json", 3), ("trace_rank_12.pt.trace.json", 12), ("RANK7.json", 7), ("worker.json", 0)],
)
def test_rank_from_file_name(tmp_path: Path, filename: str, rank: int) -> None:
    t = load_trace(write(tmp_path / filename, [cpu("aten::add", 1, 2)]))
    assert t.rank == rank
    assert t.rank_source == ("filename" if rank else "default")


def test_rank_from_distributed_info_beats_file_name(tmp_path: Path) -> None:
    t = load_trace(write(tmp_path / "rank-3.json", [cpu("x", 1, 1)], distributedInfo={"rank": 5, "world_size": 8}))
    assert (t.rank, t.rank_source, t.world_size) == (5, "distributedInfo", 8)


def test_nanosecond_timestamps_detected(tmp_path: Path) -> None:
    ev = [cpu("ProfilerStep#3", 1_000_000, 500_000, cat="user_annotation"), cpu("aten::mm", 1_000_500, 2_000)]
    t = load_trace(write(tmp_path / "ns.json", ev, displayTimeUnit="ns"))
    assert t.time_unit == "ns"
    assert t.events["ts_ns"].tolist() == [1_000_000, 1_000_500]
    # epoch nanoseconds are recognised by magnitude
    base = 1_700_000_000_000_000_000
    ev2 = [cpu("aten::mm", base + 123, 456)]
    t2 = load_trace(write(tmp_path / "epoch_ns.json", ev2, displayTimeUnit="ms"))
    assert t2.time_unit == "ns" and t2.events["ts_ns"].iloc[0] == base + 123
    # same file read as microseconds on request
    assert load_trace(tmp_path / "ns.json", time_unit="us").events["ts_ns"].iloc[0] == 1_000_000_000


def test_flow_events_fill_missing_correlation(tmp_path: Path) -> None:
    k = gpu("sgemm", 110, 20, corr=0)
    del k["args"]["correlation"]
    events = [
        cpu("cudaLaunchKernel", 102, 2, cat="cuda_runtime", correlation=9),
        k,
        {"ph": "s", "id": 9, "pid": 10, "tid": 10, "ts": 102, "cat": "ac2g", "name": "ac2g"},
        {"ph": "f", "id": 9, "pid": 0, "tid": 7, "ts": 110, "cat": "ac2g", "name": "ac2g", "bp": "e"},
    ]
    t = load_trace(write(tmp_path / "flows.json", events))
    assert t.stats["correlations_from_flows"] == 1
    assert t.events.loc[t.events["name"] == "sgemm", "correlation"].iloc[0] == 9


def test_concat_events_unifies_categoricals(loaded: dict) -> None:
    df = concat_events(loaded["hta_sampled2"])
    assert df["name"].dtype == "category" and list(df["cat"].cat.categories) == list(CATEGORIES)
    assert sorted(df["rank"].unique()) == [0, 1]
    assert len(df) == sum(len(t.events) for t in loaded["hta_sampled2"].values())


def test_memory_stays_small(loaded: dict) -> None:
    df = loaded["resnet_mi300_pyfn"][0].events  # 49k events, 34k of them Python frames
    assert df.memory_usage(deep=True).sum() < 12_000_000


# ------------------------------------------------------------------------------- failures


def test_garbage_file_names_the_file(tmp_path: Path) -> None:
    p = tmp_path / "garbage.json"
    p.write_bytes(b"\x00\x01 this is not json")
    with pytest.raises(ValueError, match="garbage.json"):
        load_traces([p])
    p.write_text("{not json")
    with pytest.raises(ValueError, match=r"garbage\.json: not valid JSON"):
        load_trace(p)


def test_truncated_gzip_is_a_clear_error(tmp_path: Path) -> None:
    data = (DATA / "hta_sampled2" / "sampled_rank-0.json.gz").read_bytes()
    p = tmp_path / "cut_rank-0.json.gz"
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceFormatError, match=r"cut_rank-0\.json\.gz: corrupt or truncated gzip"):
        load_traces(tmp_path)


def test_json_that_is_not_a_trace(tmp_path: Path) -> None:
    p = tmp_path / "summary.json"
    p.write_text(json.dumps({"ranks": [0]}))
    with pytest.raises(ValueError, match=r"summary\.json: JSON without 'traceEvents'"):
        load_trace(p)
    p.write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(ValueError, match="no timed events"):
        load_trace(p)
    p.write_text("")
    with pytest.raises(ValueError, match="empty file"):
        load_trace(p)


def test_duplicate_rank_names_both_files(tmp_path: Path) -> None:
    src = DATA / "hta_sampled2" / "sampled_rank-0.json.gz"
    shutil.copy(src, tmp_path / "a.json.gz")
    shutil.copy(src, tmp_path / "b.json.gz")
    with pytest.raises(ValueError, match=r"rank 0 appears twice: .*a\.json\.gz and .*b\.json\.gz"):
        load_traces(tmp_path)
    with pytest.raises(ValueError, match="rank 0 appears twice"):
        load_traces([src, tmp_path / "a.json.gz"])


def test_missing_paths_and_empty_folders(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such file or folder"):
        load_traces(tmp_path / "nope.json")
    with pytest.raises(ValueError, match="holds no trace files"):
        load_traces(tmp_path)
    with pytest.raises(ValueError, match="no trace paths"):
        load_traces([])
    with pytest.raises(ValueError, match="time_unit"):
        load_trace(DATA / "hta_sampled2" / "sampled_rank-0.json.gz", time_unit="s")


def test_load_trace_pauses_gc_and_restores_it(tmp_path: Path) -> None:
    import gc

    src = DATA / "hta_sampled2" / "sampled_rank-0.json.gz"
    assert gc.isenabled()
    before = load_trace(src).events
    assert gc.isenabled()                      # re-enabled after a read
    with pytest.raises(ValueError):
        load_trace(tmp_path / "missing.json")
    assert gc.isenabled()                      # and after a failed one
    gc.disable()
    try:
        pd.testing.assert_frame_equal(load_trace(src).events, before)
        assert not gc.isenabled()              # a caller's own choice is kept
    finally:
        gc.enable()
