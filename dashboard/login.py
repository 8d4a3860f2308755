"""The dashboard's password gate, shown before any page when ``dashboard_password`` is set.

``rankscope serve`` refuses to bind a non-loopback ``dashboard_host`` without a password
(storage/serve.py ``check_bind``); this gate is what the password protects. The navigation runs
only after the visitor's session has passed it, so no page, query or control runs before. A wrong
password waits a second before answering, which bounds guessing per session.
"""

from __future__ import annotations

import hmac
import time

import streamlit as st

from rankscope.config import ConfigError, Settings

SESSION_KEY = "rankscope_signed_in"
WRONG_PASSWORD_WAIT_S = 1.0


def password_ok(given: str, expected: str) -> bool:
    """Constant-time comparison of two passwords (UTF-8)."""
    return hmac.compare_digest(given.encode(), expected.encode())


def signed_in() -> bool:
    """True when no password is set or this session has entered it; otherwise draw the sign-in form
    and return False (the caller stops the script)."""
    try:
        expected = Settings.from_env().dashboard_password
    except ConfigError as e:
        st.error(f"rankscope configuration error: {e}")
        return False
    if not expected or st.session_state.get(SESSION_KEY):
        return True
    st.title("rankscope")
    with st.form("rankscope_sign_in"):
        given = st.text_input("Password", type="password")
        submitted = st.form_submit_button("Sign in")
    if submitted:
        if password_ok(given, expected):
            st.session_state[SESSION_KEY] = True
            st.rerun()
        time.sleep(WRONG_PASSWORD_WAIT_S)
        st.error("Wrong password.")
    return False
