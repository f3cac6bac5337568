"""Canary analysis through the real operator on the session's real control plane (issue
28): the operator process, as the Helm chart runs it, reads every canary pod's
``/metrics`` over HTTP at the pod's own IP and port 8000, as in a cluster, and judges
what they count. The pods are the real controller-manager's and scheduler's, run by a
simulated node (``model_rollout_e2e.simulated_traffic``): each pod has a loopback address
of its own, which the node writes to ``status.podIP``, its sidecar reports through the
API as the real one does, and its server answers made-up traffic, each version as the
test says (a candidate that answers 500s, NaN or slowly), split between the versions as
the pod's traffic policy says."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from model_rollout_contract.annotations import TARGET_VERSION
from model_rollout_contract.canary import TRAFFIC_POLICY, TrafficPolicy
from model_rollout_e2e.binaries import BinaryNotFound, prometheus_binary
from model_rollout_e2e.control_plane import ControlPlane
from model_rollout_e2e.identities import Identity
from model_rollout_e2e.node_agent import NodeAgent
from model_rollout_e2e.prometheus import PrometheusServer
from model_rollout_e2e.simulated_servers import Behaviour
from model_rollout_e2e.simulated_traffic import TrafficModelContainers
from tests.support.control_plane_operator import Operator
from tests.support.rollout_cluster import (
    RolloutCluster,
    condition,
    rollout_cluster,
    shared_operator,
)

pytestmark = pytest.mark.slow
GOOD = Behaviour(latency_s=0.010)


class Harness:
    """The rollout's cluster, and its pods' servers (what they answer, how much)."""

    def __init__(self, cluster: RolloutCluster, pods: TrafficModelContainers) -> None:
        self.cluster, self.pods = cluster, pods

    @property
    def history(self) -> list[dict[str, Any]]:
        return self.cluster.history

    async def wait(self, predicate: Any) -> dict[str, Any]:
        return await self.cluster.wait(predicate)

    async def pods_now(self) -> list[dict[str, Any]]:
        return await self.cluster.items("pods")

    async def events_of(self, reason: str, count: int) -> list[dict[str, Any]]:
        return await self.cluster.events_of(reason, count)


@pytest.fixture(scope="module")
def operator(
    control_plane: ControlPlane,
    operator_identity: Identity,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Operator]:
    """The operator of the tests that need none of their own (namespaces ``analysis-*``)."""
    work = tmp_path_factory.mktemp("operator")
    with shared_operator(control_plane, operator_identity, work, "analysis") as running:
        yield running


@contextlib.asynccontextmanager
async def harness_on(
    control_plane: ControlPlane,
    identity: Identity,
    node_agents: Callable[..., NodeAgent],
    work: Path,
    prefix: str,
    operator: Operator | None,
) -> AsyncIterator[Harness]:
    async with rollout_cluster(
        control_plane, identity, node_agents, work, prefix, operator
    ) as cluster:
        node = cluster.run_pods(runtime=lambda kubeconfig: TrafficModelContainers(kubeconfig))
        assert isinstance(node.runtime, TrafficModelContainers)
        yield Harness(cluster, node.runtime)


@pytest.fixture
async def harness(
    control_plane: ControlPlane,
    operator_identity: Identity,
    operator: Operator,
    node_agents: Callable[..., NodeAgent],
    tmp_path: Path,
) -> AsyncIterator[Harness]:
    """Pods with traffic in a namespace the module's operator runs for."""
    async with harness_on(
        control_plane, operator_identity, node_agents, tmp_path, "analysis", operator
    ) as created:
        yield created


@pytest.fixture
async def bare_harness(
    control_plane: ControlPlane,
    operator_identity: Identity,
    node_agents: Callable[..., NodeAgent],
    tmp_path: Path,
) -> AsyncIterator[Harness]:
    """Pods with traffic in a namespace no operator runs for: the test starts its own."""
    async with harness_on(
        control_plane, operator_identity, node_agents, tmp_path, "own-analysis", None
    ) as created:
        yield created


def body(**canary: Any) -> dict[str, Any]:
    analysis = {"intervalSeconds": 1, "minRequests": 20, "failureLimit": 2}
    analysis.update(canary.pop("analysis", {}))
    return {
        "metadata": {"name": "mlp"},
        "spec": {
            "model": "mlp",
            "version": "v1",
            "image": "registry.example/model-server:0.1",
            "replicas": 4,
            "backend": "onnxruntime",
            "store": {"pvc": "model-store"},
            "canary": {"percent": 25, "pauseSeconds": 3, "analysis": analysis, **canary},
            "rollout": {"batchSize": 2, "jitterSeconds": 0},
            "signingPublicKeySecret": "model-signing-key",
        },
    }


def available(version: str) -> Any:
    return lambda s: s.get("phase") == "Available" and s.get("versions") == {version: 4}


