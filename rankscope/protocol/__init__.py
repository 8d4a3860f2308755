"""The message contract: one typed struct per message kind, with its bounds declared once.

Kinds move here from rankscope/wire.py's schema table one at a time: ``profile`` (profile.py), the
``trace`` command of ``control`` messages (trace.py) and the collective records a ``beat`` carries
(collectives.py) so far. rankscope/wire.py still decodes the
envelope and hands a kind defined here to its ``validate``.
"""
