"""Time spent blocked in torch.distributed calls made from Python.

In synchronous training every rank waits for the slowest at each collective, so step time is the
same on all ranks; the slow rank is the one that waits least. We wrap the collective API (sync
calls) and ``Work.wait`` (async calls) and add the blocked time to a per-thread accumulator that
the tracer reads at each step boundary. Under DDP, :func:`register_ddp_hook` records when this
rank's backward pass produced its last gradient (its busy time).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from rankscope.torch_check import check_torch

log = logging.getLogger("rankscope.collectives")

COLLECTIVE_NAMES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier", "all_to_all",
    "all_to_all_single", "reduce", "gather", "scatter", "send", "recv", "monitored_barrier",
    "all_gather_single", "reduce_scatter_single",   # what FSDP2 (fully_shard) calls in torch 2.13
)
WRAPPER_MARK = "_rankscope_wrapped"


class CommTimer:
    """Accumulates ns blocked in collectives; the tracer takes and resets it at each step."""

    def __init__(self) -> None:
        self._ns = 0
        self._lock = threading.Lock()
        self.ddp_ready_ns: int = 0  # wall ns when DDP's backward produced its last gradient this step

    def add(self, ns: int) -> None:
        with self._lock:
            self._ns += ns

    def take(self) -> int:
        with self._lock:
            ns, self._ns = self._ns, 0
            return ns


_ACTIVE: list[CommTimer] = []
_IN_CALL = threading.local()  # nested timing (a sync collective calls Work.wait) counts once


def _wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def _rankscope_timed_collective(*args: Any, **kwargs: Any) -> Any:
        if getattr(_IN_CALL, "depth", 0):
            return fn(*args, **kwargs)
        _IN_CALL.depth = 1
        t0 = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            _IN_CALL.depth = 0
            if not kwargs.get("async_op", False):
                dt = time.perf_counter_ns() - t0
                for timer in _ACTIVE:
                    timer.add(dt)

    setattr(_rankscope_timed_collective, WRAPPER_MARK, True)
    return _rankscope_timed_collective


def install(timer: CommTimer) -> bool:
    """Wrap torch.distributed collectives (once per process). Returns False when unavailable."""
    _ACTIVE.append(timer)
    try:
        import torch.distributed as dist
    except Exception:
        return False
    check_torch()
    if not dist.is_available():
        return False
    for name in COLLECTIVE_NAMES:
        fn = getattr(dist, name, None)
        if fn is None or getattr(fn, WRAPPER_MARK, False):
            continue
        setattr(dist, name, _wrap(fn))
    _wrap_work_wait()
    return True


def _wrap_work_wait() -> None:
    try:
        from torch._C._distributed_c10d import Work
    except Exception:
        return
    orig = Work.wait
    if getattr(orig, WRAPPER_MARK, False):
        return

    def _rankscope_timed_wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(_IN_CALL, "depth", 0):
            return orig(self, *args, **kwargs)
        _IN_CALL.depth = 1
        t0 = time.perf_counter_ns()
        try:
            return orig(self, *args, **kwargs)
        finally:
            _IN_CALL.depth = 0
            dt = time.perf_counter_ns() - t0
            for timer in _ACTIVE:
                timer.add(dt)

    setattr(_rankscope_timed_wait, WRAPPER_MARK, True)
    try:
        Work.wait = _rankscope_timed_wait  # type: ignore[method-assign]
    except (TypeError, AttributeError) as e:  # some builds make the type immutable
        log.debug("cannot wrap Work.wait: %s", e)


def uninstall(timer: CommTimer) -> None:
    if timer in _ACTIVE:
        _ACTIVE.remove(timer)


def register_ddp_hook(model: Any, timer: CommTimer) -> Any:
    """Record when this rank's backward pass has produced its last gradient (its busy time).

    A gradient hook on the parameter autograd reaches last runs on the backward thread. That is the
    first parameter the forward pass uses: the first registered one for nearly every model, which is
    what DDP's own bucket order assumes. Returns the hook's handle (None when the model has no
    trainable parameter).

    Not a DDP comm hook: its all-reduce future needs a Python ``then`` callback, which runs on gloo's
    (or NCCL's) worker thread. That thread has no Python thread state, so each callback creates and
    deletes one. torch.profiler's ``with_stack`` stop walks the thread states without CPython's list
    lock, and it crashed the rank (SIGSEGV) on a half-made one. A comm hook would also take the only
    comm-hook slot a DDP model has from the user.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return None
    first = params[0]

    def _rankscope_last_grad_ready(*_args: Any) -> None:
        timer.ddp_ready_ns = time.time_ns()

    if hasattr(first, "register_post_accumulate_grad_hook"):
        return first.register_post_accumulate_grad_hook(_rankscope_last_grad_ready)
    return first.register_hook(_rankscope_last_grad_ready)  # torch < 2.1: when the gradient is computed
