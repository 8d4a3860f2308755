"""The bodies ``rankscope alerts --webhook`` POSTs for one alert version. Pure functions.

- ``alertmanager``: the JSON Alertmanager sends to its webhook receivers (``"version": "4"``), one
  alert per notification: status ``firing`` (open, update) or ``resolved``; labels ``alertname``
  (``RankscopeHang``, ``RankscopeSlowRank``, ...), ``job``, ``kind``, ``severity``; annotations
  ``summary`` and the incident's ``alert_id``, ``version``, ``status``, ``ranks``, ``step``,
  ``lost_rank_seconds`` (strings, as Alertmanager's are); ``startsAt`` the incident's opening and
  ``endsAt`` its resolution (Alertmanager's zero time while it fires), RFC 3339 in UTC.
- ``slack``: a Slack incoming-webhook message, ``{"text": ...}``: one line with the state, the
  kind, the job and the summary, one with ranks, step, version and alert id.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from rankscope.protocol.alerts import Alert

ZERO_TIME = "0001-01-01T00:00:00Z"    # Alertmanager's endsAt of an alert that still fires
RECEIVER = "rankscope"


def rfc3339(ns: int) -> str:
    """Unix time in ns as RFC 3339 in UTC, fractional seconds without trailing zeros (Go's RFC3339Nano)."""
    seconds, frac = divmod(ns, 1_000_000_000)
    text = datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    return text + (f".{frac:09d}".rstrip("0") if frac else "") + "Z"


def alertname(kind: str) -> str:
    """``slow_rank`` -> ``RankscopeSlowRank``."""
    return "Rankscope" + "".join(part.capitalize() for part in kind.split("_"))


def firing_or_resolved(alert: Alert) -> str:
    return "resolved" if alert.status == "resolved" else "firing"


def alertmanager_payload(alert: Alert) -> dict[str, Any]:
    """The Alertmanager webhook notification (version 4) of one alert version."""
    labels = {"alertname": alertname(alert.kind), "job": alert.job, "kind": alert.kind, "severity": alert.severity}
    annotations = {"summary": alert.summary, "alert_id": alert.alert_id, "version": str(alert.version),
                   "status": alert.status, "ranks": ",".join(map(str, alert.ranks)), "step": str(alert.step),
                   "lost_rank_seconds": str(alert.lost_rank_seconds)}
    state = firing_or_resolved(alert)
    ends = rfc3339(alert.resolved_ns or alert.updated_ns) if state == "resolved" else ZERO_TIME
    fingerprint = hashlib.sha256(json.dumps(labels, sort_keys=True).encode()).hexdigest()[:16]
    group_labels = {"alertname": labels["alertname"], "job": alert.job}
    return {
        "version": "4",
        "groupKey": "{}:{" + ", ".join(f"{k}={json.dumps(v)}" for k, v in group_labels.items()) + "}",
        "truncatedAlerts": 0,
        "status": state,
        "receiver": RECEIVER,
        "groupLabels": group_labels,
        "commonLabels": labels,
        "commonAnnotations": annotations,
        "externalURL": "",
        "alerts": [{"status": state, "labels": labels, "annotations": annotations,
                    "startsAt": rfc3339(alert.opened_ns), "endsAt": ends, "generatorURL": "",
                    "fingerprint": fingerprint}],
    }


def slack_escape(text: str) -> str:
    """Slack's three control characters in message text."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def slack_payload(alert: Alert) -> dict[str, Any]:
    """A Slack incoming-webhook message of one alert version."""
    if alert.status == "resolved":
        icon, state = ":white_check_mark:", "resolved"
    else:
        icon = ":rotating_light:" if alert.severity == "critical" else ":warning:"
        state = "firing" if alert.status == "open" else "still firing"
    ranks = ",".join(map(str, alert.ranks)) or "-"
    text = (f"{icon} *{alertname(alert.kind)}* {state} ({slack_escape(alert.severity)}) in job "
            f"`{slack_escape(alert.job)}`: {slack_escape(alert.summary)}\n"
            f"ranks {ranks} · step {alert.step} · version {alert.version} · `{slack_escape(alert.alert_id)}`")
    return {"text": text}


FORMATS: dict[str, Callable[[Alert], dict[str, Any]]] = {"alertmanager": alertmanager_payload, "slack": slack_payload}
