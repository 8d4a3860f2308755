"""Always-on sampling of the rank's Python stacks, from inside the process (no ptrace, no extra
process), folded into call paths with counts and sent once per interval as a ``profile`` message
(rankscope/protocol/profile.py).

A daemon thread takes every thread's stack ``profile_hz`` times a second, walked in C while it holds
the GIL (producers/native/stack_walk.c; without it, sampling is off: see :data:`PYTHON_WALK`),
keeps each stack as the tuple of its code objects with a count per (thread role, stack) and, every
``profile_s``, turns the stacks into call paths of the user's frames (``"file.py:12 func"``, the
function's first line) and sends the most sampled ones, within the wire budget, with the rest
counted per role. What a sample costs is walking the frames and one dict update: labels are made
once per code object, when an interval is sent.

- rankscope's own threads (named ``rankscope-*``) are never sampled, and its frames in the user's
  threads leave the paths (their time is the user's call that made them, :mod:`rankscope.own_frames`).
- Roles: ``training`` (the thread that calls ``tracer.step()``, the main thread before it does),
  ``pin_memory`` (a DataLoader's pin-memory thread), ``other``; a forked DataLoader worker process
  samples its threads as ``dataloader`` and hands its intervals to the rank's process, which sends
  them under the worker's pid. Workers of a ``spawn`` DataLoader are not sampled.
- While a trace window's torch.profiler runs (``paused``), nothing is sampled: the window records
  every Python call itself, and the sampler keeps clear of the profiler's hooks.
- Contract: construction, sampling and :meth:`StackSampler.stop` never raise.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgpack

from rankscope.producers.stacks import frame_label, is_own
from rankscope.producers.untraced import leave_profiler
from rankscope.protocol.profile import BYTES_PER_S, MAX_DEPTH, MAX_NAME_CHARS, MAX_NAMES, MAX_ROWS, ROLES

log = logging.getLogger("rankscope.profile")

OWN_THREAD_PREFIX = "rankscope-"
WORKER_WAIT_S = 5.0          # a forked child that is not a DataLoader worker by then stops sampling
_PIN_MEMORY = "_pin_memory_loop"
MAX_STACKS = 20000           # distinct stacks kept per interval; the rest count as "other"
# Walk stacks in Python when the C walker is missing. Off: a Python walk crashed CPython 3.11 within
# seconds under threads that come and go and torch.profiler windows (tests/producers/scripts/
# stack_walk_torture.py, SIGSEGV in the walk's f_back), where the C walker ran clean; other Pythons
# are not verified. The benchmark turns it on to measure what the C walker saves.
PYTHON_WALK = False


def _worker_info() -> Any:
    mod = sys.modules.get("torch.utils.data._utils.worker")
    return getattr(mod, "_worker_info", None) if mod is not None else None


class StackFolder:
    """Counts of (role, stack) within one interval and the ``profile`` body they make. Not thread-safe:
    one sampling thread owns it."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[int, tuple[int, ...]]] = Counter()
        self.ticks = 0
        self.overflow = [0] * len(ROLES)
        self._codes: dict[int, Any] = {}          # id -> code object, kept alive so ids stay unique
        self._labels: dict[int, str | None] = {}  # id -> user frame label, None for an own frame

    def add(self, role: int, frame: Any) -> None:
        """One sample of a thread from its innermost frame, walked here in Python."""
        stack: list[Any] = []
        f = frame
        while f is not None and len(stack) < 4 * MAX_DEPTH:
            stack.append(f.f_code)
            f = f.f_back
        self.add_codes(role, stack)

    def add_codes(self, role: int, stack: Any, ids: tuple[int, ...] | None = None) -> None:
        """One sample of a thread as its code objects, innermost first, and their ids (the C walker's
        form; computed here when None). A stack seen before in the interval costs one dict update."""
        if ids is None:
            ids = tuple(id(c) for c in stack)
        key = (role, ids)
        counts = self.counts
        if key in counts:
            counts[key] += 1
            return
        if len(counts) >= MAX_STACKS:
            self.overflow[role] += 1
            return
        codes = self._codes
        for i, c in zip(ids, stack, strict=True):
            if i not in codes:
                codes[i] = c
        counts[key] = 1

    def _label(self, i: int) -> str | None:
        if i in self._labels:
            return self._labels[i]
        c = self._codes[i]
        label = None if is_own(c.co_filename) else frame_label(c.co_filename, c.co_firstlineno,
                                                                 getattr(c, "co_qualname", c.co_name))[:MAX_NAME_CHARS]
        self._labels[i] = label
        return label

    def take(self, t0_ns: int, t1_ns: int, hz: float, max_bytes: int) -> dict[str, Any] | None:
        """The interval's body (None when nothing was sampled), and a fresh interval."""
        counts, overflow, ticks = self.counts, self.overflow, self.ticks
        self.counts, self.overflow, self.ticks = Counter(), [0] * len(ROLES), 0
        if len(self._codes) > 50000:            # a long run of generated code: start the caches over
            self._codes, self._labels = {}, {}
        folded: Counter[tuple[int, tuple[str, ...]]] = Counter()
        other = list(overflow)
        for (role, ids), n in counts.items():
            labels = []
            for i in reversed(ids):            # outermost first
                label = self._label(i) if i in self._codes else None
                if label is not None:
                    labels.append(label)
            if labels:
                folded[(role, tuple(labels[-MAX_DEPTH:]))] += n
            else:
                other[role] += n
        if not folded and not any(other):
            return None
        ranked = folded.most_common()
        keep = min(len(ranked), MAX_ROWS)
        body = _body(ranked, keep, other, t0_ns, t1_ns, hz, ticks)
        while len(msgpack.packb(body)) > max_bytes and keep > 1:
            keep //= 2
            body = _body(ranked, keep, other, t0_ns, t1_ns, hz, ticks)
        return body


