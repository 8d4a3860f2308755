"""Who reached each collective last, who never reached it, and whose collective differs.

The device's view of a job (rankscope/protocol/collectives.py): each rank's collectives by process
group and sequence number. Unlike the host-side step records, it holds where collectives do not
block the thread that issues them (NCCL on GPUs): a slow device reaches every collective late, a
stopped device never reaches the one its peers wait in, whatever the training threads do.

- Stage one (:class:`ShardCollectives`, one per shard of a job) keeps per group and sequence
  number the latest and second-latest arrival among the shard's ranks (:func:`lateness`), the op
  label each rank gave it, and each rank's last reached collective (started where the backend
  tracks starts, else enqueued). A summary carries per group (``agg["coll"]``): the newest
  ``COLL_ROWS`` collectives every member of the shard has reported, rows
  ``[seq, lateness, rank, gap, event_ns, label_crc]``; the ranks furthest behind; mismatches seen
  inside the shard; the labels of its rows.
- Stage two (:class:`CollectiveLedger`, one per job and group) merges the shards' rows of a
  collective once every shard holding the group has passed it, into the same
  :class:`~rankscope.last_arrivals.Step` records the slow-rank rule judges for steps (``step`` is
  the sequence number, ``dur_ns`` the time since the group's previous collective, per collective
  across a gap in the sequence numbers), and finds
  labels that differ across shards. :func:`behind` names, per group, the members that never
  reached the collective the others did.
"""

from __future__ import annotations

import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from rankscope.last_arrivals import Step
from rankscope.protocol.collectives import lateness, records
from rankscope.protocol.envelope import Envelope
from rankscope.protocol.shard import MAX_COLL_GROUPS, MAX_COLL_MISMATCHES, MAX_COLL_ROWS

COLL_ROWS = 128            # passed collectives per group per shard summary (~5 KB)
MAX_SUMMARY_GROUPS = MAX_COLL_GROUPS   # groups per shard summary (those with the most members first)
MAX_PENDING = MAX_COLL_ROWS            # collectives a shard or a ledger holds per group while a rank lags
LEDGER_ROWS = 8192
MAX_BEHIND = 32
MAX_MISMATCHES = MAX_COLL_MISMATCHES


def label_crc(label: str) -> int:
    return zlib.crc32(label.encode())


@dataclass(slots=True)
class _Group:
    tops: dict[int, list[int]] = field(default_factory=dict)    # seq -> [late, rank, event_ns, second, count, crc]
    seen: dict[int, int] = field(default_factory=dict)          # rank -> highest seq it reported
    reached: dict[int, int] = field(default_factory=dict)       # rank -> last collective reached
    labels: dict[int, str] = field(default_factory=dict)        # crc -> label
    votes: dict[int, dict[int, list[int]]] = field(default_factory=dict)  # seq -> crc -> [ranks, a rank]
    size: int = 0

    def majority(self, seq: int) -> int:
        """The crc of the label most of the shard's ranks gave collective ``seq`` (0 when unknown)."""
        v = self.votes.get(seq)
        return max(v, key=lambda c: (v[c][0], -c)) if v else 0

    def drop(self, seq: int) -> None:
        del self.tops[seq]
        self.votes.pop(seq, None)


