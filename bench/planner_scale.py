"""Rollout of N pods with canary, batches and jitter vs. all at once, on a virtual clock.

Uses the operator's real planner; each pod takes 2-6 s (uniform) to fetch and load a
version. Reports peak concurrent loads (what hits the model store and the nodes at once)
and total time to the new version.

    python bench/planner_scale.py
"""

from __future__ import annotations

import argparse
import random
import sys

from bench_output import write_json
from model_operator.spec import parse_spec
from model_rollout_e2e.simulation import SimCluster

STRATEGIES = {
    "staged": {
        "canary": {"percent": 10, "pauseSeconds": 30},
        "rollout": {"batchPercent": 25, "maxConcurrentLoads": 8, "jitterSeconds": 5},
    },
    "all-at-once": {"canary": {"percent": 0}, "rollout": {"batchPercent": 100, "jitterSeconds": 0}},
}


def simulate(replicas: int, strategy: str, seed: int) -> dict[str, float | int]:
    rng = random.Random(seed)
    durations: dict[tuple[str, str], float] = {}

    def load_seconds(pod: str, version: str) -> float:
        return durations.setdefault((pod, version), rng.uniform(2, 6))

    spec = parse_spec(
        {
            "model": "m",
            "version": "v2",
            "image": "i",
            "replicas": replicas,
            "store": {"url": "s3://bucket/p"},
            "signingPublicKeySecret": "signing-key",
            **STRATEGIES[strategy],
        }
    )
    cluster = SimCluster(replicas, "v1", load_seconds, seed=seed)
    start = cluster.now
    plan = cluster.run(spec, dt=0.1)
    assert plan.phase == "Available" and cluster.serving() == {"v2": replicas}
    return {
        "replicas": replicas,
        "peak_concurrent_loads": cluster.max_loading,
        "total_s": round(cluster.now - start, 1),
        "batches": plan.state.batch,
    }


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
