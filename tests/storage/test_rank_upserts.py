"""The sink's throttle of rank progress (storage/rank_upserts.py), on its own."""

from __future__ import annotations

from rankscope.storage.rank_upserts import RankUpserts

A, B, C = ("j", 0), ("j", 1), ("j", 2)


def test_the_first_batch_writes_every_rank_it_touched() -> None:
    u = RankUpserts(every_s=5.0)
    keys, due = u.plan({B, A}, set(), now=100.0)
    assert (keys, due) == ([A, B], True)
    u.written({A, B}, keys, due, now=100.0)
    assert u.deferred == set() and u.written_at == 100.0


def test_progress_waits_until_due_and_changes_go_at_once() -> None:
    u = RankUpserts(every_s=5.0)
    u.written({A}, [A], True, now=100.0)
    keys, due = u.plan({A, B, C}, {C}, now=101.0)          # only C changed more than progress
    assert (keys, due) == ([C], False)
    u.written({A, B, C}, keys, due, now=101.0)
    assert u.deferred == {A, B} and not u.waiting(104.9) and u.waiting(105.0)
    keys, due = u.plan(set(), set(), now=105.0)            # due: the deferred ones, nothing new
    assert (keys, due) == ([A, B], True)
    u.written(set(), keys, due, now=105.0)
    assert u.deferred == set() and not u.waiting(200.0)


def test_everything_writes_the_deferred_ranks_before_they_are_due() -> None:
    u = RankUpserts(every_s=5.0)
    u.written({A}, [A], True, now=100.0)
    u.written({B}, [], False, now=101.0)
    assert u.plan({C}, set(), now=102.0, everything=True) == ([B, C], True)
