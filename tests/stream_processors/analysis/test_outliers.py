"""The one slow-worker statistic (leave-one-out robust z), pure."""

from __future__ import annotations

import random
import statistics

import pytest

from rankscope.stream_processors.analysis.outliers import flag_slow, peer_z


def naive(values: dict[int, float], floor: float = 1000.0) -> dict[int, tuple[float, float]]:
    out = {}
    for r, v in values.items():
        others = [x for k, x in values.items() if k != r]
        base = statistics.median(others)
        mad = statistics.median(abs(x - base) for x in others)
        out[r] = ((v - base) / max(1.4826 * mad, 0.05 * abs(base), floor), base)
    return out


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 17])
def test_equals_the_definition(n: int) -> None:
    rng = random.Random(n)
    values = {r: rng.uniform(1e6, 2e6) for r in range(n)}
    values[n - 1] *= 3
    got = peer_z(values)
    for r, (z, base) in naive(values).items():
        assert got[r].z == pytest.approx(z) and got[r].baseline == pytest.approx(base)


def test_a_slow_rank_does_not_hide_in_its_own_spread() -> None:
    """Three ranks, one at twice the others: with itself in the baseline its z would be about 1."""
    flags = flag_slow({0: 1.0e6, 1: 1.02e6, 2: 2.0e6}, z_min=4.0, min_rel=0.25)
    assert flags[2][1] and not flags[0][1] and not flags[1][1]


def test_small_inputs_and_bad_floor() -> None:
    assert peer_z({}) == {}
    assert peer_z({7: 5.0}) == {7: (0.0, 5.0)}
    with pytest.raises(ValueError, match="abs_floor"):
        peer_z({0: 1.0}, abs_floor=0)
