"""Whether a slow rank is starved of CPU: how readily its training thread gets a CPU against its peers'.

Each shard summary carries its live ranks' wait shares over their last 30 s (a histogram, and the
ranks that waited most: rankscope/protocol/shard.py ``cpu_wait``). A rank's wait share is the part
of the time its training thread was ready to run (on a CPU, or runnable and waiting for one: the
kernel's run-queue wait) that it spent waiting. A share of ready time, not of wall time: a compute
straggler is ready to run far longer than its peers (they sit blocked in the collective, waiting for
it), so on a busy host it waits longer in seconds, but gets a CPU as readily as they do.

A slow rank is *starved* when it waited at least half of its ready time and got a CPU at most half
as readily as its peers' median: ``1 - w <= (1 - w_peers) / 2``. It is held back by its host
(data-loader workers, another process on its cores, more ranks than cores), not by its own work or
its device.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

from rankscope.protocol.shard import CPU_WAIT_BIN, MAX_SHARE
from rankscope.stream_processors.rank_state import CPU_WAIT_WINDOW_S

STARVED_MIN_SHARE = 0.5       # a starved rank waited at least this share of its ready time ...
STARVED_READINESS = 0.5       # ... and got a CPU at most this fraction as readily as its peers' median
EVIDENCE = (f"over the last {CPU_WAIT_WINDOW_S:.0f} s, the share of the time each rank's training thread was "
            "ready to run that it waited for a CPU (the kernel's run-queue wait against its CPU time, "
            "/proc/<pid>/task/<tid>/schedstat); cpu_share: its CPU time as a share of the whole time")

Part = tuple[dict[int, int], list[tuple[int, int, int]]]


def merge(parts: Iterable[Part]) -> tuple[dict[int, int], dict[int, tuple[int, int]]]:
    """The shards' parts as one histogram and one map rank -> (wait, cpu) per mille."""
    hist: dict[int, int] = {}
    top: dict[int, tuple[int, int]] = {}
    for h, rows in parts:
        for b, n in h.items():
            hist[b] = hist.get(b, 0) + n
        for rank, wait, cpu in rows:
            top[rank] = (wait, cpu)
    return hist, top


def peers_median(hist: dict[int, int], top: dict[int, tuple[int, int]], named: set[int]) -> float | None:
    """The median wait share of the ranks not in ``named``: exact when every rank is in ``top``, else
    the centre of the histogram bin that holds it (bins are 5% wide). None without peers."""
    total = sum(hist.values())
    if total == len(top):
        peers = [w for r, (w, _) in top.items() if r not in named]
        return statistics.median(peers) / MAX_SHARE if peers else None
    left = dict(hist)
    for r in named:
        if r in top:
            b = top[r][0] // CPU_WAIT_BIN
            if left.get(b, 0) > 0:
                left[b] -= 1
    n = sum(left.values())
    if n <= 0:
        return None
    seen, target = 0, (n - 1) / 2
    for b in sorted(left):
        seen += left[b]
        if seen > target:
            return (b + 0.5) * CPU_WAIT_BIN / MAX_SHARE
    return None


def evidence(parts: Iterable[Part], slow: list[int]) -> dict[str, Any] | None:
    """The alert details on the slow ranks' CPU waits: each slow rank's wait and CPU share (those the
    shards listed), the peers' median wait, and ``starved``, the slow ranks that waited far longer
    than their peers. None when no slow rank's wait is known."""
    hist, top = merge(parts)
    known = [r for r in slow if r in top]
    if not known:
        return None
    median = peers_median(hist, top, set(slow))
    out: dict[str, Any] = {
        "wait_share": {str(r): round(top[r][0] / MAX_SHARE, 3) for r in known},
        "cpu_share": {str(r): round(top[r][1] / MAX_SHARE, 3) for r in known},
        "window_s": CPU_WAIT_WINDOW_S, "evidence": EVIDENCE,
    }
    if median is not None:
        out["peers_median_wait_share"] = round(median, 3)
        out["starved"] = [r for r in known if starved(top[r][0] / MAX_SHARE, median)]
    return out


def starved(wait: float, peers: float) -> bool:
    """A rank that waited at least half of its ready time and got a CPU at most half as readily as
    its peers' median (``wait`` and ``peers`` are wait shares of ready time)."""
    return wait >= STARVED_MIN_SHARE and 1.0 - wait <= STARVED_READINESS * (1.0 - peers)
