"""Streamlit helpers shared by the pages: the store, cached queries, calm errors, alert cards, pickers.

Only the store client is a ``st.cache_resource``; query results are ``st.cache_data`` for about a
second, so many viewers of one live page cost one query per refresh (and a page's first queries may
have been started when the browser asked for the page: prefetch.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pandas as pd
import streamlit as st

from rankscope.config import ConfigError, Settings
from rankscope.dashboard import queries
from rankscope.dashboard.prefetch import PREFETCHER
from rankscope.rank_states import RANK_STATES
from rankscope.storage.store import Store, StoreError, StoreLocked, open_store

JOB_PAGE = "views/job.py"
QUERY_TTL_S = 1.0
STATE_BADGE = {
    "running": ":green-badge[running]",
    "slow": ":orange-badge[slow]",
    "waiting": ":blue-badge[waiting]",
    "hung": ":red-badge[hung]",
    "dead": ":violet-badge[dead]",
    "exited": ":gray-badge[exited]",
}
STATE_COLOUR = {"running": "#e6f4ea", "slow": "#fff1d6", "waiting": "#e3eefc", "hung": "#fde2e1", "dead": "#efe3fb",
                "exited": "#eeeeee"}
KIND_TITLE = {"hang": "Hang", "dead_rank": "Dead rank", "slow_rank": "Slow rank",
              "abnormal_worker": "Abnormal worker (report)", "rank_failed": "Rank failed (crash)",
              "collective_mismatch": "Collective mismatch"}
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
    """Run ``queries.<name>(store, **kwargs)`` through the short-lived result cache, unless the web
    server started it when the browser asked for the page (prefetch.py)."""
    started = PREFETCHER.result(cfg.store_dsn, name, kwargs)
    if started is not None:
        return started
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
    for state in RANK_STATES:
        rs = [int(r) for r in ranks_df.loc[ranks_df["state"] == state, "rank"]]
        if not rs or state == "running":
            continue
        parts.append(f"{STATE_BADGE[state]} rank{'s' if len(rs) > 1 else ''} {rank_list(rs)}")
    running = int((ranks_df["state"] == "running").sum())
    if not parts:
        return f":green-badge[healthy] all {running} ranks running"
    return " · ".join(parts) + f" · {running} running"


def render_collectives(alert: pd.Series, table: pd.DataFrame, text: list[str]) -> None:
    """The collective table of an incident: each rank's last enqueued / started / completed collective
    per process group, from the ranks' Flight Recorder dumps; the culprits' rows are marked. Its
    heading joins ``text``, the card's Markdown not yet shown (:func:`flush`)."""
    mine = table[table["alert_id"] == alert["alert_id"]] if not table.empty else table
    if mine.empty:
        text.append(":gray[No Flight Recorder dumps stored for this incident yet (every rank sends one when it opens).]")
        return
    culprits = {int(r) for r in alert["ranks"]}
    shown = mine.drop(columns=["alert_id"]).assign(culprit=mine["rank"].isin(culprits))
    text.append("**Collectives** (each rank's last per process group, from its Flight Recorder)")
    flush(text)
    st.dataframe(shown.style.apply(lambda row: ["background-color: #fde2e1" if row["culprit"] else ""] * len(row),
                                   axis=1),
                 hide_index=True,
                 column_config={"rank": "Rank", "process_group": "Process group", "last_enqueued": "Last enqueued",
                                "last_started": "Last started", "last_completed": "Last completed",
                                "culprit": "Culprit"})


def flush(text: list[str]) -> None:
    """Show ``text`` (Markdown paragraphs) as one element and empty it. A card's text goes out in as
    few elements as the widgets between its paragraphs allow: the browser lays out each element
    (React, styles) on its own, ~10 ms apiece on a 2-core host, and a card has a dozen paragraphs."""
    if text:
        st.markdown("\n\n".join(text))
        text.clear()