class ShardCollectives:
    """Stage one: one shard's ranks' collectives, per process group."""

    def __init__(self) -> None:
        self.groups: dict[str, _Group] = {}
        self.pids: dict[int, int] = {}

    def _restarted(self, rank: int, pid: int) -> None:
        """A rank in a new process counts its collectives from 1 again."""
        if self.pids.get(rank, pid) != pid:
            self.forget({rank})
        self.pids[rank] = pid

    def add(self, env: Envelope) -> None:
        """Take a ``beat``'s ``coll`` field (validated by the decoder)."""
        coll = env.body.get("coll") if env.kind == "beat" else None
        if not coll:
            return
        rank = env.rank
        self._restarted(rank, env.pid)
        for g in coll:
            grp = self.groups.get(g["pg"])
            if grp is None:
                grp = self.groups[g["pg"]] = _Group()
            grp.size = max(grp.size, g["size"])
            enq, started, _done = g["last"]
            reached = started if started >= 0 else enq
            if reached >= 0:
                grp.reached[rank] = reached
            after = grp.seen.get(rank, -1)
            for seq, reach, dur, label in records(g):
                if seq <= after:
                    continue
                after = seq
                crc = label_crc(label)
                if len(grp.labels) < 4096:
                    grp.labels.setdefault(crc, label)
                vote = grp.votes.setdefault(seq, {}).setdefault(crc, [0, rank])
                vote[0] += 1
                late = lateness(reach, dur)
                t = grp.tops.get(seq)
                if t is None:
                    grp.tops[seq] = [late, rank, reach, -(2 ** 62), 1, crc]
                else:
                    t[4] += 1
                    if late > t[0]:
                        t[3], t[0], t[1], t[2] = t[0], late, rank, reach
                    elif late > t[3]:
                        t[3] = late
            grp.seen[rank] = max(grp.seen.get(rank, -1), after)
            if len(grp.tops) > MAX_PENDING:
                for s in sorted(grp.tops)[: len(grp.tops) - MAX_PENDING]:
                    grp.drop(s)

    def forget(self, ranks: set[int]) -> None:
        """Drop exited or silent ranks: they no longer hold back what the others passed."""
        for grp in self.groups.values():
            for r in ranks:
                grp.seen.pop(r, None)
                grp.reached.pop(r, None)

    def summary(self) -> dict[str, Any]:
        """``agg["coll"]``: per group (at most MAX_SUMMARY_GROUPS, the largest first), the passed
        rows, the shard's members, the ranks furthest behind, mismatches and labels."""
        out: dict[str, Any] = {}
        ranked = sorted(self.groups.items(), key=lambda kv: (-len(kv[1].seen) - len(kv[1].reached), kv[0]))
        for name, grp in ranked[:MAX_SUMMARY_GROUPS]:
            members = len(grp.seen)
            passed = min(grp.seen.values()) if grp.seen else -1
            for s in [s for s in grp.tops if s <= passed - COLL_ROWS]:
                grp.drop(s)
            rows: list[list[int]] = []
            split: list[list[Any]] = []
            for s in sorted(s for s in grp.tops if s <= passed)[-COLL_ROWS:]:
                late, rank, event_ns, second, count, _ = grp.tops[s]
                if count >= members:
                    rows.append([s, late, rank, late - second if count > 1 else -1, event_ns, grp.majority(s)])
                    if len(grp.votes.get(s, ())) > 1 and len(split) < MAX_MISMATCHES:
                        split.append([s, [[c, n, r] for c, (n, r) in sorted(grp.votes[s].items())]])
            top = max(grp.reached.values(), default=-1)
            low = sorted(grp.reached.items(), key=lambda kv: (kv[1], kv[0]))[:MAX_BEHIND]
            crcs = {r[5] for r in rows} | {c for _, votes in split for c, _, _ in votes} | {grp.majority(top)}
            out[name] = {"rows": rows, "passed": passed, "members": members, "size": grp.size,
                         "reached_max": top, "lowest": [[r, v] for r, v in low],
                         "top_label": grp.labels.get(grp.majority(top), ""), "mismatches": split,
                         "labels": {str(c): grp.labels[c] for c in crcs if c in grp.labels}}
        return out


