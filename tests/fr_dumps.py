"""Synthetic NCCL-shaped Flight Recorder dumps (the pickle form ``_dump_fr_trace`` returns) for a
modelled job: every rank's device computes, then runs the step's collectives; a collective ends at
the same time on every member, so its device duration is how long the member waited for the last.

Fields as torch 2.15's recorder fills them for NCCL with ``TORCH_NCCL_ENABLE_TIMING=1``:
``time_created_ns`` is the host's enqueue (the same on every rank: the host runs ahead of its
device), ``duration_ms`` and the discovered start/completion times come from CUDA events.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GROUPS = {"0": ("default_pg", [0, 1, 2, 3]), "1": ("tp", [0, 1]), "2": ("tp", [2, 3])}


@dataclass
class ModelledJob:
    """Four ranks; per step one all-reduce on the default group and one on the rank's tp group."""

    compute_ns: dict[int, int]                  # rank -> device compute per step
    t0_ns: int = 1_000_000_000_000
    stop_rank: int = -1                          # this device stops before the collectives of stop_step
    stop_step: int = -1
    odd_rank: int = -1                           # this rank's default-group all-reduce of odd_step has another shape
    odd_step: int = -1
    entries: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    status: dict[int, dict[str, dict[str, int]]] = field(default_factory=dict)
    step_end_ns: list[int] = field(default_factory=list)
    _record: dict[int, int] = field(default_factory=dict)
    _seq: dict[tuple[int, str], int] = field(default_factory=dict)

    def groups_of(self, rank: int) -> list[str]:
        return [pg for pg, (_, ranks) in GROUPS.items() if rank in ranks]

    def run_step(self, step: int) -> None:
        """Append one step's collectives to every rank's ring."""
        start = self.step_end_ns[-1] if self.step_end_ns else self.t0_ns
        ready = {r: start + c for r, c in self.compute_ns.items()}
        end = start
        stuck: set[int] = set()       # ranks whose device waits in an earlier collective of this step
        for pg in ("0", "1", "2"):
            desc, members = GROUPS[pg]
            live = [r for r in members if not (r == self.stop_rank and step >= self.stop_step) and r not in stuck]
            done = max(ready[r] for r in members) + 200_000
            for r in members:
                seq = self._seq.get((r, pg), 0) + 1
                st = self.status.setdefault(r, {}).setdefault(
                    pg, {"last_enqueued_collective": -1, "last_started_collective": -1,
                         "last_completed_collective": -1})
                st["last_enqueued_collective"] = seq      # the host enqueues whatever its device does
                self._seq[(r, pg)] = seq
                rid = self._record.get(r, -1) + 1
                self._record[r] = rid
                stopped = r not in live
                blocked = len(live) < len(members)
                sizes = [[1, 4096]] if (r == self.odd_rank and step == self.odd_step and pg == "0") else [[4096]]
                e = {"record_id": rid, "pg_id": int(pg), "process_group": (pg, desc), "collective_seq_id": seq,
                     "p2p_seq_id": 0, "op_id": seq, "profiling_name": "nccl:all_reduce", "input_sizes": sizes,
                     "input_dtypes": ["BFloat16"], "output_sizes": sizes, "output_dtypes": ["BFloat16"],
                     "time_created_ns": start, "timeout_ms": 600000, "is_p2p": False, "retired": False,
                     "thread_id": "1", "thread_name": "python"}
                if stopped:
                    e.update(state="scheduled", time_discovered_started_ns=0, time_discovered_completed_ns=0,
                             duration_ms=None)
                elif blocked:
                    st["last_started_collective"] = seq
                    e.update(state="started", time_discovered_started_ns=ready[r],
                             time_discovered_completed_ns=0, duration_ms=None)
                else:
                    st["last_started_collective"] = st["last_completed_collective"] = seq
                    e.update(state="completed", retired=True, time_discovered_started_ns=ready[r],
                             time_discovered_completed_ns=done, duration_ms=(done - ready[r]) / 1e6)
                self.entries.setdefault(r, []).append(e)
            if len(live) < len(members):
                stuck |= set(members)
            end = max(end, done)
        self.step_end_ns.append(end)

    def dump(self, rank: int, ring: int = 128) -> dict[str, Any]:
        return {"version": "2.10", "pg_config": {}, "pg_status": {k: dict(v) for k, v in self.status[rank].items()},
                "entries": [dict(e) for e in self.entries[rank][-ring:]], "comm_lib_version": "2.30.7"}
