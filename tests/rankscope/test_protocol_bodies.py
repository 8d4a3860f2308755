"""The body checks of rankscope/protocol beyond decode's envelope: hw samples, worker stats, flight
records and Flight Recorder dumps, and the processors' shard summaries with their bounds."""

from __future__ import annotations

from typing import Any

import pytest

from rankscope.protocol import shard
from rankscope.protocol.errors import WireError
from rankscope.protocol.flight import check_flight, dump_of
from rankscope.protocol.hardware import check_hw
from rankscope.protocol.stats import check_stats


def refused(check: Any, body: Any, match: str = "") -> None:
    with pytest.raises(WireError, match=match) as ei:
        check(body)
    assert ei.value.reason == "bad_body"


HW = {"ts_ns": [1, 2], "device": [0, -1], "metrics": {"util": [1.5, None], "mem": [3, 4]}}


def test_hw_samples_are_checked_value_by_value() -> None:
    check_hw(HW)
    check_hw({"ts_ns": [], "device": [], "metrics": {}})
    refused(check_hw, {**HW, "device": [0]}, "hw.device has 1 values, ts_ns has 2")
    refused(check_hw, {**HW, "device": [0, 2**31]}, "hw.device=2147483648 out of range")
    refused(check_hw, {**HW, "ts_ns": [1, True]}, "hw.ts_ns is bool")
    refused(check_hw, {**HW, "metrics": {"util": [1.0]}}, r"hw.metrics\['util'\] must be a list of 2 values")
    refused(check_hw, {**HW, "metrics": {"util": [1.0, True]}}, r"hw.metrics\['util'\] is bool, expected number")
    refused(check_hw, {**HW, "metrics": {"util": ["x", 1.0]}}, "is str")
    refused(check_hw, {**HW, "metrics": {7: [1.0, 2.0]}}, "must be a list")


ENTRY = {"rank": 1, "ts_ns": 5, "step": 2, "window_steps": 3, "median_step_ns": 4, "p95_step_ns": 5,
         "median_busy_ns": 6, "median_comm_ns": 7, "busy_z": 1, "state": "running"}


def test_stats_entries_are_checked_with_their_column_bounds() -> None:
    check_stats({"ranks": [ENTRY, {**ENTRY, "busy_z": 0.5}]})
    refused(check_stats, {"ranks": [ENTRY, {**ENTRY, "rank": True}]}, r"stats.ranks\[1\].rank is bool")
    refused(check_stats, {"ranks": [{**ENTRY, "rank": 2**40}]}, r"stats.ranks\[0\].rank=1099511627776 out of range")
    refused(check_stats, {"ranks": [{**ENTRY, "step": 2**63}]}, "out of range")
    refused(check_stats, {"ranks": [{k: v for k, v in ENTRY.items() if k != "state"}]}, r"stats.ranks\[0\].state missing")
    refused(check_stats, {"ranks": [{**ENTRY, "busy_z": "x"}]}, "expected number")
    refused(check_stats, {"ranks": [[1, 2]]}, r"stats.ranks\[0\] is list")


def test_flight_steps_are_integer_rows_and_a_dump_is_a_json_object_with_entries() -> None:
    check_flight({"steps": [[1, 2, 3, 4], []], "stacks": None, "reason": "hang"})
    refused(check_flight, {"steps": [["not", "ints"]], "stacks": None, "reason": "hang"}, "flight.steps")
    refused(check_flight, {"steps": [[2**63]], "stacks": None, "reason": "hang"}, "out of range")
    assert dump_of({"dump": '{"entries": []}'}) == {"entries": []}
    refused(dump_of, {"dump": "{not json"}, "not JSON")
    refused(dump_of, {"dump": "[]"}, "no entries list")


ROW = [3, "h", 7, 10, 100, 200, 0.5, 1000, 900, 8, "", -1, "", "", 0]
AGG = {**{name: 0 for name in shard.AGG_INTS}, "step_hist": {}, "busy_hist": {}}
SUMMARY = {"shard": 0, "ts_ns": 1, "agg": AGG, "rows": [ROW], "stacks": {"ab": [2, True, ["f.py:1 g"], [3]]},
           "failures": [[3, "h", 7, 5, 10, "exception", "E", "boom", ["a.py:1 f"]]]}


