"""The JSON Schema of the alert message (``rankscope/alert.schema.json``, draft 2020-12), shipped in
the package, and a check of one decoded alert against it.

The processors do not validate with it: they publish :class:`rankscope.protocol.alerts.Alert` documents and
consumers decode them with ``Alert.from_json``. The schema is for consumers in other languages and
for the tests. :func:`validate` needs ``jsonschema``, which no rankscope extra declares (the dev
environment has it through Streamlit), so it is imported inside the function.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

SCHEMA_FILE = "alert.schema.json"


@cache
def alert_schema() -> dict[str, Any]:
    """The schema as a dict, read once from the installed package."""
    return json.loads(resources.files("rankscope").joinpath(SCHEMA_FILE).read_text(encoding="utf-8"))


def validate(alert: Any) -> None:
    """Check one decoded alert (the ``json.loads`` of a message value) against the schema.

    Raises ``jsonschema.ValidationError`` naming the first offending field; ImportError when
    ``jsonschema`` is not installed.
    """
    _validator().validate(alert)


@cache
def _validator() -> Any:
    from jsonschema import Draft202012Validator

    schema = alert_schema()
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)
