"""Rollback and rollout end to end on a real control plane, with a kubelet as slow as a
real one.

A real Kubernetes control plane (etcd, kube-apiserver, controller-manager, scheduler:
``make install`` builds them), the operator as a process with its ServiceAccount, and
real pods: the operator's Deployment made into pods by the controller-manager, placed by
the scheduler and run by the node agent (each pod's init container, server and sidecar
as processes, the sidecar with its pod's token), with a local-directory store. The node
agent refreshes Downward API and ConfigMap files only every ``--kubelet-delay`` seconds
(a real kubelet: about a minute). Under load, it measures the time from ``kubectl
patch`` of ``spec.version`` (once the API server has it) until every pod's server
serves that version (read from each pod's ``model_server_version_serving`` metric), for
a forward rollout (25% canary, then batches) and for ``--rollbacks`` rollbacks, and
counts failed requests. Then the operator's planner, alone on a virtual clock, rolls out
64 and 1000 pods (``bench/rollout_scale.py``).

    python bench/rollback_e2e.py [--rollbacks 5] [--kubelet-delay 60]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench_support import simulate, write_json
from model_rollout_contract.annotations import SIDECAR_STATUS
from model_rollout_contract.report import SidecarReport
from model_rollout_e2e.loadgen import LoadGenerator, LoadResult
from model_rollout_e2e.scenario import Scenario, StoreSetup, available


class LoadInThread:
    """The load generator on a thread with its own event loop, so that its clients do not
    share a loop with the benchmark's waits (in a cluster they are other machines)."""

    def __init__(self, load: LoadGenerator) -> None:
        self.load = load
        self.loop = asyncio.new_event_loop()
        self.result = LoadResult()
        self.thread = threading.Thread(target=self._run, name="load", daemon=True)

    def _run(self) -> None:
        self.result = self.loop.run_until_complete(self.load.run())

    def start(self) -> None:
        self.load.start_clock()
        self.thread.start()

    def stop(self) -> LoadResult:
        self.loop.call_soon_threadsafe(self.load.stop)
        self.thread.join(60)
        return self.result


async def breakdown(
    scenario: Scenario, edited: float, status: dict[str, object]
) -> dict[str, float]:
    """Where a rollback's time went: the edit and the operator's reaction (``kubectl
    patch`` started -> rollout started, kubectl's own start included), the signal (-> the
    last sidecar saw its new target)."""
    started = float(status["rollout"]["startedAt"])  # type: ignore[index]
    seen = []
    for pod in await scenario.pod_objects():
        annotations = pod["metadata"].get("annotations") or {}
        report = SidecarReport.from_json(annotations.get(SIDECAR_STATUS))
        if report is not None and report.target_seen_at is not None:
            seen.append(report.target_seen_at)
    last_seen = max(seen) if seen else started
    return {
        "operator_s": round(started - edited, 3),
        "signal_s": round(last_seen - started, 3),
    }


async def until_all_serve(scenario: Scenario, version: str, timeout_s: float) -> float:
    """Seconds until every pod's server reports ``version`` as its serving one."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        serving = await asyncio.to_thread(scenario.serving_versions)
        if serving and set(serving.values()) == {version}:
            return time.monotonic() - started
        await asyncio.sleep(0.01)
    raise TimeoutError(f"pods never all served {version}: {serving}")


async def measure(replicas: int, rollbacks: int, kubelet_delay_s: float) -> dict[str, object]:
    work = Path(tempfile.mkdtemp(prefix="mr-bench-", dir="/tmp"))
    scenario = Scenario(
        StoreSetup.local(work / "store"), work=work, volume_refresh_s=kubelet_delay_s
    )
    scenario.publish("v1", seed=1)
    scenario.publish("v2", seed=2)
    async with scenario.running():
        await scenario.apply(
            "v1",
            replicas,
            canary={"percent": 25, "pauseSeconds": 1},
            rollout={"batchSize": 1, "jitterSeconds": 0.5},
        )
        await scenario.wait(available("v1", replicas), 180)
        load = LoadInThread(
            LoadGenerator(
                scenario.pod_urls(), scenario.model, scenario.in_dim, concurrency=8, think_s=0.02
            )
        )
        load.start()
        await asyncio.sleep(1)

        await scenario.set_version("v2")
        forward_s = await until_all_serve(scenario, "v2", 180)
        await scenario.wait(available("v2", replicas), 60)
        rollback_s: list[float] = []
        phases: list[dict[str, float]] = []
        for _ in range(rollbacks):
            await asyncio.sleep(1)
            edited = time.time()
            await scenario.set_version("v1")
            rollback_s.append(await until_all_serve(scenario, "v1", 120))
            status = await scenario.wait(available("v1", replicas), 60)
            phases.append(await breakdown(scenario, edited, status))
            await asyncio.sleep(1)
            await scenario.set_version("v2")  # forward again, for the next rollback
            await until_all_serve(scenario, "v2", 180)
            await scenario.wait(available("v2", replicas), 60)
        await asyncio.sleep(1)
        result = await asyncio.to_thread(load.stop)
    failed = [s for s in result.samples if not s.ok]
    return {
        "api": "a real control plane (etcd, kube-apiserver, controller-manager, scheduler)",
        "replicas": replicas,
        "kubelet_delay_s": kubelet_delay_s,
        "forward_s": round(forward_s, 3),
        "rollback_s": [round(s, 3) for s in rollback_s],
        "rollback_s_p50": round(statistics.median(rollback_s), 3),
        "rollback_s_max": round(max(rollback_s), 3),
        "rollback_phases_s": phases,
        "requests": len(result.samples),
        "failed_requests": len(failed),
        "failures": [f.error for f in failed[:5]],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--rollbacks", type=int, default=5)
    p.add_argument("--kubelet-delay", type=float, default=60.0)
    p.add_argument("--out", default="bench/results/rollback_e2e.json")
    args = p.parse_args(argv)
    report = asyncio.run(measure(args.replicas, args.rollbacks, args.kubelet_delay))
    planner = [simulate(n, strategy, seed=0) for n in (64, 1000) for strategy in ("staged",)]
    report["planner"] = planner
    print(
        f"{args.replicas} real pods on a real control plane, kubelet refresh "
        f"{args.kubelet_delay:.0f} s, "
        f"{report['requests']} requests, {report['failed_requests']} failed"
    )
    print(f"{'what':<28} {'seconds':>8}")
    print(f"{'forward rollout (canary)':<28} {report['forward_s']:>8}")
    print(f"{'rollback p50':<28} {report['rollback_s_p50']:>8}")
    print(f"{'rollback max':<28} {report['rollback_s_max']:>8}")
    for i, phase in enumerate(report["rollback_phases_s"]):  # type: ignore[arg-type]
        print(f"  rollback {i + 1}: operator {phase['operator_s']} s, signal {phase['signal_s']} s")
    for row in planner:
        label = f"planner, {row['replicas']} pods staged"
        print(f"{label:<28} {row['total_s']:>8}  (peak loads {row['peak_concurrent_loads']})")
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
