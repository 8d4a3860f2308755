"""``hw``: a rank's hardware samples, columnar.

Body::

    {"ts_ns": [int, ...], "device": [int, ...],      # one per sample; the device -1: the host
     "metrics": {name: [number | nil, ...], ...}}    # one value per sample; nil: not measured

``ts_ns`` values are Int64, ``device`` values Int32; every metric has one value per sample, an int
or a float (NVML gives ints for memory sizes and error counts) or nil.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

from rankscope.protocol.errors import bad_body
from rankscope.protocol.fields import I32, int_list, missing, wrong_type

_LIST_ONLY = frozenset((list,))
_STR_ONLY = frozenset((str,))
_NUMBER_OR_NONE = frozenset((int, float, type(None)))


def check_hw(body: dict[str, Any]) -> None:
    """Check an ``hw`` body. The values are checked a whole column at a time (one C-level pass each):
    a Hopper rank's message holds ~100 values per sample."""
    try:
        ts_ns, device, metrics = body["ts_ns"], body["device"], body["metrics"]
    except KeyError as e:
        raise missing("hw", e) from None
    if type(ts_ns) is not list:
        raise wrong_type("hw.ts_ns", ts_ns)
    if type(device) is not list:
        raise wrong_type("hw.device", device)
    if type(metrics) is not dict:
        raise wrong_type("hw.metrics", metrics)
    n = len(ts_ns)
    if len(device) != n:
        raise bad_body(f"hw.device has {len(device)} values, ts_ns has {n}")
    int_list(ts_ns, "hw.ts_ns")
    int_list(device, "hw.device", bounds=I32)
    columns = metrics.values()
    if metrics and (set(map(type, columns)) != _LIST_ONLY or set(map(len, columns)) != {n}
                    or set(map(type, metrics)) != _STR_ONLY):
        name = next(k for k, vs in metrics.items() if type(k) is not str or type(vs) is not list or len(vs) != n)
        raise bad_body(f"hw.metrics[{name!r}] must be a list of {n} values")
    if not set(map(type, chain.from_iterable(columns))) <= _NUMBER_OR_NONE:
        name = next(k for k, vs in metrics.items() if not set(map(type, vs)) <= _NUMBER_OR_NONE)
        bad = next(v for v in metrics[name] if type(v) not in _NUMBER_OR_NONE)
        raise bad_body(f"hw.metrics[{name!r}] is {type(bad).__name__}, expected number")

