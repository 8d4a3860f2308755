"""Where a slow rank spends more of its time than its peers, from the ranks' sampled profiles.

Stage one reads each rank's ``profile`` messages beside its steps and keeps a digest of the newest
interval: the share of its training thread's samples in each of its most sampled call paths
(:func:`digest`). The digests travel to stage two in the shard summaries (:func:`pack` /
:func:`unpack`, bounded), where the slow-rank rule names the call paths in which the slow ranks
spend more than their peers' median (:func:`above_peers`), before any trace window opens.

A share is samples / ticks: the fraction of the interval the training thread was seen with that
call path innermost (wall-clock, waiting included). Pure; no I/O.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from rankscope.call_paths import departure, path_strings
from rankscope.protocol.profile import ProfileBody
from rankscope.protocol.shard import MAX_PROFILE_PATHS, check_profiles

TOP_PATHS = MAX_PROFILE_PATHS   # call paths kept per rank
MAX_FRAMES = 12            # innermost frames kept per call path
MAX_PACKED_CHARS = 12_000  # path text per shard summary; ranks past it wait for the next summary
MIN_ADDED_SHARE = 0.02     # a call path is named when the slow ranks spend 2% of their time more in it
NAMED_PATHS = 3
MAX_PEERS = 512            # peers the medians are taken over (evenly spread over the ranks)
SEP = ";"
ROLE = "training"

Shares = dict[str, float]


def digest(body: ProfileBody, top: int = TOP_PATHS, max_frames: int = MAX_FRAMES) -> Shares:
    """The training thread's share of the interval per call path (innermost ``max_frames`` frames),
    its ``top`` paths; empty when the message holds no training thread (a DataLoader worker's)."""
    if ROLE not in body.roles or body.ticks <= 0:
        return {}
    role = body.roles.index(ROLE)
    rows = sorted(((c, p) for p, r, c in zip(body.path, body.role, body.count, strict=True) if r == role),
                  reverse=True)[:top]
    strings = path_strings(body.names, body.paths, [p for _, p in rows])
    out: Shares = {}
    for count, pid in rows:
        frames = strings[pid].split(SEP)
        path = SEP.join(frames[-max_frames:])
        out[path] = out.get(path, 0.0) + min(1.0, count / body.ticks)
    return out


def pack(digests: Mapping[int, tuple[int, Shares]], max_chars: int = MAX_PACKED_CHARS) -> tuple[dict[str, Any], list[int]]:
    """The wire form of ranks' digests, ``{"names": [path, ...], "ranks": [[rank, t1_ns, [idx, ...],
    [share_per_mille, ...]], ...]}``, holding as many ranks as fit ``max_chars`` of path text, and the
    ranks it holds."""
    names: list[str] = []
    index: dict[str, int] = {}
    ranks: list[list[Any]] = []
    chars = 0
    for rank, (t1_ns, shares) in digests.items():
        new = [p for p in shares if p not in index]
        cost = sum(len(p) for p in new)
        if ranks and chars + cost > max_chars:
            continue
        for p in new:
            index[p] = len(names)
            names.append(p)
        chars += cost
        ranks.append([rank, t1_ns, [index[p] for p in shares], [round(s * 1000) for s in shares.values()]])
    return {"names": names, "ranks": ranks}, [r[0] for r in ranks]


def unpack(body: Any) -> dict[int, tuple[int, Shares]]:
    """The digests of a summary's ``profiles``, checked (rankscope/protocol/shard.py
    :func:`~rankscope.protocol.shard.check_profiles`: WireError, a ValueError, when malformed)."""
    check_profiles(body)
    names = body["names"]
    return {raw[0]: (raw[1], {names[i]: s / 1000 for i, s in zip(raw[2], raw[3], strict=True)}) for raw in body["ranks"]}


def above_peers(shares: Mapping[int, Shares], target: Sequence[int], k: int = NAMED_PATHS,
                min_added: float = MIN_ADDED_SHARE, max_peers: int = MAX_PEERS) -> list[dict[str, Any]]:
    """The ``k`` call paths where the ``target`` ranks' mean share exceeds their peers' median share
    (a peer without the path counts 0; at most ``max_peers`` peers, evenly spread) by ``min_added``
    or more, largest first: function (the frame where the path leaves what the peers run,
    :func:`rankscope.call_paths.departure`), path, share, peers_median_share, added_share. Empty without a target's
    digest or a peer's."""
    targets = sorted(r for r in set(target) if r in shares)
    peers = sorted(r for r in shares if r not in set(target))
    if not targets or not peers:
        return []
    if len(peers) > max_peers:
        peers = [peers[i * len(peers) // max_peers] for i in range(max_peers)]
    out: list[dict[str, Any]] = []
    for path in {p for r in targets for p in shares[r]}:
        mine = statistics.fmean(shares[r].get(path, 0.0) for r in targets)
        theirs = statistics.median(shares[r].get(path, 0.0) for r in peers)
        if mine - theirs >= min_added:
            out.append({"path": path, "share": round(mine, 3), "peers_median_share": round(theirs, 3),
                        "added_share": round(mine - theirs, 3)})
    out.sort(key=lambda d: (-float(d["added_share"]), str(d["path"])))
    return [{"function": departure(shares, targets, peers, str(d["path"])), **d} for d in out[:k]]
