"""Packed integer columns: numpy arrays on the wire as little-endian bytes of the narrowest type.

A trace chunk carries ~10 integer columns per event. As msgpack int lists they cost one Python object
per value to build and to read; as bytes they are one ``tobytes()`` / ``np.frombuffer`` per column
and about as small (each column uses the narrowest of int8/16/32/64 that holds its values; Kafka's
compression, zstd by default, does the rest).

Wire form: ``{"column_types": {column: "i1"|"i2"|"i4"|"i8"}, "events": {column: bytes, ...}}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

INT_TYPES = ("i1", "i2", "i4", "i8")
_BOUNDS = {t: (int(np.iinfo(np.dtype(t)).min), int(np.iinfo(np.dtype(t)).max)) for t in INT_TYPES}


def narrowest_type(values: np.ndarray) -> str:
    """The narrowest of ``INT_TYPES`` that holds every value ("i1" for an empty column)."""
    if not len(values):
        return "i1"
    lo, hi = int(values.min()), int(values.max())
    for t in INT_TYPES:
        a, b = _BOUNDS[t]
        if a <= lo and hi <= b:
            return t
    raise ValueError(f"values outside int64: {lo}..{hi}")


def pack_int(values: np.ndarray, type_code: str | None = None) -> tuple[str, bytes]:
    """(type code, little-endian bytes) of an integer array, narrowest type unless given."""
    t = type_code or narrowest_type(values)
    return t, np.ascontiguousarray(values, dtype="<" + t).tobytes()


def unpack_int_columns(columns: Mapping[str, Any], types: Mapping[str, Any] | None, names: tuple[str, ...]
                       ) -> tuple[int, dict[str, np.ndarray]]:
    """Decode ``names`` from ``columns`` into int64 arrays of one common length.

    A column is either packed bytes (its type in ``types``) or a list of ints (the older list form,
    still accepted). Raises ValueError naming the column on a missing column, an unknown type, a
    byte length that is not a whole number of values, a non-integer list value, or unequal lengths.
    """
    out: dict[str, np.ndarray] = {}
    n: int | None = None
    for name in names:
        v = columns.get(name) if isinstance(columns, Mapping) else None
        if isinstance(v, (bytes, bytearray)):
            t = types.get(name) if isinstance(types, Mapping) else None
            if t not in _BOUNDS:
                raise ValueError(f"{name}: column type {t!r} is not one of {list(INT_TYPES)}")
            size = np.dtype(t).itemsize
            if len(v) % size:
                raise ValueError(f"{name}: {len(v)} bytes is not a whole number of {t} values")
            arr = np.frombuffer(v, dtype="<" + t).astype(np.int64)
        elif isinstance(v, list):
            if not all(type(x) is int for x in v):
                raise ValueError(f"{name}: holds a non-integer")
            try:
                arr = np.array(v, dtype=np.int64)
            except OverflowError:
                raise ValueError(f"{name}: value outside int64") from None
        else:
            raise ValueError(f"{name}: missing or not bytes/list ({type(v).__name__})")
        if n is None:
            n = len(arr)
        elif len(arr) != n:
            raise ValueError(f"{name}: {len(arr)} values, expected {n}")
        out[name] = arr
    return (n or 0), out
