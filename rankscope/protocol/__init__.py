"""The message contract: every wire message's fields and bounds, declared and checked here only
(tests/rankscope/test_protocol_only_home.py holds the other packages to that).

envelope.py decodes a message: the envelope (``Envelope``, ``encode``, ``decode``, the schema
versions, ``rank_key``) and then the body, through ``BODY_CHECKS``, kind -> the check in the
kind's own module. v1 ``steps`` + ``heartbeat`` and v2 ``beat`` both decode; ``split_beat`` turns
a beat into the v1 pair. The kinds:

- ``steps``, ``heartbeat`` (v1) and ``beat`` (v2): steps.py; a beat's ``coll``: collectives.py
- ``exit``: exits.py
- ``hw``: hardware.py
- ``control`` and ``ack``: control.py; the ``trace`` command's arguments: trace.py
- ``flight`` and ``fr_dump``: flight.py
- ``trace``: trace_events.py (its events read into rows: trace_rows.py, which needs numpy)
- ``summary``: trace_summary.py
- ``profile``: profile.py
- ``shard`` (the processors' shard summaries): shard.py
- ``stats`` (the processors' worker statistics): stats.py
- the alerts topic's JSON: alerts.py; the deadletter topic's: deadletter.py

Every check raises :class:`~rankscope.protocol.errors.WireError` with a reason code; fields.py holds
the field checks they share. Everything but trace_rows.py imports with the standard library and
msgpack only: the rank side decodes.
"""
