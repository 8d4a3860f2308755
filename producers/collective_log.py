"""This rank's collectives, read from PyTorch's Flight Recorder off the training thread.

PyTorch's recorders keep rings of the rank's collectives (sequence number, op, sizes, dtypes, when
each was issued, device durations with ``TORCH_NCCL_ENABLE_TIMING``) and each group's last enqueued,
started and completed collective, on every backend: one for gloo and other CPU backends, and
ProcessGroupNCCL's own (:data:`RECORDERS`); both are read. PyTorch (2.15) records by default, in
rings of 2,000 entries; their size is read from ``TORCH_FR_BUFFER_SIZE`` or
``TORCH_NCCL_TRACE_BUFFER_SIZE`` (deprecated) when the first process group is made:
:func:`enable_recorder` sets the first to ``coll_ring`` unless the user set one, from the tracer (which ``rankscope run`` makes
at each rank's start-up, before the script makes its process group). Recording costs the issuing
thread ~12 µs per gloo collective, whatever the ring's size, which PyTorch pays by default.

:class:`CollectiveLog` reads on its own thread, at each multiple of ``coll_read_s`` (3 s) of wall
time (the tracer's loop), and the next beat takes what it read. A read costs 14 µs of CPU per entry
the ring holds (measured on an idle core; ~26 µs with both cores busy training), since the dump
builds every entry, so the ring is kept small (``coll_ring``, 64: ~1-1.7 ms a read, 0.04-0.06% of a
core) and a user's larger ring is read as many times less often (:func:`read_period_s`). A rank
that issues more collectives than the ring holds between two reads sends the newest ones: its
sequence numbers show the gap, and the rules judge the collectives every rank sent. Reading at the
same wall-clock moments on every rank keeps the ranks' windows the same. Never raises.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
from collections.abc import Callable, MutableMapping
from typing import Any

from rankscope.protocol.collectives import MAX_GROUPS, MAX_OPS, MAX_RECORDS, op_label

log = logging.getLogger("rankscope.collectives")

BUFFER_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
TIMING_ENV = "TORCH_NCCL_ENABLE_TIMING"


def enable_recorder(env: MutableMapping[str, str], ring: int, timing: bool = True) -> dict[str, str]:
    """Switch the Flight Recorder on in ``env`` unless the user configured it: a ring of ``ring``
    entries and, with ``timing``, NCCL's device timing. Returns the variables it set."""
    out: dict[str, str] = {}
    if ring > 0 and not any(env.get(k) for k in BUFFER_ENV):
        out[BUFFER_ENV[0]] = str(ring)
    if ring > 0 and timing and TIMING_ENV not in env:
        out[TIMING_ENV] = "1"
    env.update(out)
    return out