async def roll_out_v2(h: Harness, **canary: Any) -> None:
    await h.cluster.create(body(**canary))
    await h.wait(available("v1"))
    h.history.clear()
    await h.cluster.patch({"spec": {"version": "v2"}})


BAD = {
    "answers 500s": (Behaviour(error_every=3), "error rate"),
    "answers NaN": (Behaviour(non_finite=4), "non-finite outputs"),
    "answers slowly": (Behaviour(latency_s=0.5), "p99 latency"),
}


@pytest.mark.parametrize(("behaviour", "words"), BAD.values(), ids=BAD.keys())
async def test_a_bad_candidate_is_rolled_back_automatically(
    harness: Harness, behaviour: Behaviour, words: str
) -> None:
    harness.pods.behaviours = {"v1": GOOD, "v2": behaviour}
    await roll_out_v2(harness, trafficPercent=25, shadowPercent=50)
    canary_status = await harness.wait(lambda s: s.get("phase") == "Canary")
    status = await harness.wait(lambda s: s.get("phase") == "Degraded")
    degraded = condition(status, "Degraded")
    assert degraded["reason"] == "AnalysisFailed", degraded
    assert words in degraded["message"] and "failureLimit 2" in degraded["message"]
    assert status["analysis"]["lastResult"] == "Failed" and status["analysis"]["failures"] == 2
    status = await harness.wait(lambda s: s.get("versions") == {"v1": 4})
    assert status["phase"] == "Degraded" and status["currentVersion"] == "v1"
    for pod in await harness.pods_now():
        annotations = pod["metadata"].get("annotations") or {}
        assert annotations[TARGET_VERSION] == "v1" and TRAFFIC_POLICY not in annotations
    [failed] = await harness.events_of("AnalysisFailed", 1)
    assert failed["type"] == "Warning" and words in failed["message"]
    assert canary_status["targetVersion"] == "v2"


async def test_a_good_candidate_passes_its_checks_and_is_promoted(harness: Harness) -> None:
    harness.pods.behaviours = {"v1": GOOD, "v2": GOOD}
    await roll_out_v2(harness, trafficPercent=25, shadowPercent=50)
    canary = await harness.wait(lambda s: s.get("phase") == "Canary" and s.get("analysis"))
    assert canary["analysis"]["rollout"].startswith("v2@")
    # the canary pod carries the policy (its server splits and mirrors requests)
    await harness.wait(lambda s: (s.get("analysis") or {}).get("lastResult") == "Passed")
    policies = [
        (p["metadata"].get("annotations") or {}).get(TRAFFIC_POLICY)
        for p in await harness.pods_now()
    ]
    assert [TrafficPolicy.from_annotation(p) for p in policies if p] == [
        TrafficPolicy("v1", "v2", 25, 50)
    ]
    status = await harness.wait(available("v2"))
    assert status["analysis"]["lastResult"] == "Passed" and status["analysis"]["failures"] == 0
    assert "baseline" not in status["analysis"]  # that canary is over
    phases = [s.get("phase") for s in harness.history]
    assert "Degraded" not in phases and phases.index("Canary") < phases.index("Progressing")
    for pod in await harness.pods_now():
        assert TRAFFIC_POLICY not in (pod["metadata"].get("annotations") or {})
    await harness.events_of("CanaryPromoted", 1)
    reasons = await harness.cluster.reasons()  # oldest first
    assert reasons.index("AnalysisPassed") < reasons.index("CanaryPromoted"), reasons


async def test_a_canary_of_whole_pods_is_compared_with_the_stable_pods(harness: Harness) -> None:
    """No traffic policy (and no shadow step, whose policy mirrors requests): the canary
    pod serves the candidate only, and the reference latency is the stable pods' (read
    from their own /metrics)."""
    harness.pods.behaviours = {"v1": GOOD, "v2": Behaviour(latency_s=0.5)}
    await roll_out_v2(harness, shadow={"enabled": False})
    status = await harness.wait(lambda s: s.get("phase") == "Degraded")
    message = condition(status, "Degraded")["message"]
    assert "p99 latency x" in message and "vs stable 10.0ms" in message, message
    await harness.wait(lambda s: s.get("versions") == {"v1": 4})


async def test_no_traffic_holds_the_canary_inconclusive_and_never_promotes(
    harness: Harness,
) -> None:
    harness.pods.requests_per_tick = 0  # nobody sends a request
    await roll_out_v2(harness, trafficPercent=25)
    # held in its shadow step (the default with analysis), which says so from the start
    status = await harness.wait(
        lambda s: (
            s.get("message", "").endswith("after a passed check")
            and (s.get("analysis") or {}).get("lastResult") == "Inconclusive"
        )
    )
    assert status["phase"] == "Canary" and status["rollout"]["canaryStep"] == "shadow"
    assert "fewer than minRequests 20" in status["analysis"]["message"]
    # past the pause (three more checks, each a second after the last): still held,
    # nothing promoted or rolled back
    checks = status["analysis"]["checks"]
    status = await harness.wait(lambda s: (s.get("analysis") or {}).get("checks", 0) >= checks + 3)
    assert status["phase"] == "Canary" and status["versions"] == {"v1": 3, "v2": 1}
    harness.pods.requests_per_tick = 4  # traffic comes: the canary is judged, and passes
    await harness.wait(available("v2"))


