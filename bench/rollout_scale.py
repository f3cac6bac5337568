"""Rollouts at scale on a real API server (issue 28, item 8): 1000 simulated pods across
10 ModelDeployments rolled v1→v2 and back by the operator (as the chart runs it), on a
control plane of its own (etcd, kube-apiserver, controller-manager, scheduler; ``make
install`` builds them) with one simulated node whose sidecars report through the API.

Figures are the API server's own (its audit log: writes by user and resource) and the
kernel's (the operator process's CPU time). Per rollout: API writes per pod (lease
renewals apart), operator CPU seconds and average cores, wall time; per idle minute:
writes. Targets: ≤ 5 writes per pod per rollout, ≤ 0.2 operator core, 0 idle writes.

    python bench/rollout_scale.py [--pods 1000 --deployments 10]

The planner alone on a virtual clock is ``bench/planner_scale.py``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bench_support import write_json
from model_rollout_e2e.scale_run import ScaleSettings, run_scale


def table(report: dict) -> str:  # type: ignore[type-arg]
    lines = [
        f"{'window':<26} {'wall s':>8} {'writes':>7} {'per pod':>8} {'per min':>8} "
        f"{'md status':>9} {'op cpu s':>8} {'op cores':>8} {'load 1m':>7}"
    ]
    for w in report["windows"]:
        lines.append(
            f"{w['name']:<26} {w['wall_s']:>8.1f} {w['writes']:>7} {w['writes_per_pod']:>8.2f} "
            f"{w['writes_per_minute']:>8.1f} {w['md_status_writes']:>9} "
            f"{w['operator_cpu_s']:>8.2f} {w['operator_cores']:>8.3f} {w['load_1m']:>7.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--pods", type=int, default=1000)
    p.add_argument("--deployments", type=int, default=10)
    p.add_argument("--idle-seconds", type=float, default=60.0)
    p.add_argument("--timeout", type=float, default=900.0, help="a hang guard for each step")
    p.add_argument("--out", default="bench/results/rollout_scale/rollout_scale.json")
    p.add_argument("--work", help="where the control plane's files go (default: a temp dir)")
    args = p.parse_args(argv)
    settings = ScaleSettings(
        pods=args.pods, deployments=args.deployments, idle_s=args.idle_seconds,
        timeout_s=args.timeout,
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="rollout-scale-") as tmp:
        work = Path(args.work or tmp)
        report = run_scale(work, settings)
    print(table(report))
    print(f"  the node's longest gap between Lease renewals: {report['node_lease_max_gap_s']} s")
    for w in report["windows"]:
        top = ", ".join(f"{r['user']} {r['resource']} {r['writes']}" for r in w["by_writer"][:6])
        print(f"  {w['name']}: {top}")
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
