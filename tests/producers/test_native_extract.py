"""The C++ trace-window reader against the Python one, on real profiler windows (CPU ops, python
frames, gloo collectives with shapes). ``make test`` builds the reader first (``make native``); a
machine where it cannot be built fails here rather than silently measuring the Python reader."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerAction, ProfilerActivity, profile

from rankscope.call_paths import expand_call_paths
from rankscope.cli import main as cli_main
from rankscope.cli.stack.ports import free_port
from rankscope.config import Settings
from rankscope.producers.native_extract import WindowReader, extract_columns, load_native
from rankscope.producers.trace_events import to_columnar
from rankscope.producers.trace_extract import RawEvents, extract_raw
from rankscope.producers.trace_window import convert_window


@pytest.fixture(scope="module")
def native() -> Any:
    mod = load_native(Settings.from_env().cache_dir)
    assert mod is not None, "the C++ reader is not built for this torch: run `make native` (rankscope build-native)"
    return mod


@pytest.fixture(scope="module")
def ddp_window() -> Iterator[Any]:
    """A stopped profiler over 3 DDP steps of a one-process gloo group, with stacks and shapes."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = torch.nn.parallel.DistributedDataParallel(
            torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(16, 32)
        prof = profile(activities=[ProfilerActivity.CPU], with_stack=True, record_shapes=True,
                       schedule=lambda s: ProfilerAction.RECORD)
        prof.start()
        for _ in range(3):
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            dist.all_reduce(torch.ones(64))
            prof.step()
        prof.stop()
        yield prof
    finally:
        dist.destroy_process_group()


def _as_lists(raw: RawEvents) -> dict[str, Any]:
    return {"names": raw.names, "offset": raw.offset_ns, "host_attrs": raw.host_attrs, "dev_attrs": raw.dev_attrs,
            **{f"{g}.{c}": [int(v) for v in getattr(raw, g)[c]] for g in ("py", "host", "dev")
               for c in getattr(raw, g)}}


def test_native_reader_reads_exactly_what_the_python_reader_reads(native: Any, ddp_window: Any) -> None:
    py = extract_raw(ddp_window)
    nat = extract_raw(ddp_window, native=native)
    assert len(py) > 500 and len(py.py["name"]) > 100
    assert _as_lists(nat) == _as_lists(py)
    # The window has gloo collectives with their attrs and message sizes.
    coll = [a for a in nat.host_attrs.values() if a and a.get("op")]
    assert coll, nat.host_attrs
    assert any(int(b) > 0 for b in nat.host["bytes"])


def test_native_columns_give_the_same_window(native: Any, ddp_window: Any) -> None:
    a = to_columnar(extract_raw(ddp_window), "w", 7)
    b = to_columnar(extract_raw(ddp_window, native=native), "w", 7)
    assert a["names"] == b["names"] and a["paths"] == b["paths"] and a["attr_rows"] == b["attr_rows"]
    assert a["events"]["attrs"] == b["events"]["attrs"]
    for k in a["events"]:
        if k != "attrs":
            assert np.array_equal(a["events"][k], b["events"][k]), k
    assert (a["first_step"], a["last_step"]) == (b["first_step"], b["last_step"]) and a["first_step"] == 7


def test_native_reader_rejects_what_is_not_a_profiler_result(native: Any, ddp_window: Any) -> None:
    with pytest.raises(TypeError, match="not a torch profiler result"):
        extract_columns(native, object())
    with pytest.raises(IndexError, match="out of range"):
        native.details(ddp_window.profiler.kineto_results, [10**9])
    with pytest.raises(TypeError, match="not profilers|needs a stopped"):
        extract_raw(object(), native=native)     # not a profiler at all: the Python path's error


def test_native_conversion_gives_the_same_chunks_and_summary(native: Any, ddp_window: Any) -> None:
    import msgpack

    raw = extract_raw(ddp_window, native=native)
    for budget in (4 << 20, 20_000):                # whole, and truncated to a small budget
        a = convert_window(raw, "w", 7, budget, "complete")
        b = convert_window(raw, "w", 7, budget, "complete", native=native)
        assert (b.sent, b.truncated) == (a.sent, a.truncated)
        assert msgpack.packb(b.traces) == msgpack.packb(a.traces)
        assert msgpack.packb(b.summary) == msgpack.packb(a.summary)
    assert a.truncated and len(a.summary["functions"]["name"]) > 20
    assert any(";" in name for name in expand_call_paths(a.summary["functions"])["name"])   # python call paths


