"""The notebook API (rankscope.analysis): DataFrames under HTA's method names, the same numbers as
``rankscope analyze``; cheap to import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from rankscope.analysis import TraceAnalysis
from rankscope.offline.analyze import analyze_paths
from tests.offline.trace_sets import DATA, slow_rank_set


@pytest.fixture(scope="module")
def slow4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("slow4")
    slow_rank_set(d)
    return d


def test_importing_loads_neither_pandas_nor_the_analyzers() -> None:
    code = "import sys, rankscope.analysis; print('pandas' in sys.modules, 'rankscope.stream_processors' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_hta_named_breakdowns_equal_analyze() -> None:
    a = TraceAnalysis(trace_dir=DATA / "hta_sampled2", hta_compatible=True)
    rep = analyze_paths(DATA / "hta_sampled2", hta_compatible=True, workers=1, diagnose=False)
    tb = a.get_temporal_breakdown()
    assert isinstance(tb, pd.DataFrame) and tb["rank"].tolist() == [0, 1]
    assert tb.to_dict("records") == rep["temporal_breakdown"]
    assert a.get_comm_comp_overlap().to_dict("records") == rep["comm_comp_overlap"]
    types, top = a.get_gpu_kernel_breakdown()
    assert types.to_dict("records") == rep["kernel_type_breakdown"]
    assert set(top["rank"]) == {0, 1} and len(a.get_idle_time_breakdown()) > 0
    with pytest.raises(ValueError, match="k must be >= 1"):
        a.get_gpu_kernel_breakdown(num_kernels=0)


def test_diagnosis_frames_equal_analyze(slow4: Path, tmp_path: Path) -> None:
    a = TraceAnalysis(trace_dir=slow4)
    diag = analyze_paths(slow4, workers=1)["diagnosis"]
    assert a.get_slow_workers()["rank"].tolist() == [3] == [s["rank"] for s in diag["slow_workers"]]
    causes = a.get_causes()
    assert causes.to_dict("records") == diag["causes"] and set(causes["rank"]) == {3}
    arr = a.get_collective_arrivals()
    assert arr.loc[arr["straggler"], "rank"].tolist() == [3] and arr["rank"].tolist() == [0, 1, 2, 3]
    assert a.get_busy_time().set_index("rank")["busy_ms"].idxmax() == 3
    assert "Slow worker: rank 3" in a.report_markdown()
    files = a.export_kineto(tmp_path / "k")
    assert len(files) == 4
    assert TraceAnalysis(trace_dir=tmp_path / "k").get_slow_workers()["rank"].tolist() == [3]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="trace_dir or trace_files"):
        TraceAnalysis()
    with pytest.raises(ValueError, match="no such file"):
        TraceAnalysis(trace_dir="/nonexistent/traces").get_temporal_breakdown()
