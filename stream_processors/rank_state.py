"""One rank's state as the processors see it, and the fold of its steps-topic messages into it.

The fold is idempotent and order-safe, so the same message read twice (a restart re-reads the
recent input, faust re-delivers after a crash) changes nothing:
- step records at or below the rank's last step are skipped;
- a message sent before the newest one already folded is skipped (per rank, by ``sent_ns``);
- times are event times: the message's send time, clamped to the processor's clock, so state
  rebuilt from a backlog equals the state built live. Messages without a send time (0) use the
  processor's time.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from rankscope.protocol.envelope import Envelope, split_beat

EXTRAPOLATION_CAP_S = 3.0   # a lagging processor extrapolates progress age by at most this much
CPU_WAIT_WINDOW_S = 30.0    # a rank's CPU wait share is judged over its last this many seconds
CPU_WAIT_MIN_SPAN_S = 5.0   # ... once its beats span at least this many
CPU_MARK_EVERY_S = 5.0      # one kept sample per this many seconds (memory: 10,000 ranks x 8 samples)
CPU_MARKS = 8
READY_MIN_PER_SPAN = 50     # a thread ready less than 1/this of the window (2%) waited for no CPU
CPU_WAIT_WINDOW_NS, CPU_WAIT_MIN_SPAN_NS = int(CPU_WAIT_WINDOW_S * 1e9), int(CPU_WAIT_MIN_SPAN_S * 1e9)
CPU_MARK_EVERY_NS = int(CPU_MARK_EVERY_S * 1e9)
CPU_SHARE_EVERY_NS = 5 * 10**9   # a rank's shares are worked out at most once per this much of its beats' time
CRASH_REASONS = ("exception", "signal")


@dataclass(slots=True)
class RankState:
    rank: int
    host: str = ""
    pid: int = 0
    last_step: int = -1
    last_step_end_ns: int = 0
    durations: list[int] = field(default_factory=list)
    busy: list[int] = field(default_factory=list)
    comm: list[int] = field(default_factory=list)
    hb_s: float = 0.0              # event time of the latest message (seconds)
    hb_step: int = -1
    hb_since_s: float = 0.0        # seconds since the last step, as the rank measured at that time
    stacks: list[dict[str, Any]] | None = None
    exit_reason: str = ""
    exit_detail: str = ""
    exit_ns: int = 0               # event time of the exit record
    exc_type: str = ""             # an exception exit's type and traceback (outermost first)
    exc_frames: list[str] = field(default_factory=list)
    dropped: int = 0
    last_sent_ns: int = 0
    last_seq: int = 0
    version: int = 0               # bumped by every change of the step window (median caches)
    # The training thread's (event time ns, cpu ns, run-queue wait ns), cumulative: kept samples about
    # CPU_MARK_EVERY_S apart, and the newest.
    cpu_marks: list[tuple[int, int, int]] = field(default_factory=list)
    cpu_last: tuple[int, int, int] | None = None
    _cpu_share: tuple[tuple[int, int, int] | None, tuple[int, int] | None] = (None, None)   # (for cpu_last, share)
    _medians: tuple[int, int, int, int] = (-1, 0, 0, 0)   # (version, step, busy, comm)

    def progress_age_s(self, now_s: float) -> float:
        """Seconds since the rank last finished a step, extrapolated from its latest heartbeat."""
        return self.hb_since_s + min(max(0.0, now_s - self.hb_s), EXTRAPOLATION_CAP_S)

    def medians(self) -> tuple[int, int, int]:
        """Median step, busy and collective-wait time (ns) over the rolling window; 0 when empty."""
        if self._medians[0] != self.version:
            if self.durations:
                self._medians = (self.version, int(statistics.median(self.durations)),
                                 int(statistics.median(self.busy)), int(statistics.median(self.comm)))
            else:
                self._medians = (self.version, 0, 0, 0)
        return self._medians[1], self._medians[2], self._medians[3]

    def add_cpu(self, t_ns: int, cpu_ns: int, runq_ns: int) -> None:
        """Take one beat's cumulative counters of the training thread (older or equal times are
        skipped). Cheap per beat: :attr:`cpu_wait_pm` is worked out when asked."""
        last = self.cpu_last
        if last is not None:
            if t_ns <= last[0]:
                return
            if cpu_ns < last[1] or runq_ns < last[2]:
                self.forget_cpu()      # counters went back: a new thread
        sample = (t_ns, cpu_ns, runq_ns)
        marks = self.cpu_marks
        if not marks or t_ns - marks[-1][0] >= CPU_MARK_EVERY_NS:
            marks.append(sample)
            if len(marks) > CPU_MARKS:
                del marks[0]
        self.cpu_last = sample

    @property
    def cpu_wait_pm(self) -> tuple[int, int] | None:
        """Over its last CPU_WAIT_WINDOW_S, once its beats span CPU_WAIT_MIN_SPAN_S, per mille: the
        share of the time the training thread was ready to run (on a CPU or waiting for one) that it
        waited, and the share of the time it ran; None before. Worked out at most once per 5 s of the
        rank's beats (a share over 30 s moves little in 5). A wait share of ready time, not of
        wall time: a rank with more work is ready longer, and would wait longer on a busy host
        without being starved."""
        last = self.cpu_last
        if last is None:
            return None
        done_for = self._cpu_share[0]    # worked out again once the newest beat is 5 s newer
        if done_for is not None and last[0] - done_for[0] < CPU_SHARE_EVERY_NS:
            return self._cpu_share[1]
        t_ns, cpu_ns, runq_ns = last
        oldest = t_ns - CPU_WAIT_WINDOW_NS
        share: tuple[int, int] | None = None
        for first_t, first_cpu, first_runq in self.cpu_marks:   # the first mark inside the window
            if first_t >= oldest:
                span = t_ns - first_t
                if span >= CPU_WAIT_MIN_SPAN_NS:
                    ran, waited = max(0, cpu_ns - first_cpu), max(0, runq_ns - first_runq)
                    ready = ran + waited
                    # A thread ready to run less than 1/READY_MIN_PER_SPAN of the time (blocked in a
                    # collective, asleep, hung) was not held back by the CPUs, whatever its few waits.
                    wait = 0 if ready * READY_MIN_PER_SPAN < span else min(1000, (2000 * waited + ready) // (2 * ready))
                    share = (wait, min(1000, (2000 * ran + span) // (2 * span)))
                break
        self._cpu_share = (last, share) if share is not None else (None, None)   # None: asked again
        return share

    def forget_cpu(self) -> None:
        self.cpu_marks, self.cpu_last, self._cpu_share = [], None, (None, None)

    @property
    def crashed(self) -> bool:
        return self.exit_reason in CRASH_REASONS


def exception_type(detail: str) -> str:
    """The exception type an exit detail starts with ("RuntimeError: ..." -> "RuntimeError"), else ""."""
    head = detail.split(":", 1)[0].strip()
    return head if head and len(head) < 120 and " " not in head else ""


def event_s(env: Envelope, now_s: float) -> float:
    """The message's send time in seconds, clamped to ``now_s``; ``now_s`` when it has none."""
    return now_s if env.sent_ns <= 0 else min(env.sent_ns / 1e9, now_s)


