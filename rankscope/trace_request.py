"""A trace-window request: validated, planned and encoded in one place for every sender.

``rankscope trace``, the dashboard's Traces page and the processors' automatic windows all build
their control message here, so for the same request and the same job progress they send the same
command: the same bounds (rankscope/protocol/trace.py declares them), the same start step and the
same period (:mod:`rankscope.trace_start` holds the planning arithmetic). The ranks parse it with
:func:`rankscope.protocol.trace.parse_command`.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rankscope.protocol.envelope import Envelope, encode
from rankscope.protocol.trace import MAX_BYTE_BUDGET, MAX_EVERY_S, MAX_EVERY_STEPS, MAX_STEPS
from rankscope.rank_states import HUNG, WAITING, base_state
from rankscope.trace_start import START_LEAD_NS, plan_start_step, steps_per_period

MODES = ("once", "every_s", "every_steps", "continuous")
MODE_LABELS = {"once": "once", "every_s": "every N seconds", "every_steps": "every K steps",
               "continuous": "continuous (until stopped)"}
DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h)?$")
UNIT_S = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def new_request_id() -> str:
    return f"tw{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class TraceRequest:
    """A trace-window request (or, with ``stop``, a stop of running windows and schedules).

    ``ranks`` None means every rank. ``mode`` is one of :data:`MODES`; ``every_s`` / ``every_steps``
    are used by their mode only. Raises ValueError naming the bad value and its allowed range.
    """

    job: str
    ranks: list[int] | None = None
    steps: int = 3
    mode: str = "once"
    every_s: float = 0.0
    every_steps: int = 0
    with_stack: bool = True
    with_shapes: bool = False
    byte_budget: int = 0
    stop: bool = False
    reason: str = ""
    request_id: str = field(default_factory=new_request_id)

    def __post_init__(self) -> None:
        if not self.job:
            raise ValueError("job must not be empty")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}, got {self.mode!r}")
        if self.ranks is not None and (not self.ranks or min(self.ranks) < 0):
            raise ValueError(f"ranks must be None (all) or non-negative ranks, got {self.ranks!r}")
        if self.stop:
            return
        if not 1 <= self.steps <= MAX_STEPS:
            raise ValueError(f"steps must be in [1, {MAX_STEPS}], got {self.steps}")
        if self.mode == "every_s" and not 0 < self.every_s <= MAX_EVERY_S:
            raise ValueError(f"every N seconds needs N in (0, {MAX_EVERY_S}], got {self.every_s}")
        if self.mode == "every_steps" and not self.steps <= self.every_steps <= MAX_EVERY_STEPS:
            raise ValueError(f"every K steps needs K in [steps={self.steps}, {MAX_EVERY_STEPS}], got {self.every_steps}")
        if not 0 <= self.byte_budget <= MAX_BYTE_BUDGET:
            raise ValueError(f"byte_budget must be in [0, {MAX_BYTE_BUDGET}], got {self.byte_budget}")


@dataclass(frozen=True)
class Plan:
    """Where the windows start (0: when each rank gets the request) and a time period in steps (0: by the clock)."""

    start_step: int = 0
    period_steps: int = 0


def plan(req: TraceRequest, progress: list[dict[str, Any]] | None, now_ns: int) -> Plan:
    """The plan for ``req`` from the job's progress (per rank: ``step``, ``ts_ns``, ``median_step_ns``,
    as the processors' stats carry them): every rank starts at the same step, and an ``every_s``
    period becomes a period in steps, so that later windows also open at the same steps."""
    if req.stop or not progress:
        return Plan()
    period = steps_per_period(progress, req.every_s, req.steps) if req.mode == "every_s" else 0
    return Plan(start_step=plan_start_step(progress, now_ns, START_LEAD_NS), period_steps=period)


def control_body(req: TraceRequest, p: Plan = Plan()) -> dict[str, Any]:
    """The ``control`` message body for ``req`` under plan ``p``."""
    if req.stop:
        return {"command": "stop", "request_id": req.request_id, "ranks": req.ranks, "args": {}}
    args: dict[str, Any] = {"steps": req.steps, "with_shapes": req.with_shapes, "with_stack": req.with_stack,
                            "byte_budget": req.byte_budget}
    if req.reason:
        args["reason"] = req.reason
    if p.start_step > 0:
        args.update(start_step=p.start_step, lead_ns=START_LEAD_NS)
    if req.mode == "every_s":
        if p.period_steps > 0:
            args["every_steps"] = p.period_steps
        else:
            args["every_s"] = float(req.every_s)
    elif req.mode == "every_steps":
        args["every_steps"] = req.every_steps
    elif req.mode == "continuous":
        args["continuous"] = True
    return {"command": "trace", "request_id": req.request_id, "ranks": req.ranks, "args": args}


def encode_request(req: TraceRequest, p: Plan = Plan(), sender: str = "cli", now_ns: int | None = None) -> bytes:
    """The control message (msgpack envelope, kind ``control``, rank -1) for ``req`` under plan ``p``."""
    env = Envelope(kind="control", job=req.job, rank=-1, host=sender, pid=0, seq=1,
                   sent_ns=time.time_ns() if now_ns is None else now_ns, body=control_body(req, p))
    return encode(env)


def parse_ranks(spec: str) -> list[int] | None:
    """``"0-3,8"`` -> [0, 1, 2, 3, 8]; empty -> None (all ranks). Raises ValueError naming the part."""
    if not spec.strip():
        return None
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ValueError(f"bad rank range {part!r} in --ranks {spec!r}; use e.g. 0-3,8")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ValueError(f"bad rank range {part!r}: {hi} < {lo}")
        out.update(range(lo, hi + 1))
    return sorted(out)


def parse_duration(spec: str) -> float:
    """``"500ms"``, ``"30s"``, ``"10m"``, ``"1h"`` (or plain seconds) -> seconds. Raises ValueError."""
    m = DURATION.match(spec.strip())
    if not m:
        raise ValueError(f"bad duration {spec!r}; use e.g. 500ms, 30s, 10m, 1h")
    return float(m.group(1)) * UNIT_S[m.group(2)]


def stalled_note(job: str, states: Mapping[int, str], targets: Iterable[int], *,
                 idle_s: Mapping[int, float] | None = None, min_idle_s: float = 10.0) -> str | None:
    """What to tell whoever asks a window of a job whose addressed ranks have stopped stepping, None
    when they step. ``states``: rank -> its state (rankscope/rank_states.py: ``hung`` and ``waiting``
    do not step); ``idle_s``: rank -> seconds since its last step ended, more than ``min_idle_s``
    (the hang threshold) counting as not stepping too. A window starts and ends at step boundaries:
    on a rank blocked in a collective, or hung, it starts only when its steps resume."""
    wanted = set(targets)
    hung = sorted(r for r, s in states.items() if r in wanted and base_state(s) == HUNG)
    idle = {r: t for r, t in (idle_s or {}).items() if r in wanted and t > min_idle_s}
    still = sorted(r for r in wanted if r not in hung and (base_state(states.get(r)) == WAITING or r in idle))
    if not hung and not still:
        return None
    parts = [f"ranks {hung} hung"] if hung else []
    if still:
        parts.append(f"ranks {still} without a step" + (f" for {min(idle.values()):.0f} s or more" if idle else ""))
    return (f"job {job} is not stepping ({'; '.join(parts)}): a window starts at a step boundary, so on these "
            f"ranks it starts only when their steps resume. The hang alert holds every rank's stack: "
            f"`rankscope alerts --job {job}`, or the Alerts page.")
