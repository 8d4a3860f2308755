"""Crash attribution: which rank failed first, and which failed because it did.

When one rank raises (a CUDA error, an assertion, a bad batch), its peers fail after it: their
collectives see the connection close, or the launcher stops them with a signal. Every one of
them sends an exit record, so "every rank exited with an exception" says nothing; the order and
the kind of error do. The culprit is the earliest exception that is not a peer-connection error
(the earliest exception when every one is); every other failed rank is a follower.

Pure functions over :class:`~rankscope.stream_processors.summary.Failure` records; the rank_failed rule in
stream_processors/monitor.py publishes the verdict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rankscope.alerts import StackGroup
from rankscope.config import Settings
from rankscope.stream_processors.summary import Failure

# Messages of the errors a rank sees when a peer's process went away (gloo, NCCL, c10d, sockets).
PEER_ERROR_MARKERS = (
    "connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
    "socket closed", "read error", "write error", "communicator was aborted", "ncclremoteerror",
    "remote process exited", "peer closed", "distnetworkerror", "connection was forcibly closed",
)
MAX_FOLLOWERS = 64


def is_peer_error(f: Failure) -> bool:
    """True when the failure looks caused by another rank: a signal, or a peer-connection error."""
    if f.reason != "exception":
        return True
    text = f"{f.exc_type}: {f.detail}".lower()
    return any(m in text for m in PEER_ERROR_MARKERS)


@dataclass(frozen=True)
class Verdict:
    culprit: Failure
    followers: list[Failure]     # every other failed rank, first to fail first


def attribute(failures: list[Failure]) -> Verdict | None:
    """The first failing rank and its followers; None unless some rank exited with an exception
    (ranks that all stopped on a signal were stopped from outside: a cancelled job)."""
    ordered = sorted(failures, key=lambda f: (f.exit_ns, f.rank))
    exceptions = [f for f in ordered if f.reason == "exception"]
    if not exceptions:
        return None
    own = [f for f in exceptions if not is_peer_error(f)]
    culprit = (own or exceptions)[0]
    return Verdict(culprit=culprit, followers=[f for f in ordered if f.rank != culprit.rank])


def describe(f: Failure) -> str:
    """ "RuntimeError: CUDA error: an illegal memory access" (or the exit reason and detail)."""
    if f.reason == "exception":
        if f.exc_type and not f.detail.startswith(f.exc_type):
            return f"{f.exc_type}: {f.detail}" if f.detail else f.exc_type
        return f.detail or "exception"
    return f"{f.reason} {f.detail}".strip()


def failing_step(f: Failure) -> int:
    """The step a rank was in when it failed (exit records carry its last completed step)."""
    return f.step + 1


def alert_fields(job: str, v: Verdict) -> tuple[str, list[StackGroup], dict[str, Any]]:
    """The rank_failed alert's summary, stack groups (the culprit's traceback) and details."""
    c = v.culprit
    more = f"; {len(v.followers)} rank{'s' if len(v.followers) > 1 else ''} failed after it" if v.followers else ""
    summary = f"job {job}: rank {c.rank} failed first, in step {failing_step(c)}: {describe(c)[:300]}{more}"
    groups = [StackGroup(ranks=[c.rank], thread="MainThread", frames=list(c.frames), waiting_in_collective=False,
                         count=1)] if c.frames else []
    details = {"first_rank": c.rank, "last_completed_step": c.step, "host": c.host, "pid": c.pid, "reason": c.reason, "exc_type": c.exc_type,
               "message": c.detail, "frames": list(c.frames), "failed_ns": c.exit_ns,
               "followers": [f.rank for f in v.followers[:MAX_FOLLOWERS]], "follower_count": len(v.followers),
               "follower_errors": sorted({describe(f)[:120] for f in v.followers[:MAX_FOLLOWERS]})[:8]}
    return summary, groups, details


def grace_s(settings: Settings) -> float:
    """How long after the first failure the verdict waits for the other shards' failures to arrive."""
    return max(3.0, 2 * settings.scan_interval_s)