def fold(st: RankState, env: Envelope, now_s: float, window: int) -> int:
    """Fold one ``steps``, ``heartbeat``, ``beat`` or ``exit`` message; return the new steps taken.

    ``window`` bounds the rolling step, busy and wait lists. Never raises on a decoded message."""
    if 0 < env.sent_ns < st.last_sent_ns:
        return 0   # older than what this rank already told us
    if env.kind == "beat":
        steps, hb = split_beat(env)
        return fold(st, steps, now_s, window) + fold(st, hb, now_s, window)
    if st.pid and st.pid != env.pid and env.kind != "exit":
        st.last_step, st.exit_reason = -1, ""   # the rank restarted in a new process
        st.forget_cpu()
    st.host, st.pid = env.host, env.pid
    st.last_sent_ns = max(st.last_sent_ns, env.sent_ns)
    st.last_seq = env.seq
    b = env.body
    t = event_s(env, now_s)
    new = 0
    if env.kind == "steps":
        for s, a, e, c in zip(b["step"], b["start_ns"], b["end_ns"], b["comm_ns"], strict=True):
            if s <= st.last_step:
                continue
            dur = max(0, e - a)
            st.durations.append(dur)
            st.comm.append(max(0, c))
            st.busy.append(max(0, dur - c))
            st.last_step, st.last_step_end_ns = s, e
            new += 1
        if new:
            if len(st.durations) > window:
                del st.durations[:-window], st.busy[:-window], st.comm[:-window]
            st.version += 1
            st.hb_since_s = 0.0
        st.hb_s = max(st.hb_s, t)
        st.exit_reason = ""
    elif env.kind == "heartbeat":
        st.hb_s = max(st.hb_s, t)
        st.hb_step = b["step"]
        st.hb_since_s = float(b["since_step_s"])
        st.stacks = b["stacks"]
        st.dropped = b["dropped"]
        cpu = b.get("cpu")
        if cpu is not None:
            st.add_cpu(int(t * 1e9), cpu[0], cpu[1])
    elif env.kind == "exit":
        st.exit_reason = b["reason"]
        st.exit_detail = b["detail"]
        st.exit_ns = int(t * 1e9)
        st.exc_type = (b.get("exc_type") or exception_type(b["detail"])) if b["reason"] == "exception" else ""
        st.exc_frames = list(b.get("frames", []))
        st.hb_s = max(st.hb_s, t)
        st.last_step = max(st.last_step, b["step"])
    return new

