"""A closed tracer keeps nothing: no threads (its own or librdkafka's), no broker connections, and
the interpreter's hooks do not pin it (a job may close one tracer and make another, as the
always-on benchmark does in every block). Against the real broker."""

from __future__ import annotations

import functools
import gc
import os
import sys
import threading
import time
import weakref

from rankscope.config import Settings
from rankscope.producers.tracer import Tracer


def _tids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _poll(cond, deadline_s: float = 30.0) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_close_leaves_no_threads_and_releases_the_tracer(fresh_topics: Settings):
    settings = fresh_topics.with_overrides(job_id="close-test", heartbeat_s=0.2, hw_sample_s=0.2)
    import torch.distributed  # noqa: F401  (importing torch starts a native thread of its own)
    before = _tids()
    hook_before = sys.excepthook
    tracer = Tracer(settings, handle_signals=False)
    started = _poll(lambda: len(_tids() - before) >= 6)   # own threads + producer + control consumer
    for _ in range(50):
        tracer.step()
    assert started, f"the tracer started only {len(_tids() - before)} threads"
    assert tracer.control is not None and _poll(functools.partial(_consumer_ready, tracer.control))
    tracer.close()
    assert sys.excepthook is hook_before
    ref = weakref.ref(tracer)
    del tracer
    gc.collect()
    assert ref() is None, "a closed tracer is still referenced (atexit or sys.excepthook)"
    assert _poll(lambda: not (_tids() - before)), f"threads left after close: {_describe(_tids() - before)}"


def _consumer_ready(control) -> bool:
    return control._consumer is not None


def _describe(tids: set[int]) -> list[str]:
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = []
    for tid in sorted(tids):
        try:
            comm = open(f"/proc/self/task/{tid}/comm").read().strip()
        except OSError:
            comm = "?"
        out.append(f"{tid} {names.get(tid, comm)}")
    return out


def test_a_misspelled_setting_is_warned_about_on_the_rank(monkeypatch, caplog) -> None:
    import logging

    from rankscope.producers.tracer import Tracer

    monkeypatch.setenv("RANKSCOPE_HEARTBEAT_SS", "2")
    monkeypatch.setenv("RANKSCOPE_CONTROL_ENABLED", "false")
    monkeypatch.setenv("RANKSCOPE_BOOTSTRAP_SERVERS", "127.0.0.1:1")
    monkeypatch.setenv("RANKSCOPE_HW_SAMPLE_S", "0")
    with caplog.at_level(logging.WARNING, logger="rankscope"):
        tracer = Tracer(handle_signals=False, install_collective_timing=False)
        tracer.close()
    assert any("RANKSCOPE_HEARTBEAT_SS is not a rankscope setting" in r.getMessage()
               and "RANKSCOPE_HEARTBEAT_S" in r.getMessage() for r in caplog.records), caplog.text
