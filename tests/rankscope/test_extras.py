"""Which extra a command needs, and the run-time torch version check."""

from __future__ import annotations

import logging
import types

import pytest

from rankscope import torch_check
from rankscope.cli import extras
from rankscope.cli.extras import MissingExtra


def test_require_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(extras.EXTRAS, "processors", ("json", "no_such_module_rankscope"))
    with pytest.raises(MissingExtra) as e:
        extras.require("rankscope processors", "processors", "gpu")
    assert e.value.missing == ["no_such_module_rankscope"] and e.value.extras == ["processors"]
    assert "rankscope processors needs no_such_module_rankscope" in str(e.value)
    assert "pip install 'rankscope[processors]'" in str(e.value)
    extras.require("x", "sink")  # installed here: no error


def test_extra_for_and_store_extras() -> None:
    assert extras.extra_for("faust.worker") == "processors"
    assert extras.extra_for("chdb") == "embedded"
    assert extras.extra_for("torch") is None and extras.extra_for(None) is None
    assert extras.store_extras(True) == ("sink", "embedded") and extras.store_extras(False) == ("sink",)


@pytest.mark.parametrize(("version", "problem"), [("2.15.0+cu130", None), ("2.13.1", None), ("2.12.0", "older"),
                                                  ("2.16.0a0+git", "newer"), ("3.0.0", "newer"),
                                                  ("nightly", "cannot read")])
def test_torch_version_problem(version: str, problem: str | None) -> None:
    got = torch_check.version_problem(version)
    assert (got is None) if problem is None else (problem in got and version in got)


def test_check_torch_warns_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(torch_check, "_CHECKED", {})
    old = types.SimpleNamespace(__version__="2.1.0")
    with caplog.at_level(logging.WARNING, logger="rankscope.torch_check"):
        assert torch_check.check_torch(old) == "2.1.0"
        assert torch_check.check_torch(old) == "2.1.0"
    assert [r.getMessage() for r in caplog.records if "older than the tested range" in r.getMessage()] \
        and len(caplog.records) == 1


def test_check_torch_with_the_installed_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch_check, "_CHECKED", {})
    assert torch_check.check_torch() == torch.__version__
    assert torch_check.version_problem(torch.__version__) is None  # the suite runs a tested torch
