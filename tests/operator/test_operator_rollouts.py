"""The operator's rollouts end to end on the session's real control plane (issue 28): the
operator process as the Helm chart runs it (its ServiceAccount, RBAC and the sidecar
admission policy enforced by the API server), the Deployment's pods made by the real
controller-manager and scheduler and run by a simulated node whose sidecars read and
report on their pods through the API as the real ones do
(``model_rollout_e2e.simulated_sidecar``; :mod:`rollout_cluster`). Canary, batches,
rollback; a stopped operator, a killed leader; invalid specs, refused versions, deleted,
evicted and unready pods; promotions; children restored; the store's reachability and
credentials. The one fault a real API server does not give on demand (a 503 to the
status write only) comes from the fault proxy in front of it."""

from __future__ import annotations

import asyncio
import base64
import re
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio.client.exceptions import ApiException

from model_operator.spec import NO_SIGNING_KEY
from model_rollout_cli.kube import PLURAL
from model_rollout_contract.annotations import PROMOTE, SIDECAR_STATUS, TARGET_VERSION
from model_rollout_contract.report import SidecarReport
from model_rollout_contract.states import SidecarState
from model_rollout_e2e.control_plane import ControlPlane
from model_rollout_e2e.fault_proxy import Fault, FaultProxy
from model_rollout_e2e.identities import Identity
from model_rollout_e2e.node_agent import NodeAgent
from model_rollout_e2e.processes import free_port
from model_rollout_e2e.raw_api import json_call
from model_rollout_e2e.simulated_sidecar import SidecarBehaviour
from model_sidecar.store import S3Store
from tests.support.cli import kubeconfig_through
from tests.support.control_plane_operator import NAMESPACE, Operator
from tests.support.rollout_cluster import (
    INTERVAL_S,
    RolloutCluster,
    condition,
    rollout_cluster,
    shared_operator,
)
from tests.support.sidecar import make_keys, publish_versions

pytestmark = pytest.mark.slow  # whole operator loops with a node: not in make test-fast


@pytest.fixture(scope="module")
def operator(
    control_plane: ControlPlane,
    operator_identity: Identity,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Operator]:
    """The operator of the tests that need none of their own (namespaces ``rollouts-*``)."""
    work = tmp_path_factory.mktemp("operator")
    with shared_operator(control_plane, operator_identity, work, "rollouts") as running:
        yield running


@pytest.fixture
async def cluster(
    control_plane: ControlPlane,
    operator_identity: Identity,
    operator: Operator,
    node_agents: Callable[..., NodeAgent],
    tmp_path: Path,
) -> AsyncIterator[RolloutCluster]:
    """A namespace the module's operator runs for."""
    async with rollout_cluster(
        control_plane, operator_identity, node_agents, tmp_path, "rollouts", operator
    ) as created:
        yield created


@pytest.fixture
def store(s3_env, tmp_path: Path) -> S3Store:  # type: ignore[no-untyped-def]
    """v1, v2 and v3, signed, in SeaweedFS; the operator (a child of this process) reads
    it with the credentials ``s3_env`` put in the environment."""
    s3_env.create_bucket("models")
    bucket = S3Store("models", f"op-{uuid.uuid4().hex[:8]}", endpoint_url=s3_env.endpoint)
    publish_versions(bucket, make_keys(tmp_path / "keys"), tmp_path, {"v1": 1, "v2": 2, "v3": 3})
    return bucket


def md_body(store: S3Store | None, **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "mlp"},
        "spec": {
            "model": "mlp",
            "version": "v1",
            "image": "registry.example/model-server:0.1",
            "replicas": 4,
            "backend": "onnxruntime",
            "store": (
                {
                    "url": f"s3://{store.bucket}/{store.prefix}",
                    "endpoint": store.client.meta.endpoint_url,
                }
                if store is not None
                else {"pvc": "model-store"}  # a volume: the operator does not check it
            ),
            "canary": {"percent": 25, "pauseSeconds": 1},
            "rollout": {"batchSize": 1, "jitterSeconds": 0.3},
            "signingPublicKeySecret": "model-signing-key",
            **spec,
        },
    }


def versions(count: dict[str, int]) -> Callable[[dict[str, Any]], bool]:
    return lambda s: s.get("versions") == count and s.get("phase") == "Available"


