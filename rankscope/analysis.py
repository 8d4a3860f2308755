"""Notebook API: rankscope's offline analysis of Kineto trace files, returning DataFrames.

Method names follow Holistic Trace Analysis (HTA) where they overlap, so a notebook written for
HTA's ``TraceAnalysis`` mostly runs as it is::

    from rankscope.analysis import TraceAnalysis

    a = TraceAnalysis(trace_dir="traces/")          # one Kineto file per rank
    a.get_temporal_breakdown()                      # idle / compute / non-compute per rank (µs)
    a.get_slow_workers()                            # the processors' window diagnosis, offline
    a.get_causes()                                  # functions of slow ranks by cost (rank-seconds)
    print(a.report_markdown())                      # what ``rankscope analyze`` prints

The numbers are the ones ``rankscope analyze`` and the live pipeline give (the same code:
``offline/`` and the analyzers it shares with ``stream_processors/analysis``); ``hta_compatible=True`` applies HTA 0.5's conventions to the
breakdowns so they equal HTA's. Importing this module is cheap: pandas and the analyzers load on
first use.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["TraceAnalysis"]


class TraceAnalysis:
    """The traces of one job, read once (blocking, on first use), analysed on demand.

    Args:
        trace_dir: a folder of Kineto trace files (``*.json``, ``*.json.gz``, one per rank).
        trace_files: files or folders instead of (or besides) ``trace_dir``.
        hta_compatible: HTA 0.5's conventions for the breakdowns (the diagnosis is unaffected).

    Raises ValueError (naming the file) on a missing path, a file that is not a trace, or two
    files of the same rank; raised by the first method that reads the traces.
    """

    def __init__(self, trace_dir: str | Path | None = None, trace_files: Iterable[str | Path] = (),
                 hta_compatible: bool = False) -> None:
        paths = [*([trace_dir] if trace_dir is not None else []), *trace_files]
        if not paths:
            raise ValueError("give trace_dir or trace_files")
        self.paths = [Path(p) for p in paths]
        self.hta_compatible = bool(hta_compatible)

    # Reading ------------------------------------------------------------------------------------
    @cached_property
    def traces(self) -> dict[int, Any]:
        """``{rank: kineto.Trace}``: each rank's events table (``Trace.events``) and metadata."""
        from rankscope.offline.kineto import load_traces

        return load_traces(self.paths, extra_columns=True)

    @cached_property
    def _events(self) -> pd.DataFrame:
        from rankscope.offline.kineto import concat_events

        return concat_events(self.traces)

    @cached_property
    def diagnosis(self) -> dict[str, Any]:
        """The window diagnosis as a dict (the processors' report: ``slow_workers``, ``causes``,
        ``collective_arrivals``, PerfTracker's sections ...)."""
        from rankscope.offline.diagnosis import diagnose_summaries, rank_summary

        return diagnose_summaries({r: rank_summary(t) for r, t in self.traces.items()})

    # HTA's breakdowns ---------------------------------------------------------------------------
    def get_temporal_breakdown(self) -> pd.DataFrame:
        """Per rank: GPU idle, compute and non-compute time (µs) and shares of the GPU span (HTA's)."""
        from rankscope.offline import breakdown as bd

        return bd.temporal_breakdown(self._events, self.hta_compatible)

    def get_comm_comp_overlap(self) -> pd.DataFrame:
        """Per rank: the share of communication time overlapped by computation (HTA's)."""
        from rankscope.offline import breakdown as bd

        return bd.comm_comp_overlap(self._events, self.hta_compatible)

    def get_gpu_kernel_breakdown(self, num_kernels: int = 10, duration_ratio: float = 0.8,
                                 include_memory_kernels: bool = True) -> tuple[pd.DataFrame, pd.DataFrame]:
        """``(kernel type breakdown over all ranks, top kernels per rank and type)``, as HTA's method
        returns them. Raises ValueError on ``num_kernels`` < 1 or ``duration_ratio`` outside (0, 1]."""
        from rankscope.offline import breakdown as bd

        types = bd.kernel_type_breakdown(self._events, self.hta_compatible)
        top = bd.kernel_breakdown_top(self._events, num_kernels, self.hta_compatible, duration_ratio,
                                      include_memory_kernels)
        return types, top

    def get_idle_time_breakdown(self, consecutive_kernel_delay_us: float = 30.0) -> pd.DataFrame:
        """Per rank and stream: GPU idle time by cause (host_wait, kernel_wait, other; HTA's)."""
        from rankscope.offline import breakdown as bd

        return bd.idle_time_breakdown(self._events, self.hta_compatible, consecutive_kernel_delay_us)

    # rankscope's diagnosis ------------------------------------------------------------------------
    def get_slow_workers(self) -> pd.DataFrame:
        """Slow ranks: ``rank, busy_ms, median_busy_ms`` (the other ranks'), ``z``. Needs 3+ ranks."""
        import pandas as pd

        return pd.DataFrame(self.diagnosis["slow_workers"], columns=["rank", "busy_ms", "median_busy_ms", "z"])

    def get_causes(self) -> pd.DataFrame:
        """The slow ranks' functions by excess over the other ranks: ``rank, category, function,
        leaf, excess_ms, cost_rank_seconds`` (excess x world size), largest first."""
        import pandas as pd

        return pd.DataFrame(self.diagnosis["causes"],
                            columns=["rank", "category", "function", "leaf", "excess_ms", "cost_rank_seconds"])

    def get_busy_time(self) -> pd.DataFrame:
        """Per rank: busy time in the traced window (``rank, busy_ms``; see the README's diagnosis metrics)."""
        import pandas as pd

        busy = self.diagnosis["busy_ms"]
        return pd.DataFrame({"rank": [int(r) for r in busy], "busy_ms": list(busy.values())})

    def get_collective_arrivals(self) -> pd.DataFrame:
        """Per rank: how often it arrived last at a collective and its mean lateness behind the median
        arrival (``rank, last_arrivals, mean_lateness_ms, straggler``); empty without matched calls."""
        import pandas as pd

        a = self.diagnosis.get("collective_arrivals") or {}
        late = a.get("mean_lateness_ms_by_rank") or {}
        counts = a.get("last_arrival_counts") or {}
        rows = [{"rank": int(r), "last_arrivals": int(counts.get(r, 0)), "mean_lateness_ms": v,
                 "straggler": int(r) == a.get("straggler")} for r, v in late.items()]
        return pd.DataFrame(rows, columns=["rank", "last_arrivals", "mean_lateness_ms", "straggler"])

    def report_markdown(self) -> str:
        """The diagnosis as Markdown: verdict, charts' data, PerfTracker's sections."""
        from rankscope.report_view import render_markdown

        return render_markdown(self.diagnosis)

    # Exports ------------------------------------------------------------------------------------
    def export_kineto(self, out_dir: str | Path) -> list[Path]:
        """Write each rank as Kineto JSON with launch -> kernel flows (``rank-<r>.json.gz``) and
        return the paths; HTA loads them with the originals' breakdowns."""
        import gzip
        import json

        from rankscope.offline.exporters import kineto_trace

        d = Path(out_dir)
        d.mkdir(parents=True, exist_ok=True)
        out = []
        for r, t in self.traces.items():
            p = d / f"rank-{r}.json.gz"
            p.write_bytes(gzip.compress(json.dumps(kineto_trace(t.events, t.metadata, t.time_unit)).encode(), 1))
            out.append(p)
        return out