def _body(ranked: list[tuple[tuple[int, tuple[str, ...]], int]], keep: int, other_counts: list[int], t0_ns: int,
          t1_ns: int, hz: float, ticks: int) -> dict[str, Any]:
    """The first ``keep`` call paths as the interned table; the samples of the rest (and of a path
    that would pass MAX_NAMES) count as their role's other."""
    names: list[str] = []
    name_idx: dict[str, int] = {}
    paths: list[list[int]] = []
    path_idx: dict[tuple[int, int], int] = {}
    other = list(other_counts)
    kept: list[tuple[int, int, int]] = []
    for k, ((role, labels), n) in enumerate(ranked):
        if k >= keep or len(names) + len(labels) > MAX_NAMES:
            other[role] += n
            continue
        parent = -1
        for label in labels:
            ni = name_idx.get(label)
            if ni is None:
                ni = name_idx[label] = len(names)
                names.append(label)
            pi = path_idx.get((parent, ni))
            if pi is None:
                pi = path_idx[(parent, ni)] = len(paths)
                paths.append([parent, ni])
            parent = pi
        kept.append((parent, role, n))
    present = sorted({r for _, r, _ in kept} | {r for r, c in enumerate(other) if c > 0})
    pos = {r: i for i, r in enumerate(present)}
    return {"t0_ns": t0_ns, "t1_ns": t1_ns, "hz": float(hz), "ticks": ticks, "roles": [ROLES[r] for r in present],
            "names": names, "paths": paths, "path": [p for p, _, _ in kept], "role": [pos[r] for _, r, _ in kept],
            "count": [n for _, _, n in kept], "other": [other[r] for r in present]}