class _BrokenKernels:
    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"kernel {name} is broken")


def test_a_failing_native_conversion_costs_no_window(caplog: pytest.LogCaptureFixture) -> None:
    from rankscope.producers.trace_window import WindowController, _Active
    from rankscope.protocol.trace import parse_command

    class Reader:
        native = _BrokenKernels()

        def __call__(self, prof: Any) -> RawEvents:
            return extract_raw(prof)

    sent: list[tuple[str, dict[str, Any]]] = []
    acks: list[tuple[Any, ...]] = []
    wc = WindowController(send_trace=lambda k, b: sent.append((k, b)), send_summary=lambda k, b: sent.append((k, b)),
                          ack=lambda *a, **kw: acks.append(a), byte_budget=1 << 20, wall_ns=lambda: 0,
                          read_window=Reader())
    req = parse_command("r", {"steps": 1}, None, 0)
    prof = _small_window()
    expected = convert_window(extract_raw(prof), "r-0", 3, 1 << 20, "complete")
    wc._ship(_Active(req, "r-0", 3, 0, prof), 0)
    assert any("C++ conversion of window r-0 failed" in r.message for r in caplog.records)
    assert acks[-1][1] == "done"
    summary = [b for k, b in sent if k == "summary"][0]
    assert summary["functions"] == expected.summary["functions"]


def _small_window() -> Any:
    prof = profile(activities=[ProfilerActivity.CPU], with_stack=True)
    prof.start()
    torch.randn(32, 32).mm(torch.randn(32, 32)).sum()
    prof.stop()
    return prof


def test_window_reader_falls_back_with_one_log_line(tmp_path: Any, native: Any,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="rankscope.native")
    reader = WindowReader(tmp_path)             # nothing built there
    for _ in range(2):
        prof = _small_window()
        expected = _as_lists(extract_raw(prof))
        assert _as_lists(reader(prof)) == expected
        assert prof.profiler.kineto_results is None     # spent, as with the C++ reader
    assert sum("not built" in r.message for r in caplog.records) == 1
    assert WindowReader(Settings.from_env().cache_dir, enabled=False).native is None
    assert WindowReader(Settings.from_env().cache_dir).native is not None


def test_build_native_is_a_no_op_when_built(native: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["build-native"]) == 0
    assert ".so" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli_main(["build-native", "--no-such-flag"])
    assert e.value.code == 2


def test_the_tracer_reader_frees_the_window_after_reading_it(native: Any) -> None:
    prof = _small_window()
    expected = _as_lists(extract_raw(prof))
    reader = WindowReader(Settings.from_env().cache_dir)
    result = prof.profiler.kineto_results
    assert _as_lists(reader(prof)) == expected
    assert len(result.events()) == 0                    # events freed (off the GIL) once read
    assert prof.profiler.kineto_results is None         # and the rest dropped on the sender thread


