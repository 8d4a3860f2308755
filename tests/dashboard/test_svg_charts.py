"""The server-drawn SVG charts (rankscope.dashboard.svg_charts): well-formed SVG, one shape per cell
or frame, the tooltips a user hovers, colours along their scales, store text escaped."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pandas as pd
import pytest

from rankscope.dashboard import flame, svg_charts
from rankscope.dashboard.svg_charts import (
    BLUE_WHITE_RED,
    INFERNO,
    heatmap_svg,
    icicle_svg,
    page_html,
    ramp,
    svg_of,
)

NS = "{http://www.w3.org/2000/svg}"


def parse(svg: svg_charts.Svg) -> ET.Element:
    root = ET.fromstring(svg.text)
    assert root.tag == f"{NS}svg" and root.get("height") == str(svg.height)
    return root


def test_ramp_runs_from_the_first_stop_to_the_last():
    assert ramp(INFERNO, 0.0) == INFERNO[0] and ramp(INFERNO, 1.0) == INFERNO[-1]
    assert ramp(INFERNO, -3) == INFERNO[0] and ramp(INFERNO, 7) == INFERNO[-1]
    assert ramp(BLUE_WHITE_RED, 0.5) == "#f7f7f7"          # zero is white
    assert ramp(INFERNO, float("nan")) == "#dddddd"
    assert svg_charts.name_colour("train.py:3 f") == svg_charts.name_colour("train.py:3 f")


def test_heatmap_has_a_cell_per_rank_and_step_coloured_by_value():
    frame = pd.DataFrame({"rank": [0, 0, 1, 1], "step": [0, 4, 0, 4], "busy_ms": [10.0, 10.0, 10.0, 40.0]})
    svg = heatmap_svg(frame, "busy_ms", "busy ms")
    root = parse(svg)
    cells = [r for r in root.iter(f"{NS}rect") if r.find(f"{NS}title") is not None]
    assert len(cells) == 4
    tips = {c.find(f"{NS}title").text: c.get("fill") for c in cells}
    assert tips["rank 1 · step 4 · busy ms 40"] == INFERNO[-1]      # the highest value: the scale's top
    assert tips["rank 0 · step 0 · busy ms 10"] == INFERNO[0]
    # the columns follow the steps across, the rows the ranks down
    x = {c.find(f"{NS}title").text: (float(c.get("x").rstrip("%")), int(c.get("y"))) for c in cells}
    assert x["rank 0 · step 0 · busy ms 10"][0] < x["rank 0 · step 4 · busy ms 10"][0]
    assert x["rank 0 · step 0 · busy ms 10"][1] < x["rank 1 · step 0 · busy ms 10"][1]


def test_binned_heatmap_names_each_cells_ranks_and_worst_rank():
    frame = pd.DataFrame({"rank": [0, 100], "step": [0, 0], "ranks": ["0-99", "100-199"],
                          "step_ms": [5.0, 9.0], "worst_step_ms": [7, 142]})
    root = parse(heatmap_svg(frame, "step_ms", "step ms", row_label="ranks", row_names="ranks",
                             worst="worst_step_ms", worst_title="slowest rank"))
    tips = [t.text for t in root.iter(f"{NS}title")]
    assert tips == ["ranks 0-99 · step 0 · step ms 5 · slowest rank 7",
                    "ranks 100-199 · step 0 · step ms 9 · slowest rank 142"]


def icicle_of(paths: dict[str, float]) -> pd.DataFrame:
    return flame.icicle(flame.sampled_tree(pd.Series(list(paths)), pd.Series(list(paths.values())) * 1e9))


def test_icicle_has_a_frame_per_node_with_its_call_path_and_escapes_names():
    ice = icicle_of({"main;step;<lambda>": 3.0, "main;step;load & parse": 1.0})
    svg = icicle_svg(ice, "ms")
    root = parse(svg)     # well-formed: the names' < and & are escaped
    frames = root.findall(f"{NS}svg")
    assert len(frames) == len(ice)
    tips = [f.find(f"{NS}title").text for f in frames]
    assert any(t.startswith("main → step → <lambda> · total 3000 ms") for t in tips), tips
    assert any(t.startswith("main → step → load & parse · total 1000 ms") for t in tips), tips
    assert svg.height == svg_charts.FLAME_ROW * (int(ice["depth"].max()) + 1)
    # the root spans the whole width; a callee taking 3/4 of the time spans 3/4 of it
    widths = {f.find(f"{NS}title").text.split(" · ")[0]: float(f.get("width").rstrip("%")) for f in frames}
    assert widths["all"] == pytest.approx(100.0) and widths["main → step → <lambda>"] == pytest.approx(75.0)


def test_differential_icicle_colours_what_grew_red_and_what_shrank_blue():
    ice = icicle_of({"main;grew": 2.0, "main;shrank": 2.0, "main;same": 1.0})
    added = {("main", "grew"): 1.5, ("main", "shrank"): -0.5}
    root = parse(icicle_svg(ice, "ms", added=added))
    fill = {f.find(f"{NS}title").text.split(" · ")[0]: f.find(f"{NS}rect").get("fill") for f in root.findall(f"{NS}svg")}
    assert fill["main → grew"] == BLUE_WHITE_RED[-1]           # the most added: the reddest
    assert fill["main → same"] == "#f7f7f7"                      # nothing added: white
    assert fill["main → shrank"] == ramp(BLUE_WHITE_RED, 0.5 - 0.5 / 1.5 / 2)


def test_a_drawing_goes_on_the_page_as_a_script_without_markup_in_its_text():
    """st.html's sanitiser drops a script whose text holds markup, and nothing in a drawing may close
    the script: its text has no "<" at all, and the drawing comes back whole."""
    svg = heatmap_svg(pd.DataFrame({"rank": [0], "step": [1], "busy_ms": [2.0]}), "busy_ms", "</script><b>x")
    html = page_html(svg)
    script = html.split("<script>", 1)[1].removesuffix("</script>")
    assert "<" not in script and html.startswith("<div") and f"height:{svg.height + 4}px" in html
    assert svg_of(html) == svg.text and "&lt;/script&gt;" in svg_of(html)
    assert svg_of("<p>not a drawing</p>") == ""