async def settled(cluster: RolloutCluster) -> bool:
    """Every pod's sidecar reports serving the pod's target: nothing is under way."""
    for pod in await cluster.items("pods"):
        annotations = pod["metadata"].get("annotations") or {}
        report = SidecarReport.from_json(annotations.get(SIDECAR_STATUS))
        target = annotations.get(TARGET_VERSION)
        if report is None or report.serving != target or report.state is not SidecarState.OK:
            return False
    return True


async def test_create_rollout_canary_batches_and_rollback(
    cluster: RolloutCluster, store: S3Store
) -> None:
    cluster.run_pods()
    await cluster.create(md_body(store))
    status = await cluster.wait(versions({"v1": 4}))
    assert status["currentVersion"] == "v1" and status["readyReplicas"] == 4
    [deployment] = await cluster.items("deployments")
    assert deployment["spec"]["replicas"] == 4
    owner = deployment["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "ModelDeployment" and owner["name"] == "mlp" and owner["uid"]
    template = deployment["spec"]["template"]["spec"]
    assert [c["name"] for c in template["containers"]] == ["server", "sidecar"]
    assert template["initContainers"][0]["name"] == "prefetch"
    for kind, name in (("service", "mlp"), ("config_map", "mlp-rollout"),
                       ("service_account", "model-sidecar-mlp")):  # fmt: skip
        assert await cluster.get(kind, name) is not None, (kind, name)
    cm = await cluster.get("config_map", "mlp-rollout")
    assert cm is not None and cm["data"]["target-version"] == "v1"

    # v1 -> v2 with a 25% canary: one pod first, held, then one pod per batch
    cluster.history.clear()
    await cluster.patch({"spec": {"version": "v2"}})
    await cluster.wait(
        lambda s: s.get("phase") == "Canary" and s.get("versions") == {"v1": 3, "v2": 1}
    )
    status = await cluster.wait(versions({"v2": 4}))
    assert (status["currentVersion"], status["previousVersion"]) == ("v2", "v1")
    phases = [s.get("phase") for s in cluster.history]
    assert phases.index("Canary") < phases.index("Progressing") and phases[-1] == "Available"
    counts = [s.get("versions") for s in cluster.history if s.get("phase") == "Progressing"]
    assert {"v1": 2, "v2": 2} in counts  # batches of one pod
    assert all(c["type"] != "Degraded" or c["status"] == "False" for c in status["conditions"])
    assert status["observedGeneration"] == 2
    cm = await cluster.get("config_map", "mlp-rollout")
    assert cm is not None and cm["data"]["target-version"] == "v2"

    await cluster.events_of("RolloutComplete", 2)
    reasons = await cluster.reasons()
    for reason in (
        "RolloutStarted",
        "CanaryStarted",
        "CanaryHealthy",
        "CanaryPromoted",
        "BatchStarted",
        "BatchComplete",
        "RolloutComplete",
    ):
        assert reason in reasons, reasons

    # edit back: a fast rollback, no canary
    cluster.history.clear()
    await cluster.patch({"spec": {"version": "v1"}})
    status = await cluster.wait(versions({"v1": 4}))
    assert "Canary" not in [s.get("phase") for s in cluster.history]
    assert (status["currentVersion"], status["previousVersion"]) == ("v1", "v2")
    assert status["rollout"]["fast"] is True


async def test_operator_process_stopped_mid_rollout_resumes_from_status(
    bare_cluster: RolloutCluster, store: S3Store
) -> None:
    cluster = bare_cluster
    cluster.run_pods()
    cluster.start_operator()
    await cluster.create(md_body(store))
    await cluster.wait(versions({"v1": 4}))
    await cluster.patch({"spec": {"version": "v2"}})
    await cluster.wait(
        lambda s: s.get("rollout", {}).get("batch", 0) >= 1 and s.get("phase") == "Progressing"
    )
    # stop the operator process in the middle of the batches: nothing moves without it
    await cluster.stop_operator()
    targets_while_down = await cluster.pod_targets()
    assert 1 <= list(targets_while_down.values()).count("v2") < 4, targets_while_down
    async with asyncio.timeout(60):  # the pods finish what they were given, and wait
        while not await settled(cluster):
            await asyncio.sleep(0.1)
    assert await cluster.pod_targets() == targets_while_down
    # a new process resumes from .status and the pods' annotations
    cluster.start_operator()
    status = await cluster.wait(versions({"v2": 4}))
    assert (status["currentVersion"], status["previousVersion"]) == ("v2", "v1")
    assert status["observedGeneration"] == 2
    await cluster.events_of("RolloutComplete", 2)
    reasons = await cluster.reasons()
    # the initial v1 rollout and v2's, each once: the restart repeated nothing
    assert (reasons.count("RolloutComplete"), reasons.count("CanaryStarted")) == (2, 1), reasons
    # and the rollout history kept in the status lost and repeated no entry either
    status = await cluster.wait(lambda s: bool((s.get("history") or [{}])[0].get("finishedAt")))
    history = [(e["version"], e["result"], e["triggeredBy"]) for e in status["history"]]
    assert history == [
        ("v2", "Succeeded", "spec.version edit"),
        ("v1", "Succeeded", "spec.version edit"),
    ]


async def test_malformed_spec_is_rejected_and_changes_nothing(
    cluster: RolloutCluster, store: S3Store
) -> None:
    """What the CRD's schema refuses never reaches the operator: the API server refuses
    the edit with the field's name. What only the operator can tell (a version the
    store does not have) is a condition on the resource. Neither moves a pod."""
    cluster.run_pods()
    await cluster.create(md_body(store, replicas=2))
    await cluster.wait(versions({"v1": 2}))
    targets = await cluster.pod_targets()
    for bad, fragment in (
        ({"replicas": -1}, "spec.replicas"),
        ({"canary": {"percent": 150}}, "spec.canary.percent"),
    ):
        with pytest.raises(ApiException) as refused:
            await cluster.patch({"spec": bad})
        assert refused.value.status == 422 and fragment in str(refused.value.reason), refused
        spec = (await cluster.md())["spec"]
        assert (spec["replicas"], spec["canary"]["percent"]) == (2, 25)
    await cluster.patch({"spec": {"version": "v404"}})
    status = await cluster.wait(lambda s: s.get("phase") == "Invalid")
    assert "not in s3://" in status["message"], status["message"]
    valid = condition(status, "SpecValid")
    assert valid["status"] == "False" and valid["reason"] == "InvalidSpec"
    await cluster.passes(2)
    assert await cluster.pod_targets() == targets
    [deployment] = await cluster.items("deployments")
    assert deployment["spec"]["replicas"] == 2
    await cluster.patch({"spec": {"version": "v1"}})
    await cluster.wait(versions({"v1": 2}))
    events = await cluster.events_of("InvalidSpec", 1)
    assert any(e.get("type") == "Warning" for e in events)


async def test_refused_version_stops_the_rollout(cluster: RolloutCluster, store: S3Store) -> None:
    cluster.run_pods(SidecarBehaviour(fetch_s=0.1, load_s=0.3, refuse={"v3": "bad_signature"}))
    await cluster.create(md_body(store))
    await cluster.wait(versions({"v1": 4}))
    await cluster.patch({"spec": {"version": "v3"}})
    status = await cluster.wait(lambda s: s.get("phase") == "Degraded")
    assert "refused mlp:v3" in status["message"] and "bad_signature" in status["message"]
    degraded = condition(status, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "RolloutFailed"
    await cluster.passes(2)
    assert list((await cluster.pod_targets()).values()).count("v3") == 1  # only the canary
    await cluster.patch({"spec": {"version": "v1"}})
    await cluster.wait(versions({"v1": 4}))


async def pod_named(cluster: RolloutCluster, version: str) -> str:
    targets = await cluster.pod_targets()
    return next(name for name, target in targets.items() if target == version)


async def test_deleted_and_evicted_pods_are_replaced_and_the_rollout_completes(
    cluster: RolloutCluster,
) -> None:
    """A canary deleted while it loads (the ReplicaSet makes another pod, the operator
    picks a new canary); a pod of the rollout evicted by its node under memory pressure
    (kept, Failed: no replica any more; the ReplicaSet replaces it)."""
    node = cluster.run_pods(SidecarBehaviour(fetch_s=0.1, load_s=1.5))  # slow loads
    await cluster.create(md_body(None, canary={"percent": 25, "pauseSeconds": 0.5}))
    await cluster.wait(versions({"v1": 4}))
    await cluster.patch({"spec": {"version": "v2"}})
    await cluster.wait(lambda s: s.get("phase") == "Canary")
    canary = await pod_named(cluster, "v2")
    await json_call(
        cluster.core.delete_namespaced_pod(canary, cluster.namespace, _preload_content=False)
    )  # deleted while loading: a new canary is picked
    await cluster.wait(lambda s: s.get("phase") == "Progressing")
    evicted = await pod_named(cluster, "v2")
    await asyncio.to_thread(node.evict, cluster.namespace, evicted)  # Failed: kept
    status = await cluster.wait(versions({"v2": 4}))
    assert status["replicas"] == 4 and status["readyReplicas"] == 4
    pods = await cluster.items("pods")
    phases = {p["metadata"]["name"]: (p.get("status") or {}).get("phase") for p in pods}
    assert canary not in phases and phases[evicted] == "Failed"
    [gone] = [p["status"] for p in pods if p["metadata"]["name"] == evicted]
    assert gone["reason"] == "Evicted", gone
    await cluster.events_of("CanaryReplaced", 1)


async def test_a_promotion_promotes_one_rollout_and_is_cleared(cluster: RolloutCluster) -> None:
    cluster.run_pods()
    await cluster.create(md_body(None, canary={"percent": 25, "manualPromote": True}))
    await cluster.wait(versions({"v1": 4}))
    await cluster.patch({"spec": {"version": "v2"}})
    status = await cluster.wait(lambda s: s.get("rollout", {}).get("canaryHealthyAt") is not None)
    status = await cluster.wait(lambda s: "promote with annotation" in s.get("message", ""))
    token = status["message"].rsplit("=", 1)[1]
    assert token.startswith("v2@")

    async def promote(value: str) -> None:
        await cluster.patch({"metadata": {"annotations": {PROMOTE: value}}})

    await promote("v2")  # the version alone promotes nothing
    await cluster.passes(2)
    assert (await cluster.md())["status"]["phase"] == "Canary"
    await promote(token)
    await cluster.wait(versions({"v2": 4}))
    annotations = (await cluster.md())["metadata"].get("annotations") or {}
    assert PROMOTE not in annotations  # used once, then cleared


async def test_a_promotion_is_cleared_only_once_the_status_saying_so_is_written(
    bare_cluster: RolloutCluster,
) -> None:
    """A pass that acted on the promote annotation but could not write its status is
    repeated from the old status: the annotation must still be there for it. The API
    server answers 503 to the status write only (the fault proxy in front of it, which
    the operator's kubeconfig names)."""
    cluster = bare_cluster
    cluster.run_pods()
    server, ca = cluster.cluster.server, cluster.cluster.pki.ca.cert
    async with FaultProxy(server, ca) as proxy:
        status_write = f"/namespaces/{cluster.namespace}/{PLURAL}/mlp/status"
        proxy.only = lambda method, path: method == "PATCH" and path.endswith(status_write)
        through = cluster.work / "operator-through-proxy.kubeconfig"
        cluster.start_operator(kubeconfig=kubeconfig_through(cluster.identity, proxy.url, through))
        await cluster.create(md_body(None, canary={"percent": 25, "manualPromote": True}))
        await cluster.wait(versions({"v1": 4}))
        await cluster.patch({"spec": {"version": "v2"}})
        status = await cluster.wait(lambda s: "promote with annotation" in s.get("message", ""))
        token = status["message"].rsplit("=", 1)[1]
        proxy.fault = Fault("status", 503)
        await cluster.patch({"metadata": {"annotations": {PROMOTE: token}}})
        async with asyncio.timeout(60):
            while proxy.count(faulted=True) < 2:  # two passes acted, neither wrote its status
                await asyncio.sleep(0.1)
        assert ((await cluster.md())["metadata"].get("annotations") or {}).get(PROMOTE) == token
        proxy.fault = None
        await cluster.wait(versions({"v2": 4}))
        async with asyncio.timeout(30):
            while PROMOTE in ((await cluster.md())["metadata"].get("annotations") or {}):
                await asyncio.sleep(0.1)
        await cluster.kill_operator()  # before its API goes


async def test_children_are_recreated_restored_and_never_adopted(cluster: RolloutCluster) -> None:
    cluster.run_pods()
    core, ns = cluster.core, cluster.namespace
    foreign = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "other"},
               "spec": {"selector": {"app": "someone-else"}, "ports": [{"port": 81}]}}  # fmt: skip
    await json_call(core.create_namespaced_service(ns, foreign, _preload_content=False))
    await cluster.create(md_body(None, replicas=2))
    await cluster.wait(versions({"v1": 2}))

    await json_call(core.delete_namespaced_service("mlp", ns, _preload_content=False))
    drift = {"data": {"target-version": "v9"}}  # drifted
    await json_call(
        core.patch_namespaced_config_map(
            "mlp-rollout", ns, drift, _content_type="application/merge-patch+json",
            _preload_content=False,
        )
    )  # fmt: skip
    service: dict[str, Any] | None = None
    data: dict[str, Any] = {}
    try:
        async with asyncio.timeout(60):
            while True:
                service = await cluster.get("service", "mlp")
                configmap = await cluster.get("config_map", "mlp-rollout") or {}
                data = configmap.get("data") or {}
                if service is not None and data.get("target-version") == "v1":
                    break
                await asyncio.sleep(0.1)
    except TimeoutError:
        raise AssertionError(
            f"children not restored: service {service}, configmap {data}"
        ) from None
    assert service["metadata"]["ownerReferences"][0]["name"] == "mlp"

    body = md_body(None, replicas=1)
    body["metadata"]["name"] = "other"
    await cluster.create(body)
    status = await cluster.wait(
        lambda s: condition(s, "ChildrenReady").get("status") == "False", name="other"
    )
    ready = condition(status, "Ready")
    assert ready["status"] == "False" and "Service/other" in status["foreignChildren"]
    untouched = await cluster.get("service", "other")
    assert untouched is not None and untouched["spec"]["selector"] == {"app": "someone-else"}
    assert not untouched["metadata"].get("ownerReferences")
    events = await cluster.events_of("ForeignObject", 1)
    assert any(e.get("type") == "Warning" for e in events)
    mlp = await cluster.md()
    ready = condition(mlp["status"], "Ready")
    assert ready["status"] == "True" and ready["reason"] == "Available"


