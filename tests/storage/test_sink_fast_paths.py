"""The sink's fast paths give the same rows as the checked paths they stand in for."""

from __future__ import annotations

from typing import Any

import pytest

from rankscope.storage.columns import TABLE_COLUMNS, Columns, InvalidMessage
from rankscope.storage.rows import hw_columns, hw_columns_checked, stats_rows, stats_tuples
from rankscope.wire import Envelope


def _env(kind: str, body: dict[str, Any]) -> Envelope:
    return Envelope(kind=kind, job="j", rank=3, host="h", pid=7, seq=1, sent_ns=10, body=body)


@pytest.mark.parametrize("metrics", [
    {"util": [1.5, None], "mem": [3, 4], "none": [None, None]},
    {"util": [1.5, 2.5]},
    {"util": [True, 1.0]},        # bool: rejected by the checked path
    {"util": ["x", 1.0]},
    {"util": [1.0]},              # wrong length
])
def test_hw_fast_path_matches_checked(metrics: dict[str, Any]) -> None:
    check_hw_paths_agree({"ts_ns": [1, 2], "device": [0, 1], "metrics": metrics})


@pytest.mark.parametrize("metrics", [
    {"util": [1.5], "mem": [3], "none": [None]},
    {"util": [2**53]},
    {"util": [True]},
    {"util": ["x"]},
    {"util": [1.0, 2.0]},         # wrong length
    {"util": 1.0},
    {7: [1.0]},
    {},
])
def test_hw_fast_path_of_one_sample_matches_checked(metrics: dict[str, Any]) -> None:
    check_hw_paths_agree({"ts_ns": [5], "device": [2], "metrics": metrics})


def check_hw_paths_agree(body: dict[str, Any]) -> None:
    fast, checked = Columns(TABLE_COLUMNS["hw_samples"]), Columns(TABLE_COLUMNS["hw_samples"])
    errors = []
    for fn, cols in ((hw_columns, fast), (hw_columns_checked, checked)):
        try:
            fn(_env("hw", body), cols)
            errors.append(None)
        except InvalidMessage as e:
            errors.append(str(e))
    assert errors[0] == errors[1]
    assert fast.data == checked.data and fast.rows == checked.rows


def test_stats_tuples_match_stats_rows_and_reject_alike() -> None:
    entry = {"rank": 1, "ts_ns": 5, "step": 2, "window_steps": 3, "median_step_ns": 4, "p95_step_ns": 5,
             "median_busy_ns": 6, "median_comm_ns": 7, "busy_z": 1, "state": "running"}
    e = _env("stats", {"ranks": [entry, {**entry, "rank": 2, "busy_z": 0.5}]})
    names = TABLE_COLUMNS["worker_stats"]
    assert stats_tuples(e) == [tuple(r[c] for c in names) for r in stats_rows(e)]
    assert type(stats_tuples(e)[0][names.index("busy_z")]) is float
    for bad in ({**entry, "rank": True}, {**entry, "rank": 2**40}, {k: v for k, v in entry.items() if k != "state"}):
        b = _env("stats", {"ranks": [entry, bad]})
        with pytest.raises(InvalidMessage) as fast:
            stats_tuples(b)
        with pytest.raises(InvalidMessage) as checked:
            stats_rows(b)
        assert str(fast.value) == str(checked.value)
