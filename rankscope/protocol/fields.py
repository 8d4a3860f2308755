"""Field checks the kinds' validators share: presence, exact type (a bool is not an int), integer range.
Each raises WireError("bad_body") naming the field (``kind.field``)."""

from __future__ import annotations

from typing import Any

from rankscope.protocol.errors import WireError, bad_body

I64 = (-(2 ** 63), 2 ** 63 - 1)     # the range of an integer field stored as Int64
I32 = (-(2 ** 31), 2 ** 31 - 1)     # ... as Int32


def missing(kind: str, e: KeyError) -> WireError:
    """The error of a body without a required field (``e``: the KeyError of looking it up)."""
    return bad_body(f"{kind}.{e.args[0]} missing")


def wrong_type(name: str, value: Any) -> WireError:
    """The error of a field whose value has the wrong type."""
    return bad_body(f"{name} is {type(value).__name__}")


def field(kind: str, body: dict[str, Any], name: str, typ: type) -> Any:
    """``body[name]``, required, of exactly type ``typ``."""
    try:
        value = body[name]
    except KeyError as e:
        raise missing(kind, e) from None
    if type(value) is not typ:
        raise wrong_type(f"{kind}.{name}", value)
    return value


def list_or_none(kind: str, body: dict[str, Any], name: str) -> list[Any] | None:
    """``body[name]``, required, a list or nil."""
    try:
        value = body[name]
    except KeyError as e:
        raise missing(kind, e) from None
    if value is not None and type(value) is not list:
        raise wrong_type(f"{kind}.{name}", value)
    return value


def int_field(value: Any, name: str, bounds: tuple[int, int] = I64) -> int:
    """``value``, an int within ``bounds``."""
    if type(value) is not int:
        raise bad_body(f"{name} is {type(value).__name__}, expected int")
    if not bounds[0] <= value <= bounds[1]:
        raise bad_body(f"{name}={value} out of range {bounds}")
    return value


def number_field(value: Any, name: str) -> float:
    """``value``, an int or a float."""
    if type(value) is not float and type(value) is not int:
        raise bad_body(f"{name} is {type(value).__name__}, expected number")
    return value


def str_field(value: Any, name: str) -> str:
    """``value``, a str."""
    if type(value) is not str:
        raise bad_body(f"{name} is {type(value).__name__}, expected str")
    return value


def str_list(values: Any, name: str) -> list[str]:
    """``values``, a list of str."""
    if type(values) is not list or not all(type(v) is str for v in values):
        raise bad_body(f"{name} must be a list of strings")
    return values


_INT_ONLY = frozenset((int,))


def int_list(values: Any, name: str, n: int | None = None, bounds: tuple[int, int] = I64) -> list[int]:
    """``values``, a list (of ``n`` values when given) of ints within ``bounds``. A right list takes a
    few C-level passes; a wrong one names its first bad value."""
    if type(values) is not list or (n is not None and len(values) != n):
        raise bad_body(f"{name} must be a list of {'' if n is None else f'{n} '}values")
    if values and not (set(map(type, values)) <= _INT_ONLY and bounds[0] <= min(values) and max(values) <= bounds[1]):
        for v in values:
            int_field(v, name, bounds)
    return values
