"""Log set-up of a rankscope process: one handler on stderr, text or JSON lines, secrets masked.

:func:`configure` is called once at each service's start-up (the CLI does it for every command)
with the process's :class:`~rankscope.config.Settings`; ``log_format`` chooses the line format:

- ``text``: ``2026-12-02 00:50:00,123 WARNING rankscope.processors: message``;
- ``json``: one object per line, ``{"ts": "2026-12-02T00:50:00.123Z", "level": "WARNING", "logger":
  "rankscope.processors", "message": "...", "service": "processors"}``, plus ``exc`` (the formatted
  traceback) when the record carries one.

The settings themselves are never logged. Every line passes through :func:`mask`: the values of the
secret settings (a name containing ``password``, ``secret`` or ``token``) and the password part of
any ``scheme://user:password@host`` URL are replaced by ``***``.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Iterable
from dataclasses import fields
from typing import IO, Any

SECRET_NAME = re.compile(r"password|passwd|secret|token", re.IGNORECASE)
URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)[^@\s/]+(?P<tail>@)")
MASK = "***"
MIN_SECRET_LEN = 3   # shorter values would mask ordinary words
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def secrets_of(settings: Any) -> list[str]:
    """The non-empty values of the secret settings of ``settings`` (a dataclass), longest first."""
    values = {str(getattr(settings, f.name)) for f in fields(settings) if SECRET_NAME.search(f.name)}
    return sorted((v for v in values if len(v) >= MIN_SECRET_LEN), key=len, reverse=True)


def mask(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with each of ``secrets`` and every URL password replaced by ``***``."""
    for s in secrets:
        if s in text:
            text = text.replace(s, MASK)
    if "://" in text:
        text = URL_PASSWORD.sub(lambda m: f"{m['head']}{MASK}{m['tail']}", text)
    return text


class TextFormatter(logging.Formatter):
    """The plain format (:data:`TEXT_FORMAT`), masked."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__(TEXT_FORMAT)
        self.secrets = list(secrets)

    def format(self, record: logging.LogRecord) -> str:
        return mask(super().format(record), self.secrets)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts (UTC, ISO 8601, milliseconds), level, logger, message, service,
    and exc/stack when the record has them; every string masked."""

    def __init__(self, service: str, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self.service = service
        self.secrets = list(secrets)

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        obj: dict[str, str] = {"ts": ts, "level": record.levelname, "logger": record.name,
                               "message": mask(record.getMessage(), self.secrets), "service": self.service}
        if record.exc_info:
            obj["exc"] = mask(self.formatException(record.exc_info), self.secrets)
        elif record.exc_text:
            obj["exc"] = mask(record.exc_text, self.secrets)
        if record.stack_info:
            obj["stack"] = mask(self.formatStack(record.stack_info), self.secrets)
        return json.dumps(obj, ensure_ascii=False)


def configure(settings: Any, service: str, stream: IO[str] | None = None) -> logging.Handler:
    """Make the root logger write to ``stream`` (default stderr) in ``settings.log_format`` at
    ``settings.log_level``; handlers installed before are removed. Returns the new handler."""
    secrets = secrets_of(settings)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    if settings.log_format == "json":
        handler.setFormatter(JsonFormatter(service, secrets))
    else:
        handler.setFormatter(TextFormatter(secrets))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, str(settings.log_level).upper(), logging.INFO))
    logging.captureWarnings(True)
    return handler
