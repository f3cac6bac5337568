"""``make demo``: the whole system on this machine, with a live view.

Publishes two signed versions of a small model to a local-directory store (the embedded
default), starts a real Kubernetes control plane (etcd, kube-apiserver,
controller-manager, scheduler: ``make install`` builds them), the operator as its
ServiceAccount and a node agent that runs the operator's 4 pods (init container, server
and sidecar each as a real process); prints the ``KUBECONFIG`` to follow it with
``kubectl get md -w`` and ``kubectl model status mlp --watch`` in another terminal;
sends traffic to every pod, rolls out v2
with a 25% canary (which holds both versions and is judged on its own figures: first its
shadow step, where v2 answers only copies of the requests v1 answered, then, once a check
passed, live, where v2 answers 20% of the canary's requests and half of the rest are
mirrored to it) and jittered batches, rolls back to v1 by editing the version, then rolls
out a broken v3 (NaN on real inputs): its analysis fails in the shadow step and the
canary is rolled back automatically, before v3 answered a single user. Then the cluster
stays up, under load, for ``--hold`` seconds (Ctrl-C ends it sooner) for the user's own
edits; ``--hold 0`` ends at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from model_rollout_contract.annotations import SIDECAR_STATUS, TARGET_VERSION
from model_rollout_contract.report import SidecarReport
from model_rollout_contract.states import SidecarState

from .loadgen import LoadGenerator, LoadResult
from .scenario import Scenario, StoreSetup, available

STATE_COLOURS = {SidecarState.OK: "green", SidecarState.REFUSED: "red", SidecarState.ERROR: "red"}


def pods_table(pods: list[dict[str, Any]]) -> Table:
    table = Table(title="pods", expand=True)
    for column in ("pod", "ready", "target", "serving", "sidecar", "reason"):
        table.add_column(column)
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        annotations = pod["metadata"].get("annotations") or {}
        report = SidecarReport.from_json(annotations.get(SIDECAR_STATUS))
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in (pod.get("status") or {}).get("conditions", [])
        )
        state = str(report.state) if report else "-"
        colour = STATE_COLOURS.get(report.state, "yellow") if report else "yellow"
        table.add_row(
            pod["metadata"]["name"],
            "yes" if ready else "no",
            annotations.get(TARGET_VERSION, "-"),
            (report.serving if report else None) or "-",
            f"[{colour}]{state}[/]",
            ((report.reason if report else None) or "")[:40],
        )
    return table


def rollout_table(status: dict[str, Any]) -> Table:
    table = Table(title="ModelDeployment mlp", expand=True, show_header=False)
    rollout = status.get("rollout") or {}
    rows = [
        ("phase", status.get("phase", "-")),
        ("message", status.get("message", "-")),
        ("current / target", f"{status.get('currentVersion')} / {status.get('targetVersion')}"),
        ("pods per version", json.dumps(status.get("versions", {}))),
        ("stage / batch", f"{stage_text(rollout)} / {rollout.get('batch', 0)}"),
    ]
    analysis = status.get("analysis") or {}
    if analysis:
        rows.append(("analysis", f"{analysis.get('lastResult', '-')}: {analysis.get('message')}"))
    for key, value in rows:
        table.add_row(key, str(value))
    return table


def stage_text(rollout: dict[str, Any]) -> str:
    """The rollout's stage, and the canary's step while it is one."""
    stage = str(rollout.get("stage", "-"))
    step = rollout.get("canaryStep")
    return f"{stage} (step {step})" if stage == "canary" and step else stage


def traffic_table(result: LoadResult, now: float) -> Table:
    recent = result.window(now - 2, now)
    summary = LoadResult.summary(recent)
    total = LoadResult.summary(result.samples)
    versions: dict[str, int] = {}
    for sample in recent:
        versions[sample.version or "error"] = versions.get(sample.version or "error", 0) + 1
    table = Table(title="traffic (last 2 s)", expand=True)
    for column in ("requests", "errors (all time)", "p50 ms", "p99 ms", "answered by"):
        table.add_column(column)
    table.add_row(
        str(summary["requests"]),
        str(total["errors"]),
        str(summary["p50_ms"]),
        str(summary["p99_ms"]),
        json.dumps(versions),
    )
    return table


async def hold(seconds: float) -> None:
    """Until ``seconds`` have passed or Ctrl-C (which then ends only the wait)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except asyncio.TimeoutError:
        pass
    finally:
        loop.remove_signal_handler(signal.SIGINT)


