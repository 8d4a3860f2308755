"""The README documents every setting (its env var) and follows the order its readers need."""

from __future__ import annotations

import re
from pathlib import Path

from rankscope.config import Settings

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_every_setting_has_a_row_in_the_settings_table():
    settings = README.split("\n## Settings", 1)[1].split("\n## ", 1)[0]
    rows = {name for line in settings.splitlines() if line.startswith("| RANKSCOPE_")
            for name in re.findall(r"RANKSCOPE_[A-Z0-9_]+", line.split("|")[1])}
    assert sorted(set(Settings.env_names()) - rows) == []


def test_sections_come_in_the_readers_order():
    heads = [h for h in re.findall(r"^## (.+)$", README, flags=re.M)]
    order = ["The two commands", "Instrumenting a training script", "What you see", "CLI", "Settings"]
    assert [h for h in heads if h in order] == order
    assert heads.index("Settings") < heads.index("Production") < heads.index("Benchmarks")