class StackSampler:
    """The sampling thread of one process (see the module doc). ``send(kind, body, pid)`` queues a
    message of this rank (``pid`` None: this process). With ``workers``, a forked DataLoader worker
    samples too and hands each interval's body to this process through a datagram socket made
    before the fork: the worker never makes a Kafka producer (librdkafka is not fork-safe), and a
    full socket drops the body (counted in the parent as ``worker_drops``) rather than wait."""

    def __init__(self, hz: float, interval_s: float, send: Callable[[str, dict[str, Any], int | None], None],
                 training_ident: Callable[[], int | None], wall_ns: Callable[[], int], workers: bool = False,
                 walker: Any = None, cache_dir: str | None = None) -> None:
        self.hz = hz
        self.walker = walker                     # producers/stack_walk.py's C module, or None: walk in Python
        self._cache_dir = cache_dir              # where the walker is built (once per Python) when not given
        self.interval_s = interval_s
        self._send = send
        self._training_ident = training_ident
        self._wall_ns = wall_ns
        self._workers = workers
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()           # the folder: the sampling thread, and the last flush
        self.folder = StackFolder()
        self._t0_ns = wall_ns()
        self._role_of: dict[int, int] = {}
        self._skip: set[int] = set()
        self._names_at = 0.0
        self.in_worker = False
        self.paused = False                      # while a trace window's torch.profiler runs
        self.sent = 0
        self.worker_bodies = 0
        self.worker_drops = 0
        self._rx: socket.socket | None = None    # the parent's end: the workers' bodies
        self._tx: socket.socket | None = None    # the workers' end

    def start(self) -> StackSampler:
        try:
            if self.walker is None and self._cache_dir is not None:
                # Built before (rankscope build-native): loading is quick, and forked workers inherit it.
                from rankscope.producers import stack_walk

                self.walker = stack_walk.load(self._cache_dir)
            if self._workers:
                self._rx, self._tx = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._rx.setblocking(False)
                self._tx.setblocking(False)
                ref = weakref.ref(self)        # held weakly: the interpreter keeps fork handlers for good
                os.register_at_fork(after_in_child=lambda: _after_fork(ref))
            self._thread = threading.Thread(target=self._run, name="rankscope-profile", daemon=True)
            self._thread.start()
        except Exception as e:
            log.warning("rankscope: stack sampling off: %s: %s", type(e).__name__, e)
        return self

    def stop(self, timeout_s: float = 1.0) -> None:
        """Stop sampling and send the interval so far. Never raises."""
        try:
            self._stop.set()
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join(timeout_s)
            self.flush()
            if not self.in_worker:
                self._forward_workers()
                for sock in (self._rx, self._tx):
                    if sock is not None:
                        sock.close()
        except Exception as e:
            log.debug("stack sampler stop: %s", e)

    def flush(self) -> None:
        """Send what was sampled since the last message."""
        with self._lock:
            now = self._wall_ns()
            t0, self._t0_ns = self._t0_ns, now
            span_s = max((now - t0) / 1e9, self.interval_s)
            body = self.folder.take(t0, max(now, t0), self.hz, int(BYTES_PER_S * span_s))
        if body is None:
            return
        if self.in_worker:
            try:
                self._tx.send(msgpack.packb({"pid": os.getpid(), "body": body}))  # type: ignore[union-attr]
            except OSError:
                pass          # the parent counts what it never got from the gap in the worker's intervals
        else:
            self._send("profile", body, None)
        self.sent += 1

    def _forward_workers(self) -> None:
        """Send the bodies the DataLoader workers handed over, under their pids."""
        rx = self._rx
        while rx is not None:
            try:
                data = rx.recv(1 << 20)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            try:
                got = msgpack.unpackb(data)
                pid, body = int(got["pid"]), got["body"]
            except Exception:
                self.worker_drops += 1
                continue
            self.worker_bodies += 1
            self._send("profile", body, pid)

    def sample_once(self) -> None:
        """One sample of every thread but rankscope's own: by the C walker when it is loaded, which
        walks them all while holding the GIL, else in Python (:data:`PYTHON_WALK`)."""
        if self.walker is not None:
            stacks = self.walker.sample(self._skip)
            self._maybe_refresh(t for t, _, _ in stacks)
            with self._lock:
                self.folder.ticks += 1
                for tid, codes, ids in stacks:
                    if tid not in self._skip:
                        self.folder.add_codes(self._role_of.get(tid, 3), codes, ids)
            return
        frames = sys._current_frames()
        me = threading.get_ident()
        self._maybe_refresh(frames)
        with self._lock:
            self.folder.ticks += 1
            for tid, frame in frames.items():
                if tid == me or tid in self._skip:
                    continue
                self.folder.add(self._role_of.get(tid, 3), frame)

    def _maybe_refresh(self, tids: Any) -> None:
        now = self._wall_ns() / 1e9
        if now - self._names_at > 1.0 or any(t not in self._role_of and t not in self._skip for t in tids):
            self._refresh_threads()
            self._names_at = now

    def _refresh_threads(self) -> None:
        train = self._training_ident() if not self.in_worker else None
        main = threading.main_thread().ident
        roles: dict[int, int] = {}
        skip: set[int] = set()
        for t in threading.enumerate():
            if t.ident is None:
                continue
            if t.name.startswith(OWN_THREAD_PREFIX):
                skip.add(t.ident)
            elif self.in_worker:
                roles[t.ident] = 1 if t.ident == main else 3
            elif t.ident == (train or main):
                roles[t.ident] = 0
            elif _PIN_MEMORY in t.name:
                roles[t.ident] = 2
            else:
                roles[t.ident] = 3
        self._role_of, self._skip = roles, skip

    def _find_walker(self) -> bool:
        """Build (once per Python, into the cache dir) and load the C walker unless one was given.
        Without it sampling is off (:data:`PYTHON_WALK`), said once in the log. Returns whether
        sampling can go on."""
        if self.walker is None and self._cache_dir is not None:
            from rankscope.producers import stack_walk

            try:
                stack_walk.build(self._cache_dir)
                self.walker = stack_walk.load(self._cache_dir)
            except Exception as e:
                log.info("rankscope: the C stack walker did not build (%s)", str(e)[:300])
        if self.walker is not None or PYTHON_WALK:
            return True
        log.warning("rankscope: stack sampling off: the C stack walker is not built for this Python (a C "
                    "compiler and Python's headers make it: `rankscope build-native`); walking stacks in "
                    "Python has crashed processes")
        return False

    def _run(self) -> None:
        leave_profiler()
        if not self._find_walker():
            return
        period = 1.0 / self.hz
        next_send = self._wall_ns() / 1e9 + self.interval_s
        while not self._stop.wait(period):
            try:
                leave_profiler()   # torch.profiler puts its hook on every thread when a window starts
                if self.paused:
                    continue
                self.sample_once()
                if not self.in_worker:
                    self._forward_workers()
                if self._wall_ns() / 1e9 >= next_send:
                    next_send += self.interval_s
                    self.flush()
            except Exception as e:   # keep sampling whatever one sample met
                log.debug("stack sample failed: %s", e)

    # In a forked child ----------------------------------------------------------------------------
    def _in_child(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.folder = StackFolder()
        self._role_of, self._skip = {}, set()
        if self._rx is not None:
            self._rx.close()           # the parent's end
            self._rx = None
        self._thread = threading.Thread(target=self._child_run, name="rankscope-profile", daemon=True)
        self._thread.start()

    def _child_run(self) -> None:
        """Sample as a DataLoader worker, or stop if this child is none."""
        leave_profiler()
        waited = 0.0
        while _worker_info() is None:
            if waited >= WORKER_WAIT_S or self._stop.wait(0.05):
                return
            waited += 0.05
        self.in_worker = True
        self._t0_ns = self._wall_ns()
        try:
            import multiprocessing.util

            # A worker leaves through multiprocessing's exit path, which runs these (not atexit).
            multiprocessing.util.Finalize(None, self.stop, args=(0.5,), exitpriority=10)
        except Exception as e:
            log.debug("worker finalizer: %s", e)
        self._run()


def _after_fork(ref: weakref.ref[StackSampler]) -> None:
    sampler = ref()
    if sampler is not None and sampler._thread is not None and sampler._tx is not None:
        try:
            sampler._in_child()
        except Exception:
            pass
