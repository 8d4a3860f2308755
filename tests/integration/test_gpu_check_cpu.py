"""The GPU check (benchmarks/gpu_check.py, run on a lent GPU machine) exercised on the CPU with
``--cpu``: the same script, a real broker, the sink into chDB, a trace window, and its verdict.
On the CPU its window must hold host ops and Python frames; the kernel, memcpy and CUDA runtime
requirements apply on a GPU only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rankscope.config import Settings

pytestmark = pytest.mark.kafka

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_runs_the_whole_pipeline_on_the_cpu(kafka_settings: Settings, tmp_path: Path):
    out = tmp_path / "gpu_check.json"
    # The script runs on the session's broker (its own topics) as on a GPU machine it runs on a
    # throw-away one; only the cache (Kafka jars, C++ reader) is shared.
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_") or k == "RANKSCOPE_CACHE_DIR"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--cpu", "--steps", "80", "--out", str(out),
                           "--bootstrap", kafka_settings.bootstrap],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ok"] and result["problems"] == []
    assert result["tables"]["steps"] >= 80
    cats = result["trace"]["categories"]
    assert cats["cpu_op"]["events"] > 0 and cats["python"]["events"] > 0
    assert "kernel" not in cats          # no GPU here: no device events are invented
    [window] = result["trace"]["windows"]
    assert window["status"] == "complete" and window["steps"][1] - window["steps"][0] + 1 == 10
    assert result["trace"]["function_summary_rows"] > 0
    assert "trace_events per category" in proc.stdout
    coll = result["collectives_sent"]     # the gradient all-reduces, from the Flight Recorder, in the beats
    assert coll["collectives"] > 0 and coll["timed"] == 0 and any(op.startswith("all_reduce") for op in coll["ops"])
    assert coll["last_state"]["0"][0] >= 5 * 80          # five gradient all-reduces a step, all enqueued
    assert len(result["fr_dumps"]) == 1 and result["fr_dumps"][0][1] > 100


def test_a_recorded_h200_run_replays_through_the_real_pipeline(kafka_settings: Settings, tmp_path: Path):
    """A real GPU rank's messages (one NCCL rank on an H200, torch 2.11, recorded with ``--record`` on a
    lent GPU machine) through a real broker, the sink and chDB here: GPU and GPM samples, the NCCL
    collectives with device durations, the NCCL Flight Recorder dump, and a trace window with kernels,
    host-to-device copies and CUDA runtime calls (torch 2.11's events read through FunctionEvents)."""
    out = tmp_path / "replay.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_") or k == "RANKSCOPE_CACHE_DIR"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--replay",
                           str(ROOT / "tests" / "data" / "gpu_check_h200_torch211"), "--out", str(out),
                           "--bootstrap", kafka_settings.bootstrap],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ok"] and result["recorded_on"] == "cuda" and result["gpu"]["name"] == "NVIDIA H200"
    assert result["tables"]["steps"] == 300
    gpu_metrics = {r["metric"] for r in result["hw_samples"] if r["device"] == 0}
    assert {"gpu_util", "power_w", "gpm_sm_active_pct", "gpm_dram_bw_pct"} <= gpu_metrics
    cats = result["trace"]["categories"]
    assert all(cats[c]["events"] > 0 for c in ("kernel", "memcpy", "runtime", "collective"))
    [window] = result["trace"]["windows"]
    assert window["status"] == "complete" and window["steps"][1] - window["steps"][0] + 1 == 10
    assert result["collectives_sent"]["timed"] > 0 and result["fr_dumps"][0][1] > 10_000
