"""Trace windows of a job: request one (or a schedule) and stop, see the ranks' acks, list windows,
export a window as a Chrome/Perfetto trace, and a flame graph of its Python call paths."""

from functools import partial

import pandas as pd
import streamlit as st

from rankscope.config import Settings
from rankscope.dashboard import control, flame, flame_chart, queries, ui
from rankscope.storage.chrome_trace import chrome_trace_json
from rankscope.storage.store import StoreError

ACK_BADGE = {"accepted": ":green-badge[accepted]", "queued": ":blue-badge[queued]", "done": ":green-badge[done]",
             "stopped": ":gray-badge[stopped]", "rejected": ":red-badge[rejected]"}
ALL_RANKS = "all ranks"


def request_form(cfg: Settings, job: str) -> None:
    with st.form("trace_request", border=True):
        st.markdown("**Request a trace window**")
        c = st.columns([2, 1, 2, 1, 1])
        ranks_text = c[0].text_input("Ranks", placeholder="all ranks, or e.g. 0-3,8",
                                     help="Ranges and single ranks, comma-separated; empty = every rank.")
        steps = c[1].number_input("Steps", min_value=1, max_value=10_000, value=3, help="Steps per window.")
        mode = c[2].selectbox("Mode", list(control.MODES), format_func=lambda m: control.MODE_LABELS[m])
        every_s = c[3].number_input("N seconds", min_value=1.0, max_value=604_800.0, value=60.0, step=10.0,
                                    help="Used by the mode 'every N seconds'.")
        every_steps = c[4].number_input("K steps", min_value=1, max_value=10_000_000, value=100,
                                        help="Used by the mode 'every K steps' (K >= steps).")
        o = st.columns([2, 2, 3])
        with_stack = o[0].checkbox("Python call paths", value=True, help="Needed for the flame graph.")
        shapes = o[1].checkbox("Tensor shapes", value=False, help="More detail, more overhead.")
        b = st.columns([1, 1, 4])
        go = b[0].form_submit_button("Request window", type="primary", icon=":material/play_arrow:")
        stop = b[1].form_submit_button("Stop windows", icon=":material/stop:",
                                       help="Stops running windows and schedules on the chosen ranks.")
    if go or stop:
        submit(cfg, job, ranks_text, int(steps), str(mode), float(every_s), int(every_steps), with_stack, shapes,
               stop=bool(stop))
    last = st.session_state.get("trace_acks")
    if last and last["job"] == job:
        show_acks(last)


def submit(cfg: Settings, job: str, ranks_text: str, steps: int, mode: str, every_s: float, every_steps: int,
           with_stack: bool, shapes: bool, stop: bool) -> None:
    try:
        ranks = control.parse_ranks(ranks_text)
        req = control.TraceRequest(job=job, ranks=ranks, steps=steps, mode=mode, every_s=every_s,
                                    every_steps=every_steps, with_stack=with_stack, with_shapes=shapes, stop=stop)
    except ValueError as e:
        st.error(f"Not sent: {e}")
        return
    known = ui.query(cfg, "ranks", job=job, dead_after_s=cfg.dead_after_s)
    alive = [int(r) for r, s in zip(known["rank"], known["state"], strict=True) if s not in ("exited", "dead")]
    if ranks is not None:
        missing = sorted(set(ranks) - {int(r) for r in known["rank"]})
        if missing:
            st.error(f"Not sent: job {job} has no rank {ui.rank_list(missing)}; its ranks are "
                     f"{ui.rank_list(sorted(int(r) for r in known['rank']))}.")
            return
    targets = sorted(set(ranks) & set(alive)) if ranks is not None else alive
    what = "stop" if stop else f"{steps}-step window ({control.MODE_LABELS[mode]})"
    with st.spinner(f"Sending {what} to job {job} and reading acknowledgements for {control.ACK_WAIT_S:g} s…"):
        try:
            acks = control.request_window(cfg, req, expect_ranks=targets or None)
        except RuntimeError as e:
            st.error(f"Not sent: {e}")
            return
    stalled = None if stop else control.stalled_note(
        job, dict(zip(known["rank"].astype(int), known["state"].astype(str), strict=True)), targets)
    st.session_state["trace_acks"] = {"job": job, "request_id": req.request_id, "what": what, "acks": acks,
                                      "targets": targets, "stalled": stalled}


