"""Rollout of N pods with canary, batches and jitter vs. all at once, on a virtual clock.

Uses the operator's real planner; each pod takes 2-6 s (uniform) to fetch and load a
version. Reports peak concurrent loads (what hits the model store and the nodes at once)
and total time to the new version. (``rollout_scale.py`` measures rollouts on a real
API server.)

    python bench/planner_scale.py
"""

from __future__ import annotations

import argparse
import sys

from bench_support import STRATEGIES, simulate, write_json


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", default="4,16,64")
    p.add_argument("--seeds", type=int, default=5, help="runs per cell (medians reported)")
    p.add_argument("--out", default="bench/results/planner_scale.json")
    args = p.parse_args(argv)
    rows = []
    for replicas in (int(n) for n in args.sizes.split(",")):
        for strategy in STRATEGIES:
            runs = [simulate(replicas, strategy, seed) for seed in range(args.seeds)]
            median = sorted(runs, key=lambda r: r["total_s"])[len(runs) // 2]
            rows.append(
                {
                    "strategy": strategy,
                    **median,
                    "peak_concurrent_loads_max": max(r["peak_concurrent_loads"] for r in runs),
                }
            )
    print(f"{'pods':>5} {'strategy':<12} {'peak loads':>10} {'batches':>8} {'total s':>8}")
    for row in rows:
        print(
            f"{row['replicas']:>5} {row['strategy']:<12} {row['peak_concurrent_loads']:>10} "
            f"{row['batches']:>8} {row['total_s']:>8}"
        )
    write_json(args.out, {"strategies": STRATEGIES, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
