"""The one slow-worker statistic: each worker's robust z against its peers (leave-one-out).

Used by the diagnosis report (``report.py``: slow workers and abnormal workers of every section),
by the live slow-rank rule (``slow_rule.py``: the busy-time evidence of its alerts) and by stage
one's per-rank ``busy_z`` (``shard.py``), so that a rank the live rule calls slow and a rank a
report calls slow are judged by the same number. Pure, no pandas needed.

Definition, for worker ``r`` with value ``v_r`` among values ``V``:

- baseline ``b_r`` = median of ``V`` without ``v_r`` (a slow worker must not move its own
  baseline: in a small job it would hide inside the spread it causes);
- scale ``s_r`` = max(1.4826 x median of ``|v - b_r|`` over ``V`` without ``v_r``,
  5% of ``|b_r|``, ``abs_floor``);
- ``z_r = (v_r - b_r) / s_r``.

Computed in O(n log n): removing one value moves a sorted list's median by at most one place, so
there are at most three distinct baselines.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import NamedTuple, TypeVar

__all__ = ["PeerZ", "flag_slow", "peer_z"]

K = TypeVar("K", bound=Hashable)
MAD_TO_SIGMA = 1.4826
REL_SCALE_FLOOR = 0.05


class PeerZ(NamedTuple):
    """A worker's robust z against its peers and the peers' median (``baseline``, same unit as the values)."""

    z: float
    baseline: float


def peer_z(values: Mapping[K, float], abs_floor: float = 1000.0) -> dict[K, PeerZ]:
    """:class:`PeerZ` of every key of ``values`` (see the module docstring).

    ``abs_floor`` is the smallest scale, in the values' unit (default 1000: 1 µs for ns values).
    With fewer than 2 values every z is 0 and the baseline is the value itself.
    """
    if abs_floor <= 0:
        raise ValueError(f"abs_floor must be > 0, got {abs_floor}")
    order = sorted(values, key=lambda k: values[k])
    vals = [float(values[k]) for k in order]
    if len(vals) < 2:
        return {k: PeerZ(0.0, float(values[k])) for k in order}
    out: dict[K, PeerZ] = {}
    deviations: dict[float, tuple[list[float], dict[int, int]]] = {}  # per baseline: sorted |v - b|, places
    for p, k in enumerate(order):
        base = _median_without(vals, p)
        if base not in deviations:
            devs = sorted((abs(v - base), i) for i, v in enumerate(vals))
            deviations[base] = ([d for d, _ in devs], {i: j for j, (_, i) in enumerate(devs)})
        devs_sorted, place = deviations[base]
        mad = _median_without(devs_sorted, place[p])
        scale = max(MAD_TO_SIGMA * mad, REL_SCALE_FLOOR * abs(base), abs_floor)
        out[k] = PeerZ((vals[p] - base) / scale, base)
    return out


def flag_slow(values: Mapping[K, float], z_min: float, min_rel: float, abs_floor: float = 1000.0
              ) -> dict[K, tuple[float, bool]]:
    """``(z, flagged)`` per key: flagged when z > ``z_min`` and the value is more than ``min_rel``
    (a fraction) above its baseline. This is the slow-worker test of reports and live rule."""
    return {k: (pz.z, pz.z > z_min and float(values[k]) > pz.baseline * (1 + min_rel))
            for k, pz in peer_z(values, abs_floor).items()}


def _median_without(sorted_vals: list[float], pos: int) -> float:
    """Median of ``sorted_vals`` (at least 2) without the value at ``pos``."""
    m = len(sorted_vals) - 1

    def at(k: int) -> float:
        return sorted_vals[k] if k < pos else sorted_vals[k + 1]

    return at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2
