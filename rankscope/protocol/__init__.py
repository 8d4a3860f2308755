"""The message contract: every wire message's fields and bounds, declared and checked here once.

envelope.py decodes the envelope and hands each kind's body to its check (``BODY_CHECKS``); each
kind lives in its own module: ``steps``, ``heartbeat``, ``beat`` (steps.py, the beat's ``coll`` in
collectives.py), ``exit`` (exits.py), ``hw`` (hardware.py), ``control`` and ``ack`` (control.py;
the ``trace`` command's arguments in trace.py), ``flight`` and ``fr_dump`` (flight.py), ``trace``
(trace_events.py; its rows: trace_rows.py), ``summary`` (trace_summary.py), ``profile``
(profile.py), ``shard`` (shard.py), ``stats`` (stats.py); the alerts topic (alerts.py) and the
deadletter topic (deadletter.py). Every check raises :class:`~rankscope.protocol.errors.WireError`.
"""