async def test_the_operator_reports_its_own_metrics(cluster: RolloutCluster) -> None:
    cluster.run_pods()
    operator = cluster.operator
    assert operator is not None
    await cluster.create(md_body(None, replicas=2))
    await cluster.wait(versions({"v1": 2}))
    labels = f'name="mlp",namespace="{cluster.namespace}"'
    available = f'model_operator_deployment_phase{{{labels},phase="Available"}} 1.0'
    async with asyncio.timeout(30):  # the pass that wrote the status has recorded it
        while available not in (metrics := await asyncio.to_thread(operator.metrics)):
            await asyncio.sleep(0.1)
    assert f'model_operator_deployment_phase{{{labels},phase="Canary"}} 0.0' in metrics
    assert f'model_operator_deployment_pods{{{labels},version="v1"}} 2.0' in metrics
    count = re.search(
        rf"model_operator_reconcile_duration_seconds_count\{{{labels}\}} (\d+)", metrics
    )
    assert count is not None and int(count.group(1)) > 0
    assert "model_operator_api_errors" in metrics


LEASE = "model-rollout-operator"  # leader.LeaseSettings' default name


async def test_the_standby_takes_over_when_the_leader_dies_mid_rollout(
    bare_cluster: RolloutCluster,
) -> None:
    """Two replicas on the chart's Lease; the leader is killed (SIGKILL) mid-rollout, once
    the canary's events are posted (an event goes on a task of its own after the status
    write, so a kill just then may lose it, never repeat it), and the standby finishes
    the rollout, repeating no event."""
    cluster = bare_cluster
    cluster.run_pods(SidecarBehaviour(fetch_s=0.1, load_s=1.5))

    async def holder() -> dict[str, Any]:
        lease = await json_call(
            cluster.coordination.read_namespaced_lease(LEASE, NAMESPACE, _preload_content=False)
        )
        return dict(lease["spec"])

    # a leader that cannot renew for two thirds of this gives up leading (the fence): on a
    # loaded 2-core machine 2 s was once too short for it, and the standby left early
    election = ["--leader-election", "--lease-namespace", NAMESPACE, "--lease-seconds", "6"]
    names = (f"{cluster.namespace}-a", f"{cluster.namespace}-b")  # not an earlier test's
    replicas = {
        name: Operator(
            cluster.identity.kubeconfig, cluster.namespace, cluster.work / f"{name}.log",
            INTERVAL_S, extra=[*election, "--identity", name],
        ).start()
        for name in names
    }  # fmt: skip
    try:
        await cluster.create(md_body(None))
        await cluster.wait(versions({"v1": 4}))
        await cluster.patch({"spec": {"version": "v2"}})
        await cluster.wait(lambda s: s.get("phase") == "Progressing")
        await cluster.events_of("CanaryPromoted", 1)
        leader = (await holder())["holderIdentity"]
        assert leader in replicas
        standby = next(name for name in replicas if name != leader)
        assert replicas[standby].running(), replicas[standby].log_tail()
        await asyncio.to_thread(replicas[leader].kill)  # mid-rollout, without a word
        cluster.operator = replicas[standby]  # its log, should the rollout not finish
        assert (await cluster.md())["status"]["versions"] != {"v2": 4}  # not over yet
        status = await cluster.wait(versions({"v2": 4}))
        assert (status["currentVersion"], status["previousVersion"]) == ("v2", "v1")
        spec = await holder()
        assert spec["holderIdentity"] != leader and spec["leaseTransitions"] >= 1
        await cluster.events_of("RolloutComplete", 2)
        reasons = await cluster.reasons()
        counts = {
            r: reasons.count(r) for r in ("RolloutStarted", "CanaryStarted", "CanaryPromoted")
        }
        assert counts == {"RolloutStarted": 2, "CanaryStarted": 1, "CanaryPromoted": 1}, reasons
        assert reasons.count("RolloutComplete") == 2, reasons  # v1 at creation, then v2
    finally:
        for process in replicas.values():
            await asyncio.to_thread(process.kill)


