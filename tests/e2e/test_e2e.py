"""End to end on a real control plane: the operator (a process, as its ServiceAccount),
the real controller-manager and scheduler making and placing the pods of its Deployment,
the node agent running each pod's init container, server and sidecar as processes, and
SeaweedFS as the store.

A ModelDeployment of 4 replicas at v1 takes traffic on every pod; v2 is rolled out with a
25% canary and batches by ``kubectl patch`` of spec.version, then rolled back; no request
may fail and no pod is replaced or restarted. The node agent writes each pod's Downward
API file when the pod starts and not again during the test (a kubelet refreshes it about
once a minute): every version the pods move to reaches them through the API."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from model_rollout_e2e.control_plane import ControlPlane
from model_rollout_e2e.loadgen import LoadGenerator
from model_rollout_e2e.s3_scenario import s3_scenario
from model_rollout_e2e.scenario import available
from model_rollout_e2e.seaweed import SeaweedFS
from tests.support.e2e import deployed, pods_of

pytestmark = [pytest.mark.slow, pytest.mark.s3]
REPLICAS = 4


async def test_rollout_and_rollback_under_load_lose_nothing(
    s3_env: SeaweedFS, control_plane: ControlPlane
) -> None:
    scenario = s3_scenario(s3_env, "e2e", cluster=control_plane, volume_refresh_s=3600)
    scenario.publish("v1", seed=1)
    scenario.publish("v2", seed=2)
    phases: list[str] = []

    def record(status: dict) -> None:
        if status.get("phase") and (not phases or phases[-1] != status["phase"]):
            phases.append(status["phase"])

    async with scenario.running():
        await deployed(
            scenario,
            "v1",
            REPLICAS,
            120,
            canary={"percent": 25, "pauseSeconds": 1},
            rollout={"batchSize": 1, "jitterSeconds": 0.5},
        )
        urls, lives = await pods_of(scenario, REPLICAS)
        assert all(len(c) == 2 for c in lives.values()), lives
        assert all(
            started and restarts == 0 for c in lives.values() for _, started, restarts in c.values()
        ), lives
        load = LoadGenerator(urls, "mlp", scenario.in_dim, concurrency=6)
        load.start_clock()
        traffic = asyncio.create_task(load.run())
        await asyncio.sleep(1)

        await scenario.set_version("v2")
        status = await scenario.wait(available("v2", REPLICAS), 120, record)
        assert (status["currentVersion"], status["previousVersion"]) == ("v2", "v1")
        assert "Canary" in phases and phases[-1] == "Available"
        assert scenario.serving_versions() == {n: "v2" for n in scenario.serving_versions()}
        # every pod serves v2 and no pod's Downward API file says so: sidecars follow their
        # pods through the API, not the file the kubelet refreshes
        targets = scenario.projected_targets()
        assert len(targets) == REPLICAS and "v2" not in targets.values(), targets

        await scenario.set_version("v1")
        status = await scenario.wait(available("v1", REPLICAS), 60, record)
        assert status["rollout"]["fast"] is True
        await asyncio.sleep(1)
        load.stop()
        result = await traffic

        failed = [s for s in result.samples if not s.ok]
        assert failed == [], failed[:5]
        versions = Counter(s.version for s in result.samples)
        assert versions["v1"] > 0 and versions["v2"] > 0, versions
        assert len({s.target for s in result.samples}) == REPLICAS  # traffic hit every pod
        assert set(scenario.serving_versions().values()) == {"v1"}
        assert await scenario.pod_lives() == lives  # the same pods, no container restarted

        for pod, events in scenario.audit_events().items():
            loads = [(e["version"], e["result"], e["source"]) for e in events]
            assert loads[0] == ("v1", "success", "startup"), (pod, loads)
            assert ("v2", "success", "socket") in loads, (pod, loads)
            assert loads[-1][:2] == ("v1", "success"), (pod, loads)
            assert all(e["who"].startswith(("socket:uid=", "startup")) for e in events)
        conditions = {c["type"]: c["status"] for c in status["conditions"]}
        assert conditions == {
            "SpecValid": "True",
            "Progressing": "False",
            "Available": "True",
            "Degraded": "False",
            "ChildrenReady": "True",
            "StoreReachable": "True",
            "SignaturesVerified": "True",
            "PodsSchedulable": "True",
            "Paused": "False",
            "Ready": "True",
        }
