"""Sampled profiles (the ``profile_samples`` rows): seconds per call path, one rank against its
peers, and pprof (folded stacks and speedscope come from offline/exporters.py through
:func:`as_functions`). Pure; no I/O.

Rows come as a DataFrame with columns rank, role, path (``"root;...;leaf"``, "" for samples that
left a message), samples and hz; a path's seconds are samples / hz, the time a thread was seen
with that call path innermost (its self time; wall-clock, waiting included).
"""

from __future__ import annotations

import gzip
from typing import Any

import numpy as np
import pandas as pd

SEP = ";"
OTHER = "(other)"
DIFF_COLUMNS = ["path", "function", "target_s", "peers_median_s", "added_s"]
NAMED_GROWN = 20      # call paths that grew, named by call_paths.departure


def seconds(rows: pd.DataFrame) -> pd.DataFrame:
    """Self seconds per (rank, role, path); the samples that left the messages as ``(other)``."""
    if rows.empty:
        return pd.DataFrame(columns=["rank", "role", "path", "seconds"])
    df = rows.assign(seconds=rows["samples"].astype(float) / rows["hz"].astype(float),
                     path=rows["path"].where(rows["path"] != "", OTHER))
    return df.groupby(["rank", "role", "path"], as_index=False)["seconds"].sum()


def leaf(path: str) -> str:
    return path.rsplit(SEP, 1)[-1]


def _codes(values: pd.Series) -> tuple[np.ndarray, list[Any]]:
    """Integer codes of ``values`` and the distinct values they index, sorted (a categorical's codes
    are taken as they are: a call path's text is then never hashed row by row)."""
    if isinstance(values.dtype, pd.CategoricalDtype):
        cat = values.cat.remove_unused_categories()
        order = np.argsort(np.asarray(cat.cat.categories, dtype=object), kind="stable")
        remap = np.empty(len(order), dtype=np.int64)
        remap[order] = np.arange(len(order))
        codes = np.asarray(cat.cat.codes, dtype=np.int64)
        return remap[codes], [cat.cat.categories[i] for i in order]
    codes, uniques = pd.factorize(values, sort=True)
    return np.asarray(codes, dtype=np.int64), list(uniques)