async def test_an_unreachable_store_is_a_condition_and_holds_the_rollout(
    cluster: RolloutCluster,
) -> None:
    cluster.run_pods()
    body = md_body(None)
    body["spec"]["store"] = {"url": "s3://models/p", "endpoint": f"http://127.0.0.1:{free_port()}"}
    await cluster.create(body)

    def store(status: dict[str, Any]) -> dict[str, Any]:
        return condition(status, "StoreReachable")

    # the first version cannot be checked either: the children are created all the same
    await cluster.wait(versions({"v1": 4}))
    await cluster.patch({"spec": {"version": "v2"}})
    status = await cluster.wait(lambda s: "holding" in s.get("message", ""))
    assert store(status)["status"] == "False" and "unreachable" in store(status)["message"]
    await cluster.passes(2)
    assert set((await cluster.pod_targets()).values()) == {"v1"}  # nothing moved to v2
    assert condition(status, "Ready")["status"] == "False"
    # back to the version it serves: never blocked by the store
    await cluster.patch({"spec": {"version": "v1"}})
    await cluster.wait(lambda s: store(s).get("status") == "True" and s["phase"] == "Available")


async def test_the_store_is_checked_with_the_resources_own_credentials(
    bare_cluster: RolloutCluster, store: S3Store
) -> None:
    cluster = bare_cluster
    from model_rollout_e2e.seaweed import CREDENTIALS

    cluster.run_pods()
    wrong = {"AWS_ACCESS_KEY_ID": "not-these", "AWS_SECRET_ACCESS_KEY": "not-these"}
    cluster.start_operator(env=wrong)

    def encoded(value: str) -> str:
        return base64.b64encode(value.encode()).decode()

    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "store-credentials"},
        "data": {
            "AWS_ACCESS_KEY_ID": encoded(CREDENTIALS["aws_access_key_id"]),
            "AWS_SECRET_ACCESS_KEY": encoded(CREDENTIALS["aws_secret_access_key"]),
        },
    }
    await json_call(
        cluster.core.create_namespaced_secret(cluster.namespace, secret, _preload_content=False)
    )
    body = md_body(store, replicas=1)
    body["spec"]["store"]["credentialsSecret"] = "store-credentials"
    await cluster.create(body)
    await cluster.wait(versions({"v1": 1}))  # checked with the Secret's keys
    # with the operator's own (wrong) credentials the store refuses: a condition, no rollout
    await cluster.patch({"spec": {"version": "v2", "store": {"credentialsSecret": None}}})
    status = await cluster.wait(lambda s: "holding" in s.get("message", ""))
    # the manifest is read (its publish sequence is pinned): S3 names the refusal's code
    refused = ("403", "Forbidden", "InvalidAccessKeyId")
    assert any(word in status["message"] for word in refused), status["message"]
    await cluster.patch({"spec": {"store": {"credentialsSecret": "store-credentials"}}})
    await cluster.wait(versions({"v2": 1}))


