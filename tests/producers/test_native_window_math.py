"""The C++ window-conversion kernels (producers/native/window_math.h) give exactly what their numpy
twins in producers/trace_events.py give, on random windows full of ties, zero durations, improper
overlaps, unsorted rows and garbage call-path parents. ``make test`` builds the module first."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from rankscope.config import Settings
from rankscope.producers.native_extract import load_native
from rankscope.producers.trace_events import (
    ANNOTATION,
    COLLECTIVE,
    CPU_OP,
    KERNEL,
    MEMCPY,
    PYTHON,
    RUNTIME,
    call_paths,
    exclusive_times,
    group_stats,
    summarize,
)


@pytest.fixture(scope="module")
def native() -> Any:
    mod = load_native(Settings.from_env().cache_dir)
    assert mod is not None, "the C++ module is not built for this torch: run `make native` (rankscope build-native)"
    return mod


def random_window(rng: np.random.Generator, n: int, *, presorted: bool) -> dict[str, Any]:
    """A columnar window of ``n`` random events on 3 host threads and 2 devices, times on a coarse grid
    (many equal starts and ends), with nested stacks, improper overlaps and zero durations."""
    host_cats = [PYTHON, CPU_OP, RUNTIME, COLLECTIVE, ANNOTATION]
    dev_cats = [KERNEL, MEMCPY, COLLECTIVE, ANNOTATION]
    on_dev = rng.random(n) < 0.3
    cat = np.where(on_dev, rng.choice(dev_cats, n), rng.choice(host_cats, n)).astype(np.int64)
    start = rng.integers(0, 60, n).astype(np.int64) * 10
    dur = rng.choice([0, 10, 20, 50, 100, 300], n).astype(np.int64)
    nested = rng.random(n) < 0.5       # half the events sit inside an earlier one (a call stack)
    for i in np.flatnonzero(nested)[1:]:
        p = int(rng.integers(0, i))
        if dur[p] > 0:
            start[i] = start[p] + int(rng.integers(0, dur[p] + 1))
            dur[i] = int(rng.integers(0, start[p] + dur[p] - start[i] + 1))
    dup = np.flatnonzero(rng.random(n) < 0.1)        # the same interval again, another category
    src = rng.integers(0, n, len(dup))
    start[dup], dur[dup] = start[src], dur[src]
    device = np.where(on_dev, rng.integers(0, 2, n), -1).astype(np.int64)
    tid = np.where(on_dev, -1, rng.choice([11, 12, 13], n)).astype(np.int64)
    name = rng.integers(0, 8, n).astype(np.int64)
    path = np.where(cat == PYTHON, rng.integers(-1, 5, n), -1).astype(np.int64)
    cols = {"category": cat, "start_ns": start, "dur_ns": dur, "device": device, "tid": tid, "name": name,
            "path": path}
    if presorted:
        order = np.lexsort((-dur, start))
        cols = {k: v[order] for k, v in cols.items()}
    return {"window_id": "w", "first_step": 0, "last_step": 0, "start_ns": 0, "end_ns": 1000,
            "names": [f"f{i}" for i in range(8)], "paths": [[-1, 0], [0, 1], [1, 2], [-1, 3], [3, 4]],
            "events": cols}


@pytest.mark.parametrize("seed", range(40))
def test_exclusive_times_match(native: Any, seed: int) -> None:
    rng = np.random.default_rng(seed)
    col = random_window(rng, int(rng.integers(1, 400)), presorted=seed % 2 == 0)
    expected = exclusive_times(col)
    got = exclusive_times(col, native)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("seed", range(20))
def test_summaries_match(native: Any, seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    col = random_window(rng, int(rng.integers(1, 300)), presorted=True)
    assert summarize(col, native=native) == summarize(col)
    assert summarize(col, python_min_frac=0.05, native=native) == summarize(col, python_min_frac=0.05)


@pytest.mark.parametrize("seed", range(20))
def test_group_stats_match(native: Any, seed: int) -> None:
    rng = np.random.default_rng(200 + seed)
    n = int(rng.integers(1, 500))
    key = rng.integers(0, 30, n).astype(np.int64) << 40
    dur = rng.integers(0, 7, n).astype(np.int64) * int(rng.integers(1, 10**9))
    excl = rng.integers(0, 100, n).astype(np.int64)
    for got, expected in zip(native.group_stats(key, dur, excl), group_stats(key, dur, excl), strict=True):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("seed", range(30))
def test_call_paths_match(native: Any, seed: int) -> None:
    rng = np.random.default_rng(300 + seed)
    n = int(rng.integers(1, 300))
    ids = np.arange(n, dtype=np.int64) * 2 + 5
    if seed % 3 == 0:
        ids = rng.permutation(ids)
    if seed % 3 == 1:
        ids = rng.integers(0, n, n).astype(np.int64)        # duplicate ids: the lowest row wins
    # Parents: mostly an earlier frame, sometimes none, a later frame (no cycles), or a missing id.
    parents = np.where(rng.random(n) < 0.8, ids[rng.integers(0, n, n)], rng.choice([-1, -7, 10**6], n))
    names = rng.integers(0, 12, n).astype(np.int64)
    raw = SimpleNamespace(py={"py_id": ids.tolist(), "py_parent": parents.tolist()})
    path_py, table_py = call_paths(raw, names)
    path_c, table_c = call_paths(raw, names, native)
    np.testing.assert_array_equal(path_c, path_py)
    assert table_c == table_py


def test_kernels_reject_columns_of_different_lengths(native: Any) -> None:
    a, b = np.zeros(3, dtype=np.int64), np.zeros(2, dtype=np.int64)
    with pytest.raises(ValueError, match="one length"):
        native.group_stats(a, b, a)
    with pytest.raises(ValueError, match="one length"):
        native.call_paths(a, a, b)