class CollectiveLedger:
    """Stage two for one process group: the job's complete collectives, from the shards' rows."""

    def __init__(self, pg: str) -> None:
        self.pg = pg
        self.pending: dict[int, dict[int, list[int]]] = {}    # seq -> shard -> row
        self.passed: dict[int, int] = {}                      # shard -> highest seq passed
        self.labels: dict[int, str] = {}
        self.steps: deque[Step] = deque(maxlen=LEDGER_ROWS)
        self.last_complete = -1
        self.last_event_ns = 0
        self.last_event_seq = -1
        self.members: dict[int, int] = {}                     # shard -> its ranks in the group
        self.split: dict[int, dict[int, list[list[int]]]] = {}   # seq -> shard -> [[crc, ranks, a rank]]
        self.mismatches: list[list[Any]] = []                 # [seq, rank, label, odd rank, odd label]
        self.crc_of: dict[int, int] = {}                      # closed seq -> its op label's crc

    def add(self, shard: int, g: dict[str, Any]) -> None:
        for row in g["rows"]:
            if row[0] > self.last_complete:
                self.pending.setdefault(row[0], {})[shard] = row
        if g["members"] and g["passed"] >= 0:
            self.passed[shard] = max(self.passed.get(shard, -1), g["passed"])
        self.members[shard] = g["members"]
        for crc, label in g["labels"].items():
            if len(self.labels) < 4096:
                self.labels[int(crc)] = str(label)[:200]
        for seq, votes in g["mismatches"]:
            if seq > self.last_complete:
                self.split.setdefault(seq, {})[shard] = votes
        if len(self.pending) > MAX_PENDING:
            for s in sorted(self.pending)[: len(self.pending) - MAX_PENDING]:
                del self.pending[s]
        for s in [s for s in self.split if s not in self.pending]:
            del self.split[s]

    def complete(self, shards: list[int]) -> list[Step]:
        """Close, oldest first, the collectives every one of ``shards`` (those holding the group's
        live ranks) has passed and sent a row for; return the ones closed now."""
        if not shards or any(sh not in self.passed for sh in shards):
            return []
        upto = min(self.passed[sh] for sh in shards)
        out = []
        for s in sorted(s for s in self.pending if s <= upto):
            by_shard = self.pending.pop(s)
            self.last_complete = s
            if any(sh not in by_shard for sh in shards):
                continue        # a shard's row is missing (its window moved on): no verdict on this one
            rows = sorted(by_shard.values(), key=lambda r: r[1], reverse=True)
            self._compare_labels(s, by_shard, self.split.pop(s, {}))
            top = rows[0]
            second = max(top[1] - top[3] if top[3] >= 0 else -(2 ** 62), rows[1][1] if len(rows) > 1 else -(2 ** 62))
            # The time since the group's previous collective: after collectives no row was sent for
            # (ranks read their recorder's newest entries every few seconds), the time per collective
            # across the gap, so that a horizon's time is the time its collectives cover and its cost
            # share is not diluted by the collectives between reads.
            dur = max(0, top[4] - self.last_event_ns) // max(1, s - self.last_event_seq) if self.last_event_ns else 0
            self.last_event_ns = max(self.last_event_ns, top[4])
            self.last_event_seq = s
            if second <= -(2 ** 61):
                continue        # one rank only
            step = Step(s, top[2], max(0, top[1] - second), dur, top[4])
            self.steps.append(step)
            self.crc_of[s] = top[5]
            if len(self.crc_of) > LEDGER_ROWS:
                del self.crc_of[next(iter(self.crc_of))]
            out.append(step)
        return out

    def _compare_labels(self, seq: int, by_shard: dict[int, list[int]], split: dict[int, list[list[int]]]) -> None:
        """Count, over the shards, the members that gave collective ``seq`` each label; more than one
        label is a mismatch, and the label fewest members gave names the odd rank."""
        votes: dict[int, list[int]] = {}
        for sh, row in by_shard.items():
            for crc, n, rank in split.get(sh) or [[row[5], max(1, self.members.get(sh, 1)), row[2]]]:
                v = votes.setdefault(crc, [0, rank])
                v[0] += n
        if len(votes) < 2 or len(self.mismatches) >= MAX_MISMATCHES:
            return
        ranked = sorted(votes.items(), key=lambda kv: (-kv[1][0], kv[0]))
        (common, (_, peer)), (odd, (_, rank)) = ranked[0], ranked[-1]
        self.mismatches.append([seq, peer, self.labels.get(common, f"crc {common:08x}"),
                                rank, self.labels.get(odd, f"crc {odd:08x}")])

    def label_of(self, horizon: list[Step], ranks: set[int]) -> str:
        """The op label of most of ``horizon``'s collectives at which one of ``ranks`` was last."""
        counts: dict[int, int] = {}
        for st in horizon:
            if st.rank in ranks and st.step in self.crc_of:
                counts[self.crc_of[st.step]] = counts.get(self.crc_of[st.step], 0) + 1
        if not counts:
            return ""
        return self.labels.get(max(counts, key=lambda c: counts[c]), "")


def behind(groups: dict[str, list[dict[str, Any]]], live: set[int]) -> dict[str, dict[str, Any]]:
    """Per group, from every shard's ``agg["coll"]`` entry for it: the live members whose last
    reached collective is below the newest one another member reached, with that collective.
    ``{pg: {"seq": newest, "ranks": {rank: reached}}}``; groups where no one is behind are left out."""
    out: dict[str, dict[str, Any]] = {}
    for pg, entries in groups.items():
        top = max((g["reached_max"] for g in entries), default=-1)
        if top < 0:
            continue
        late = {r: v for g in entries for r, v in g["lowest"] if v < top and r in live}
        if late:
            low = min(late.values())
            label = next((str(g.get("top_label", "")) for g in entries if g["reached_max"] == top and g.get("top_label")), "")
            out[pg] = {"seq": top, "op": label[:200], "ranks": {r: v for r, v in late.items() if v == low}}
    return out
