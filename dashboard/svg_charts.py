"""Charts drawn as plain SVG on the server: the rank x step heatmap of a large job and the icicle
(flame graph). Pure functions from frames to SVG text; :func:`show` puts one on the page.

The browser lays out an SVG of a few thousand shapes without running a charting library. Measured
with ``python -m benchmarks.job_page`` (the Job page of a 10,000-rank job, 2 cores): drawn by
Vega-Lite, the heatmap and the flame graph kept the browser's main thread busy about 0.3 s longer,
and the page took 2.0 s (median of 5 visits) instead of 1.7 s. Tooltips are each shape's
``<title>``, as in flamegraph.pl's SVGs. Positions across are percentages, so the drawing fills the
page's width and its text keeps its size.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

import pandas as pd
import streamlit as st

#: Matplotlib's "inferno", sampled at 10 even steps (low values dark, high values light).
INFERNO = ("#000004", "#1b0c41", "#4a0c6b", "#781c6d", "#a52c60", "#cf4446", "#ed6925", "#fb9b06", "#f7d13d",
           "#fcffa4")
#: ColorBrewer's RdBu, reversed: blue below zero, white at zero, red above.
BLUE_WHITE_RED = ("#2166ac", "#4393c3", "#92c5de", "#d1e5f0", "#f7f7f7", "#fddbc7", "#f4a582", "#d6604d", "#b2182b")
#: Tableau 20: a frame's colour by its name (one function keeps its colour across the graph).
TABLEAU20 = ("#4c78a8", "#9ecae9", "#f58518", "#ffbf79", "#54a24b", "#88d27a", "#b79a20", "#f2cf5b", "#439894",
             "#83bcb6", "#e45756", "#ff9d98", "#79706e", "#bab0ac", "#d67195", "#fcbfd2", "#b279a2", "#d6a5c9",
             "#9e765f", "#d8b5a5")

FONT = 'font-family="sans-serif" font-size="11"'
FLAME_ROW = 22               # px per frame row


@dataclass(frozen=True)
class Svg:
    """An SVG drawing and its height in pixels. Horizontal positions are percentages of the width it
    is given, so text keeps its size at any width."""
    text: str
    height: int


def _pct(v: float) -> str:
    return f"{v:.3f}%"


def _hex(rgb: Sequence[float]) -> str:
    return "#" + "".join(f"{max(0, min(255, round(c))):02x}" for c in rgb)


def _rgb(colour: str) -> tuple[int, int, int]:
    return int(colour[1:3], 16), int(colour[3:5], 16), int(colour[5:7], 16)


def ramp(palette: Sequence[str], t: float) -> str:
    """The colour at ``t`` in [0, 1] along ``palette`` (linear between its stops; NaN: light grey)."""
    if t is None or math.isnan(t):
        return "#dddddd"
    t = min(1.0, max(0.0, float(t))) * (len(palette) - 1)
    i = min(int(t), len(palette) - 2)
    a, b = _rgb(palette[i]), _rgb(palette[i + 1])
    f = t - i
    return _hex([x + (y - x) * f for x, y in zip(a, b, strict=True)])


def name_colour(name: str) -> str:
    """A stable Tableau 20 colour for a frame's name (the same in every graph and every process)."""
    return TABLEAU20[int(hashlib.blake2b(name.encode(), digest_size=2).hexdigest(), 16) % len(TABLEAU20)]


def _num(v: float) -> str:
    return f"{v:.1f}".rstrip("0").rstrip(".") if abs(v) < 1e6 else f"{v:.0f}"