async def test_a_restarted_operator_continues_the_analysis_from_the_status(
    bare_harness: Harness,
) -> None:
    """The operator process is stopped after the first failed check; a new one goes on
    from .status (the failures so far and the last scrape) instead of starting over.

    The canary's traffic stops once the first failure is seen, so checks until the stop
    are inconclusive (no failure, no promotion) however long the stop takes: on a loaded
    machine the first operator once ran two more failing checks before it stopped,
    reached the failure limit itself and left the second nothing to continue."""
    harness = bare_harness
    harness.pods.behaviours = {"v1": GOOD, "v2": Behaviour(error_every=2)}
    harness.cluster.start_operator()
    await roll_out_v2(harness, trafficPercent=50, analysis={"failureLimit": 3})
    status = await harness.wait(lambda s: (s.get("analysis") or {}).get("failures") == 1)
    await harness.events_of("AnalysisCheckFailed", 1)  # posted, not only in the status
    traffic, harness.pods.requests_per_tick = harness.pods.requests_per_tick, 0
    await harness.cluster.stop_operator()
    # what the stopped operator left: the status it wrote last (the interval under way
    # when the traffic stopped may have made one more failed check) and the events it
    # posted; kopf posts an event after the status write it goes with, on a task of its
    # own that a stop cancels, so that one event can be lost, never repeated
    assert status["analysis"]["baseline"], status  # the last scrape, to measure from
    kept = (await harness.cluster.md())["status"]["analysis"]
    assert kept["failures"] in (1, 2), kept
    lost = kept["failures"] - len(await harness.events_of("AnalysisCheckFailed", 1))
    assert lost in (0, 1), kept
    harness.pods.requests_per_tick = traffic
    harness.cluster.start_operator()
    status = await harness.wait(lambda s: s.get("phase") == "Degraded")
    assert status["analysis"]["failures"] == 3 and status["analysis"]["checks"] > kept["checks"]
    failed = await harness.events_of("AnalysisCheckFailed", 3 - lost)
    numbers = sorted(int(re.match(r"check (\d+) failed", e["message"])[1]) for e in failed)  # type: ignore[index]
    assert len(numbers) == 3 - lost and numbers == sorted(set(numbers)), numbers  # none repeated


async def test_with_prometheus_the_figures_come_from_promql(
    harness: Harness, tmp_path: Path
) -> None:
    """A real Prometheus scrapes the pods (at their IPs, port 8000, as Kubernetes service
    discovery would) and the operator asks it, not the pods."""
    try:
        prometheus_binary()
    except BinaryNotFound as exc:  # .ci/run installs it: under CI=true this fails
        pytest.skip(str(exc))
    harness.pods.behaviours = {"v1": GOOD, "v2": Behaviour(error_every=2)}
    prometheus = PrometheusServer(tmp_path / "prometheus", [], scrape_interval_s=0.5)
    analysis = {"intervalSeconds": 2, "minRequests": 10, "prometheus": {"url": prometheus.url}}
    await harness.cluster.create(body(trafficPercent=25, analysis=analysis))
    await harness.wait(available("v1"))
    pods = await harness.pods_now()
    ips = [p["status"]["podIP"] for p in pods]
    assert len(set(ips)) == 4 and "127.0.0.1" not in ips  # an address of its own each
    # the labels Kubernetes service discovery gives (the queries select the pods by name)
    prometheus.targets = [
        (f"{p['status']['podIP']}:8000",
         {"namespace": harness.cluster.namespace, "pod": p["metadata"]["name"]})
        for p in pods
    ]  # fmt: skip
    prometheus.start()
    try:
        await asyncio.to_thread(prometheus.wait_for_scrapes, 2)
        await harness.cluster.patch({"spec": {"version": "v2"}})
        held = await harness.wait(lambda s: (s.get("analysis") or {}).get("checks", 0) >= 1)
        assert "baseline" not in held["analysis"]  # nothing scraped by the operator itself
        status = await harness.wait(lambda s: s.get("phase") == "Degraded")
    finally:
        prometheus.stop()
    degraded = condition(status, "Degraded")
    assert degraded["reason"] == "AnalysisFailed" and "error rate" in degraded["message"]
    await harness.wait(lambda s: s.get("versions") == {"v1": 4})
