"""Crash attribution: which rank failed first, and which failed because it did.

When one rank raises (a CUDA error, an assertion, a bad batch), its peers fail after it: their
collectives see the connection close, or the launcher stops them with a signal. Every one of
them sends an exit record, so "every rank exited with an exception" says nothing; the order and
the kind of error do. A rank that dies on a signal of its own (SIGKILL from the OOM killer,
SIGSEGV) fails the same way, and a SIGKILL leaves no exit record at all: its messages just stop.

The culprit, in order of evidence:
1. the earliest own failure on record: an exception that is not a peer-connection error, or a
   signal other than the ones that stop a job from outside (SIGTERM, SIGINT, SIGHUP);
2. else the first rank to go silent: no exit record, its last message before the first failure
   on record, and nothing from it for :func:`silent_after_s` (a live rank beats every second);
   a rank the world size says exists but that never sent anything went silent first of all;
3. else the earliest exception (every one is a peer-connection error).
Every other failed rank is a follower. Ranks that all stopped on SIGTERM-like signals, with none
silent, were stopped from outside (a cancelled job): no verdict. An exit record's time is exact,
a silent rank's death is known only to within a heartbeat, which is why (1) comes before (2).

Pure functions over :class:`~rankscope.stream_processors.shard_summary.Failure` records; the rank_failed rule in
stream_processors/monitor.py publishes the verdict.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rankscope.config import Settings
from rankscope.protocol.alerts import StackGroup
from rankscope.stream_processors.shard_summary import Failure, Row

# Messages of the errors a rank sees when a peer's process went away (gloo, NCCL, c10d, sockets).
PEER_ERROR_MARKERS = (
    "connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
    "socket closed", "read error", "write error", "communicator was aborted", "ncclremoteerror",
    "remote process exited", "peer closed", "distnetworkerror", "connection was forcibly closed",
)
# Signals that stop a job from outside (the launcher tearing the job down, a cancel, a lost terminal).
STOP_SIGNALS = frozenset({"SIGTERM", "SIGINT", "SIGHUP"})
SILENT = "silent"               # Failure.reason of a rank that went silent with no exit record
SILENT_DETAIL = "no exit record"
MAX_FOLLOWERS = 64


def is_peer_error(f: Failure) -> bool:
    """True when the failure looks caused by another rank: a stop signal (SIGTERM, SIGINT, SIGHUP),
    or a peer-connection error. A rank's own signal (SIGSEGV, SIGKILL, SIGABRT) and silence are not."""
    if f.reason == "signal":
        return signal_name(f) in STOP_SIGNALS
    if f.reason != "exception":
        return False
    text = f"{f.exc_type}: {f.detail}".lower()
    return any(m in text for m in PEER_ERROR_MARKERS)


def signal_name(f: Failure) -> str:
    """ "SIGSEGV" from a signal exit's detail ("SIGSEGV", "signal SIGSEGV (11)"), else the detail."""
    for word in f.detail.translate(str.maketrans("().:,", "     ")).split():
        if word.upper().startswith("SIG") and word[3:].isalpha():
            return word.upper()
    return f.detail.strip()


def silent_after_s(settings: Settings) -> float:
    """How long a rank must have sent nothing to count as gone (several missed heartbeats)."""
    return max(settings.dead_after_s, 3 * settings.heartbeat_s)


def silent_ranks(rows: Iterable[Row], first_failure_ns: int, now_s: float, settings: Settings,
                 frontier_s: Mapping[int, float] | None = None) -> tuple[list[Failure], bool, list[Failure]]:
    """The ranks that went silent before the first failure on record, as :class:`Failure` records
    (reason :data:`SILENT`, time = their last message); whether some rank may still turn out
    silent before it (its last message also precedes the first failure, but for less than
    :func:`silent_after_s`); and the ranks that went silent after it (peers the launcher killed
    before their exit record was out: followers, never culprits). Silence is judged at each rank's
    shard frontier (``frontier_s``, as the dead-rank rule does) when given: a rank whose partition is
    read late is not taken for silent."""
    silent, pending, later = [], False, []
    frontier = frontier_s or {}
    for r in rows:
        if r.exit_reason or r.hb_ns <= 0:
            continue
        gone = min(now_s, frontier.get(r.rank, now_s)) - r.hb_ns / 1e9 > silent_after_s(settings)
        if r.hb_ns > first_failure_ns:
            if gone and first_failure_ns:
                later.append(_silent(r))
        elif gone:
            silent.append(_silent(r))
        else:
            pending = True
    return silent, pending, later


def _silent(r: Row) -> Failure:
    return Failure(rank=r.rank, host=r.host, pid=r.pid, exit_ns=r.hb_ns, step=r.last_step, reason=SILENT,
                   exc_type="", detail=SILENT_DETAIL, frames=[])


