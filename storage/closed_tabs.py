"""One log line, not a traceback, for a browser tab that closed while the dashboard answered it.

Streamlit's websocket handler (1.67, on Starlette) takes the ``RuntimeError`` Starlette raises when it
reads from a connection the browser already closed for a text frame, and closes the connection
again; Starlette then raises ``WebSocketDisconnected`` and uvicorn logs "Exception in ASGI
application" with a full traceback. Nothing is lost: the tab is gone. Serve's log keeps tracebacks
for what is wrong, so this one becomes an INFO line.
"""

from __future__ import annotations

import logging

LOGGER = "uvicorn.error"   # the logger uvicorn reports an ASGI application's exceptions on


def is_closed_tab(exc: BaseException | None) -> bool:
    """Starlette's ``WebSocketDisconnected``: a send on a websocket already closed."""
    return exc is not None and type(exc).__name__ == "WebSocketDisconnected" \
        and type(exc).__module__.startswith("starlette")


class ClosedTabs(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if is_closed_tab(exc):
            record.msg, record.args = "a browser tab closed while the dashboard answered it (%s)", (exc,)
            record.exc_info, record.exc_text, record.stack_info = None, None, None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def install() -> None:
    logger = logging.getLogger(LOGGER)
    if not any(isinstance(f, ClosedTabs) for f in logger.filters):
        logger.addFilter(ClosedTabs())