def render_alert(alert: pd.Series, groups: pd.DataFrame, rank_state: dict[int, str] | None = None,
                 lost_s: float | None = None, job_link: bool = False,
                 collectives: pd.DataFrame | None = None) -> None:
    """One alert as a bordered card: what, which ranks, since when, its cost, the collective table
    (``collectives``: :func:`~rankscope.dashboard.queries.incident_collectives`) and grouped stacks."""
    culprits = [int(r) for r in alert["ranks"]]
    state = rank_state or {}
    text: list[str] = []
    with st.container(border=True):
        status = ":red-badge[open]" if alert["open"] else ":green-badge[resolved]"
        sev = SEVERITY_BADGE.get(str(alert["severity"]), f":gray-badge[{alert['severity']}]")
        title = KIND_TITLE.get(str(alert["kind"]), str(alert["kind"]))
        text.append(f"#### {title} · {alert['job']}\n{status} {sev} · step {alert['step']} · "
                    f"for {alert['duration_s']:.0f} s · alert `{alert['alert_id']}` v{alert['version']}")
        if alert["summary"]:
            text.append(str(alert["summary"]))
        if alert["kind"] in ("hang", "dead_rank"):
            words = []
            for r in culprits:
                w = state.get(r) or ("dead" if alert["kind"] == "dead_rank" else "hung")
                words.append(f"rank {r} {STATE_BADGE.get(w, w)} at step {alert['step']}")
            text.append("**Culprit:** " + (", ".join(words) or "unknown"))
        elif alert["kind"] == "slow_rank":
            text.append(f"**Slow rank {rank_list(culprits)}** {STATE_BADGE['slow']}")
            render_slow_profile(alert, culprits, text)
        elif alert["kind"] == "rank_failed":
            text.append(f"**Failed first:** rank {rank_list(culprits)} {STATE_BADGE['exited']} at step {alert['step']}"
                        " (its traceback is below; the ranks that failed after it are followers)")
        elif alert["kind"] == "abnormal_worker":
            text.append(f"**Abnormal worker {rank_list(culprits)}** in a trace window; see the Reports page "
                        "for the functions it runs longer")
        elif alert["kind"] == "collective_mismatch":
            text.append(f"**Mismatched collective on rank {rank_list(culprits)}**: its peers issued another "
                        "op, shape or dtype at the same sequence number")
        if alert["kind"] in ("hang", "collective_mismatch") and collectives is not None:
            render_collectives(alert, collectives, text)
        cost = lost_s if lost_s is not None else float(alert["lost_rank_seconds"])
        if cost > 0:
            text.append(f"**Lost:** {cost:,.1f} rank-seconds")
        if job_link:
            flush(text)
            st.page_link(JOB_PAGE, label=f"Open job {alert['job']}", icon=":material/open_in_new:",
                         query_params={"job": str(alert["job"])})
        mine = groups[groups["alert_id"] == alert["alert_id"]] if not groups.empty else groups
        if mine.empty:
            flush(text)
            if alert["kind"] in ("hang", "dead_rank"):
                st.caption("No stacks captured for this alert.")
            return
        text.append(f"**Stacks** ({len(mine)} group{'s' if len(mine) > 1 else ''}, identical stacks merged)")
        for g in mine.sort_values(["culprit", "group"], ascending=[False, True]).itertuples():
            tag = (":red-badge[culprit]" if g.culprit else
                   ":gray-badge[waiting in collective]" if g.waiting_in_collective else ":gray-badge[other]")
            who = f"ranks {rank_list(list(g.ranks))}"
            text.append(f"{f'**{who}**' if g.culprit else who} · thread `{g.thread}` {tag}")
            text.append(stack_markdown(list(g.frames)))
        flush(text)


def stack_markdown(frames: list[str]) -> str:
    """A stack as Markdown: one monospace line per frame. (``st.code`` would run each stack through
    the browser's syntax highlighter, ~0.1 s of a page with a few stacks.)"""
    if not frames:
        return "(no frames)"
    return "  \n".join("`` " + f.replace("`", "'") + " ``" for f in frames)


def alert_details(alert: pd.Series) -> dict[str, Any]:
    """The ``details`` of an alert row's JSON body ({} when it has none or does not parse)."""
    try:
        details = json.loads(str(alert.get("body") or "{}")).get("details")
    except (ValueError, AttributeError):
        return {}
    return details if isinstance(details, dict) else {}


def profile_link(alert: pd.Series, rank: int) -> dict[str, str]:
    """The Job page's query parameters for ``rank``'s profile against its peers over the incident:
    from the start of the steps that opened it to its resolution (or now)."""
    details = alert_details(alert)
    since = int(alert["opened"].value) - int(float(details.get("horizon_s") or 0) * 1e9) if "opened" in alert \
        else 0
    out = {"job": str(alert["job"]), "profile_rank": str(rank), "profile_from": str(max(since, 0))}
    if not alert["open"] and "resolved" in alert and pd.notna(alert["resolved"]):
        out["profile_to"] = str(int(alert["resolved"].value))
    return out


def render_slow_profile(alert: pd.Series, culprits: list[int], text: list[str]) -> None:
    """What a slow-rank alert says of the slow ranks' code (``details.profile``), joining ``text`` (the
    card's Markdown not yet shown), and a link to the first slow rank's profile against its peers
    over the incident."""
    paths = alert_details(alert).get("profile") or []
    if paths:
        text.append("**Where its time goes** (sampled stacks, against its peers' median): " + "; ".join(
            f"`{p['function']}` {float(p['share']):.0%} of its time (peers {float(p['peers_median_share']):.0%})"
            for p in paths if isinstance(p, dict) and {"function", "share", "peers_median_share"} <= set(p)))
    if culprits:
        flush(text)
        st.page_link(JOB_PAGE, label=f"Profile of rank {culprits[0]} against its peers",
                     icon=":material/local_fire_department:", query_params=profile_link(alert, culprits[0]))


# Pickers shared by pages ----------------------------------------------------------------------------

