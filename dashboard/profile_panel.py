"""The profile panel of the Job and Host pages: the ranks' sampled Python stacks over the chosen time
range as a flame graph (all ranks or one, by thread role) and, for one rank, where it spends more
than its peers' median: the call paths that grew, ranked by added seconds, and the flame graph
coloured by them."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from rankscope import profiles
from rankscope.config import Settings
from rankscope.dashboard import flame, flame_chart, ui
from rankscope.protocol.profile import ROLES

ALL_RANKS = "all ranks"
#: Above this many ranks the rank picker lists the ranks it is given first (and the lowest ranks up to
#: this many), and takes any other rank typed in: a browser lays out a picker of 10,000 options in ~0.3 s.
MAX_RANK_OPTIONS = 256


def linked(key: str, options: list[str]) -> tuple[int, int]:
    """Follow a link from an alert (``?profile_rank=R&profile_from=NS[&profile_to=NS]``): preselect
    the rank once per link, and return the link's time bounds (0: none)."""
    qp = st.query_params
    rank = qp.get("profile_rank")
    if rank in options and st.session_state.get(f"_{key}_linked") != rank:
        st.session_state[f"{key}_rank"] = rank
        st.session_state[f"_{key}_linked"] = rank
    bounds = []
    for name in ("profile_from", "profile_to"):
        try:
            bounds.append(max(0, int(qp.get(name) or 0)))
        except ValueError:
            bounds.append(0)
    return bounds[0], bounds[1]


def rank_options(ranks: list[int], first: list[int] | None = None) -> list[str]:
    """The rank picker's options: every rank, or above :data:`MAX_RANK_OPTIONS` ranks, ``first`` (the
    ranks not running) and the lowest ranks up to that many; the rank an alert's link names is added."""
    if len(ranks) <= MAX_RANK_OPTIONS:
        return [ALL_RANKS, *[str(r) for r in ranks]]
    known = set(ranks)
    linked_rank = st.query_params.get("profile_rank")
    wanted = [int(linked_rank)] if linked_rank and linked_rank.isdigit() and int(linked_rank) in known else []
    shown = list(dict.fromkeys([*wanted, *[r for r in first or [] if r in known]]))
    shown += [r for r in ranks[:MAX_RANK_OPTIONS] if r not in set(shown)][:max(0, MAX_RANK_OPTIONS - len(shown))]
    return [ALL_RANKS, *[str(r) for r in shown]]


def render(cfg: Settings, job: str, ranks: list[int], host: str = "", key: str = "profile",
           first: list[int] | None = None) -> None:
    """The panel for ``ranks`` of ``job`` (of ``host`` when given); ``first``: ranks the picker lists
    first when there are too many to list them all (:func:`rank_options`)."""
    rng = ui.time_range()
    t0, t1 = rng.bounds()
    options = rank_options(ranks, first)
    many = len(ranks) > MAX_RANK_OPTIONS
    since, until = linked(key, options)
    if since:
        t0 = max(t0, since)
        st.caption(f"From the alert's link: since {pd.Timestamp(since, unit='ns', tz='UTC'):%H:%M:%S} UTC"
                   + (f", until {pd.Timestamp(until, unit='ns', tz='UTC'):%H:%M:%S} UTC" if until else ""))
    if until:
        t1 = min(t1, until)
    c = st.columns([2, 3])
    pick = c[0].selectbox("Rank", options, key=f"{key}_rank", accept_new_options=many,
                          help="One rank also shows where it spends more than its peers."
                          + (f" Lists the ranks not running first; type any of the {len(ranks):,} ranks." if many
                             else ""))
    roles = c[1].multiselect("Threads", list(ROLES), default=["training"], key=f"{key}_roles",
                             help="training: the thread that calls tracer.step(); dataloader: DataLoader worker "
                                  "processes; pin_memory: the DataLoader's pin-memory thread; other: any other thread.")
    if pick != ALL_RANKS and (pick is None or not str(pick).isdigit() or int(pick) not in set(ranks)):
        st.warning(f"No rank {pick} in this job; showing all ranks.")
        pick = ALL_RANKS
    where = {"job": job, "t0_ns": t0, "t1_ns": t1, "roles": roles or None, "hosts": [host] if host else None}
    # All ranks: seconds per call path summed in the store (a 10,000-rank job's rows never leave it);
    # one rank: its peers' seconds per path too, for their median.
    per = ui.query(cfg, "path_seconds" if pick == ALL_RANKS else "rank_path_seconds", **where)
    if per.empty:
        st.caption("No sampled stacks in this range. Ranks sample their stacks all the time (`profile_hz`) and "
                   "send them every `profile_s` seconds.")
        return
    if pick == ALL_RANKS:
        flame_chart.icicle_chart(flame.icicle(_tree(per)), "rank-ms")
        return
    rank = int(pick)
    diff, nodes = profiles.differential_and_nodes(per, [rank])
    grown = diff[diff["added_s"] > 0].head(10)
    st.markdown(f"**Where rank {rank} spends more than its peers' median**")
    if grown.empty:
        st.caption(f"Rank {rank} spends no more time than its peers' median in any call path.")
    else:
        top = grown.iloc[0]
        st.markdown(f"Most added: `{top['function']}`, {top['added_s']:.1f} s more than its peers' median")
        st.dataframe(pd.DataFrame({"function": grown["function"], "added s": grown["added_s"].round(2),
                                   f"rank {rank} s": grown["target_s"].round(2),
                                   "peers' median s": grown["peers_median_s"].round(2), "call path": grown["path"]}),
                     hide_index=True, key=f"{key}_diff")
    added = dict(zip(nodes["node"], nodes["added_s"], strict=True))
    flame_chart.icicle_chart(flame.icicle(_tree(per[per["rank"] == rank])), "ms", added=added)


def _tree(per: pd.DataFrame) -> pd.DataFrame:
    """The flame graph's tree of rows of path and seconds (``(other)``, the samples that left the
    messages, is not drawn)."""
    paths = per["path"].astype(str)
    return flame.sampled_tree(paths.where(paths != profiles.OTHER, ""), per["seconds"] * 1e9)