def _peers_table(keys: np.ndarray, n_keys: int, ranks: np.ndarray, seconds: np.ndarray,
                 target: set[int] | list[int]) -> tuple[np.ndarray, np.ndarray] | None:
    """Per key (codes in [0, n_keys)): the target ranks' mean seconds and the other ranks' median,
    a rank without the key counting 0 there (a key's seconds per rank summed first); None without a
    target rank among ``ranks``. What a (key x rank) pivot with 0 fill gives, without building it:
    each key's peer values are sorted once and the zeros placed by count."""
    rank_ids, rank_idx = np.unique(ranks, return_inverse=True)
    n_ranks = len(rank_ids)
    is_target = np.isin(rank_ids, np.fromiter((int(r) for r in set(target)), dtype=np.int64))
    n_mine = int(is_target.sum())
    if n_mine == 0:
        return None
    n_peers = n_ranks - n_mine
    pair, inv = np.unique(keys * n_ranks + rank_idx, return_inverse=True)
    sums = np.bincount(inv.ravel(), weights=seconds, minlength=len(pair))
    key, mine = pair // n_ranks, is_target[pair % n_ranks]
    target_s = np.bincount(key[mine], weights=sums[mine], minlength=n_keys) / n_mine
    if n_peers == 0:
        return target_s, np.zeros(n_keys)
    pk, pv = key[~mine], sums[~mine]
    order = np.lexsort((pv, pk))
    pk, pv = pk[order], pv[order]
    count = np.bincount(pk, minlength=n_keys)
    start = np.cumsum(count) - count
    below = np.bincount(pk[pv < 0], minlength=n_keys)      # values sorted before the zeros
    zeros = n_peers - count

    def at(i: int) -> np.ndarray:
        """Each key's i-th smallest peer value, zeros included."""
        if len(pv) == 0:
            return np.zeros(n_keys)
        j = np.where(i < below, start + i, start + i - zeros)
        got = pv[np.clip(j, 0, len(pv) - 1)]
        return np.where((i >= below) & (i < below + zeros), 0.0, got)

    return target_s, (at((n_peers - 1) // 2) + at(n_peers // 2)) / 2


def _against_peers(long: pd.DataFrame, key: str, target: set[int] | list[int]) -> pd.DataFrame | None:
    """Per ``key``: the target ranks' mean seconds, the other ranks' median (0 where a rank never had
    it) and the difference (``key``, target_s, peers_median_s, added_s), by ``key``; None without a
    target rank."""
    if long.empty:
        return None
    codes, uniques = _codes(long[key])
    got = _peers_table(codes, len(uniques), np.asarray(long["rank"], dtype=np.int64),
                       np.asarray(long["seconds"], dtype=float), target)
    if got is None:
        return None
    out = pd.DataFrame({key: uniques, "target_s": got[0], "peers_median_s": got[1]})
    out["added_s"] = out["target_s"] - out["peers_median_s"]
    return out


def _node_rows(per_path: pd.DataFrame) -> pd.DataFrame:
    """:func:`inclusive`'s input rows expanded: one row per (rank, call path, prefix of it), the
    prefixes as integer codes into the sorted list of node tuples (``attrs["nodes"]``)."""
    known = per_path[per_path["path"] != OTHER]
    codes, paths = _codes(known["path"])
    node_of: dict[tuple[str, ...], int] = {}
    chains: list[list[int]] = []
    for p in paths:
        frames = tuple(str(p).split(SEP))
        chains.append([node_of.setdefault(frames[:i], len(node_of)) for i in range(1, len(frames) + 1)])
    nodes = sorted(node_of)
    rename = np.empty(len(nodes), dtype=np.int64)
    for i, n in enumerate(nodes):
        rename[node_of[n]] = i
    lens = np.array([len(c) for c in chains], dtype=np.int64)
    flat = rename[np.array([n for c in chains for n in c], dtype=np.int64)] if chains else np.zeros(0, np.int64)
    offset = np.cumsum(lens) - lens
    per_row = lens[codes] if len(codes) else np.zeros(0, np.int64)
    row = np.repeat(np.arange(len(codes)), per_row)
    within = np.arange(len(row)) - np.repeat(np.cumsum(per_row) - per_row, per_row)
    out = pd.DataFrame({"rank": np.asarray(known["rank"], dtype=np.int64)[row],
                        "node": flat[offset[codes[row]] + within] if len(row) else np.zeros(0, np.int64),
                        "seconds": np.asarray(known["seconds"], dtype=float)[row]})
    out.attrs["nodes"] = nodes
    return out


def _nodes_table(per_path: pd.DataFrame, target: set[int] | list[int]) -> pd.DataFrame:
    cols = ["node", "target_s", "peers_median_s", "added_s"]
    rows = _node_rows(per_path)
    nodes = rows.attrs["nodes"]
    got = _peers_table(rows["node"].to_numpy(), len(nodes), rows["rank"].to_numpy(), rows["seconds"].to_numpy(),
                       target) if len(rows) else None
    if got is None:
        return pd.DataFrame(columns=cols)
    out = pd.DataFrame({"node": nodes, "target_s": got[0], "peers_median_s": got[1]})
    out["added_s"] = out["target_s"] - out["peers_median_s"]
    return out[cols]


def _departure(nodes: pd.DataFrame, path: str) -> str:
    """:func:`rankscope.call_paths.departure` read off a :func:`differential_nodes` table (the same
    means and medians of inclusive seconds per call-path prefix)."""
    frames = path.split(SEP)
    by_node = dict(zip(nodes["node"], zip(nodes["target_s"], nodes["peers_median_s"], strict=True), strict=True))
    for i in range(1, len(frames) + 1):
        mine, peers = by_node.get(tuple(frames[:i]), (0.0, 0.0))
        if peers < mine / 4:
            return frames[i - 1]
    return frames[-1]


def differential(per_path: pd.DataFrame, target: set[int] | list[int]) -> pd.DataFrame:
    """Where the ``target`` ranks spend more than their peers: per call path, the targets' mean self
    seconds, the peers' median (a peer that never had the path counts 0) and the difference,
    largest first; ``function`` names a path that grew by the frame where it leaves what the peers
    run (:func:`rankscope.call_paths.departure`), others by their innermost frame. ``per_path``:
    rank, path, seconds (roles summed or filtered by the caller)."""
    return differential_and_nodes(per_path, target)[0]


def differential_and_nodes(per_path: pd.DataFrame, target: set[int] | list[int]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """:func:`differential` and :func:`differential_nodes` of the same rows, the nodes computed once
    (they name the grown paths too). Vectorised: 10,000 ranks of 20 call paths take well under a
    second."""
    out = _against_peers(per_path, "path", target)
    if out is None:
        return pd.DataFrame(columns=DIFF_COLUMNS), _nodes_table(per_path.iloc[:0], target)
    nodes = _nodes_table(per_path, target)
    out = out[out["path"] != OTHER].copy()
    out["path"] = out["path"].astype(str)
    out["function"] = out["path"].map(leaf)
    out = out.sort_values(["added_s", "path"], ascending=[False, True]).reset_index(drop=True)
    # The call paths that grew are named where they leave what the peers run (as the slow-rank alert
    # does): the first prefix whose peers' median inclusive time is under a quarter of the targets'.
    grown = out.index[out["added_s"] > 0][:NAMED_GROWN]
    known = per_path[per_path["path"] != OTHER]
    ranks = set(int(r) for r in pd.unique(known["rank"]))
    if len(grown) and ranks & set(target) and ranks - set(target):
        out.loc[grown, "function"] = [_departure(nodes, str(p)) for p in out.loc[grown, "path"]]
    return out[DIFF_COLUMNS], nodes


def inclusive(per_path: pd.DataFrame) -> pd.DataFrame:
    """Seconds per (rank, call-path prefix) including callees: rank, node (a tuple of frames), seconds."""
    rows = _node_rows(per_path)
    nodes = rows.attrs["nodes"]
    if rows.empty:
        return pd.DataFrame(columns=["rank", "node", "seconds"])
    agg = rows.groupby(["rank", "node"], as_index=False, sort=False)["seconds"].sum()
    return pd.DataFrame({"rank": agg["rank"].astype(int), "node": [nodes[i] for i in agg["node"]],
                         "seconds": agg["seconds"]})


def differential_nodes(per_path: pd.DataFrame, target: set[int] | list[int]) -> pd.DataFrame:
    """Per call-path prefix (a flame graph's node): the targets' mean inclusive seconds, the peers'
    median (0 where a peer never had it) and the difference: node, target_s, peers_median_s, added_s."""
    return _nodes_table(per_path, target)


def as_functions(per_path: pd.DataFrame) -> pd.DataFrame:
    """The rows as offline/exporters.py's function summaries (python category, exclusive ns), so the
    folded-stack and speedscope writers there serve profiles too."""
    df = per_path[per_path["path"] != OTHER]
    return pd.DataFrame({"rank": df["rank"].astype(int), "category": "python", "name": df["path"],
                         "exclusive_ns": (df["seconds"] * 1e9).round().astype("int64")})


# pprof (github.com/google/pprof, proto/profile.proto), written directly in protobuf's wire format.
def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field(num: int, payload: bytes) -> bytes:
    return _varint(num << 3 | 2) + _varint(len(payload)) + payload


def _int(num: int, v: int) -> bytes:
    return _varint(num << 3) + _varint(v)


def _packed(num: int, values: list[int]) -> bytes:
    return _field(num, b"".join(_varint(v) for v in values))


def pprof(per_path: pd.DataFrame, time_ns: int = 0, duration_ns: int = 0) -> bytes:
    """A gzipped pprof Profile: sample type ("wall", "nanoseconds"), one sample per (rank, call
    path) with a ``rank`` label, leaf first as pprof wants; a frame ``file.py:12 func`` becomes a
    function with its file and first line."""
    strings: list[str] = [""]
    index: dict[str, int] = {"": 0}

    def s(x: str) -> int:
        i = index.get(x)
        if i is None:
            i = index[x] = len(strings)
            strings.append(x)
        return i

    functions: dict[str, int] = {}
    body = bytearray()
    body += _field(1, _int(1, s("wall")) + _int(2, s("nanoseconds")))
    rank_key = s("rank")
    locs = bytearray()
    funcs = bytearray()
    for rank, path, sec in zip(per_path["rank"], per_path["path"], per_path["seconds"], strict=True):
        if path == OTHER:
            continue
        ids = []
        for frame in reversed(str(path).split(SEP)):
            fid = functions.get(frame)
            if fid is None:
                fid = functions[frame] = len(functions) + 1
                filename, line, name = _split_frame(frame)
                funcs += _field(5, _int(1, fid) + _int(2, s(name)) + _int(3, s(name)) + _int(4, s(filename))
                                + _int(5, line))
                locs += _field(4, _int(1, fid) + _field(4, _int(1, fid) + _int(2, line)))
            ids.append(fid)
        label = _int(1, rank_key) + _int(3, int(rank))   # Label{key = 1, num = 3}
        body += _field(2, _packed(1, ids) + _packed(2, [int(round(float(sec) * 1e9))]) + _field(3, label))
    body += locs + funcs
    body += _int(9, time_ns) + _int(10, duration_ns) + _field(11, _int(1, s("wall")) + _int(2, s("nanoseconds")))
    for x in strings:
        body += _field(6, x.encode())
    return gzip.compress(bytes(body))


def _split_frame(frame: str) -> tuple[str, int, str]:
    """``path/file.py:12 func`` -> (file, 12, func); any other name is a function without a file."""
    head, _, name = frame.partition(" ")
    file, _, line = head.rpartition(":")
    if name and file and line.isdigit():
        return file, int(line), name
    return "", 0, frame
