"""`make chaos`: every fault scenario at a larger size, then the results table.

python -m tests.chaos [--seed N] [--scenario NAME ...] [--rate R --duration S] ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from pgqueue.embedded import EmbeddedPostgres
from tests.chaos.harness import Config
from tests.chaos.report import HEADER, row
from tests.chaos.scenarios import SCENARIOS, run_scenario


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    parser.add_argument("--seed", type=int, default=0, help="replay a run (default: random)")
    parser.add_argument("--scenario", action="append", choices=list(SCENARIOS))
    parser.add_argument("--rate", type=float, default=400.0, help="jobs enqueued per second")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of feeding")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--faults", type=int, default=10, help="faults per scenario")
    parser.add_argument("--lease", type=float, default=2.0)
    parser.add_argument(
        "--group-size", type=int, default=100_000, help="members of the control scenario's group"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    seed = args.seed or int.from_bytes(os.urandom(3))
    config = Config(
        seed=seed,
        workers=args.workers,
        concurrency=args.concurrency,
        lease=args.lease,
        rate=args.rate,
        duration=args.duration,
        faults=args.faults,
        drain_timeout=max(120.0, args.duration * 2) + args.group_size / 500,
        group_size=args.group_size,
    )
    names = args.scenario or list(SCENARIOS)
    print(f"seed {seed}; {config}", file=sys.stderr)
    results = []
    logroot = Path(tempfile.mkdtemp(prefix="pgqueue-chaos-"))
    with EmbeddedPostgres() as cluster:
        for name in names:
            started = time.monotonic()
            result = run_scenario(cluster, config, name, logroot / name)
            results.append(result)
            took = time.monotonic() - started
            print(f"{row(result)}  ({took:.0f} s)", file=sys.stderr)
    if args.json:
        print(json.dumps([{**asdict(r), "passed": r.passed} for r in results], default=str))
    else:
        print(f"\nseed {seed}, {config.workers} workers x {config.concurrency}, lease "
              f"{config.lease:g} s, {config.rate:g} jobs/s for {config.duration:g} s per scenario\n")  # fmt: skip
        print(HEADER)
        for result in results:
            print(row(result))
        for result in results:
            if result.passed and result.notes:
                print(f"{result.scenario}: " + "; ".join(result.notes[:3]), file=sys.stderr)
        for result in results:
            if not result.passed:
                print(f"\n{result.scenario}:", *result.notes[:3], sep="\n", file=sys.stderr)
    print(f"worker logs: {logroot}", file=sys.stderr)
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