def explained_by_failure(r: Row, first_failure_ns: int, settings: Settings) -> bool:
    """Whether a rank gone silent belongs to the failure that began at ``first_failure_ns`` (it
    spoke within :func:`silent_after_s` of it, or later): the rank_failed incident names it, as
    its culprit or a follower, not a dead-rank incident of its own."""
    return bool(first_failure_ns) and r.hb_ns >= first_failure_ns - silent_after_s(settings) * 1e9


NEVER_REPORTED = "never reported: no message from it at all"


def never_reported(rows: Mapping[int, Row] | Iterable[int], world_size: int) -> list[Failure]:
    """The ranks the world size says exist but that sent nothing (killed before their first
    heartbeat), as silent :class:`Failure` records dated 0: gone before any failure on record."""
    known = set(rows)
    return [Failure(rank=r, host="", pid=0, exit_ns=0, step=-1, reason=SILENT, exc_type="", detail=NEVER_REPORTED,
                    frames=[]) for r in range(max(0, world_size)) if r not in known][:MAX_FOLLOWERS]


@dataclass(frozen=True)
class Verdict:
    culprit: Failure
    followers: list[Failure]     # every other failed rank, first to fail first


def attribute(failures: list[Failure], silent: list[Failure] | None = None,
              later: list[Failure] | None = None) -> Verdict | None:
    """The first failing rank and its followers (module docstring: the order of evidence).

    ``failures`` are the exit records of ranks that exited with an exception or a signal;
    ``silent`` the ranks :func:`silent_ranks` found gone before the first failure, ``later`` those
    gone after it (followers only). None when there is no culprit: no failure on record, or ranks
    that all stopped on stop signals with none silent (a cancelled job)."""
    if not failures:
        return None
    ordered = sorted(failures, key=lambda f: (f.exit_ns, f.rank))
    own = [f for f in ordered if not is_peer_error(f)]
    gone = sorted(silent or [], key=lambda f: (f.exit_ns, f.rank))
    exceptions = [f for f in ordered if f.reason == "exception"]
    culprits = own or gone or exceptions
    if not culprits:
        return None
    culprit = culprits[0]
    # Every other failed or silent rank follows (a lost node takes all its ranks; the launcher kills
    # the peers of a failed rank, some before their exit record is out).
    others = sorted(ordered + gone + list(later or []), key=lambda f: (f.exit_ns, f.rank))
    return Verdict(culprit=culprit, followers=[f for f in others if f.rank != culprit.rank])


def describe(f: Failure) -> str:
    """ "RuntimeError: CUDA error: an illegal memory access", "signal SIGSEGV" or
    "silent: no exit record"."""
    if f.reason == "exception":
        if f.exc_type and not f.detail.startswith(f.exc_type):
            return f"{f.exc_type}: {f.detail}" if f.detail else f.exc_type
        return f.detail or "exception"
    if f.reason == "signal":
        return f"signal {signal_name(f)}".strip()
    if f.reason == SILENT:
        return f"{SILENT}: {f.detail or SILENT_DETAIL}"
    return f"{f.reason} {f.detail}".strip()


def ended(f: Failure) -> str:
    """How a failed rank ended: "exception", its signal ("SIGSEGV") or "silent: no exit record"."""
    if f.reason == "signal":
        return signal_name(f)
    if f.reason == SILENT:
        return f"{SILENT}: {SILENT_DETAIL}"
    return f.reason


def failing_step(f: Failure) -> int:
    """The step a rank was in when it failed (exit records carry its last completed step)."""
    return f.step + 1


def alert_fields(job: str, v: Verdict) -> tuple[str, list[StackGroup], dict[str, Any]]:
    """The rank_failed alert's summary, stack groups (the culprit's traceback) and details."""
    c = v.culprit
    more = f"; {len(v.followers)} rank{'s' if len(v.followers) > 1 else ''} failed after it" if v.followers else ""
    how = describe(c)[:300] + (" (SIGKILL, the OOM killer or node loss)" if c.reason == SILENT else "")
    summary = f"job {job}: rank {c.rank} failed first, in step {failing_step(c)}: {how}{more}"
    groups = [StackGroup(ranks=[c.rank], thread="MainThread", frames=list(c.frames), waiting_in_collective=False,
                         count=1)] if c.frames else []
    details = {"first_rank": c.rank, "last_completed_step": c.step, "host": c.host, "pid": c.pid, "reason": c.reason,
               "ended": ended(c), "exc_type": c.exc_type,
               "message": c.detail, "frames": list(c.frames), "failed_ns": c.exit_ns,
               "followers": [f.rank for f in v.followers[:MAX_FOLLOWERS]], "follower_count": len(v.followers),
               "follower_errors": sorted({describe(f)[:120] for f in v.followers[:MAX_FOLLOWERS]})[:8]}
    return summary, groups, details


def grace_s(settings: Settings) -> float:
    """How long after the first failure the verdict waits for the other shards' failures to arrive."""
    return max(3.0, 2 * settings.scan_interval_s)
