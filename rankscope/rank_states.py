"""Rank states: the one vocabulary of the processors' stats rows (``worker_stats.state``) and the
dashboard's ranks table.

Most severe first; the dashboard shows a rank in the first state that applies:

- ``exited``: the rank sent an exit record. The processors write ``exited:<reason>`` for an
  abnormal end (``exited:exception``, ``exited:signal``), plain ``exited`` for a normal one.
- ``dead``: no heartbeat for ``dead_after_s`` while its peers go on.
- ``hung``: named by the open hang incident (the culprit).
- ``slow``: named by the open slow-rank incident, or a straggler below its cost gate.
- ``waiting``: no step for longer than the hang threshold, not the culprit: a rank blocked in a
  collective for a peer.
- ``running``: none of the above.
"""

from __future__ import annotations

EXITED, DEAD, HUNG, SLOW, WAITING, RUNNING = "exited", "dead", "hung", "slow", "waiting", "running"
RANK_STATES: tuple[str, ...] = (EXITED, DEAD, HUNG, SLOW, WAITING, RUNNING)


def exited_state(reason: str) -> str:
    """The state of a rank that sent an exit record with ``reason``."""
    return EXITED if reason in ("completed", "atexit") else f"{EXITED}:{reason}"


def base_state(state: str | None) -> str:
    """``state`` as one of :data:`RANK_STATES` (``exited:signal`` -> ``exited``); "" for no state or
    a name this version does not know (a newer processors' state reads as no state)."""
    base = (state or "").split(":", 1)[0]
    return base if base in RANK_STATES else ""
