"""What a real GPU rank sent: a one-rank NCCL job on an H200 (torch 2.11, CUDA 13), recorded by
``python -m benchmarks.gpu_check --record`` on a lent GPU machine (tests/data/gpu_check_h200_torch211).
Its NCCL Flight Recorder dump goes through the rank-side reader and PyTorch's own analyzer; its beats
carry NCCL's device durations (tests/integration/test_gpu_check_cpu.py replays the whole recording
through a real broker, sink and chDB)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack

from rankscope.producers.collective_log import CollectiveLog
from rankscope.protocol.collectives import validate
from rankscope.protocol.envelope import decode

RECORDING = Path(__file__).resolve().parents[1] / "data" / "gpu_check_h200_torch211"


def _messages(topic: str) -> list[Any]:
    raw = msgpack.unpackb((RECORDING / "messages.msgpack").read_bytes())
    return [decode(v) for t, _k, v in raw if t == topic]


def _nccl_dump() -> dict[str, Any]:
    [env] = [e for e in _messages("replies") if e.kind == "fr_dump"]
    return json.loads(env.body["dump"])


def test_a_real_nccl_dump_is_read_with_device_durations() -> None:
    dump = _nccl_dump()
    assert dump["entries"][-1]["profiling_name"] == "nccl:all_reduce"     # ProcessGroupNCCL's own recorder
    groups = CollectiveLog(1, dump=lambda: dump, ready=lambda: True).read()
    assert groups is not None
    validate(groups)
    [g] = groups
    assert g["pg"] == "0" and g["size"] == 1 and len(g["seq"]) == 64
    assert g["last"] == [1500, 1500, 1500]                     # NCCL's status strings, as numbers
    assert set(g["ops"]) == {"all_reduce float32[4096,4096]", "all_reduce float32[10,4096]"}
    assert all(d > 0 for d in g["dur_ns"])                     # TORCH_NCCL_ENABLE_TIMING: CUDA-event durations
    assert g["reach_ns"] == sorted(g["reach_ns"])


def test_the_beats_of_the_gpu_rank_carried_timed_nccl_collectives() -> None:
    timed = total = 0
    last = None
    for env in _messages("steps"):
        for g in env.body.get("coll") or [] if env.kind == "beat" else []:
            total += len(g["seq"])
            timed += sum(1 for d in g["dur_ns"] if d >= 0)
            last = g["last"]
    assert total > 300 and timed > 0.8 * total and last == [1500, 1500, 1500]


def test_pytorchs_analyzer_reads_the_exported_nccl_dump(tmp_path: Path) -> None:
    from rankscope.cli.commands.export import write_fr_dumps

    folder = tmp_path / "fr"
    write_fr_dumps({0: _nccl_dump()}, folder)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(folder),
                          "--prefix", "rank_"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "Not all ranks" not in out.stdout   # a healthy one-rank group