def test_a_shard_summary_is_checked_whole() -> None:
    shard.check_shard(SUMMARY)
    shard.check_summary(SUMMARY)
    refused(shard.check_summary, {**SUMMARY, "rows": [ROW[:-1]]}, "shard.rows entry has the wrong shape")
    refused(shard.check_summary, {**SUMMARY, "rows": [[True, *ROW[1:]]]}, "shard.rows value True")
    refused(shard.check_summary, {**SUMMARY, "stacks": {"ab": [2, True, ["f"], ["x"]]}}, "shard.stacks")
    refused(shard.check_summary, {**SUMMARY, "failures": "x"}, "shard.failures is not a list")
    refused(shard.check_summary, {**SUMMARY, "agg": {**AGG, "live": None}}, "shard.agg.live")
    refused(shard.check_summary, {**SUMMARY, "agg": {k: v for k, v in AGG.items() if k != "busy_hist"}},
            "shard.agg.busy_hist missing")


def test_a_shard_summarys_rule_rows_are_bounded() -> None:
    rows = [[s, 10, 1, -1, 5] for s in range(shard.MAX_ARRIVAL_ROWS)]
    assert len(shard.arrival_rows({"arrivals": rows})) == shard.MAX_ARRIVAL_ROWS
    refused(shard.arrival_rows, {"arrivals": [*rows, [0, 0, 0, 0, 0]]}, "at most 2048 rows")
    refused(shard.arrival_rows, {"arrivals": [[1, 2, 3, 4, True]]}, "is not 5 integers")
    group = {"passed": 5, "members": 2, "size": 2, "reached_max": 6, "rows": [[5, 1, 0, -1, 9, 77]],
             "lowest": [[0, 5]], "mismatches": [], "labels": {}, "top_label": ""}
    groups = {str(i): group for i in range(shard.MAX_COLL_GROUPS)}
    assert shard.coll_groups({"coll": groups}) == groups
    refused(shard.coll_groups, {"coll": {**groups, "x": group}}, "at most 4 groups")
    refused(shard.coll_groups, {"coll": {"0": {**group, "rows": [[5, 1, 0, -1, 9, 77]] * (shard.MAX_COLL_ROWS + 1)}}},
            "wrong shape")
    refused(shard.coll_groups, {"coll": {"0": {**group, "mismatches": [[1, []]] * (shard.MAX_COLL_MISMATCHES + 1)}}},
            "wrong shape")


def test_a_shard_summarys_cpu_waits_are_bounded() -> None:
    top = [[r, 900 - r, 400] for r in range(shard.MAX_CPU_WAIT_TOP)]
    hist, rows = shard.cpu_wait({"cpu_wait": {"hist": {0: 30, 18: 2}, "top": top}})
    assert hist == {0: 30, 18: 2} and rows[0] == (0, 900, 400)
    assert shard.cpu_wait({}) == ({}, [])
    refused(shard.cpu_wait, {"cpu_wait": {"hist": {}, "top": [*top, [99, 1, 1]]}}, "at most 16 rows")
    refused(shard.cpu_wait, {"cpu_wait": {"hist": {}, "top": [[1, 1001, 0]]}}, "per mille")
    refused(shard.cpu_wait, {"cpu_wait": {"hist": {21: 1}, "top": []}}, "bins 0..20")
    refused(shard.cpu_wait, {"cpu_wait": {"hist": {0: 0}, "top": []}}, "bins 0..20")
    refused(shard.cpu_wait, {"cpu_wait": [1]}, "hist")


def test_profile_digests_are_bounded() -> None:
    ok = {"names": ["a;b"], "ranks": [[1, 5, [0], [500]]]}
    shard.check_profiles(ok)
    refused(shard.check_profiles, {"names": ["a"], "ranks": [[1, 5, [0] * 9, [1] * 9]]}, "shard.profiles.ranks entries")
    refused(shard.check_profiles, {"names": ["a"], "ranks": [[1, 5, [0], [1001]]]}, "a share outside 0..1000")
