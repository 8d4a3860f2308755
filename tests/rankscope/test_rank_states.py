"""The rank states: one vocabulary for the processors' stats rows and the dashboard."""

from __future__ import annotations

from rankscope.dashboard import ui
from rankscope.rank_states import RANK_STATES, base_state, exited_state


def test_every_state_has_a_badge_and_a_colour_on_the_dashboard() -> None:
    assert set(ui.STATE_BADGE) == set(RANK_STATES) == set(ui.STATE_COLOUR)


def test_exit_states_read_back_as_exited() -> None:
    assert exited_state("completed") == exited_state("atexit") == "exited"
    assert exited_state("signal") == "exited:signal"
    assert base_state(exited_state("exception")) == "exited"


def test_an_unknown_or_missing_state_reads_as_none() -> None:
    assert base_state("stalled") == base_state("") == base_state(None) == ""
    assert [base_state(s) for s in RANK_STATES] == list(RANK_STATES)
