"""Sampled profiles (the ``profile_samples`` rows): seconds per call path, one rank against its
peers, and pprof (folded stacks and speedscope come from offline/exporters.py through
:func:`as_functions`). Pure; no I/O.

Rows come as a DataFrame with columns rank, role, path (``"root;...;leaf"``, "" for samples that
left a message), samples and hz; a path's seconds are samples / hz, the time a thread was seen
with that call path innermost (its self time; wall-clock, waiting included).
"""

from __future__ import annotations

import gzip

import pandas as pd

from rankscope.call_paths import departure

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


def _against_peers(long: pd.DataFrame, key: str, target: set[int] | list[int]) -> pd.DataFrame | None:
    """Per ``key``: the target ranks' mean seconds, the other ranks' median (0 where a rank never had
    it) and the difference (``key``, target_s, peers_median_s, added_s); None without a target rank."""
    if long.empty:
        return None
    wide = long.pivot_table(index=key, columns="rank", values="seconds", aggfunc="sum", fill_value=0.0)
    mine = [r for r in wide.columns if r in set(target)]
    peers = [r for r in wide.columns if r not in set(target)]
    if not mine:
        return None
    out = pd.DataFrame({key: list(wide.index), "target_s": wide[mine].mean(axis=1).to_numpy(),
                        "peers_median_s": wide[peers].median(axis=1).to_numpy() if peers else 0.0})
    out["added_s"] = out["target_s"] - out["peers_median_s"]
    return out


def differential(per_path: pd.DataFrame, target: set[int] | list[int]) -> pd.DataFrame:
    """Where the ``target`` ranks spend more than their peers: per call path, the targets' mean self
    seconds, the peers' median (a peer that never had the path counts 0) and the difference,
    largest first; ``function`` names a path that grew by the frame where it leaves what the peers
    run (:func:`rankscope.call_paths.departure`), others by their innermost frame. ``per_path``:
    rank, path, seconds (roles summed or filtered by the caller)."""
    out = _against_peers(per_path, "path", target)
    if out is None:
        return pd.DataFrame(columns=DIFF_COLUMNS)
    out = out[out["path"] != OTHER].copy()
    out["function"] = out["path"].map(leaf)
    out = out.sort_values(["added_s", "path"], ascending=[False, True]).reset_index(drop=True)
    # The call paths that grew are named where they leave what the peers run (as the slow-rank alert does).
    grown = out.index[out["added_s"] > 0][:NAMED_GROWN]
    if len(grown):
        known = per_path[per_path["path"] != OTHER]
        per_rank: dict[int, dict[str, float]] = {}
        for rank, path, sec in zip(known["rank"], known["path"], known["seconds"], strict=True):
            per_rank.setdefault(int(rank), {})[str(path)] = per_rank.get(int(rank), {}).get(str(path), 0.0) + float(sec)
        mine = sorted(r for r in per_rank if r in set(target))
        peers = sorted(r for r in per_rank if r not in set(target))
        if mine and peers:
            out.loc[grown, "function"] = [departure(per_rank, mine, peers, str(p)) for p in out.loc[grown, "path"]]
    return out[DIFF_COLUMNS]


def inclusive(per_path: pd.DataFrame) -> pd.DataFrame:
    """Seconds per (rank, call-path prefix) including callees: rank, node (a tuple of frames), seconds."""
    acc: dict[tuple[int, tuple[str, ...]], float] = {}
    for rank, path, sec in zip(per_path["rank"], per_path["path"], per_path["seconds"], strict=True):
        if path == OTHER:
            continue
        frames = tuple(str(path).split(SEP))
        for i in range(1, len(frames) + 1):
            key = (int(rank), frames[:i])
            acc[key] = acc.get(key, 0.0) + float(sec)
    return pd.DataFrame([(r, n, v) for (r, n), v in acc.items()], columns=["rank", "node", "seconds"])


def differential_nodes(per_path: pd.DataFrame, target: set[int] | list[int]) -> pd.DataFrame:
    """Per call-path prefix (a flame graph's node): the targets' mean inclusive seconds, the peers'
    median (0 where a peer never had it) and the difference: node, target_s, peers_median_s, added_s."""
    cols = ["node", "target_s", "peers_median_s", "added_s"]
    out = _against_peers(inclusive(per_path), "node", target)
    if out is None:
        return pd.DataFrame(columns=cols)
    return out[cols]


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
