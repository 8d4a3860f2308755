"""Breakdowns against Holistic Trace Analysis 0.5.0's own numbers on real traces
(tests/data/<set>/hta_reference/), plus exact checks on small synthetic traces."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from rankscope.cli import main
from rankscope.offline import breakdown as bd
from rankscope.offline.analyze import analyze_paths, render_markdown
from rankscope.offline.kineto import concat_events, load_trace, load_traces

DATA = Path(__file__).resolve().parents[1] / "data"
SETS = ["hta_sampled2", "resnet_mi300_pyfn", "hta_nccl_meta_a100"]
REL = 0.005  # 0.5 %


def ref(name: str, table: str) -> pd.DataFrame:
    return pd.read_csv(DATA / name / "hta_reference" / f"{table}.csv", index_col=0)


def close(a: float, b: float, rel: float = REL, abs_: float = 0.0) -> bool:
    return abs(a - b) <= max(rel * abs(b), abs_)


@pytest.fixture(scope="module")
def events() -> dict[str, pd.DataFrame]:
    return {s: concat_events(load_traces(DATA / s)) for s in SETS}


# ------------------------------------------------------------------- HTA reference numbers


@pytest.mark.parametrize("name", SETS)
def test_temporal_breakdown_matches_hta(events: dict, name: str) -> None:
    got = bd.temporal_breakdown(events[name], hta_compatible=True).set_index("rank")
    want = ref(name, "temporal_breakdown").set_index("rank")
    assert list(got.index) == list(want.index)
    assert list(got.columns) == list(want.columns)
    for rank in want.index:
        for col in ("idle_time(us)", "compute_time(us)", "non_compute_time(us)", "kernel_time(us)"):
            assert close(got.at[rank, col], want.at[rank, col]), (rank, col, got.at[rank, col], want.at[rank, col])
        for col in ("idle_time_pctg", "compute_time_pctg", "non_compute_time_pctg"):
            assert close(got.at[rank, col], want.at[rank, col], abs_=0.01), (rank, col)
    assert got.attrs["convention"] == "hta"


@pytest.mark.parametrize("name", SETS)
def test_comm_comp_overlap_matches_hta(events: dict, name: str) -> None:
    got = bd.comm_comp_overlap(events[name], hta_compatible=True).set_index("rank")
    want = ref(name, "comm_comp_overlap").set_index("rank")
    assert list(got.index) == list(want.index)
    for rank in want.index:
        g, w = got.at[rank, "comp_comm_overlap_pctg"], want.at[rank, "comp_comm_overlap_pctg"]
        assert close(g, w), (rank, g, w)


@pytest.mark.parametrize("name", SETS)
def test_top_kernels_match_hta(events: dict, name: str) -> None:
    got = bd.kernel_breakdown_top(events[name], k=10, hta_compatible=True)
    want = ref(name, "kernel_breakdown_top")
    assert list(got.columns) == list(want.columns)
    keys = ["name", "rank", "kernel_type"]
    assert sorted(map(tuple, got[keys].values.tolist())) == sorted(map(tuple, want[keys].values.tolist()))
    m = got.merge(want, on=keys, suffixes=("", "_ref"))
    for col in ("sum (us)", "max (us)", "min (us)", "mean (us)", "stddev"):
        for g, w in zip(m[col], m[f"{col}_ref"], strict=True):
            assert close(g, w, abs_=1e-6), (col, g, w)


@pytest.mark.parametrize("name", SETS)
def test_kernel_type_breakdown_matches_hta(events: dict, name: str) -> None:
    got = bd.kernel_type_breakdown(events[name], hta_compatible=True).set_index("kernel_type")
    want = ref(name, "kernel_type_breakdown").set_index("kernel_type")
    assert sorted(got.index) == sorted(want.index)
    for kt in want.index:
        assert close(got.at[kt, "sum"], want.at[kt, "sum"]), kt
        assert close(got.at[kt, "percentage"], want.at[kt, "percentage"], abs_=0.1), kt


@pytest.mark.parametrize("name", SETS)
def test_idle_time_breakdown_matches_hta(events: dict, name: str) -> None:
    got = bd.idle_time_breakdown(events[name], hta_compatible=True)
    want = ref(name, "idle_time_breakdown")
    keys = ["rank", "stream", "idle_category"]
    m = got.merge(want, on=keys, how="outer", indicator=True)
    assert (m["_merge"] == "both").all(), m[m["_merge"] != "both"]
    for g, w in zip(m["idle_time(us)"], m["idle_time"], strict=True):
        assert close(g, w, abs_=1.0), (g, w)


def test_hta_summary_steps_and_row_counts(events: dict) -> None:
    for name in SETS:
        summary = json.loads((DATA / name / "hta_reference" / "summary.json").read_text())
        view = bd.hta_view(events[name])
        host_steps = view.loc[(view["step"] >= 0) & (view["stream"] < 0), "step"]
        assert sorted(host_steps.unique()) == summary["profiler_steps"], name


# ------------------------------------------------------------------- default convention


def test_default_convention_keeps_last_step(events: dict) -> None:
    for name in SETS:
        hta = bd.temporal_breakdown(events[name], hta_compatible=True).set_index("rank")
        own = bd.temporal_breakdown(events[name]).set_index("rank")
        assert own.attrs["convention"] == "rankscope"
        assert (own["kernel_time(us)"] > hta["kernel_time(us)"]).all(), name


def test_analysis_functions_do_not_modify_input(events: dict) -> None:
    df = events["hta_nccl_meta_a100"]
    before = df.drop(columns="args").copy()
    for hta in (False, True):
        bd.temporal_breakdown(df, hta)
        bd.comm_comp_overlap(df, hta)
        bd.kernel_type_breakdown(df, hta, by_rank=True)
        bd.kernel_breakdown_top(df, 5, hta)
        bd.idle_time_breakdown(df, hta)
    pd.testing.assert_frame_equal(df.drop(columns="args"), before)


# ------------------------------------------------------------------- synthetic, exact


def _x(name: str, cat: str, ts: float, dur: float, **args: Any) -> dict[str, Any]:
    gpu_side = cat in ("kernel", "gpu_memcpy", "gpu_memset")
    return {"ph": "X", "cat": cat, "name": name, "pid": 0 if gpu_side else 10,
            "tid": args.get("stream", 10), "ts": ts, "dur": dur, "args": args}


def _trace(tmp_path: Path, events: list[dict], fname: str = "t.json") -> pd.DataFrame:
    p = tmp_path / fname
    p.write_text(json.dumps({"traceEvents": events}))
    return load_trace(p).events


def _launch(ts: float, corr: int) -> dict[str, Any]:
    return _x("cudaLaunchKernel", "cuda_runtime", ts, 1, correlation=corr)


def test_interval_arithmetic_is_exact(tmp_path: Path) -> None:
    ev = [
        _launch(0, 1), _launch(1, 2), _launch(2, 3),
        _x("gemm", "kernel", 10, 10, stream=7, correlation=1),            # compute [10, 20)
        _x("ncclKernel_AllReduce", "kernel", 15, 15, stream=8, correlation=2),  # comm [15, 30)
        _x("Memcpy DtoD (Device -> Device)", "gpu_memcpy", 35, 5, stream=7, correlation=3),  # [35, 40)
    ]
    df = _trace(tmp_path, ev)
    for hta in (False, True):
        tb = bd.temporal_breakdown(df, hta).iloc[0]
        assert tb["kernel_time(us)"] == 30 and tb["idle_time(us)"] == 5
        assert tb["compute_time(us)"] == 10 and tb["non_compute_time(us)"] == 15
        ov = bd.comm_comp_overlap(df, hta).iloc[0]
        assert ov["comp_comm_overlap_pctg"] == pytest.approx(33.33) and ov["overlap_time(us)"] == 5
        kt = bd.kernel_type_breakdown(df, hta).set_index("kernel_type")["sum"].to_dict()
        assert kt == {"COMMUNICATION": 10, "COMPUTATION": 5, "COMPUTATION overlapping COMMUNICATION": 5,
                      "MEMORY": 5}
        idle = bd.idle_time_breakdown(df, hta)
        s7 = idle[idle["stream"] == 7].set_index("idle_category")["idle_time(us)"]
        # launched at 2 µs, long before the gap; the 15 µs gap is under the 30 µs launch threshold;
        # the first work on a stream has no gap ("other", 0)
        assert s7.to_dict() == {"kernel_wait": 15.0, "other": 0.0}
        s7 = bd.idle_time_breakdown(df, hta, consecutive_kernel_delay_us=10).query("stream == 7")
        assert s7.set_index("idle_category")["idle_time(us)"].to_dict() == {"other": 15.0}


def test_hta_rounds_inward_and_default_keeps_nanoseconds(tmp_path: Path) -> None:
    ev = [_launch(0, 1), _launch(1, 2),
          _x("gemm", "kernel", 10.2, 1.5, stream=7, correlation=1),      # [10.2, 11.7) -> [11, 11)
          _x("gemm", "kernel", 20.0, 2.25, stream=7, correlation=2)]     # [20, 22.25) -> [20, 22)
    df = _trace(tmp_path, ev)
    own = bd.temporal_breakdown(df).iloc[0]
    assert own["kernel_time(us)"] == pytest.approx(12.05) and own["compute_time(us)"] == pytest.approx(3.75)
    hta = bd.temporal_breakdown(df, hta_compatible=True).iloc[0]
    assert hta["kernel_time(us)"] == 11 and hta["compute_time(us)"] == 2


def test_hta_drops_last_step_and_unlaunched_work(tmp_path: Path) -> None:
    ev = [
        _x("ProfilerStep#1", "user_annotation", 0, 100),
        _x("ProfilerStep#2", "user_annotation", 100, 100),
        _launch(10, 1), _launch(110, 2),
        _x("gemm", "kernel", 20, 10, stream=7, correlation=1),
        _x("gemm", "kernel", 120, 10, stream=7, correlation=2),   # launched in the last step
        _x("orphan", "kernel", 50, 10, stream=7, correlation=99),  # launch not recorded
    ]
    df = _trace(tmp_path, ev)
    view = bd.hta_view(df)
    kernels = view[view["stream"] >= 0]
    assert kernels["correlation"].tolist() == [1]
    assert sorted(view.loc[view["stream"] < 0, "name"].astype(str)) == ["ProfilerStep#1", "cudaLaunchKernel"]
    top = bd.kernel_breakdown_top(df)
    assert top.set_index("name").at["gemm", "sum (us)"] == 20 and "orphan" in set(top["name"])
    assert bd.kernel_breakdown_top(df, hta_compatible=True)["name"].tolist() == ["gemm"]


def test_default_recognises_non_nccl_communication(tmp_path: Path) -> None:
    ev = [
        _x("cross_device_reduce_1stage<__hip_bfloat16, 8>", "kernel", 0, 10, stream=7, correlation=1),
        _x("rcclGenericKernel", "kernel", 20, 10, stream=7, correlation=2),
        _x("my_collective_kernel", "kernel", 40, 10, stream=7, correlation=3,
           **{"Collective name": "allreduce", "Process Group Name": "0", "dtype": "BFloat16",
              "In msg nelems": 8}),
        _x("ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)", "kernel", 60, 10, stream=7, correlation=4),
        _x("gemm", "kernel", 80, 10, stream=7, correlation=5),
    ]
    df = _trace(tmp_path, ev)
    own = bd.gpu_work(df).set_index("name")["kernel_type"].astype(str).to_dict()
    hta = bd.gpu_work(df, hta_compatible=True).set_index("name")["kernel_type"].astype(str).to_dict()
    comm = [n for n, t in own.items() if t == "COMMUNICATION"]
    assert len(comm) == 4 and own["gemm"] == "COMPUTATION"
    assert [n for n, t in hta.items() if t == "COMMUNICATION"] == [
        "ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)"]
    assert bd.comm_comp_overlap(df).iloc[0]["comm_time(us)"] == 40


def test_argument_validation(events: dict) -> None:
    df = events["hta_sampled2"]
    with pytest.raises(ValueError, match="k must be >= 1"):
        bd.kernel_breakdown_top(df, k=0)
    with pytest.raises(ValueError, match="duration_ratio"):
        bd.kernel_breakdown_top(df, duration_ratio=1.5)
    with pytest.raises(ValueError, match="lacks column"):
        bd.temporal_breakdown(df.drop(columns="stream"))


# ------------------------------------------------------------------- report and CLI


def test_offline_report_is_json_and_markdown() -> None:
    report = analyze_paths([DATA / "hta_sampled2"], hta_compatible=True)
    text = json.dumps(report, allow_nan=False)
    assert json.loads(text)["convention"]["name"] == "hta"
    assert report["ranks"] == [0, 1] and len(report["files"]) == 2
    assert {r["rank"]: r["comp_comm_overlap_pctg"] for r in report["comm_comp_overlap"]} == {0: 11.81, 1: 20.05}
    md = render_markdown(report)
    assert "## Temporal breakdown per rank" in md and "Convention: **hta**" in md
    own = analyze_paths(DATA / "resnet_mi300_pyfn")
    assert own["convention"]["hta_compatible"] is False
    assert own["departures_from_hta"]["last_step_kept"] is True
    assert "Departures from HTA" in render_markdown(own)


def test_cli_analyze_json_matches_hta(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    rc = main(["analyze", str(DATA / "hta_nccl_meta_a100"), "--hta-compatible", "--format", "json",
               "--output", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    want = ref("hta_nccl_meta_a100", "temporal_breakdown").iloc[0]
    got = report["temporal_breakdown"][0]
    assert got["idle_time(us)"] == want["idle_time(us)"] and got["compute_time(us)"] == want["compute_time(us)"]


def test_cli_analyze_markdown_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["analyze", str(DATA / "hta_sampled2" / "sampled_rank-0.json.gz"),
               str(DATA / "hta_sampled2" / "sampled_rank-1.json.gz")])
    assert rc == 0
    assert "# rankscope analyze" in capsys.readouterr().out


def test_cli_analyze_bad_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "broken.json.gz"
    bad.write_bytes(b"\x1f\x8b\x08\x00garbage")
    assert main(["analyze", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "rankscope analyze: error:" in err and "broken.json.gz" in err
    assert main(["analyze", str(tmp_path / "missing")]) == 2
    src = DATA / "hta_sampled2" / "sampled_rank-0.json.gz"
    assert main(["analyze", str(src), str(src)]) == 2
    assert "appears twice" in capsys.readouterr().err


@pytest.mark.parametrize("hta_compatible", [True, False])
def test_parallel_analysis_equals_one_process(hta_compatible: bool) -> None:
    one = analyze_paths([DATA / "hta_sampled2"], hta_compatible=hta_compatible, workers=1)
    two = analyze_paths([DATA / "hta_sampled2"], hta_compatible=hta_compatible, workers=2)
    assert one == two


def test_parallel_analysis_names_bad_file_and_duplicate_rank(tmp_path: Path) -> None:
    src = DATA / "hta_sampled2" / "sampled_rank-0.json.gz"
    (tmp_path / "a.json.gz").write_bytes(src.read_bytes())
    (tmp_path / "b.json.gz").write_bytes(src.read_bytes())
    with pytest.raises(ValueError, match="rank 0 appears twice"):
        analyze_paths(tmp_path, workers=2)
    (tmp_path / "b.json.gz").write_bytes(b"not json at all")
    with pytest.raises(ValueError, match="b.json.gz"):
        analyze_paths(tmp_path, workers=2)
