"""Trace windows on the rank: torch.profiler for N steps, opened by control messages.

Lifecycle (one window at a time per rank):
1. The control thread validates a ``trace`` command and queues it, acknowledging ``accepted``
   (nothing running) or ``queued`` (a window is running or waiting); a second repeating schedule is
   ``rejected`` until the first is stopped. ``stop`` ends the schedule and the running window.
2. The training thread, in ``tracer.step()``, starts the profiler at the boundary before the
   request's ``start_step`` (the same step on every rank), or without one at the first step boundary
   after its ``start_at_ns`` (ranks in lockstep then start at the same step unless the time falls
   between their boundaries), marks each step with
   ``prof.step()``, and stops after ``steps`` steps. Idle cost: one attribute check per step.
3. The training thread only stops the profiler; taking its events, conversion, the on-rank
   summary, byte budgeting and sending happen on a background thread, which then acks
   ``done`` with the event counts and whether the window was truncated.
Repeating modes: every ``every_s`` seconds, every ``every_steps`` steps, or ``continuous``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rankscope.producers.control import ControlError
from rankscope.producers.untraced import leave_profiler
from rankscope.protocol.trace import START_STEP_MAX_WAIT_NS, TraceCommand, parse_command

log = logging.getLogger("rankscope.trace")

SendFn = Callable[[str, dict[str, Any]], None]   # (kind, body) -> queued on the right topic


@dataclass
class _Active:
    request: TraceCommand
    window_id: str
    first_step: int
    start_ns: int
    profiler: Any
    steps_done: int = 0
    stop_requested: bool = False
    thread_cpu: tuple[int, int] | None = None     # the training thread's (cpu_ns, runq_ns) at the start


def default_profiler(request: TraceCommand) -> Any:
    import torch
    from torch.profiler import ProfilerAction, ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    # A schedule that always records: the window's length is ours to decide, and with a schedule
    # torch marks every step with a ProfilerStep#N annotation.
    return profile(activities=activities, with_stack=request.with_stack, record_shapes=request.with_shapes,
                   schedule=lambda step: ProfilerAction.RECORD)


class WindowController:
    def __init__(self, *, send_trace: SendFn, send_summary: SendFn, ack: Callable[..., None],
                 byte_budget: int, wall_ns: Callable[[], int],
                 profiler_factory: Callable[[TraceCommand], Any] = default_profiler,
                 on_window: Callable[[bool], None] | None = None,
                 read_window: Callable[[Any], Any] | None = None,
                 thread_cpu: Callable[[], tuple[int, int] | None] | None = None) -> None:
        self._thread_cpu = thread_cpu or (lambda: None)   # the training thread's (cpu_ns, runq_ns) now
        self._send_trace, self._send_summary, self._ack = send_trace, send_summary, ack
        self._byte_budget = byte_budget
        self._wall_ns = wall_ns
        self._profiler_factory = profiler_factory
        self._read_window = read_window     # stopped profiler -> RawEvents; None: extract_raw
        self._on_window = on_window or (lambda active: None)
        self._lock = threading.Lock()
        self._pending: list[TraceCommand] = []
        self._schedule: TraceCommand | None = None
        self._schedule_count = 0
        self._next_due_ns = 0
        self._next_due_step = 0
        self._active: _Active | None = None
        self._counts: dict[str, int] = {}
        self.armed = False                      # fast path for step(): anything to do at all?
        self._work: queue.Queue[tuple[_Active, int]] = queue.Queue(maxsize=4)
        self._worker: threading.Thread | None = None
        self.windows_done = 0
        self.last_ship_s = (0.0, 0.0)           # (wall, sender-thread CPU) seconds of the last window sent
        self.last_ship_cpu_stages: dict[str, float] = {}   # sender-thread CPU seconds per stage of it

    @property
    def native_reader(self) -> bool:
        """Whether windows are read by the C++ reader (loads it if not loaded yet)."""
        return getattr(self._read_window, "native", None) is not None

    # Control thread --------------------------------------------------------------------------
    def handle(self, command: str, request_id: str, args: dict[str, Any], ranks: list[int] | None,
               sent_ns: int) -> None:
        if command == "stop":
            with self._lock:
                stopped = [r.request_id for r in self._pending]
                self._pending.clear()
                if self._schedule is not None:
                    stopped.append(self._schedule.request_id)
                self._schedule = None
                if self._active is not None:
                    self._active.stop_requested = True
                    stopped.append(self._active.request.request_id)
                self._rearm()
            self._ack(request_id, "stopped", f"stopped {sorted(set(stopped))}" if stopped else "nothing was running")
            return
        if command != "trace":
            raise ControlError(f"command {command!r} is not handled by trace windows")
        req = parse_command(request_id, args, ranks, sent_ns)
        with self._lock:
            if req.repeating and self._schedule is not None:
                raise ControlError(f"schedule {self._schedule.request_id} is active on this rank; stop it first")
            busy = self._active is not None or bool(self._pending)
            if req.repeating:
                self._schedule = req
                self._schedule_count = 0
                self._next_due_ns = 0 if req.start_step else req.start_at_ns   # a start step gates the first
                self._next_due_step = -1
            else:
                self._pending.append(req)
            self._rearm()
        mode = ("continuous" if req.continuous else f"every {req.every_s:g}s" if req.every_s
                else f"every {req.every_steps} steps" if req.every_steps else "once")
        self._ack(request_id, "queued" if busy else "accepted",
                  f"{req.steps} steps, {mode}" + (f", from step {req.start_step}" if req.start_step else ""))

    def _rearm(self) -> None:
        self.armed = self._active is not None or bool(self._pending) or self._schedule is not None

    # Training thread -------------------------------------------------------------------------
    def on_step(self, completed_step: int) -> None:
        """Called by ``tracer.step()`` after step ``completed_step`` ended. Never raises."""
        if not self.armed:
            return
        try:
            self._on_step(completed_step)
        except Exception as e:
            log.warning("rankscope: trace window failed: %s: %s", type(e).__name__, e)
            with self._lock:
                act, self._active = self._active, None
                self._rearm()
            if act is not None:
                self._safe_stop(act.profiler)
                self._ack(act.request.request_id, "rejected", f"window {act.window_id} failed: {e}")
                self._on_window(False)

    def _on_step(self, completed_step: int) -> None:
        act = self._active
        if act is not None:
            act.steps_done += 1
            if act.steps_done >= act.request.steps or act.stop_requested:
                self._finish(act, completed_step)
            else:
                act.profiler.step()
            return
        now = self._wall_ns()
        req = self._due(now, completed_step)
        if req is None:
            return
        self._begin(req, completed_step + 1, now)

    def _due(self, now: int, step: int) -> TraceCommand | None:
        with self._lock:
            if self._pending and _start_due(self._pending[0], now, step):
                return self._pending.pop(0)
            s = self._schedule
            if s is None or not _start_due(s, now, step):
                return None
            if s.continuous or (s.every_s and now >= self._next_due_ns) or \
                    (s.every_steps and (self._next_due_step < 0 or step + 1 >= self._next_due_step)):
                if s.every_steps and self._next_due_step < 0:
                    self._next_due_step = step + 1
                return s
            return None

    def _begin(self, req: TraceCommand, first_step: int, now: int) -> None:
        k = self._counts.get(req.request_id, 0)
        self._counts[req.request_id] = k + 1
        window_id = f"{req.request_id}-{k}"
        if k == 0 and 0 < req.start_step < first_step:
            log.warning("rankscope: window %s starts at step %d, %d after its planned start step %d: the request "
                        "came late, so this rank traces other steps than its peers", window_id, first_step,
                        first_step - req.start_step, req.start_step)
        prof = self._profiler_factory(req)
        prof.start()
        with self._lock:
            self._active = _Active(req, window_id, first_step, now, prof, thread_cpu=self._thread_cpu())
            if req is self._schedule:
                self._next_due_ns = now + int(req.every_s * 1e9)  # type: ignore[union-attr]
                self._next_due_step = first_step + req.every_steps  # type: ignore[union-attr]
            self._rearm()
        self._on_window(True)

    def _finish(self, act: _Active, last_step: int) -> None:
        act.thread_cpu = window_thread_cpu(act.thread_cpu, self._thread_cpu())
        act.profiler.stop()
        end_ns = self._wall_ns()
        with self._lock:
            self._active = None
            self._rearm()
        self._on_window(False)
        self._ensure_worker()
        try:
            self._work.put_nowait((act, end_ns))
        except queue.Full:
            self._ack(act.request.request_id, "rejected", f"window {act.window_id} dropped: sender busy")

    @staticmethod
    def _safe_stop(prof: Any) -> None:
        try:
            prof.stop()
        except Exception:
            pass

    # Background sender -------------------------------------------------------------------------
    def _ensure_worker(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._work_loop, name="rankscope-trace-sender", daemon=True)
            self._worker.start()

    def _work_loop(self) -> None:
        while True:
            act, end_ns = self._work.get()
            leave_profiler()     # a continuous schedule's next window may already be running
            try:
                self._ship(act, end_ns)
            except Exception as e:
                log.warning("rankscope: sending window %s failed: %s", act.window_id, e)
                self._ack(act.request.request_id, "rejected", f"window {act.window_id} failed: {e}")
            finally:
                self._work.task_done()

    def _ship(self, act: _Active, end_ns: int) -> None:
        import time

        from rankscope.producers.trace_events import extract_raw

        wall0 = time.perf_counter()
        cpu = [time.thread_time()]
        read = self._read_window or extract_raw
        raw = read(act.profiler)  # off the training thread: the profiler has stopped
        act.profiler = None
        raw, own_events = raw.without_threads(own_thread_ids())   # rankscope's own threads are not the job
        cpu.append(time.thread_time())
        budget = act.request.byte_budget or self._byte_budget
        status = "stopped" if act.stop_requested else "complete"
        native = getattr(read, "native", None)
        try:
            out = convert_window(raw, act.window_id, act.first_step, budget, status, native=native)
        except Exception as e:
            if native is None:
                raise
            # A bug in the C++ kernels must not cost the window: this one is converted again in Python.
            log.warning("rankscope: C++ conversion of window %s failed (%s: %s); converting it in Python",
                        act.window_id, type(e).__name__, e)
            out = convert_window(raw, act.window_id, act.first_step, budget, status)
        cpu.append(time.thread_time())
        for body in out.traces:
            self._send_trace("trace", body)
        body = out.summary
        body.update(request_id=act.request.request_id, request_ranks=act.request.ranks, own_events_dropped=own_events)
        if act.thread_cpu is not None:
            body["thread_cpu"] = list(act.thread_cpu)
        self._send_summary("summary", body)
        cpu.append(time.thread_time())
        self.last_ship_s = (time.perf_counter() - wall0, cpu[-1] - cpu[0])
        self.last_ship_cpu_stages = dict(zip(("read", "convert", "send"),
                                             (b - a for a, b in zip(cpu, cpu[1:], strict=False)), strict=True))
        self.windows_done += 1
        sent, total, truncated = out.sent, body["events_total"], out.truncated
        how = f"{'C++' if self.native_reader else 'Python'} reader"
        late = act.window_id.endswith("-0") and 0 < act.request.start_step < act.first_step
        detail = (f"window {act.window_id}: steps {body['first_step']}-{body['last_step']}, {sent}/{total} events sent"
                  + (f", LATE: planned from step {act.request.start_step}" if late else "")
                  + (f", TRUNCATED to the {budget}-byte budget" if truncated else "") + f" ({how})")
        self._ack(act.request.request_id, "done", detail, window_id=act.window_id, truncated=bool(truncated))

    def drain(self, timeout_s: float) -> None:
        """Wait (bounded) for windows being sent; used at exit."""
        if self._worker is None:
            return
        import time

        deadline = time.monotonic() + timeout_s
        while self._work.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.002)


def window_thread_cpu(start: tuple[int, int] | None, end: tuple[int, int] | None) -> tuple[int, int] | None:
    """The training thread's ``(cpu_ns, runq_ns)`` over a window from its counters at the window's start
    and end; None when either is unknown or the counters went back (another thread was read)."""
    if start is None or end is None:
        return None
    cpu, runq = end[0] - start[0], end[1] - start[1]
    return (cpu, runq) if cpu >= 0 and runq >= 0 else None


def own_thread_ids() -> set[int]:
    """Native ids of the tracer's live threads (all named ``rankscope-*``): their Python frames are
    the tracer's, left out of windows so that reports and flame graphs show the job alone."""
    return {t.native_id for t in threading.enumerate()
            if t.name.startswith("rankscope-") and t.native_id is not None}


