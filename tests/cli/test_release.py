"""Day 2 end to end: ``model-rollout release`` and the ``kubectl-model`` plugin, each run
as a real process with the kubeconfig of a user bound to the chart's rollout-editor role
(as the README binds it), against the real API server (the session's control plane),
the real operator process and real pod processes (init, sidecar, server) on the node
agent, under load.

One farm of 2 pods (a 1-pod canary with analysis) goes through a release of a good
version (exit 0, JSON), of a version the canary analysis refuses (NaN outputs: exit 1
with the reason), a retry of it (the canary serves it again, and it is refused again),
a promotion, a rollback to the previous success and an abort; each step is checked in
what the pods serve (their /metrics) and in ``status.history``."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from model_rollout_e2e.control_plane import ControlPlane
from model_rollout_e2e.loadgen import LoadGenerator
from model_rollout_e2e.onnx_models import write_mlp
from model_rollout_e2e.scenario import Scenario, StoreSetup, available
from tests.support.cli import EDITOR, bound_user, install_tools, run_tool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
REPLICAS = 2
CANARY = {
    "percent": 50,
    "trafficPercent": 20,
    "shadowPercent": 50,
    "pauseSeconds": 2,
    "analysis": {  # as tests/e2e/test_e2e_canary.py: latency is noise on a loaded 2-core machine
        "intervalSeconds": 2,
        "minRequests": 15,
        "failureLimit": 2,
        "maxOutputDrift": 0.01,
        "maxLatencyRatio": 1000,
    },
}
WAIT = "240"


class Release:
    """``model-rollout release`` of a model file built for it."""

    def __init__(self, scenario: Scenario, kubeconfig: Path) -> None:
        self.scenario, self.kubeconfig = scenario, kubeconfig

    async def __call__(self, version: str, *extra: str, **dims: Any) -> tuple[int, str, str]:
        path = self.scenario.work / "release" / version / "model.onnx"
        write_mlp(path, in_dim=self.scenario.in_dim, **dims)
        store = self.scenario.store.host_dir
        return await run_tool(
            "model-rollout", "release",
            "--model", self.scenario.model, "--version", version, "--file", str(path),
            "--key", str(self.scenario.keys / "signing.key"),
            "--deployment", self.scenario.model, "--store", f"file://{store}",
            "--kubeconfig", str(self.kubeconfig), *extra,
        )  # fmt: skip


@contextlib.asynccontextmanager
async def served(scenario: Scenario) -> AsyncIterator[set[str]]:
    """Every version any pod's server reported serving while the block ran (its
    ``model_server_version_serving`` over HTTP, read again and again)."""
    seen: set[str] = set()
    stop = asyncio.Event()

    async def sample() -> None:
        while not stop.is_set():
            versions = await asyncio.to_thread(scenario.serving_versions)
            seen.update(v for v in versions.values() if v)
            await asyncio.sleep(0.2)

    task = asyncio.create_task(sample())
    try:
        yield seen
    finally:
        stop.set()
        await task


async def awaiting_promotion(scenario: Scenario, version: str) -> dict[str, Any]:
    def held(s: dict[str, Any]) -> bool:
        progressing = next((c for c in s.get("conditions", []) if c["type"] == "Progressing"), {})
        return (
            s.get("phase") == "Canary"
            and (s.get("rollout") or {}).get("toVersion") == version
            and progressing.get("reason") == "AwaitingPromotion"
        )

    return await scenario.wait(held, 180)


def serving(scenario: Scenario) -> set[str | None]:
    return set(scenario.serving_versions().values())


async def test_release_promote_abort_retry_rollback_and_history(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    install_tools(control_plane)  # the CRD and the chart's user roles
    scenario = Scenario(StoreSetup.local(tmp_path / "store"), cluster=control_plane)
    scenario.publish("v1", seed=1)
    async with scenario.running():
        user = bound_user(control_plane, scenario.namespace, "release-bot", EDITOR)
        kubeconfig = user.kubeconfig
        release = Release(scenario, kubeconfig)

        async def plugin(*args: str) -> tuple[int, str, str]:
            return await run_tool("kubectl-model", *args, "--kubeconfig", str(kubeconfig))

        await scenario.apply(
            "v1", REPLICAS, canary=CANARY, rollout={"batchSize": 1, "jitterSeconds": 0.2}
        )
        await scenario.wait(available("v1", REPLICAS), 180)
        load = LoadGenerator(scenario.pod_urls(), "mlp", scenario.in_dim, concurrency=4)
        load.start_clock()
        traffic = asyncio.create_task(load.run())

        # a good version: published, rolled out through the canary, exit 0 with a report
        code, out, err = await release("v2", "--wait", "--timeout", WAIT, "-o", "json", seed=1)
        assert code == 0, (out, err)
        report = json.loads(out)
        assert report["result"] == "Succeeded" and report["currentVersion"] == "v2", report
        assert report["versions"] == {"v2": REPLICAS} and "published mlp:v2" in report["published"]
        assert "Canary" in err  # the progress lines went to stderr, the JSON alone to stdout
        assert serving(scenario) == {"v2"}

        # a version the canary analysis refuses: exit 1, the reason, the pods on v2
        code, out, err = await release(
            "v3", "--wait", "--timeout", WAIT, "-o", "json", seed=1, nan_above=0.5
        )
        assert code == 1, (out, err)
        report = json.loads(out)
        assert report["result"] == "RolledBack" and "non-finite outputs" in report["reason"]
        await scenario.wait(lambda s: s.get("versions") == {"v2": REPLICAS}, 60)
        assert serving(scenario) == {"v2"}

        # retry: the same version runs again (a canary pod serves it) and fails again
        async with served(scenario) as seen:
            code, out, err = await plugin("retry", "mlp", "--wait", "--timeout", WAIT)
        assert code == 1 and "RolledBack" in out and "non-finite" in out, (out, err)
        assert "v3" in seen, seen
        await scenario.wait(lambda s: s.get("versions") == {"v2": REPLICAS}, 60)

        # promote: a canary held for the annotation, promoted by the plugin
        await scenario.patch({"spec": {"canary": {"manualPromote": True}}})
        code, out, err = await release("v4", "-o", "json", seed=1)  # no --wait: started
        assert code == 0 and json.loads(out)["result"] == "Started", (out, err)
        await awaiting_promotion(scenario, "v4")
        assert serving(scenario) == {"v2", "v4"}
        code, out, err = await plugin("status", "mlp")
        assert code == 0 and "AwaitingPromotion" in out and "kubectl model promote mlp" in out
        code, out, err = await plugin("promote", "mlp", "--wait", "--timeout", WAIT)
        assert code == 0 and "result: Succeeded" in out, (out, err)
        assert serving(scenario) == {"v4"}

        # rollback: to the previous Succeeded version, v2
        code, out, err = await plugin("rollback", "mlp", "--wait", "--timeout", WAIT)
        assert code == 0 and "to v2" in out and "result: Succeeded" in out, (out, err)
        assert serving(scenario) == {"v2"}

        # the CI job of v2 run again: nothing published or rolled out, exit 0
        code, out, err = await release("v2", "--wait", "--timeout", WAIT, "-o", "json", seed=1)
        assert code == 0, (out, err)
        report = json.loads(out)
        assert (report["result"], report["reason"]) == ("Succeeded", "already serving v2")
        assert report["published"] is None and "not published again" in err

        # abort: the canary of v5 goes back to the stable version at once
        code, out, err = await release("v5", seed=1)
        assert code == 0, (out, err)
        await awaiting_promotion(scenario, "v5")
        assert serving(scenario) == {"v2", "v5"}
        code, out, err = await plugin("abort", "mlp", "--wait", "--timeout", WAIT)
        assert code == 0 and "result: Aborted" in out, (out, err)
        assert serving(scenario) == {"v2"}
        status = await scenario.status()
        degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
        assert (status["phase"], degraded["reason"]) == ("Degraded", "Aborted")
        code, out, err = await plugin("abort", "mlp")
        assert code == 6 and "nothing to abort" in err, (out, err)

        # the history, most recent first, as the operator kept it
        code, out, err = await plugin("history", "mlp", "-o", "json")
        assert code == 0, err
        history = json.loads(out)
        assert [(e["version"], e["result"]) for e in history] == [
            ("v5", "Aborted"),
            ("v2", "Succeeded"),
            ("v4", "Succeeded"),
            ("v3", "RolledBack"),
            ("v3", "RolledBack"),
            ("v2", "Succeeded"),
            ("v1", "Succeeded"),
        ]
        causes = [e["triggeredBy"] for e in history]
        assert causes[0].startswith("release by") and causes[1].startswith("rollback by")
        assert causes[3].startswith("retry by") and causes[-1] == "spec.version edit"
        assert all(e.get("finishedAt") for e in history)
        code, out, err = await plugin("history", "mlp")
        assert code == 0 and "Aborted" in out and "rollback by" in out
        load.stop()
        result = await traffic
        events = await scenario.events()
    reasons = [e.get("reason") for e in events]
    assert reasons.count("RolloutRetried") == 1 and reasons.count("RolloutAborted") == 1
    assert "AbortIgnored" not in reasons and "RetryIgnored" not in reasons
    assert result.samples and sum(s.ok for s in result.samples) > 0
