"""rankscope.cli.logs: text and JSON lines, the root handler it installs, and secrets masked."""

from __future__ import annotations

import io
import json
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from rankscope.cli import logs
from rankscope.config import ConfigError, Settings


@pytest.fixture(autouse=True)
def keep_root_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)
    logging.captureWarnings(False)


@dataclass(frozen=True)
class SecretSettings:
    """A stand-in with secret fields like the ones Settings may carry."""

    log_format: str = "json"
    log_level: str = "INFO"
    kafka_sasl_password: str = field(default="hunter2-sasl", repr=False)
    clickhouse_password: str = "ch-pass-99"
    api_token: str = ""
    topic_prefix: str = "rankscope."


def _lines(buf: io.StringIO) -> list[str]:
    return [ln for ln in buf.getvalue().splitlines() if ln]


def test_json_lines_carry_ts_level_logger_message_service() -> None:
    buf = io.StringIO()
    logs.configure(Settings.from_env({}, log_format="json"), service="sink", stream=buf)
    logging.getLogger("rankscope.sink").warning("wrote %d rows", 5)
    logging.getLogger("other.lib").info("info line")
    logging.getLogger("other.lib").debug("not shown at INFO")
    lines = _lines(buf)
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert set(first) == {"ts", "level", "logger", "message", "service"}
    assert first["level"] == "WARNING" and first["logger"] == "rankscope.sink"
    assert first["message"] == "wrote 5 rows" and first["service"] == "sink"
    assert first["ts"].endswith("Z") and "T" in first["ts"]
    assert json.loads(lines[1])["logger"] == "other.lib"


def test_json_exception_is_one_line_with_exc() -> None:
    buf = io.StringIO()
    logs.configure(Settings.from_env({}, log_format="json"), service="processors", stream=buf)
    try:
        raise RuntimeError("boom\nsecond line")
    except RuntimeError:
        logging.getLogger("x").exception("failed")
    (line,) = _lines(buf)
    obj = json.loads(line)
    assert obj["message"] == "failed" and "RuntimeError: boom" in obj["exc"] and "Traceback" in obj["exc"]


def test_text_format_and_level() -> None:
    buf = io.StringIO()
    logs.configure(Settings.from_env({}, log_level="WARNING"), service="serve", stream=buf)
    logging.getLogger("a.b").info("hidden")
    logging.getLogger("a.b").warning("shown")
    (line,) = _lines(buf)
    assert line.endswith("WARNING a.b: shown")
    with pytest.raises(json.JSONDecodeError):
        json.loads(line)


def test_configure_replaces_the_root_handlers_and_captures_warnings() -> None:
    buf1, buf2 = io.StringIO(), io.StringIO()
    logs.configure(Settings.from_env({}), service="a", stream=buf1)
    logs.configure(Settings.from_env({}, log_format="json"), service="b", stream=buf2)
    assert len(logging.getLogger().handlers) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("deprecated thing", DeprecationWarning, stacklevel=1)
    logging.getLogger("z").warning("once")
    assert buf1.getvalue() == ""
    messages = [json.loads(ln)["message"] for ln in _lines(buf2)]
    assert messages[-1] == "once" and any("deprecated thing" in m for m in messages)


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_secret_settings_and_url_passwords_are_masked(fmt: str) -> None:
    settings = SecretSettings(log_format=fmt)
    buf = io.StringIO()
    logs.configure(settings, service="sink", stream=buf)
    log = logging.getLogger("rankscope.test")
    log.warning("sasl.password=%s", settings.kafka_sasl_password)
    log.warning("store http://default:%s@127.0.0.1:8123/db", settings.clickhouse_password)
    log.warning("dsn https://alice:other-secret@127.0.0.1:8443 and %r", settings)
    try:
        raise ValueError(f"login failed with {settings.kafka_sasl_password}")
    except ValueError:
        log.exception("auth")
    out = buf.getvalue()
    assert "hunter2-sasl" not in out and "ch-pass-99" not in out and "other-secret" not in out
    assert out.count(logs.MASK) >= 4
    assert "http://default:***@127.0.0.1:8123/db" in out and "https://alice:***@127.0.0.1:8443" in out


def test_secrets_of_picks_secret_names_only() -> None:
    assert logs.secrets_of(SecretSettings()) == ["hunter2-sasl", "ch-pass-99"]
    assert logs.mask("prefix rankscope. stays", logs.secrets_of(SecretSettings())) == "prefix rankscope. stays"
    assert logs.mask("ftp://u@host no password") == "ftp://u@host no password"


def test_log_format_is_validated() -> None:
    with pytest.raises(ConfigError, match="log_format"):
        Settings.from_env({"RANKSCOPE_LOG_FORMAT": "xml"})