def heatmap_svg(frame: pd.DataFrame, value: str, title: str, row_label: str = "rank",
                row_names: str | None = None, worst: str | None = None, worst_title: str = "") -> Svg:
    """A rank x step heatmap: one cell per row of ``frame`` (columns ``rank``, ``step``, ``value``),
    ranks down, steps across, coloured by ``value`` along :data:`INFERNO`. With binned ranks,
    ``row_names`` names each row's range of ranks and ``worst`` the rank whose value the cell shows;
    both are in the cell's tooltip."""
    steps = sorted(int(s) for s in frame["step"].unique())
    rows = sorted(int(r) for r in frame["rank"].unique())
    col_of = {s: i for i, s in enumerate(steps)}
    row_of = {r: i for i, r in enumerate(rows)}
    left, right = 7.0, 99.0            # the cells' span, % of the width
    top, legend = 6, 50                # px
    cell_h = 4 if len(rows) > 40 else 12
    cell_w = (right - left) / max(len(steps), 1)
    base = top + cell_h * len(rows)
    values = pd.to_numeric(frame[value], errors="coerce")
    lo, hi = (float(values.min()), float(values.max())) if values.notna().any() else (0.0, 0.0)
    span = (hi - lo) or 1.0
    out = [f'<svg class="rs-heatmap" xmlns="http://www.w3.org/2000/svg" width="100%" height="{base + legend}" '
           f'{FONT} role="img" aria-label="{escape(title)}">']
    names = frame[row_names] if row_names else frame["rank"]
    worsts = frame[worst] if worst else [None] * len(frame)
    for r, s, v, name, w in zip(frame["rank"], frame["step"], values, names, worsts, strict=True):
        tip = f"{row_label} {name} · step {int(s)} · {title} {'n/a' if math.isnan(v) else _num(v)}"
        if w is not None:
            tip += f" · {worst_title} {int(w)}"
        out.append(f'<rect x="{_pct(left + col_of[int(s)] * cell_w)}" y="{top + row_of[int(r)] * cell_h}" '
                   f'width="{_pct(cell_w * 1.02)}" height="{cell_h}" fill="{ramp(INFERNO, (v - lo) / span)}">'
                   f'<title>{escape(tip)}</title></rect>')
    # rank labels down the left (about every 10th row), step labels under the cells
    every = max(1, len(rows) // 10)
    for r in rows[::every]:
        out.append(f'<text x="{_pct(left - 0.5)}" y="{top + row_of[r] * cell_h + min(cell_h, 10)}" '
                   f'text-anchor="end">{r}</text>')
    every = max(1, math.ceil(len(steps) / 12))
    for s in steps[::every]:
        out.append(f'<text x="{_pct(left + col_of[s] * cell_w)}" y="{base + 13}">{s}</text>')
    out.append(f'<text x="{_pct(right)}" y="{base + 13}" text-anchor="end">step</text>')
    # the colour scale: a gradient from the lowest to the highest value
    stops = "".join(f'<stop offset="{i / (len(INFERNO) - 1):.2f}" stop-color="{c}"/>' for i, c in enumerate(INFERNO))
    y = base + 22
    out.append(f'<defs><linearGradient id="rs-inferno">{stops}</linearGradient></defs>'
               f'<rect x="{_pct(left)}" y="{y}" width="20%" height="10" fill="url(#rs-inferno)"/>'
               f'<text x="{_pct(left)}" y="{y + 22}">{_num(lo)}</text>'
               f'<text x="{_pct(left + 20)}" y="{y + 22}" text-anchor="end">{_num(hi)}</text>'
               f'<text x="{_pct(left + 21)}" y="{y + 9}">{escape(title)}</text>')
    out.append("</svg>")
    return Svg("".join(out), base + legend)


def icicle_svg(ice: pd.DataFrame, unit: str, added: dict[tuple[str, ...], float] | None = None) -> Svg:
    """The icicle of a :func:`rankscope.dashboard.flame.icicle` layout: width = inclusive time, callees
    below their callers, each frame named by its ``label`` (the name cut to its width; a frame's
    own ``<svg>`` clips what still overflows). Frames are coloured by name, or with ``added`` (call
    path -> seconds more than the peers' median) along :data:`BLUE_WHITE_RED`, symmetric about zero:
    the paths that grew red."""
    total = float(ice["x1"].max()) or 1.0
    height = (int(ice["depth"].max()) + 1) * FLAME_ROW
    grown = None
    if added is not None:
        grown = [added.get(tuple(p[1:]), 0.0) for p in ice["path"]]
        top = max((abs(g) for g in grown), default=0.0) or 1.0
    out = [f'<svg class="rs-flame" xmlns="http://www.w3.org/2000/svg" width="100%" height="{height}" {FONT} '
           'role="img" aria-label="flame graph">']
    rows = zip(ice["path"], ice["x0"], ice["x1"], ice["depth"], ice["name"], ice["label"], ice["total_ms"],
               ice["self_ms"], ice["share"], ice["calls"], strict=True)
    for i, (path, x0, x1, d, name, label, total_ms, self_ms, share, calls) in enumerate(rows):
        frames = " → ".join(path[1:]) or "all"
        tip = (f"{frames} · total {_num(total_ms)} {unit} · self {_num(self_ms)} {unit} · {share:.1%}"
               + (f" · {int(calls)} calls" if grown is None else f" · {grown[i]:+.3f} s against the peers' median"))
        fill = name_colour(str(name)) if grown is None else ramp(BLUE_WHITE_RED, 0.5 + grown[i] / top / 2)
        out.append(f'<svg x="{_pct(100 * float(x0) / total)}" y="{int(d) * FLAME_ROW}" '
                   f'width="{_pct(100 * (float(x1) - float(x0)) / total)}" height="{FLAME_ROW - 1}">'
                   f'<title>{escape(tip)}</title><rect width="100%" height="100%" fill="{fill}" stroke="white"/>'
                   + (f'<text x="3" y="15">{escape(str(label))}</text>' if label else "") + "</svg>")
    out.append("</svg>")
    return Svg("".join(out), height)


def show(svg: Svg) -> None:
    """Put an SVG of this module on the page (:func:`page_html`)."""
    st.html(page_html(svg), unsafe_allow_javascript=True)


#: A drawing's text as a JavaScript string in its script: "<" written as an escape, because
#: st.html's sanitiser (DOMPurify) drops a script whose text holds markup ("<" then a letter, "/"
#: or "!"), and so that nothing in it can close the script.
_PAYLOAD = re.compile(r"\.innerHTML = (\".*\");</script>$", re.S)


def page_html(svg: Svg) -> str:
    """An SVG of this module as ``st.html`` takes it: a box of the drawing's height, black on white
    (it reads the same under a dark theme), and a script that puts the drawing in it. In the page,
    not in a frame of its own: ``st.html`` sanitises SVG away, so the script carries it; a frame
    (``st.iframe``) costs the browser a document of its own, and the Job page of a 10,000-rank job
    took 0.16 s longer with its two drawings in frames (benchmarks/job_page.py, alternating visits);
    as Markdown a drawing of a few hundred kilobytes is parsed as Markdown first (0.5 s slower).
    The script runs what it is given: every text from the store is escaped where the SVG is built,
    and the drawing is a JSON string in it."""
    payload = json.dumps(svg.text).replace("<", "\\u003c")
    return (f'<div style="background:#fff;color:#000;height:{svg.height + 4}px;overflow:hidden"></div>'
            f"<script>document.currentScript.previousElementSibling.innerHTML = {payload};</script>")


def svg_of(html: str) -> str:
    """The drawing that :func:`page_html` carries ("" for any other HTML)."""
    m = _PAYLOAD.search(html)
    return str(json.loads(m.group(1))) if m else ""
