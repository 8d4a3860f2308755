"""Python call paths on the wire: the interned table ``[[parent_path_id, name_idx], ...]`` (parent -1
at a root) that trace chunks and summaries carry, and the ``"root;...;leaf"`` strings it stands for.

Shared by the rank (producers/trace_events.py builds the tables) and the central side (the sink
and the processors expand summaries at their boundary)."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def path_strings(names: Sequence[str], paths: Sequence[Sequence[int]], ids: Iterable[int] | None = None,
                 sep: str = ";") -> dict[int, str]:
    """Call-path id -> ``"root;...;leaf"`` for ``ids`` (all paths if None). Raises ValueError on a
    malformed table (a cycle, an index out of range)."""
    if ids is not None:
        return _leaf_strings(names, paths, ids, sep)
    out: dict[int, str] = {}
    for pid in range(len(paths)):
        if pid in out:
            continue
        chain: list[int] = []
        p = pid
        while p >= 0 and p not in out:
            if p >= len(paths) or len(chain) > len(paths):
                raise ValueError(f"call path {pid} is malformed (at {p})")
            chain.append(p)
            p = paths[p][0]
        prefix = out[p] if p >= 0 else None
        for q in reversed(chain):
            ni = paths[q][1]
            if not 0 <= ni < len(names):
                raise ValueError(f"call path {q} names index {ni}, table has {len(names)}")
            prefix = names[ni] if prefix is None else f"{prefix}{sep}{names[ni]}"
            out[q] = prefix
    return out


def _leaf_strings(names: Sequence[str], paths: Sequence[Sequence[int]], ids: Iterable[int],
                  sep: str) -> dict[int, str]:
    """:func:`path_strings` for a few ``ids``: each one's frames, walked up to its root and joined
    once (no string is built for the paths in between)."""
    out: dict[int, str] = {}
    npaths, nnames = len(paths), len(names)
    for pid in ids:
        if pid in out:
            continue
        chain: list[str] = []
        p = pid
        while p >= 0:
            if p >= npaths or len(chain) > npaths:
                raise ValueError(f"call path {pid} is malformed (at {p})")
            parent, ni = paths[p]
            if not 0 <= ni < nnames:
                raise ValueError(f"call path {p} names index {ni}, table has {nnames}")
            chain.append(names[ni])
            p = parent
        chain.reverse()
        out[pid] = sep.join(chain)
    return out


def valid_leaf_strings(names: Sequence[str], paths: Sequence[Sequence[int]], ids: Iterable[int],
                       sep: str = ";", max_depth: int | None = None) -> dict[int, str]:
    """:func:`path_strings` for ``ids`` of a table already checked (each parent -1 or an earlier
    entry, each name index inside ``names``; rankscope.protocol.profile.validate): the walk up
    checks nothing but the depth, so a profile's rows cost what their frames do. Raises ValueError
    on a path of more than ``max_depth`` frames."""
    out: dict[int, str] = {}
    for pid in ids:
        chain: list[str] = []
        p = pid
        while p >= 0:
            p, ni = paths[p]
            chain.append(names[ni])
        if max_depth is not None and len(chain) > max_depth:
            raise ValueError(f"profile: a call path deeper than {max_depth} frames")
        chain.reverse()
        out[pid] = sep.join(chain)
    return out


def expand_call_paths(functions: dict[str, Any]) -> dict[str, Any]:
    """A summary's ``functions`` in the plain form: python rows named ``"root;...;leaf"``. Bodies
    without ``call_paths`` come back as they are. Raises ValueError on a malformed table or columns."""
    cp = functions.get("call_paths")
    if cp is None:
        return functions
    if not isinstance(cp, dict) or not isinstance(cp.get("names"), list) or not isinstance(cp.get("paths"), list):
        raise ValueError("functions.call_paths must be {names: [...], paths: [[parent, name], ...]}")
    names, table, path, fn = cp["names"], cp["paths"], functions.get("path"), functions.get("name")
    if not isinstance(path, list) or not isinstance(fn, list) or len(path) != len(fn):
        raise ValueError("functions.path must be a list as long as functions.name")
    if not all(isinstance(n, str) for n in names) or not all(
            isinstance(t, list) and len(t) == 2 and all(isinstance(v, int) for v in t) for t in table):
        raise ValueError("functions.call_paths holds values of the wrong type")
    if not all(isinstance(p, int) and -1 <= p < len(table) for p in path):
        raise ValueError(f"functions.path holds an id outside the {len(table)}-path table")
    strings = path_strings(names, table, [p for p in path if p >= 0])
    out = {k: v for k, v in functions.items() if k not in ("call_paths", "path")}
    out["name"] = [strings[p] if p >= 0 else n for p, n in zip(path, fn, strict=True)]
    return out


def _inclusive(values: Mapping[str, float], prefix: str, sep: str) -> float:
    """The total of the paths that run through ``prefix`` (it included)."""
    below = prefix + sep
    return sum(v for p, v in values.items() if p == prefix or p.startswith(below))


def departure(per_rank: Mapping[int, Mapping[str, float]], targets: Sequence[int], peers: Sequence[int],
              path: str, sep: str = ";") -> str:
    """The frame of ``path`` where the ``targets`` leave what their ``peers`` run: the outermost whose
    call path holds, in the peers' median, less than a quarter of the targets' mean (time or share per
    call path, per rank; a rank without a path has 0 there). The innermost frame when there is none:
    the targets run the same code longer. The slow-rank alert and the dashboard's differential
    both name a call path by this frame."""
    frames = path.split(sep)
    for i in range(1, len(frames) + 1):
        prefix = sep.join(frames[:i])
        mine = statistics.fmean(_inclusive(per_rank.get(r, {}), prefix, sep) for r in targets)
        if statistics.median(_inclusive(per_rank.get(r, {}), prefix, sep) for r in peers) < mine / 4:
            return frames[i - 1]
    return frames[-1]