def read_period_s(env: MutableMapping[str, str] | dict[str, str], ring: int, period_s: float) -> float:
    """How often to read: every ``period_s`` for a ring of ``ring`` entries, and as many times less
    often as the ring the user configured is larger (a read costs per entry the ring holds), so that
    reading stays within the same CPU whatever the ring."""
    user = 0
    for k in BUFFER_ENV:
        try:
            user = max(user, int(env.get(k) or 0))
        except ValueError:
            pass
    return period_s * max(1, -(-user // max(ring, 1)))


# PyTorch keeps two recorders: the generic one (gloo and other CPU backends; ``_dump_fr_trace``)
# and ProcessGroupNCCL's own, timed with CUDA events (``_dump_nccl_trace``). A job's collectives can be
# in either or both (an NCCL training group beside a gloo group for host-side metadata).
RECORDERS = ("_dump_fr_trace", "_dump_nccl_trace")


def _recorders(suffix: str = "") -> list[Any]:
    """The dump functions of this torch's recorders (with ``suffix`` "_json", their JSON forms). The
    NCCL recorder is read only once CUDA is initialised: an NCCL collective needs CUDA, and a CPU
    job's reads must not touch it."""
    from torch._C import _distributed_c10d as c10d

    fns = []
    for name in RECORDERS:
        fn = getattr(c10d, name + suffix, None)
        if fn is not None and (name != "_dump_nccl_trace" or _cuda_initialized()):
            fns.append(fn)
    return fns


def _cuda_initialized() -> bool:
    import sys

    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:
        return False


def _dump() -> dict[str, Any] | None:
    """Every recorder's dump (collectives, no stacks) as one (:func:`merge_dumps`), or None when this
    torch has no recorder."""
    fns = _recorders()
    if not fns:
        return None
    return merge_dumps([pickle.loads(fn(includeCollectives=True, includeStackTraces=False, onlyActive=False))
                        for fn in fns])


def merge_dumps(dumps: list[dict[str, Any]]) -> dict[str, Any]:
    """Several recorders' dumps as one: each entry tagged with its recorder (``source``, the index in
    ``dumps``: record ids count per recorder), an entry two recorders both hold kept once, and each
    group's status and configuration from the recorder that holds the group."""
    if len(dumps) == 1:
        return dumps[0]
    out: dict[str, Any] = {"entries": [], "pg_status": {}, "pg_config": {}}
    seen: set[tuple[Any, ...]] = set()
    for source, dump in enumerate(dumps):
        for k, v in dump.items():
            if k not in out:
                out[k] = v
        for e in dump.get("entries") or []:
            key = (str(e.get("process_group")), e.get("collective_seq_id"), e.get("p2p_seq_id"),
                   e.get("time_created_ns"), e.get("profiling_name"))
            if key in seen:
                continue
            seen.add(key)
            e["source"] = source
            out["entries"].append(e)
        for field in ("pg_status", "pg_config"):
            for name, value in (dump.get(field) or {}).items():
                if name not in out[field] or (field == "pg_status" and _last(value) > _last(out[field][name])):
                    out[field][name] = value
    return out


def full_dump_json() -> str:
    """Every entry the recorders hold, with stacks where they have them, as the analyzer's JSON: one
    recorder's dump as PyTorch writes it, or, when both hold entries, the two merged."""
    import json

    texts = []
    for fn in _recorders("_json"):
        out = fn(includeCollectives=True, onlyActive=False)
        texts.append(out.decode() if isinstance(out, bytes) else str(out))
    if not texts:
        raise RuntimeError("this torch has no Flight Recorder")
    dumps = [json.loads(t) for t in texts]
    holding = [i for i, d in enumerate(dumps) if d.get("entries")]
    if len(holding) < 2:
        return texts[holding[0] if holding else 0]
    merged = merge_dumps([dumps[i] for i in holding])
    for e in merged["entries"]:
        e.pop("source", None)
    return json.dumps(merged)


# The recorder's dtype names (c10 ScalarType) as torch spells them.
DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16", "Long": "int64",
          "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8", "Bool": "bool",
          "Float8_e4m3fn": "float8_e4m3fn", "Float8_e5m2": "float8_e5m2"}


MAX_DUMP_CHARS = 800_000   # under Kafka's default 1 MB message limit


def bounded_dump(text: str, max_chars: int = MAX_DUMP_CHARS) -> tuple[str, bool]:
    """A dump's JSON within ``max_chars``: whole, or with its oldest entries left out. Returns
    ``(json, truncated)``."""
    import json

    if len(text) <= max_chars:
        return text, False
    dump = json.loads(text)
    entries = dump.get("entries") or []
    while entries:
        entries = entries[len(entries) // 4 + 1:]
        dump["entries"] = entries
        out = json.dumps(dump)
        if len(out) <= max_chars:
            return out, True
    dump["entries"] = []
    return json.dumps(dump)[:max_chars], True


def _int(v: Any, default: int = -1) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


class CollectiveLog:
    """The collectives recorded since the last :meth:`read`, as a beat's ``coll`` field."""

    def __init__(self, world_size: int, dump: Callable[[], dict[str, Any] | None] | None = None,
                 ready: Callable[[], bool] | None = None) -> None:
        self.world_size = world_size
        self._dump = dump or _dump
        self._ready = ready or _process_group_ready
        self._last_record: dict[int, int] = {}   # per recorder (an entry's ``source``)
        self.off_reason = ""        # why nothing is read ("" while reading)
        self.gaps = 0               # collectives that left the ring before they were read
        self._pending: list[dict[str, Any]] | None = None
        self._lock = threading.Lock()
        self._read_lock = threading.Lock()   # one read at a time (the loop's, or the last one at close)

    def collect(self) -> None:
        """Read the recorder and keep what is new for :meth:`take`. Called on its own thread: a dump
        waits for the recorder's and process groups' locks, and a process group failing under it
        (a peer gone) must not hold up the heartbeats or the exit record."""
        with self._read_lock:
            batch = self.read()
        if batch:
            with self._lock:
                self._pending = batch if self._pending is None else merge(self._pending, batch)

    def take(self) -> list[dict[str, Any]] | None:
        """What :meth:`collect` kept since the last call (the beat's ``coll`` field); never blocks
        for longer than a merge."""
        with self._lock:
            out, self._pending = self._pending, None
        return out

    def read(self) -> list[dict[str, Any]] | None:
        """The groups' new collectives and states; None when there is nothing to send. Never raises."""
        if self.off_reason:
            return None
        try:
            if not self._ready():
                return None
            dump = self._dump()
        except Exception as e:
            self._off(f"{type(e).__name__}: {e}")
            return None
        if dump is None:
            self._off("this torch has no Flight Recorder")
            return None
        try:
            return self._groups(dump)
        except Exception as e:   # a recorder of another shape: off, said once
            self._off(f"unreadable Flight Recorder dump: {type(e).__name__}: {e}")
            return None

    def turn_off(self, why: str) -> None:
        self._off(why)

    def _off(self, why: str) -> None:
        self.off_reason = why
        log.info("rankscope: collective records off (%s); slow ranks and hangs are judged from host-side "
                 "step times and stacks only", why)

    def _groups(self, dump: dict[str, Any]) -> list[dict[str, Any]] | None:
        entries = dump.get("entries") or []
        if not entries and not any(os.environ.get(k) for k in BUFFER_ENV):
            self._off(f"{BUFFER_ENV[0]} was not set before the process group was made")
            return None
        status = dump.get("pg_status") or {}
        groups: dict[str, dict[str, Any]] = {}
        newest = dict(self._last_record)
        first_new: dict[int, int] = {}
        for e in entries:
            rid, source = _int(e.get("record_id")), _int(e.get("source"), 0)
            last = self._last_record.get(source, -1)
            newest[source] = max(newest.get(source, -1), rid)
            if rid <= last or e.get("is_p2p"):
                continue
            first_new[source] = min(first_new.get(source, rid), rid)
            pg = e.get("process_group") or ("", "")
            name, desc = str(pg[0]), str(pg[1]) if len(pg) > 1 else ""
            g = groups.get(name)
            if g is None:
                if len(groups) >= MAX_GROUPS:
                    continue
                g = groups[name] = {"pg": name, "size": self.world_size if desc == "default_pg" else 0,
                                    "seq": [], "op": [], "reach_ns": [], "dur_ns": [], "ops": [],
                                    "last": _last(status.get(name)), "_ops": {}}
            dtypes = [DTYPES.get(str(d), str(d)) for d in e.get("input_dtypes") or []]
            label = op_label(e.get("profiling_name", ""), e.get("input_sizes"), dtypes)
            idx = g["_ops"].get(label)
            if idx is None:
                if len(g["ops"]) >= MAX_OPS:
                    continue
                idx = g["_ops"][label] = len(g["ops"])
                g["ops"].append(label)
            dur = e.get("duration_ms")
            g["seq"].append(_int(e.get("collective_seq_id")))
            g["op"].append(idx)
            g["reach_ns"].append(_int(e.get("time_created_ns"), 0))
            g["dur_ns"].append(int(float(dur) * 1e6) if isinstance(dur, (int, float)) and dur >= 0 else -1)
        for source, first in first_new.items():
            last = self._last_record.get(source, -1)
            if last >= 0 and first > last + 1:
                self.gaps += first - last - 1
        self._last_record = newest
        for name, st in status.items():   # groups with no new collective still report their state
            if name not in groups and len(groups) < MAX_GROUPS:
                groups[name] = {"pg": str(name), "size": 0, "seq": [], "op": [], "reach_ns": [], "dur_ns": [],
                                "ops": [], "last": _last(st), "_ops": {}}
        out = []
        for g in groups.values():
            del g["_ops"]
            if len(g["seq"]) > MAX_RECORDS:
                for c in ("seq", "op", "reach_ns", "dur_ns"):
                    g[c] = g[c][-MAX_RECORDS:]
            out.append(g)
        return out or None


def merge(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Two reads' groups as one: each group's collectives in order (the newest MAX_RECORDS), its
    newest state."""
    by_pg = {g["pg"]: g for g in old}
    for g in new:
        cur = by_pg.get(g["pg"])
        if cur is None:
            if len(by_pg) < MAX_GROUPS:
                by_pg[g["pg"]] = g
            continue
        index = {label: i for i, label in enumerate(cur["ops"])}
        for seq, op, reach, dur in zip(g["seq"], g["op"], g["reach_ns"], g["dur_ns"], strict=True):
            label = g["ops"][op]
            if label not in index:
                if len(cur["ops"]) >= MAX_OPS:
                    continue
                index[label] = len(cur["ops"])
                cur["ops"].append(label)
            cur["seq"].append(seq)
            cur["op"].append(index[label])
            cur["reach_ns"].append(reach)
            cur["dur_ns"].append(dur)
        for c in ("seq", "op", "reach_ns", "dur_ns"):
            cur[c] = cur[c][-MAX_RECORDS:]
        cur["last"], cur["size"] = g["last"], max(cur["size"], g["size"])
    return list(by_pg.values())


def _last(st: Any) -> list[int]:
    if not isinstance(st, dict):
        return [-1, -1, -1]
    return [_int(st.get("last_enqueued_collective")), _int(st.get("last_started_collective")),
            _int(st.get("last_completed_collective"))]


def _process_group_ready() -> bool:
    import sys

    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())
