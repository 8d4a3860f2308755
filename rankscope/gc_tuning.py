"""Garbage-collector settings for the long-running stream services (sink, processors).

Both hold large sets of live objects (per-rank state, a batch's row tuples) and allocate a few
hundred thousand objects a second. With CPython's default thresholds (700, 10, 10) the young objects
that survive into a batch keep triggering full collections, each walking every live object: in a
10,000-rank sink that was 54 full collections in 40 s, 3.2 s of the main thread's 18 s of CPU
(measured with ``gc.callbacks``). The services make almost no reference cycles, so they collect the
young generations less often and, in practice, never the old one; :func:`tune_for_streaming` also
moves everything alive after start-up (modules, config, compiled schemas) out of the collector's view.
The Prometheus endpoint of each service exports ``python_gc_collections_total`` per generation.
"""

from __future__ import annotations

import gc

STREAMING_THRESHOLDS = (50_000, 20, 100)


def tune_for_streaming(thresholds: tuple[int, int, int] = STREAMING_THRESHOLDS) -> None:
    """Freeze what is alive now and set the collection ``thresholds``. Call once, after start-up."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*thresholds)