def pick_param(label: str, options: list[str], param: str, key: str) -> str:
    """A selectbox kept in step with ``?<param>=``; without the parameter it starts on the value last
    picked on any page (session state), else the first option. Warns about an unknown value."""
    wanted = st.query_params.get(param)
    last = f"_last_{param}"
    if wanted and wanted not in options:
        st.warning(f"No data for {param} `{wanted}` yet; pick another {param} below.")
    elif wanted and (st.session_state.get(f"_{key}_qp") != wanted or key not in st.session_state):
        st.session_state[key] = wanted
    elif not wanted and st.session_state.get(last) in options:
        st.session_state[key] = st.session_state[last]
    value = st.selectbox(label, options, key=key)
    st.session_state[f"_{key}_qp"] = value
    st.session_state[last] = value
    if st.query_params.get(param) != value:
        st.query_params[param] = value
    return value


def pick_job(options: list[str], key: str = "job_pick") -> str:
    """The job picker of the job, trace-window and report pages (``?job=``)."""
    return pick_param("Job", options, "job", key)


def choose_job(cfg: Any) -> str | None:
    """Jobs from the store and the picker; None (after a calm message) when there is none to show."""
    try:
        job_list = query(cfg, "jobs")
    except StoreError as e:
        st.warning(f"The store did not answer: {e}")
        return None
    if job_list.empty:
        st.info(EMPTY_FLEET, icon="🛰️")
        return None
    return pick_job([str(j) for j in job_list["job"]])


#: Time ranges of the picker: key -> (label, seconds); "custom" takes explicit bounds.
RANGES = {"15m": ("Last 15 min", 900), "1h": ("Last 1 h", 3600), "6h": ("Last 6 h", 6 * 3600),
          "24h": ("Last 24 h", 86400), "custom": ("Custom", 0)}
DEFAULT_RANGE = "15m"


@dataclass(frozen=True)
class TimeRange:
    """A picked time range: relative (the last ``span_s`` seconds) or custom [start_ns, end_ns)."""

    key: str
    span_s: float
    start_ns: int = 0
    end_ns: int = 0

    @property
    def label(self) -> str:
        if self.key != "custom":
            return RANGES[self.key][0].lower()
        fmt = "%Y-%m-%d %H:%M"
        return (f"{datetime.fromtimestamp(self.start_ns / 1e9, UTC):{fmt}} – "
                f"{datetime.fromtimestamp(self.end_ns / 1e9, UTC):{fmt}} UTC")

    def bounds(self, now_ns: int | None = None) -> tuple[int, int]:
        """(since_ns, until_ns); relative ranges end now."""
        if self.key == "custom":
            return self.start_ns, self.end_ns
        now = -(-time.time_ns() // 10**9) * 10**9 if now_ns is None else int(now_ns)  # whole seconds: shared cache
        return now - int(self.span_s * 1e9), now


def _load(key: str, default: Any) -> None:
    """Give widget ``key`` its page-independent value: Streamlit drops widget state on a page change,
    and a widget of the same key on another page is another widget."""
    st.session_state[key] = st.session_state.get(f"_keep_{key}", default)


def _remember(key: str) -> None:
    st.session_state[f"_keep_{key}"] = st.session_state[key]


def time_range(where: Any = None) -> TimeRange:
    """The time-range picker (last 15 min / 1 h / 6 h / 24 h / custom); the choice follows the user
    across pages. ``where`` is a container (default: the page body)."""
    box = where if where is not None else st.container()
    now = datetime.now(UTC).replace(second=0, microsecond=0)
    _load("range_pick", DEFAULT_RANGE)
    cols = box.columns([2, 2, 2, 2, 2])
    key = cols[0].selectbox("Time range", list(RANGES), format_func=lambda k: RANGES[k][0], key="range_pick",
                            on_change=_remember, args=("range_pick",))
    if key != "custom":
        return TimeRange(key, float(RANGES[key][1]))
    defaults = {"range_from_d": (now - timedelta(hours=1)).date(), "range_from_t": (now - timedelta(hours=1)).time(),
                "range_to_d": now.date(), "range_to_t": now.time()}
    for k, v in defaults.items():
        _load(k, v)
    cols[1].date_input("From (UTC)", key="range_from_d", on_change=_remember, args=("range_from_d",))
    cols[2].time_input("at", key="range_from_t", step=60, on_change=_remember, args=("range_from_t",))
    cols[3].date_input("To (UTC)", key="range_to_d", on_change=_remember, args=("range_to_d",))
    cols[4].time_input("at ", key="range_to_t", step=60, on_change=_remember, args=("range_to_t",))
    start = datetime.combine(st.session_state["range_from_d"], st.session_state["range_from_t"], UTC)
    end = datetime.combine(st.session_state["range_to_d"], st.session_state["range_to_t"], UTC)
    if end <= start:
        box.warning("The custom range ends before it starts; showing the hour before its end.")
        start = end - timedelta(hours=1)
    return TimeRange("custom", (end - start).total_seconds(), int(start.timestamp() * 1e9),
                     int(end.timestamp() * 1e9))
