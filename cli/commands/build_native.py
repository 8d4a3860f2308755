"""``rankscope build-native``: compile the C++ trace-window reader (producers/native/) for this
torch and Python into ``<cache_dir>/native/<key>/``. Ranks load it when present (setting
``native_reader``) and use the Python reader otherwise.

Exit status: 0 built (or already built); 1 the build failed (the compiler's complaint is printed;
``--optional`` turns that into a warning and exit status 0, for ``make native`` on machines
without a compiler).
"""

from __future__ import annotations

import argparse
import sys
import time

from rankscope.config import Settings


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("build-native", parents=[common], help="compile the C++ trace-window reader",
                       description="Compile the C stack walker (producers/native/stack_walk.c, with Python's C "
                                   "compiler) and producers/native/kineto_columns.cpp with torch.utils.cpp_extension "
                                   "into the cache dir (needs a C++ compiler and ninja; about a minute).")
    p.add_argument("--optional", action="store_true", help="a failed build is a warning (exit 0)")
    p.add_argument("--verbose", action="store_true", help="show the compiler's output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, settings: Settings) -> int:
    from rankscope.producers import stack_walk
    from rankscope.producers.native_extract import NativeBuildError, build, load_native

    t0 = time.monotonic()
    try:
        walker = stack_walk.build(settings.cache_dir)
        if stack_walk.load(settings.cache_dir) is None:
            raise stack_walk.WalkerBuildError(f"{walker} was built but does not load")
        print(f"rankscope build-native: {walker}")
    except stack_walk.WalkerBuildError as e:
        print(f"rankscope build-native: {'warning' if args.optional else 'error'}: {e}\n"
              "the stack sampler walks stacks in Python on Python 3.12+, and is off on 3.11.", file=sys.stderr)
        if not args.optional:
            return 1
    try:
        so = build(settings.cache_dir, verbose=args.verbose)
    except NativeBuildError as e:
        print(f"rankscope build-native: {'warning' if args.optional else 'error'}: {e}\n"
              "trace windows will be read by the Python reader (slower).", file=sys.stderr)
        return 0 if args.optional else 1
    if load_native(settings.cache_dir) is None:
        print(f"rankscope build-native: error: {so} was built but does not load", file=sys.stderr)
        return 0 if args.optional else 1
    print(f"rankscope build-native: {so} ({time.monotonic() - t0:.1f} s)")
    return 0
