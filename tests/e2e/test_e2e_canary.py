"""End to end, canary analysis, on a real control plane: the operator (a process, as its
ServiceAccount), the pods of its Deployment made by the real controller-manager and run
by the node agent as processes (init, sidecar, server), SeaweedFS as the store, under
load. Each pod has an IP of its own (a loopback address) and its server listens on port
8000, where the operator reads its /metrics. The canary pod holds both versions and
splits requests itself (trafficPercent) and mirrors some of the stable answers to the
candidate (shadowPercent).

A v2 that answers NaN, then one whose outputs are not v1's (seen in the shadow), are
each caught in the canary's shadow step (the default with analysis) and rolled back
automatically; a good v2 passes its shadow step, then its live step, and is promoted. No
request fails, the bad versions never answer a client (0 live answers: only mirrored
requests ran on them), and no pod is replaced or restarted."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from model_rollout_contract.canary import TRAFFIC_POLICY
from model_rollout_e2e.control_plane import ControlPlane
from model_rollout_e2e.loadgen import LoadGenerator
from model_rollout_e2e.s3_scenario import s3_scenario
from model_rollout_e2e.scenario import available
from model_rollout_e2e.seaweed import SeaweedFS
from tests.support.e2e import deployed, pods_of
from tests.support.rollout_cluster import condition

pytestmark = [pytest.mark.slow, pytest.mark.s3]
REPLICAS = 4
CANARY = {
    "percent": 25,
    "trafficPercent": 20,
    "shadowPercent": 50,
    "pauseSeconds": 4,
    # latency is judged by the simulated tests: on a loaded 2-core machine the p99 of a
    # few dozen requests is noise, so here it may be anything
    "analysis": {
        "intervalSeconds": 2,
        "minRequests": 15,
        "failureLimit": 2,
        "maxOutputDrift": 0.01,
        "maxLatencyRatio": 1000,
    },
}


async def test_bad_candidates_are_rolled_back_and_a_good_one_promoted(
    s3_env: SeaweedFS, control_plane: ControlPlane
) -> None:
    scenario = s3_scenario(s3_env, "canary", cluster=control_plane)
    scenario.publish("v1", seed=1)
    scenario.publish("v2-nan", seed=1, nan_above=0.5)  # NaN on real inputs (ones), not zeros
    scenario.publish("v2-other", seed=2)  # a model, but not the one v1 is
    scenario.publish("v2", seed=1)  # the same function as v1: passes every check

    async with scenario.running():
        await deployed(
            scenario, "v1", REPLICAS, 180, canary=CANARY,
            rollout={"batchSize": 2, "jitterSeconds": 0.5},
        )  # fmt: skip
        urls, lives = await pods_of(scenario, REPLICAS)
        assert not any("127.0.0.1" in u for u in urls), urls
        load = LoadGenerator(urls, "mlp", scenario.in_dim, concurrency=4, think_s=0.01)
        load.start_clock()
        traffic = asyncio.create_task(load.run())

        for bad, words in (("v2-nan", "non-finite outputs"), ("v2-other", "drift p99")):
            await scenario.set_version(bad)
            await scenario.wait(lambda s: s.get("phase") == "Canary", 120)
            status = await scenario.wait(lambda s: s.get("phase") == "Degraded", 180)
            degraded = condition(status, "Degraded")
            assert degraded["reason"] == "AnalysisFailed", degraded
            assert words in degraded["message"], degraded["message"]
            assert "failed in the shadow step" in degraded["message"], degraded["message"]
            assert status["rollout"]["canaryStep"] == "shadow"
            assert status["analysis"]["lastResult"] == "Failed"
            status = await scenario.wait(lambda s: s.get("versions") == {"v1": REPLICAS}, 60)
            assert status["currentVersion"] == "v1"
            for pod in await scenario.pod_objects():
                assert TRAFFIC_POLICY not in (pod["metadata"].get("annotations") or {})

        await scenario.set_version("v2")
        status = await scenario.wait(available("v2", REPLICAS), 240)
        assert status["analysis"]["lastResult"] == "Passed"
        assert status["rollout"]["shadowResult"].startswith("passed at check")
        assert (status["currentVersion"], status["previousVersion"]) == ("v2", "v1")
        await asyncio.sleep(1)
        load.stop()
        result = await traffic
        assert await scenario.pod_lives() == lives  # the same pods, no container restarted
        events = await scenario.events()
    failures = [e for e in events if e.get("reason") == "AnalysisFailed"]
    assert [e.get("type") for e in failures] == ["Warning", "Warning"], failures

    failed = [s for s in result.samples if not s.ok]
    assert failed == [], failed[:5]
    answered = Counter(s.version for s in result.samples)
    assert answered["v1"] > 0 and answered["v2"] > 0, answered
    for bad in ("v2-nan", "v2-other"):  # caught in the shadow step: no client got its answer
        assert answered[bad] == 0, answered