def show_acks(last: dict) -> None:
    acks: list[control.Ack] = last["acks"]
    answered = {a.rank for a in acks}
    silent = sorted(set(last["targets"]) - answered)
    st.markdown(f"Request `{last['request_id']}` ({last['what']}): "
                + (", ".join(f"{ACK_BADGE.get(s, s)} ×{n}" for s, n in
                             pd.Series([a.status for a in acks]).value_counts().items()) or "no answer"))
    if acks:
        st.dataframe(pd.DataFrame({"rank": [a.rank for a in acks], "status": [a.status for a in acks],
                                   "detail": [a.detail for a in acks], "window": [a.window_id for a in acks]}),
                     hide_index=True)
    if last.get("stalled"):
        st.warning(last["stalled"], icon="⏸️")
    if acks and not last["what"].startswith("stop"):
        st.markdown(f"Its report, once the window is analysed: [Reports](reports?job={last['job']}"
                    f"&window={last['request_id']})")
    if not acks:
        st.warning(f"No acknowledgement within {control.ACK_WAIT_S:g} s: the ranks are not running, cannot "
                   "reach Kafka, or run with RANKSCOPE_CONTROL_ENABLED=0. Windows that start later still "
                   "appear in the list below.", icon="📭")
    elif silent:
        st.caption(f"No answer yet from ranks {ui.rank_list(silent)}.")


def windows_panel(cfg: Settings, job: str) -> None:
    wins = ui.query(cfg, "trace_windows", job=job)
    if wins.empty:
        st.info(f"No trace windows for {job} yet. Request one above, or from a shell: "
                f"`rankscope trace --job {job} --steps 3`.", icon="🔬")
        return
    st.dataframe(
        wins.assign(ranks=wins["ranks"].map(ui.rank_list),
                    steps=[f"{a}–{b}" for a, b in zip(wins["first_step"], wins["last_step"], strict=True)],
                    truncated=wins["truncated_ranks"].map(lambda n: f"{n} rank{'s' if n != 1 else ''}" if n else "")),
        hide_index=True,
        column_order=["window_id", "status", "ranks", "steps", "events", "truncated", "start", "duration_s"],
        column_config={"window_id": "Window", "status": "Status", "ranks": "Ranks", "steps": "Steps",
                       "events": st.column_config.NumberColumn("Events", format="%d"),
                       "truncated": st.column_config.TextColumn(
                           "Truncated", help="Ranks whose events hit the byte budget (the rest was dropped)"),
                       "start": st.column_config.DatetimeColumn("Started (UTC)", format="YYYY-MM-DD HH:mm:ss"),
                       "duration_s": st.column_config.NumberColumn("Duration s", format="%.2f")})


def window_detail(cfg: Settings, job: str) -> None:
    wins = ui.query(cfg, "trace_windows", job=job)
    if wins.empty:
        return
    labels = {w: f"{w} · {s} · steps {a}–{b}" for w, s, a, b in
              zip(wins["window_id"], wins["status"], wins["first_step"], wins["last_step"], strict=True)}
    wid = str(st.selectbox("Window", list(labels), format_func=lambda w: labels[w], key="trace_window_pick"))
    row = wins[wins["window_id"] == wid].iloc[0]
    per_rank = ui.query(cfg, "trace_window_ranks", job=job, window_id=wid)
    with st.expander(f"Ranks of {wid} ({len(per_rank)})"):
        st.dataframe(per_rank, hide_index=True)
    store = ui.store_or_warn(cfg)
    if store is None:
        return
    events = int(row["events"])
    c = st.columns([2, 5])
    c[0].download_button(
        "Chrome / Perfetto trace", icon=":material/download:", on_click="ignore", mime="application/json",
        file_name=f"{job}-{wid}.trace.json", disabled=events == 0,
        data=partial(_trace_json, store, job, wid))
    c[1].caption(f"{events:,} events from {len(row['ranks'])} rank(s); open the file in "
                 "[ui.perfetto.dev](https://ui.perfetto.dev) or chrome://tracing. One process per rank, one "
                 "thread per GPU stream or host thread." + (" Some ranks were truncated to their byte budget."
                                                             if row["truncated_ranks"] else ""))

    st.subheader("Flame graph (Python call paths)")
    py_ranks = ui.query(cfg, "window_event_ranks", job=job, window_id=wid)
    if not py_ranks:
        st.caption("No Python call paths in this window; request windows with **Python call paths** on.")
        return
    pick = st.selectbox("Rank", [ALL_RANKS, *py_ranks], key="flame_rank",
                        help="'all ranks' adds the ranks' time together (rank-milliseconds).")
    ev = ui.query(cfg, "trace_events", job=job, window_id=wid, categories=["python"],
                  ranks=None if pick == ALL_RANKS else [int(pick)])
    flame_chart.icicle_chart(flame.icicle(flame.call_tree(ev)), "rank-ms" if pick == ALL_RANKS else "ms",
                             empty="The Python events of this window have no duration.")


def _trace_json(store, job: str, window_id: str) -> bytes:
    return chrome_trace_json(queries.trace_events(store, job, window_id), job=job, window_id=window_id)


st.title("Trace windows")
cfg = ui.connect()
chosen = ui.choose_job(cfg) if cfg is not None else None
if cfg is not None and chosen is not None:
    request_form(cfg, chosen)
    st.subheader("Windows")
    ui.live(cfg, partial(windows_panel, cfg, chosen))
    try:
        window_detail(cfg, chosen)
    except StoreError as e:
        st.warning(f"The store did not answer: {e}")
