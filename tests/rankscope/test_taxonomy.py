"""One taxonomy for the ranks' trace windows and the offline reader: the same host event is a
collective, a cpu_op or an annotation in both."""

from __future__ import annotations

import json
from pathlib import Path

from rankscope.offline.kineto import load_trace
from rankscope.producers.categories import classify
from rankscope.taxonomy import CATEGORIES, dtype_bytes, is_collective_name

HOST_EVENTS = [
    ("cpu_op", "c10d::allreduce_"),
    ("cpu_op", "_c10d_functional::all_reduce"),          # DTensor / FSDP2 / torch.compile collectives
    ("cpu_op", "_c10d_functional::wait_tensor"),
    ("cpu_op", "ProcessGroupNCCL::allreduce"),
    ("cpu_op", "record_param_comms"),
    ("cpu_op", "aten::mm"),
    ("cpu_op", "record_param_comms_extra"),
    ("user_annotation", "nccl:all_reduce"),
    ("user_annotation", "gloo:broadcast"),
    ("user_annotation", "hccl:all_gather"),
    ("user_annotation", "forward"),
    ("kernel", "void gemm_kernel<float>"),
]


def test_collective_names() -> None:
    assert is_collective_name("_c10d_functional::all_gather_into_tensor")
    assert is_collective_name("gloo:all_reduce") and is_collective_name("record_param_comms")
    assert not is_collective_name("aten::all_reduce_like") and not is_collective_name("record_param_comms_x")


def test_the_ranks_and_the_offline_reader_put_host_events_in_the_same_category(tmp_path: Path) -> None:
    events = [{"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": 10 * i, "dur": 5}
              for i, (cat, name) in enumerate(HOST_EVENTS)]
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps({"traceEvents": events}))
    offline = load_trace(path).events.sort_values("ts_ns")
    got = dict(zip(offline["name"].astype(str), offline["cat"].astype(str), strict=True))
    live = {name: CATEGORIES[classify(cat, name)] for cat, name in HOST_EVENTS}
    assert got == live
    assert live["_c10d_functional::all_reduce"] == "collective" and live["aten::mm"] == "cpu_op"
    assert live["forward"] == "annotation"


def test_dtype_sizes_read_every_spelling() -> None:
    assert dtype_bytes("float") == dtype_bytes("torch.float32") == 4
    assert dtype_bytes("c10::BFloat16") == 2 and dtype_bytes("Long") == 8
    assert dtype_bytes("mystery") is None