async def test_a_pod_that_never_turns_ready_fails_the_rollout_at_its_deadline(
    cluster: RolloutCluster,
) -> None:
    node = cluster.run_pods()
    body = md_body(
        None,
        canary={"percent": 0},
        rollout={"batchSize": 1, "jitterSeconds": 0, "progressDeadlineSeconds": 3},
    )
    await cluster.create(body)
    await cluster.wait(versions({"v1": 4}))
    stuck = sorted(await cluster.pod_targets())[-1]
    await asyncio.to_thread(node.fail_readiness, cluster.namespace, stuck)  # probe fails
    await cluster.patch({"spec": {"version": "v2"}})
    status = await cluster.wait(lambda s: s.get("phase") == "Degraded")
    assert "not ready for 3s" in status["message"] or stuck in status["message"], status["message"]
    degraded = condition(status, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "RolloutFailed"


async def _sidecar_args(cluster: RolloutCluster, name: str = "mlp") -> list[list[str]]:
    """The sidecars' arguments in the pod template of the Deployment ``name``."""
    [deployment] = [d for d in await cluster.items("deployments") if d["metadata"]["name"] == name]
    pod = deployment["spec"]["template"]["spec"]
    return [
        c["args"] for c in [*pod["initContainers"], *pod["containers"]] if c["name"] != "server"
    ]


async def test_pods_run_unsigned_only_when_the_spec_says_so_and_then_it_shows(
    cluster: RolloutCluster,
) -> None:
    """Without signingPublicKeySecret the sidecars used to run --allow-unsigned silently.
    The CRD refuses such a resource (the operator's own words, which it also says of a
    resource it finds without one); with allowUnsigned the pods run unsigned, and the
    status shows it."""
    cluster.run_pods()
    body = md_body(None, replicas=2)
    del body["spec"]["signingPublicKeySecret"]
    with pytest.raises(ApiException) as refused:
        await cluster.create(body)
    assert refused.value.status == 422 and NO_SIGNING_KEY in str(refused.value.reason)
    assert await cluster.items("deployments") == []
    assert await cluster.pod_targets() == {}  # no pod at all, so none unsigned

    body["spec"]["allowUnsigned"] = True
    await cluster.create(body)
    status = await cluster.wait(versions({"v1": 2}))
    unsigned = condition(status, "SignaturesVerified")
    assert (unsigned["status"], unsigned["reason"]) == ("False", "AllowUnsigned")
    assert condition(status, "Ready")["status"] == "True"  # a choice, not a failure
    assert all("--allow-unsigned" in args for args in await _sidecar_args(cluster))

    await cluster.patch(
        {"spec": {"allowUnsigned": False, "signingPublicKeySecret": "model-signing-key"}}
    )
    status = await cluster.wait(
        lambda s: condition(s, "SignaturesVerified").get("status") == "True"
    )
    # new sidecar flags are a new pod template: its rollout ends on a Deployment of its own
    status = await cluster.wait(
        lambda s: (
            s.get("template", {}).get("deployment", "mlp") != "mlp" and not s.get("templateRollout")
        )
    )
    for args in await _sidecar_args(cluster, status["template"]["deployment"]):
        assert "--allow-unsigned" not in args and "--public-key" in args
    warnings = await cluster.events_of("AllowUnsigned", 1)
    assert [e.get("type") for e in warnings] == ["Warning"], warnings  # once, when it started