def follow_it(scenario: Scenario, console: Console) -> None:
    """How to watch the demo's cluster from another terminal."""
    assert scenario.cluster is not None
    kubeconfig = scenario.cluster.admin_kubeconfig(scenario.work / "kubeconfig", scenario.namespace)
    tools = Path(sys.executable).parent  # the venv's kubectl and kubectl-model plugin
    console.print(
        "[bold]follow it in another terminal[/] (namespace "
        f"{scenario.namespace}, the kubeconfig's default):\n"
        f"  export KUBECONFIG={kubeconfig}\n"
        f"  export PATH={tools}:$PATH\n"
        f"  kubectl get md -w\n"
        f"  kubectl model status {scenario.model} --watch",
        soft_wrap=True,
    )


async def run_demo(replicas: int, hold_s: float, console: Console) -> int:
    work = Path(tempfile.mkdtemp(prefix="mr-demo-", dir="/tmp"))  # short: socket paths
    scenario = Scenario(StoreSetup.local(work / "store"), work=work, namespace="ml")
    console.print(f"[bold]model-rollout demo[/] - working directory {scenario.work}")
    console.print(
        f"the node agent (the kubelet stand-in) refreshes Downward API files every "
        f"{scenario.volume_refresh_s:.0f} s, as a real kubelet does; sidecars follow "
        "their pods through the API instead"
    )
    scenario.publish("v1", seed=1, hidden=256, depth=4)
    scenario.publish("v2", seed=2, hidden=256, depth=4)
    scenario.publish("v3", seed=3, hidden=256, depth=4, nan_above=0.5)  # NaN on real inputs
    console.print("published signed versions v1, v2 and a broken v3 to the local model store")
    view: dict[str, Any] = {"status": {}, "pods": []}
    console.print(
        "starting a Kubernetes control plane (etcd, kube-apiserver, controller-manager,"
        " scheduler), the Helm chart's CRD, RBAC and admission policy, the operator and a"
        " node agent"
    )
    async with scenario.running():
        follow_it(scenario, console)
        await scenario.apply(
            "v1",
            replicas,
            canary={
                "percent": 25,
                "trafficPercent": 20,
                "shadowPercent": 50,
                "pauseSeconds": 4,
                # latency within 10x: on a few shared cores the shadow step's mirrored
                # runs (every request twice on the canary pod) time as noise
                "analysis": {"intervalSeconds": 2, "minRequests": 20, "maxLatencyRatio": 10},
            },
            rollout={"batchSize": 1, "jitterSeconds": 1.5},
        )
        console.print(f"applied ModelDeployment mlp: {replicas} replicas of v1")
        await scenario.wait(available("v1", replicas), 180)
        load = LoadGenerator(scenario.pod_urls(), "mlp", scenario.in_dim, concurrency=4)
        load.start_clock()
        traffic = asyncio.create_task(load.run())

        def render() -> Group:
            return Group(
                rollout_table(view["status"]),
                pods_table(view["pods"]),
                traffic_table(load.result, load.now()),
            )

        async def refresh(live: Live | None, until: asyncio.Event) -> None:
            last_phase = None
            while not until.is_set():
                view["status"] = await scenario.status()
                view["pods"] = await scenario.pod_objects()
                if live is not None:
                    live.update(render())
                elif view["status"].get("phase") != last_phase:
                    last_phase = view["status"].get("phase")
                    console.print(
                        f"{time.strftime('%H:%M:%S')} phase {last_phase}: "
                        f"{view['status'].get('message')}"
                    )
                await asyncio.sleep(0.3)

        done = asyncio.Event()
        live = (
            Live(render(), console=console, refresh_per_second=4) if console.is_terminal else None
        )
        if live is not None:
            live.start()
        painter = asyncio.create_task(refresh(live, done))
        try:
            await asyncio.sleep(2)
            console.log(
                "edit spec.version: v1 -> v2 (25% canary: shadow step, then live; then"
                " batches with jitter)"
            )
            await scenario.set_version("v2")
            status = await scenario.wait(shadow_passed, 180)
            console.log(f"v2's shadow step {status['rollout']['shadowResult']}: v2 goes live")
            await scenario.wait(available("v2", replicas), 180)
            await asyncio.sleep(2)
            console.log("edit spec.version back: v2 -> v1 (rollback)")
            started = time.monotonic()
            await scenario.set_version("v1")
            await scenario.wait(available("v1", replicas), 120)
            console.log(f"rolled back: Available on v1 {time.monotonic() - started:.2f} s later")
            await asyncio.sleep(2)
            console.log("edit spec.version: v1 -> v3, a broken version (NaN on real inputs)")
            await scenario.set_version("v3")
            status = await scenario.wait(lambda s: s.get("phase") == "Degraded", 180)
            step = (status.get("rollout") or {}).get("canaryStep")
            console.log(
                f"caught in the canary's {step} step and rolled back, after "
                f"{live_answers(load.result, 'v3')} live answers of v3: {status.get('message')}"
            )
            await scenario.wait(lambda s: s.get("versions") == {"v1": replicas}, 60)
            await asyncio.sleep(2)
            if hold_s > 0:
                console.log(
                    f"the cluster stays up {hold_s:.0f} s more (Ctrl-C ends it): try"
                    f" kubectl patch md {scenario.model} --type=merge"
                    """ -p '{"spec": {"version": "v2"}}'"""
                )
                await hold(hold_s)
        finally:
            done.set()
            await painter
            if live is not None:
                live.update(render())
                live.stop()
            load.stop()
            result = await traffic
    summary = LoadResult.summary(result.samples)
    answered = {v: live_answers(result, v) for v in ("v1", "v2", "v3")}
    latencies = np.array([s.latency_s for s in result.samples if s.ok]) * 1000
    console.print(
        f"\n[bold]done[/]: {summary['requests']} requests, {summary['errors']} failed, "
        f"p50 {np.percentile(latencies, 50):.1f} ms, p99 "
        f"{np.percentile(latencies, 99):.1f} ms; answered by {answered}"
    )
    console.print(
        f"the broken v3 answered {answered['v3']} live requests: "
        + (
            "caught in its shadow step, before any user got an answer of it"
            if answered["v3"] == 0
            else "users got its NaN answers"
        )
    )
    console.print(f"logs and pod volumes: {scenario.work}")
    return 0 if summary["errors"] == 0 and answered["v3"] == 0 else 1


def shadow_passed(status: dict[str, Any]) -> bool:
    """The rollout's canary has passed its shadow step."""
    return bool((status.get("rollout") or {}).get("shadowResult"))


def live_answers(result: LoadResult, version: str) -> int:
    """Requests of the load generator that ``version`` answered (a shadow run answers
    none: its client got the stable version's answer)."""
    return sum(1 for s in result.samples if s.version == version)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model_rollout_e2e.demo", description=__doc__)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument(
        "--hold", type=float, default=300.0,
        help="seconds the cluster stays up after the scripted rollouts (0: end at once)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.replicas < 1 or args.hold < 0:
        parser.error("--replicas must be at least 1 and --hold not negative")
    logging.basicConfig(level=logging.WARNING)
    console = Console()
    try:
        return asyncio.run(run_demo(args.replicas, args.hold, console))
    except KeyboardInterrupt:  # everything it started is stopped by then
        console.print("interrupted: the cluster and its processes are stopped")
        return 130


if __name__ == "__main__":
    sys.exit(main())
