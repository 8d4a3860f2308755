"""A stopped profiler's events read through ``prof.events()`` (FunctionEvents): for a torch whose
KinetoEvent has no activity type (before 2.13; seen on torch 2.11 on a lent H200), and for objects
whose ``events()`` are FunctionEvent-like. Event dicts as :meth:`RawEvents.from_dicts` takes them."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any

log = logging.getLogger("rankscope.trace")
_LEGACY_SAID: list[bool] = []


def legacy_start_ns(result: Any) -> int:
    """The trace start of a profiler ``result`` of a torch whose KinetoEvent has no ``activity_type``
    (before 2.13), whose window is then read from ``prof.events()``: every event is kept, without the Python call tree's
    ids, and reading is slower. Said once in the log."""
    if not _LEGACY_SAID:
        _LEGACY_SAID.append(True)
        import torch

        log.info("rankscope: torch %s's profiler events have no activity type: trace windows are read "
                 "through FunctionEvents (slower; CUDA runtime calls and memcpy known by name; Python frames "
                 "only where torch lists them, without their call tree)", torch.__version__)
    return int(result.trace_start_ns())


# What a FunctionEvent without an activity type (torch before 2.13) is, by its name.
_RUNTIME_NAME = re.compile(r"^cu(da)?[A-Z]\w*$")
_STEP_STAR = "ProfilerStep*"


def _legacy_type(name: str, cpu: bool) -> str:
    if cpu:
        return "cuda_runtime" if _RUNTIME_NAME.match(name) else "cpu_op"
    return "gpu_memcpy" if name.startswith("Memcpy") else "gpu_memset" if name.startswith("Memset") else "kernel"


def from_function_events(fevents: Iterable[Any], base_ns: int) -> list[dict[str, Any]]:
    out = []
    steps = 0
    for fe in sorted(fevents, key=lambda fe: fe.time_range.start):
        at = getattr(fe, "activity_type", None)
        dev = getattr(fe, "device_type", None)
        cpu = dev is None or getattr(dev, "name", str(dev)).upper().endswith("CPU")
        name = fe.name
        if not isinstance(at, str):
            at = ("python_function" if getattr(fe, "is_python_function", False) else
                  "user_annotation" if getattr(fe, "is_user_annotation", False) else _legacy_type(name, cpu))
        if name == _STEP_STAR and cpu:   # an older torch names every step so: number the host's in order
            name, steps = f"ProfilerStep#{steps}", steps + 1
        start = base_ns + int(round(fe.time_range.start * 1000))
        rec: dict[str, Any] = {"type": at, "name": name, "start_ns": start,
                               "dur_ns": int(round(fe.time_range.elapsed_us() * 1000)),
                               "corr": int(getattr(fe, "id", 0) or 0)}
        if cpu:
            rec["tid"] = int(getattr(fe, "device_resource_id", -1) or getattr(fe, "thread", -1))
            rec["py_id"] = int(getattr(fe, "python_id", -1) or -1) if at == "python_function" else -1
            rec["py_parent"] = int(getattr(fe, "python_parent_id", -1) or -1) if at == "python_function" else -1
        else:
            rec["device"] = int(getattr(fe, "device_index", 0))
            rec["stream"] = int(getattr(fe, "device_resource_id", -1))
            rec["linked"] = int(getattr(fe, "linked_correlation_id", 0) or 0)
        out.append(rec)
    return out
