"""Packed integer columns (rankscope/packed.py): narrowest types, round trips, malformed input."""

from __future__ import annotations

import numpy as np
import pytest

from rankscope.packed import narrowest_type, pack_int, unpack_int_columns


@pytest.mark.parametrize(("values", "want"), [
    ([], "i1"), ([-128, 127], "i1"), ([128], "i2"), ([-32769], "i4"), ([2**31], "i8"), ([-(2**63), 2**63 - 1], "i8"),
])
def test_narrowest_type(values: list[int], want: str) -> None:
    assert narrowest_type(np.array(values, dtype=np.int64)) == want


def test_round_trip_and_list_form() -> None:
    cols = {"a": np.array([1, -1, 300], dtype=np.int64), "b": np.array([2**40, 0, -5], dtype=np.int64)}
    types, data = {}, {}
    for k, v in cols.items():
        types[k], data[k] = pack_int(v)
    assert types == {"a": "i2", "b": "i8"} and len(data["a"]) == 6
    n, got = unpack_int_columns(data, types, ("a", "b"))
    assert n == 3 and all(np.array_equal(got[k], cols[k]) and got[k].dtype == np.int64 for k in cols)
    n, got = unpack_int_columns({"a": [1, 2], "b": [3, 4]}, None, ("a", "b"))   # older list form
    assert n == 2 and got["b"].tolist() == [3, 4]


@pytest.mark.parametrize(("columns", "types", "match"), [
    ({"a": b"\x00\x01\x02"}, {"a": "i2"}, "whole number"),
    ({"a": b"\x00"}, {"a": "u1"}, "column type"),
    ({"a": b"\x00"}, None, "column type"),
    ({"a": [1, "x"]}, None, "non-integer"),
    ({"a": [1, True]}, None, "non-integer"),
    ({"a": [2**70]}, None, "int64"),
    ({"a": 5}, None, "missing"),
    ({}, None, "missing"),
    ({"a": [1], "b": [1, 2]}, None, "expected 1"),
])
def test_malformed_columns_are_named(columns: dict, types: dict | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        unpack_int_columns(columns, types, tuple(columns) or ("a",))
