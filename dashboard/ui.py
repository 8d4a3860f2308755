"""Streamlit helpers shared by the pages: the store, cached queries, calm errors, alert cards.

Only the store client is a ``st.cache_resource``; query results are ``st.cache_data`` for about a
second, so many viewers of one live page cost one query per refresh.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

import pandas as pd
import streamlit as st

from dashboard import queries
from rankscope.config import ConfigError, Settings
from storage.store import Store, StoreError, StoreLocked, open_store

JOB_PAGE = "pages/job.py"
QUERY_TTL_S = 1.0
STATE_BADGE = {
    "running": ":green-badge[running]",
    "slow": ":orange-badge[slow]",
    "hung": ":red-badge[hung]",
    "dead": ":violet-badge[dead]",
    "exited": ":gray-badge[exited]",
}
STATE_COLOUR = {"running": "#e6f4ea", "slow": "#fff1d6", "hung": "#fde2e1", "dead": "#efe3fb",
                "exited": "#eeeeee"}
KIND_TITLE = {"hang": "Hang", "dead_rank": "Dead rank", "slow_rank": "Slow rank"}
SEVERITY_BADGE = {"critical": ":red-badge[critical]", "warning": ":orange-badge[warning]",
                  "info": ":blue-badge[info]"}
EMPTY_FLEET = (
    "**No jobs yet.** Instrument a training script with `from rankscope import Tracer`, create "
    "`tracer = Tracer()` and call `tracer.step()` once per step, then launch it with `torchrun`; "
    "or run `make demo` to start a small job that shows a slow rank and a hang."
)


def settings() -> Settings | None:
    """Settings from the environment, or None after showing the configuration error."""
    try:
        return Settings.from_env()
    except ConfigError as e:
        st.error(f"rankscope is misconfigured: {e}")
        return None


@st.cache_resource(show_spinner=False)
def _store(dsn: str) -> Store:
    return open_store(dsn)


def connect() -> Settings | None:
    """Settings whose store opened, or None after a calm message saying what is wrong."""
    cfg = settings()
    if cfg is None or store_or_warn(cfg) is None:
        return None
    return cfg


def store_or_warn(cfg: Settings) -> Store | None:
    """The shared store, or None after a calm warning when it cannot be opened (retried next run)."""
    try:
        return _store(cfg.store_dsn)
    except StoreLocked as e:
        st.warning(f"The embedded store is busy: {e}\n\nThe dashboard retries on reload.", icon="🔒")
    except StoreError as e:
        st.warning(f"Cannot open the store at `{cfg.store_dsn}`: {e}\n\n"
                   "Start it with `rankscope up` or set `RANKSCOPE_CLICKHOUSE_DSN`; this page retries "
                   "on reload.", icon="⚠️")
    return None


@st.cache_data(ttl=QUERY_TTL_S, show_spinner=False, max_entries=512)
def _cached(name: str, dsn: str, kwargs: tuple[tuple[str, Any], ...]) -> pd.DataFrame:
    return getattr(queries, name)(_store(dsn), **dict(kwargs))


def query(cfg: Settings, name: str, **kwargs: Any) -> pd.DataFrame:
    """Run ``queries.<name>(store, **kwargs)`` through the short-lived result cache."""
    return _cached(name, cfg.store_dsn, tuple(sorted(kwargs.items())))


def live(cfg: Settings, body: Callable[[], None]) -> None:
    """Run ``body`` as a fragment that reruns every ``dashboard_refresh_s`` seconds.

    A StoreError inside becomes a calm warning; a "last updated" caption closes the panel.
    """

    @st.fragment(run_every=cfg.dashboard_refresh_s)
    def panel() -> None:
        try:
            body()
        except StoreError as e:
            st.warning(f"The store did not answer: {e}. Retrying every {cfg.dashboard_refresh_s:g} s.",
                       icon="⚠️")
        st.caption(f"Last updated {datetime.now():%H:%M:%S} · refreshes every {cfg.dashboard_refresh_s:g} s")

    panel()


def ago(seconds: float | None) -> str:
    """Human age: '3 s ago', '4 min ago', '2 h ago'; 'never' for None/NaN."""
    if seconds is None or pd.isna(seconds):
        return "never"
    s = max(0.0, float(seconds))
    if s < 90:
        return f"{s:.0f} s ago"
    if s < 5400:
        return f"{s / 60:.0f} min ago"
    if s < 172800:
        return f"{s / 3600:.0f} h ago"
    return f"{s / 86400:.0f} d ago"


def rank_list(ranks: list[int], limit: int = 16) -> str:
    """'1,2,3' (or '1,2,3,... +N more')."""
    head = ",".join(str(r) for r in ranks[:limit])
    return head + (f",... +{len(ranks) - limit} more" if len(ranks) > limit else "")


def state_counts_line(ranks_df: pd.DataFrame) -> str:
    """Markdown summary of the non-running ranks: ':red-badge[hung] rank 3 · ...'."""
    if ranks_df.empty:
        return ""
    parts = []
    for state in queries.RANK_STATES:
        rs = [int(r) for r in ranks_df.loc[ranks_df["state"] == state, "rank"]]
        if not rs or state == "running":
            continue
        parts.append(f"{STATE_BADGE[state]} rank{'s' if len(rs) > 1 else ''} {rank_list(rs)}")
    running = int((ranks_df["state"] == "running").sum())
    if not parts:
        return f":green-badge[healthy] all {running} ranks running"
    return " · ".join(parts) + f" · {running} running"


def render_alert(alert: pd.Series, groups: pd.DataFrame, rank_state: dict[int, str] | None = None,
                 lost_s: float | None = None, job_link: bool = False) -> None:
    """One alert as a bordered card: what, which ranks, since when, its cost, and grouped stacks."""
    culprits = [int(r) for r in alert["ranks"]]
    state = rank_state or {}
    with st.container(border=True):
        status = ":red-badge[open]" if alert["open"] else ":green-badge[resolved]"
        sev = SEVERITY_BADGE.get(str(alert["severity"]), f":gray-badge[{alert['severity']}]")
        title = KIND_TITLE.get(str(alert["kind"]), str(alert["kind"]))
        st.markdown(f"#### {title} · {alert['job']}\n{status} {sev} · step {alert['step']} · "
                    f"for {alert['duration_s']:.0f} s · alert `{alert['alert_id']}` v{alert['version']}")
        if alert["summary"]:
            st.markdown(str(alert["summary"]))
        if alert["kind"] in ("hang", "dead_rank"):
            words = []
            for r in culprits:
                w = state.get(r) or ("dead" if alert["kind"] == "dead_rank" else "hung")
                words.append(f"rank {r} {STATE_BADGE.get(w, w)} at step {alert['step']}")
            st.markdown("**Culprit:** " + (", ".join(words) or "unknown"))
        elif alert["kind"] == "slow_rank":
            st.markdown(f"**Slow rank {rank_list(culprits)}** {STATE_BADGE['slow']}")
        cost = lost_s if lost_s is not None else float(alert["lost_rank_seconds"])
        if cost > 0:
            st.markdown(f"**Lost:** {cost:,.1f} rank-seconds")
        if job_link:
            st.page_link(JOB_PAGE, label=f"Open job {alert['job']}", icon=":material/open_in_new:",
                         query_params={"job": str(alert["job"])})
        mine = groups[groups["alert_id"] == alert["alert_id"]] if not groups.empty else groups
        if mine.empty:
            if alert["kind"] in ("hang", "dead_rank"):
                st.caption("No stacks captured for this alert.")
            return
        st.markdown(f"**Stacks** ({len(mine)} group{'s' if len(mine) > 1 else ''}, identical stacks merged)")
        for g in mine.sort_values(["culprit", "group"], ascending=[False, True]).itertuples():
            tag = (":red-badge[culprit]" if g.culprit else
                   ":gray-badge[waiting in collective]" if g.waiting_in_collective else ":gray-badge[other]")
            who = f"ranks {rank_list(list(g.ranks))}"
            st.markdown(f"{f'**{who}**' if g.culprit else who} · thread `{g.thread}` {tag}")
            st.code("\n".join(g.frames) or "(no frames)", language=None)