def test_a_failing_native_reader_falls_back_to_python(caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        ABI = 2

        @staticmethod
        def read_columns(result: Any) -> Any:
            raise RuntimeError("boom")

    caplog.set_level(logging.WARNING, logger="rankscope.native")
    reader = WindowReader(Settings.from_env().cache_dir)
    reader._native, reader._loaded = Broken(), True
    for _ in range(2):
        prof = _small_window()
        expected = _as_lists(extract_raw(prof))
        assert _as_lists(reader(prof)) == expected
    assert reader.native is None
    assert sum("C++ trace reader failed" in r.message for r in caplog.records) == 1


def _window_beside_threads(threads: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """A 3-op with_stack window recorded while threads named as ``threads``' keys loop in Python
    (each value: a callable run at the top of every turn); returns it and the started threads."""
    import threading
    import time

    stop = threading.Event()

    def loop(each_turn: Any) -> None:
        while not stop.is_set():
            each_turn()
            sum(abs(i) for i in range(100))
            time.sleep(0.001)

    started = {name: threading.Thread(target=loop, args=(fn,), name=name, daemon=True) for name, fn in threads.items()}
    for t in started.values():
        t.start()
    time.sleep(0.02)
    try:
        prof = profile(activities=[ProfilerActivity.CPU], with_stack=True)
        prof.start()
        for _ in range(3):
            torch.randn(32, 32).mm(torch.randn(32, 32))
            time.sleep(0.01)
        prof.stop()
        return prof, started
    finally:
        stop.set()
        for t in started.values():
            t.join()


def test_the_tracers_own_threads_are_left_out_of_windows() -> None:
    from rankscope.producers.trace_window import own_thread_ids

    seen: list[set[int]] = []
    prof, started = _window_beside_threads({"rankscope-test-busy": lambda: None,
                                            "dataloader-like": lambda: None,
                                            "rankscope-test-ids": lambda: seen.append(own_thread_ids())})
    ours, theirs = started["rankscope-test-busy"], started["dataloader-like"]
    tids = seen[-1]
    assert ours.native_id in tids and theirs.native_id not in tids
    raw = extract_raw(prof)
    py_tids = [int(t) for t in raw.py["tid"]]
    assert ours.native_id in py_tids and theirs.native_id in py_tids
    kept, dropped = raw.without_threads({ours.native_id})
    assert dropped == py_tids.count(ours.native_id) + [int(t) for t in raw.host["tid"]].count(ours.native_id)
    assert ours.native_id not in {int(t) for t in kept.py["tid"]}
    assert theirs.native_id in {int(t) for t in kept.py["tid"]}
    assert len(kept) == len(raw) - dropped
    assert raw.without_threads(set()) == (raw, 0)


def test_leaving_out_threads_keeps_the_attrs_of_the_other_rows() -> None:
    raw = RawEvents.from_dicts([
        {"type": "cpu_op", "name": "aten::mm", "start_ns": 1, "dur_ns": 5, "tid": 7},
        {"type": "user_annotation", "name": "gloo:all_reduce", "start_ns": 2, "dur_ns": 5, "tid": 9,
         "shapes": [[4]], "dtypes": ["float"]},
        {"type": "user_annotation", "name": "gloo:broadcast", "start_ns": 3, "dur_ns": 5, "tid": 8,
         "shapes": [[2]], "dtypes": ["float"]},
    ])
    kept, dropped = raw.without_threads({9})
    assert dropped == 1 and [int(t) for t in kept.host["tid"]] == [7, 8]
    assert list(kept.host_attrs) == [1] and kept.host_attrs[1] == raw.host_attrs[2]
    a, b = to_columnar(kept, "w", 0), to_columnar(raw, "w", 0)
    assert len(a["events"]["category"]) == len(b["events"]["category"]) - 1


def test_stacks_of_tracer_threads_filed_under_another_thread_are_left_out_too() -> None:
    # The profiler files the stacks open at its start under the thread that starts it.
    def frame(name: str, py_id: int, parent: int, tid: int = 5) -> dict[str, Any]:
        return {"type": "python_function", "name": name, "start_ns": py_id, "dur_ns": 100 - py_id, "tid": tid,
                "py_id": py_id, "py_parent": parent}

    raw = RawEvents.from_dicts([
        frame("threading.py(1002): _bootstrap", 1, -1), frame("threading.py(982): run", 2, 1),
        frame("producers/transport.py(115): _run", 3, 2), frame("threading.py(331): wait", 4, 3),
        frame("train.py(3): main", 5, -1), frame("train.py(9): step", 6, 5),
        frame("threading.py(1002): _bootstrap", 7, -1, tid=6), frame("loader.py(2): worker", 8, 7, tid=6),
    ])
    kept, dropped = raw.without_threads(set())
    assert dropped == 4
    assert [kept.names[int(i)] for i in kept.py["name"]] == [
        "train.py(3): main", "train.py(9): step", "threading.py(1002): _bootstrap", "loader.py(2): worker"]


def test_a_thread_that_leaves_the_profiler_is_not_traced() -> None:
    from rankscope.producers.untraced import leave_profiler

    prof, started = _window_beside_threads({"traced": lambda: None, "left": leave_profiler})
    py_tids = [int(t) for t in extract_raw(prof).py["tid"]]
    traced, left = py_tids.count(started["traced"].native_id), py_tids.count(started["left"].native_id)
    assert traced > 1000 and left < 20     # only the frames open when the window started
