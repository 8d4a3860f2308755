"""The message contract: one typed struct per message kind, with its bounds declared once.

Kinds move here from rankscope/wire.py's schema table one at a time. So far: ``profile``
(profile.py), the ``trace`` command of ``control`` messages (trace.py), the collective records a
``beat`` carries (collectives.py), the alerts of the alerts topic (alerts.py) and the dead letters of
the deadletter topic (deadletter.py). rankscope/wire.py still decodes the envelope and hands a kind
defined here to its ``validate``.
"""
