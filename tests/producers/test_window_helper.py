"""The window helper process: same output as converting on the sender thread, clear errors for bad
requests (and it keeps serving), and a rank that never loses a window when the helper fails."""

from __future__ import annotations

import io
import logging
import time
from typing import Any

import msgpack
import pytest
import torch
from torch.profiler import ProfilerAction, ProfilerActivity, profile

from producers.trace_extract import RawEvents, extract_raw
from producers.trace_window import WindowController, convert_window
from producers.window_helper import (
    PROTOCOL,
    HelperProcess,
    ProtocolError,
    pack_raw,
    read_frame,
    serve_request,
    unpack_raw,
    write_frame,
)


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


@pytest.fixture(scope="module")
def raw() -> RawEvents:
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = profile(activities=[ProfilerActivity.CPU], with_stack=True, schedule=lambda s: ProfilerAction.RECORD)
    prof.start()
    for _ in range(3):
        _train_step(model, opt, torch.randn(8, 16))
        prof.step()
    prof.stop()
    return extract_raw(prof)


def _norm(obj: Any) -> Any:
    """What the wire sees (tuples become lists)."""
    return msgpack.unpackb(msgpack.packb(obj, use_bin_type=True), raw=False, strict_map_key=False)


def _request(raw: RawEvents, **over: Any) -> bytes:
    req = {"v": PROTOCOL, "id": 1, "window_id": "w", "first_step": 3, "budget": 1 << 20, "status": "complete",
           "raw": pack_raw(raw)}
    req.update(over)
    return msgpack.packb(req, use_bin_type=True)


def test_helper_converts_exactly_like_the_sender_thread(raw: RawEvents) -> None:
    helper = HelperProcess(nice=0)
    try:
        for budget in (1 << 20, 3000):                     # whole, and truncated to a small budget
            got = helper.convert(raw, "w", 3, budget, "complete")
            want = convert_window(raw, "w", 3, budget, "complete")
            assert got is not None, helper.failed
            assert (got.sent, got.truncated) == (want.sent, want.truncated)
            assert got.traces == _norm(want.traces) and got.summary == _norm(want.summary)
        assert want.truncated > 0 and helper.windows_converted == 2
        assert helper.rss_bytes() > 0
    finally:
        helper.close()


def test_raw_events_survive_the_pipe(raw: RawEvents) -> None:
    back = unpack_raw(_norm(pack_raw(raw)))
    assert back.names == raw.names and back.offset_ns == raw.offset_ns
    for g in ("py", "host", "dev"):
        assert {c: list(v) for c, v in getattr(back, g).items()} == {c: list(v) for c, v in getattr(raw, g).items()}
    assert back.host_attrs == raw.host_attrs


@pytest.mark.parametrize("mutate, error", [
    (lambda r: r.update(v=99), "unknown protocol version 99"),
    (lambda r: r.update(budget=0), "budget"),
    (lambda r: r.pop("window_id"), "window_id"),
    (lambda r: r.update(raw=[1, 2]), "not a map"),
    (lambda r: r["raw"]["py"].pop("tid"), "exactly the columns"),
    (lambda r: r["raw"]["host"].update(start_ns=b"\x00" * 7), "not packed int64"),
    (lambda r: r["raw"]["host"].update(start_ns=b""), "differ in length"),
    (lambda r: r["raw"].update(names=["only-one"]), "indexes outside"),
    (lambda r: r["raw"].update(host_attrs=[[10**6, {}]]), "host_attrs"),
])
def test_bad_requests_get_an_error_answer(raw: RawEvents, mutate: Any, error: str) -> None:
    req = msgpack.unpackb(_request(raw), raw=False)
    mutate(req)
    answer = serve_request(msgpack.packb(req, use_bin_type=True))
    assert answer["ok"] is False and error in answer["error"], answer


def test_garbage_frames_get_an_error_answer() -> None:
    for frame in (b"", b"\xc1\xc1", msgpack.packb([1, 2]), msgpack.packb({"id": 5})):
        answer = serve_request(frame)
        assert answer["ok"] is False and answer["error"]
    buf = io.BytesIO()
    write_frame(buf, b"abc")
    buf.seek(0)
    assert read_frame(buf) == b"abc" and read_frame(buf) is None
    with pytest.raises(ProtocolError, match="truncated"):
        read_frame(io.BytesIO(b"\x05\x00\x00\x00ab"))


def test_the_helper_process_keeps_serving_after_a_bad_request(raw: RawEvents) -> None:
    helper = HelperProcess(nice=0)
    try:
        bad = RawEvents()
        bad.py["name"].append(5)               # one column longer than the others
        with pytest.raises(ValueError, match="differ in length"):
            helper.convert(bad, "w", 0, 1 << 20, "complete")
        assert helper.failed is None
        assert helper.convert(raw, "w", 0, 1 << 20, "complete") is not None
    finally:
        helper.close()


def _run_window(helper: HelperProcess | None) -> tuple[list[tuple[str, dict[str, Any]]], list[tuple[Any, ...]]]:
    sent: list[tuple[str, dict[str, Any]]] = []
    acks: list[tuple[Any, ...]] = []
    wc = WindowController(send_trace=lambda k, b: sent.append((k, b)), send_summary=lambda k, b: sent.append((k, b)),
                          ack=lambda *a, **kw: acks.append(a), byte_budget=1 << 20, wall_ns=time.time_ns,
                          helper=helper)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wc.handle("trace", "r1", {"steps": 3, "lead_ns": 0}, None, time.time_ns())
    for step in range(6):
        _train_step(model, opt, torch.randn(4, 8))
        wc.on_step(step)
    wc.drain(60)
    wc.close()
    return sent, acks


def test_a_window_is_shipped_through_the_helper() -> None:
    helper = HelperProcess(nice=5)
    sent, acks = _run_window(helper)
    assert helper.windows_converted == 1 and helper.failed is None
    kinds = [k for k, _ in sent]
    assert kinds.count("summary") == 1 and "trace" in kinds
    assert acks[-1][1] == "done", acks


def test_a_helper_that_fails_costs_no_window(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="rankscope.trace")
    helper = HelperProcess(python="/nonexistent/python")
    sent, acks = _run_window(helper)
    assert helper.windows_converted == 0 and "cannot start" in (helper.failed or "")
    assert [k for k, _ in sent].count("summary") == 1 and acks[-1][1] == "done", acks
    assert sum("helper" in r.message for r in caplog.records) == 1

    helper = HelperProcess()
    helper.start()
    assert helper._proc is not None
    helper._proc.kill()                        # dies between windows
    helper._proc.wait(10)
    bad = RawEvents()
    assert helper.convert(bad, "w", 0, 1 << 20, "complete") is None
    assert "failed" in (helper.failed or "")


def test_a_window_that_does_not_pack_is_converted_in_thread(raw: RawEvents) -> None:
    odd = unpack_raw(_norm(pack_raw(raw)))
    odd.host_attrs[0] = {"x": object()}         # not msgpack-able
    helper = HelperProcess(nice=0)
    try:
        assert helper.convert(odd, "w", 0, 1 << 20, "complete") is None
        assert helper.failed is None            # the helper itself is fine
        assert helper.convert(raw, "w", 0, 1 << 20, "complete") is not None
    finally:
        helper.close()
