"""Multi-rank Kineto trace sets built from the real traces in tests/data, for the diagnosis tests.

:func:`slow_rank_set` copies the two ``hta_sampled2`` ranks into ``ranks`` files (rank r copies
source rank r % 2, with ``distributedInfo`` rewritten) and time-dilates one rank: every timestamp
of it moves ``factor`` times as far from its first event and every duration is ``factor`` times as
long, so everything that rank does takes longer and it arrives late at each collective.
"""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parents[1] / "data"


def _load(path: Path) -> dict[str, Any]:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def _rank_doc(doc: dict[str, Any], rank: int, world: int, factor: float) -> dict[str, Any]:
    out = {k: copy.deepcopy(v) for k, v in doc.items() if k != "traceEvents"}
    out["distributedInfo"] = {**(out.get("distributedInfo") or {}), "rank": rank, "world_size": world}
    stamps = [e["ts"] for e in doc["traceEvents"] if isinstance(e.get("ts"), int | float) and e.get("ph") != "M"]
    t0 = min(stamps)
    events = []
    for e in doc["traceEvents"]:
        if factor != 1.0 and isinstance(e.get("ts"), int | float) and not isinstance(e.get("ts"), bool):
            e = dict(e)
            e["ts"] = round(t0 + (e["ts"] - t0) * factor, 3)
            if isinstance(e.get("dur"), int | float):
                e["dur"] = round(e["dur"] * factor, 3)
        events.append(e)
    out["traceEvents"] = events
    return out


def slow_rank_set(folder: Path, ranks: int = 4, slow: int = 3, factor: float = 1.6) -> list[Path]:
    """Write ``ranks`` gzipped traces (``rank-<r>.json.gz``) to ``folder``, rank ``slow`` dilated."""
    folder.mkdir(parents=True, exist_ok=True)
    src = [_load(DATA / "hta_sampled2" / f"sampled_rank-{r}.json.gz") for r in (0, 1)]
    paths = []
    for r in range(ranks):
        doc = _rank_doc(src[r % 2], r, ranks, factor if r == slow else 1.0)
        p = folder / f"rank-{r}.json.gz"
        p.write_bytes(gzip.compress(json.dumps(doc).encode(), compresslevel=1))
        paths.append(p)
    return paths
