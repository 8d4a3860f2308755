"""Serve's log: a browser tab closed mid-answer is one line; any other exception keeps its traceback."""

from __future__ import annotations

import io
import logging

from starlette.websockets import WebSocketDisconnected

from rankscope.storage.closed_tabs import ClosedTabs


def logged(exc: Exception) -> str:
    out = io.StringIO()
    logger = logging.getLogger(f"test-closed-tabs-{id(exc)}")
    logger.propagate = False
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.addFilter(ClosedTabs())
    try:
        raise exc
    except Exception:
        logger.exception("Exception in ASGI application\n")
    return out.getvalue()


def test_a_send_on_a_closed_websocket_is_one_info_line() -> None:
    text = logged(WebSocketDisconnected('Cannot call "send" once a close message has been sent.'))
    assert "Traceback" not in text and text.count("\n") == 1, text
    assert text.startswith("INFO a browser tab closed while the dashboard answered it"), text


def test_other_exceptions_keep_their_traceback() -> None:
    text = logged(RuntimeError("Cannot call \"send\" once a close message has been sent."))
    assert text.startswith("ERROR Exception in ASGI application") and "Traceback" in text, text
