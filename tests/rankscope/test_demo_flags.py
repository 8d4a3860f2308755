"""`rankscope demo`'s job flags: a hang planted by a file or by time replaces the one at a step."""

from __future__ import annotations

from rankscope.cli import build_parser
from rankscope.cli.commands.demo import _hang_said, _train_flags


def flags(*argv: str) -> dict[str, str]:
    args = build_parser().parse_args(["demo-job", *argv])
    out = _train_flags(args)
    return dict(zip(out[::2], out[1::2], strict=True))


def test_the_default_hang_is_at_step_600() -> None:
    f = flags()
    assert f["--hang-at-step"] == "600" and f["--hang-after-s"] == "0.0" and f["--hang-when-file"] == ""
    assert _hang_said(build_parser().parse_args(["demo"])) == "at step 600"


def test_a_hang_file_replaces_the_step() -> None:
    f = flags("--hang-when-file", "/tmp/x", "--hang-rank", "2")
    assert f["--hang-at-step"] == "-1" and f["--hang-when-file"] == "/tmp/x" and f["--hang-rank"] == "2"
    assert _hang_said(build_parser().parse_args(["demo", "--hang-when-file", "/tmp/x"])) == "once /tmp/x exists"


def test_a_hang_in_time_replaces_the_step() -> None:
    f = flags("--hang-after-s", "40")
    assert f["--hang-at-step"] == "-1" and f["--hang-after-s"] == "40.0"
    assert _hang_said(build_parser().parse_args(["demo", "--hang-after-s", "40"])) == "40 s in"