def _start_due(req: TraceCommand, now_ns: int, completed_step: int) -> bool:
    """May ``req``'s first window start at the boundary after ``completed_step``?"""
    if req.start_step > 0:
        return completed_step + 1 >= req.start_step or now_ns >= req.start_at_ns + START_STEP_MAX_WAIT_NS
    return now_ns >= req.start_at_ns


@dataclass
class ConvertedWindow:
    traces: list[dict[str, Any]]      # trace chunk bodies, in order
    summary: dict[str, Any]           # the summary body (request fields are added by the sender)
    sent: int                         # events in the chunks
    truncated: int                    # events left out by the byte budget


def convert_window(raw: Any, window_id: str, first_step: int, budget: int, status: str,
                   native: Any = None) -> ConvertedWindow:
    """RawEvents of one window -> its trace chunks within ``budget`` bytes and its summary body (with
    the collective arrivals). Pure. ``native``: the C++ module, for the same result in less time."""
    from rankscope.producers.trace_events import chunk, summarize, summary_body, to_columnar

    cols = to_columnar(raw, window_id, first_step, native=native)
    bodies, truncated, sent = chunk(cols, budget)
    body = summary_body(cols, summarize(cols, native=native, compact_paths=True), events_sent=sent,
                        truncated=truncated, status=status)
    body["arrivals"] = collective_arrivals(cols)
    return ConvertedWindow(bodies, body, sent, truncated)


def collective_arrivals(cols: dict[str, Any], limit: int = 5000) -> dict[str, list[Any]]:
    """When this rank called each collective (host side, ``c10d::*`` ops): the k-th call of each name
    on every rank is the same collective, so the processors can tell who arrived last."""
    import numpy as np

    from rankscope.producers.trace_events import COLLECTIVE

    ev, names = cols["events"], cols["names"]
    out: dict[str, list[Any]] = {"name": [], "seq": [], "start_ns": []}
    rows = np.flatnonzero(np.asarray(ev["category"]) == COLLECTIVE)
    if not len(rows):
        return out
    start = np.asarray(ev["start_ns"], dtype=np.int64)[rows]
    rows = rows[np.argsort(start, kind="stable")]
    seen: dict[str, int] = {}
    for i, t in zip(np.asarray(ev["name"])[rows].tolist(), np.asarray(ev["start_ns"])[rows].tolist(), strict=True):
        name = names[i]
        if not name.startswith("c10d::") or len(out["name"]) >= limit:
            continue
        k = seen.get(name, 0)
        seen[name] = k + 1
        out["name"].append(name)
        out["seq"].append(k)
        out["start_ns"].append(t)
    return out
