"""`make bench`: run every benchmark, write JSON results to benchmarks/results/, print a table."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks import (
    capacity,
    collector,
    dashboard_queries,
    detection,
    job_page,
    offline_vs_hta,
    profile_sampler,
    scale,
    tracer_overhead,
)

RESULTS = Path(__file__).resolve().parent / "results"
BENCHES = {"detection": detection.run, "tracer_overhead": tracer_overhead.run,
           "collector": collector.run, "dashboard_queries": dashboard_queries.run,
           "offline_vs_hta": offline_vs_hta.run, "scale": scale.run, "capacity": capacity.run,
           "profile_sampler": profile_sampler.run, "job_page": job_page.run}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks")
    p.add_argument("names", nargs="*", help=f"benchmarks to run, of {sorted(BENCHES)} (default all)")
    args = p.parse_args(argv)
    unknown = [n for n in args.names if n not in BENCHES]
    if unknown:
        p.error(f"unknown benchmark(s) {unknown}; choose from {sorted(BENCHES)}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.names or list(BENCHES):
        t0 = time.monotonic()
        result = BENCHES[name]()
        result["wall_s"] = round(time.monotonic() - t0, 1)
        (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2))
        for metric, value in result["metrics"].items():
            rows.append((name, metric, value, result.get("targets", {}).get(metric, "")))
    width = max(len(r[1]) for r in rows) + 2
    print(f"\n{'benchmark':<18}{'metric':<{width}}{'value':>14}  target")
    for name, metric, value, target in rows:
        v = f"{value:.4g}" if isinstance(value, float) else str(value)
        print(f"{name:<18}{metric:<{width}}{v:>14}  {target}")
    print(f"\nJSON results in {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
