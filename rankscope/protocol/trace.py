"""The ``trace`` command of a ``control`` message: a trace-window request as every rank receives it.

Its arguments and their bounds are declared here once. Senders (``rankscope trace``, the dashboard,
the processors' automatic windows) build it with rankscope/trace_request.py, which checks a
request against these bounds; ranks parse it with :func:`parse_command` into a
:class:`TraceCommand` (producers/trace_window.py runs it).

Arguments (all optional)::

    {"steps": int, "every_s": float, "every_steps": int, "continuous": bool, "with_shapes": bool,
     "with_stack": bool, "byte_budget": int, "lead_ns": int, "start_step": int, "reason": str}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_STEPS = 3
MAX_STEPS = 10_000                  # steps per window
MAX_EVERY_S = 7 * 86400             # a period by time
MAX_EVERY_STEPS = 10_000_000        # a period by steps
MAX_BYTE_BUDGET = 1 << 31           # bytes a window may send (0: the rank's default)
DEFAULT_LEAD_NS = 1_000_000_000     # windows start this long after the command was sent...
MAX_LEAD_NS = 3_600_000_000_000
MAX_START_STEP = 1 << 62            # ... or at this step (0: at the first step boundary after the lead)


class CommandError(ValueError):
    """A command a rank refuses; the message names the bad value and its allowed range."""


@dataclass(frozen=True)
class TraceCommand:
    """A validated ``trace`` command. ``steps`` per window; one of the modes below."""

    request_id: str
    steps: int
    every_s: float = 0.0        # periodic by time
    every_steps: int = 0        # periodic by steps
    continuous: bool = False    # back-to-back windows until stopped
    with_shapes: bool = False
    with_stack: bool = True
    byte_budget: int = 0        # 0 = the rank's default
    start_at_ns: int = 0        # wall clock; ranks start at the first step boundary after it...
    start_step: int = 0         # ... or, when > 0, at the boundary before this step (the same on every
                                # DDP rank; senders derive it from the ranks' latest steps), unless that
                                # has not come ``START_STEP_MAX_WAIT_NS`` after ``start_at_ns``
    ranks: list[int] | None = field(default=None)

    @property
    def repeating(self) -> bool:
        return self.continuous or self.every_s > 0 or self.every_steps > 0


START_STEP_MAX_WAIT_NS = 60 * 10**9


def parse_command(request_id: str, args: dict[str, Any], ranks: list[int] | None, sent_ns: int) -> TraceCommand:
    """Validate a trace command's arguments; raise CommandError naming the bad value."""
    def num(name: str, typ: type, default: Any, lo: float, hi: float) -> Any:
        v = args.get(name, default)
        if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
            raise CommandError(f"{name}={v!r} must be a number in [{lo}, {hi}]")
        return typ(v)

    steps = num("steps", int, DEFAULT_STEPS, 1, MAX_STEPS)
    every_s = num("every_s", float, 0.0, 0, MAX_EVERY_S)
    every_steps = num("every_steps", int, 0, 0, MAX_EVERY_STEPS)
    budget = num("byte_budget", int, 0, 0, MAX_BYTE_BUDGET)
    lead_ns = num("lead_ns", int, DEFAULT_LEAD_NS, 0, MAX_LEAD_NS)
    start_step = num("start_step", int, 0, 0, MAX_START_STEP)
    if every_steps and every_steps < steps:
        raise CommandError(f"every_steps={every_steps} must be >= steps={steps}")
    return TraceCommand(request_id=request_id, steps=steps, every_s=every_s, every_steps=every_steps,
                        continuous=bool(args.get("continuous", False)), with_shapes=bool(args.get("with_shapes", False)),
                        with_stack=bool(args.get("with_stack", True)), byte_budget=budget,
                        start_at_ns=sent_ns + lead_ns, start_step=start_step, ranks=ranks)
