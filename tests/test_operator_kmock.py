"""The real kopf operator loop against kmock's stateful Kubernetes API over HTTP, with a
simulated kubelet creating the Deployment's pods and faking the sidecars' reports.

kopf runs inside the test's event loop (as kopf's ``examples/09-testing-kmock`` does),
except in the restart test, which kills and restarts it as a separate process
(``python -m model_operator``), as a pod would be."""

from __future__ import annotations

import asyncio
import base64
import re
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from model_operator.config import OperatorConfig
from model_operator.spec import NO_SIGNING_KEY
from model_rollout_contract.annotations import PROMOTE, TARGET_VERSION
from model_rollout_e2e.api_client import HarnessApi
from model_rollout_e2e.kube_emulator import (
    create_model_deployment,
    get_model_deployment,
    kube_emulator,
    list_objects,
    patch_model_deployment,
    wait_for_status,
)
from model_rollout_e2e.kubelet import Kubelet, SimulatedPods
from model_rollout_e2e.processes import ChildProcess, OperatorProcess, OperatorThread, free_port
from model_sidecar.store import S3Store
from sidecar_helpers import make_keys, publish_versions

pytestmark = pytest.mark.slow  # whole operator loops with a kubelet: not in make test-fast
NS = "ml"
INTERVAL_S = 0.25


@dataclass
class Cluster:
    """The emulated API, the simulated pods, and the operator: a task in this event loop,
    or its own process (``python -m model_operator``) for the tests that kill it."""

    api: HarnessApi
    pods: SimulatedPods
    kubelet: Kubelet
    log_dir: Path
    operator: ChildProcess | OperatorThread | None = None
    history: list[dict[str, Any]] = field(default_factory=list)

    def start_operator(self, metrics_port: int | None = None) -> None:
        """kopf in this process (a thread, as kopf's KopfRunner): no process start."""
        config = OperatorConfig(
            self.api.url, [NS], INTERVAL_S, disable_scanning=True, metrics_port=metrics_port
        )
        self.operator = OperatorThread(config).start()

    def start_operator_process(self) -> None:
        self.operator = OperatorProcess(
            self.api.url, NS, INTERVAL_S, self.log_dir / "operator.log"
        ).start()

    async def stop_operator(self) -> None:
        if self.operator is not None:
            await asyncio.to_thread(self.operator.stop)
            self.operator = None

    async def md(self, name: str = "mlp") -> dict[str, Any]:
        return await get_model_deployment(self.api, NS, name)

    async def wait(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 30, name: str = "mlp"
    ) -> dict[str, Any]:
        def record(status: dict[str, Any]) -> None:
            if status and (not self.history or self.history[-1] != status):
                self.history.append(status)

        try:
            return await wait_for_status(self.api, NS, name, predicate, timeout, record)
        except TimeoutError as exc:
            log = self.operator.log_tail(40) if isinstance(self.operator, ChildProcess) else ""
            raise AssertionError(f"{exc}\noperator log:\n{log}") from None

    async def pod_targets(self) -> dict[str, str | None]:
        pods = await list_objects(self.api, f"/api/v1/namespaces/{NS}/pods")
        return {
            p["metadata"]["name"]: (p["metadata"].get("annotations") or {}).get(TARGET_VERSION)
            for p in pods
        }


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with kube_emulator() as api:
        pods = SimulatedPods(api, NS, delay_s=0.3)
        kubelet = Kubelet(api, NS, pods, interval_s=0.1)
        stop_kubelet = asyncio.Event()
        kubelet_task = asyncio.create_task(kubelet.run(stop_kubelet))
        c = Cluster(api, pods, kubelet, tmp_path)
        try:
            yield c
        finally:
            stop_kubelet.set()
            await kubelet_task
            await c.stop_operator()  # raises what an in-process operator died of


@pytest.fixture
def store(s3_env, tmp_path: Path) -> S3Store:
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


async def test_create_rollout_canary_batches_and_rollback(cluster: Cluster, store: S3Store) -> None:
    cluster.start_operator()
    await create_model_deployment(cluster.api, NS, md_body(store))
    status = await cluster.wait(versions({"v1": 4}))
    assert status["currentVersion"] == "v1" and status["readyReplicas"] == 4
    deployments = await list_objects(cluster.api, f"/apis/apps/v1/namespaces/{NS}/deployments")
    [deployment] = deployments
    assert deployment["spec"]["replicas"] == 4
    owner = deployment["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "ModelDeployment" and owner["name"] == "mlp" and owner["uid"]
    template = deployment["spec"]["template"]["spec"]
    assert [c["name"] for c in template["containers"]] == ["server", "sidecar"]
    assert template["initContainers"][0]["name"] == "prefetch"
    for kind in ("services", "configmaps", "serviceaccounts"):
        assert await list_objects(cluster.api, f"/api/v1/namespaces/{NS}/{kind}")
    [cm] = await list_objects(cluster.api, f"/api/v1/namespaces/{NS}/configmaps")
    assert cm["data"]["target-version"] == "v1"

    # v1 -> v2 with a 25% canary: one pod first, held, then one pod per batch
    cluster.history.clear()
    await patch_model_deployment(cluster.api, NS, "mlp", {"spec": {"version": "v2"}})
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
    [cm] = await list_objects(cluster.api, f"/api/v1/namespaces/{NS}/configmaps")
    assert cm["data"]["target-version"] == "v2"

    events = await list_objects(cluster.api, f"/api/v1/namespaces/{NS}/events")
    reasons = [e.get("reason") for e in events]
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
    await patch_model_deployment(cluster.api, NS, "mlp", {"spec": {"version": "v1"}})
    status = await cluster.wait(versions({"v1": 4}))
    assert "Canary" not in [s.get("phase") for s in cluster.history]
    assert (status["currentVersion"], status["previousVersion"]) == ("v1", "v2")
    assert status["rollout"]["fast"] is True


async def test_operator_process_killed_mid_rollout_resumes_from_status(
    cluster: Cluster, store: S3Store
) -> None:
    cluster.start_operator_process()
    await create_model_deployment(cluster.api, NS, md_body(store))
    await cluster.wait(versions({"v1": 4}))
    await patch_model_deployment(cluster.api, NS, "mlp", {"spec": {"version": "v2"}})
    await cluster.wait(
        lambda s: s.get("rollout", {}).get("batch", 0) >= 1 and s.get("phase") == "Progressing"
    )
    # stop the operator process in the middle of the batches: nothing moves without it
    await cluster.stop_operator()
    targets_while_down = await cluster.pod_targets()
    assert 1 <= list(targets_while_down.values()).count("v2") < 4, targets_while_down
    await asyncio.sleep(0.5)
    assert await cluster.pod_targets() == targets_while_down
    # a new process resumes from .status and the pods' annotations
    cluster.start_operator_process()
    status = await cluster.wait(versions({"v2": 4}))
    assert (status["currentVersion"], status["previousVersion"]) == ("v2", "v1")
    assert status["observedGeneration"] == 2
    events = await list_objects(cluster.api, f"/api/v1/namespaces/{NS}/events")
    reasons = [e.get("reason") for e in events]
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
    cluster: Cluster, store: S3Store
) -> None:
    cluster.start_operator()
    await create_model_deployment(cluster.api, NS, md_body(store, replicas=2))
    await cluster.wait(versions({"v1": 2}))
    targets = await cluster.pod_targets()
    for bad, fragment in (
        ({"replicas": -1}, "spec.replicas"),
        ({"canary": {"percent": 150}}, "spec.canary.percent"),
        ({"version": "v404"}, "not in s3://"),
    ):
        await patch_model_deployment(cluster.api, NS, "mlp", {"spec": bad})
        status = await cluster.wait(lambda s: s.get("phase") == "Invalid")
        assert fragment in status["message"], status["message"]
        valid = next(c for c in status["conditions"] if c["type"] == "SpecValid")
        assert valid["status"] == "False" and valid["reason"] == "InvalidSpec"
        await asyncio.sleep(0.6)
        assert await cluster.pod_targets() == targets
        [deployment] = await list_objects(cluster.api, f"/apis/apps/v1/namespaces/{NS}/deployments")
        assert deployment["spec"]["replicas"] == 2
        fix = {"replicas": 2, "canary": {"percent": 25}, "version": "v1"}
        await patch_model_deployment(cluster.api, NS, "mlp", {"spec": fix})
        await cluster.wait(versions({"v1": 2}))
    events = await list_objects(cluster.api, f"/api/v1/namespaces/{NS}/events")
    assert any(e.get("reason") == "InvalidSpec" and e.get("type") == "Warning" for e in events)


async def test_refused_version_stops_the_rollout(cluster: Cluster, store: S3Store) -> None:
    cluster.pods.refuse.add("v3")
    cluster.start_operator()
    await create_model_deployment(cluster.api, NS, md_body(store))
    await cluster.wait(versions({"v1": 4}))
    await patch_model_deployment(cluster.api, NS, "mlp", {"spec": {"version": "v3"}})
    status = await cluster.wait(lambda s: s.get("phase") == "Degraded")
    assert "refused mlp:v3" in status["message"] and "bad_signature" in status["message"]
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "RolloutFailed"
    await asyncio.sleep(0.8)
    assert list((await cluster.pod_targets()).values()).count("v3") == 1  # only the canary
    await patch_model_deployment(cluster.api, NS, "mlp", {"spec": {"version": "v1"}})
    await cluster.wait(versions({"v1": 4}))


async def pod_named(cluster: Cluster, version: str) -> str:
    targets = await cluster.pod_targets()
    return next(name for name, target in targets.items() if target == version)


async def test_deleted_and_evicted_pods_are_replaced_and_the_rollout_completes(
    cluster: Cluster,
) -> None:
    cluster.start_operator()
    await create_model_deployment(
        cluster.api, NS, md_body(None, canary={"percent": 25, "pauseSeconds": 0.5})
    )
    await cluster.wait(versions({"v1": 4}))
    cluster.pods.delay_s = 1.5  # loads take long enough to delete pods while they load
    await patch_model_deployment(cluster.api, NS, "mlp", {"spec": {"version": "v2"}})
    await cluster.wait(lambda s: s.get("phase") == "Canary")
    canary = await pod_named(cluster, "v2")
    await cluster.kubelet.delete_pod(canary)  # deleted while loading: a new canary is picked
    await cluster.wait(lambda s: s.get("phase") == "Progressing", timeout=60)
    evicted = await pod_named(cluster, "v2")
    await cluster.kubelet.evict(evicted)  # phase Failed: kept, but no replica any more
    status = await cluster.wait(versions({"v2": 4}), timeout=60)
    assert status["replicas"] == 4 and status["readyReplicas"] == 4
    pods = await list_objects(cluster.api, f"/api/v1/namespaces/{NS}/pods")
    phases = {p["metadata"]["name"]: (p.get("status") or {}).get("phase") for p in pods}
    assert canary not in phases and phases[evicted] == "Failed"
    events = await list_objects(cluster.api, f"/api/v1/namespaces/{NS}/events")
    assert "CanaryReplaced" in [e.get("reason") for e in events]


async def test_a_promotion_promotes_one_rollout_and_is_cleared(cluster: Cluster) -> None:
    cluster.start_operator()
    await create_model_deployment(
        cluster.api, NS, md_body(None, canary={"percent": 25, "manualPromote": True})
    )
    await cluster.wait(versions({"v1": 4}))
    await patch_model_deployment(cluster.api, NS, "mlp", {"spec": {"version": "v2"}})
    status = await cluster.wait(lambda s: s.get("rollout", {}).get("canaryHealthyAt") is not None)
    status = await cluster.wait(lambda s: "promote with annotation" in s.get("message", ""))
    token = status["message"].rsplit("=", 1)[1]
    assert token.startswith("v2@")

    async def promote(value: str) -> None:
        patch = {"metadata": {"annotations": {PROMOTE: value}}}
        await patch_model_deployment(cluster.api, NS, "mlp", patch)

    await promote("v2")  # the version alone promotes nothing
    await asyncio.sleep(1)
    assert (await cluster.md())["status"]["phase"] == "Canary"
    await promote(token)
    await cluster.wait(versions({"v2": 4}))
    annotations = (await cluster.md())["metadata"].get("annotations") or {}
    assert PROMOTE not in annotations  # used once, then cleared


async def test_a_promotion_is_cleared_only_once_the_status_saying_so_is_written(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass that acted on the promote annotation but could not write its status is
    repeated from the old status: the annotation must still be there for it."""
    from model_operator import cluster as operator_cluster
    from model_operator.errors import TransientApiError

    failing = {"on": False, "refused": 0}
    write = operator_cluster.patch_status

    async def status_write(*args: Any, **kwargs: Any) -> dict[str, Any]:
        if failing["on"]:  # the API server answers 503 to the status write only
            failing["refused"] += 1
            raise TransientApiError(503, "PATCH .../status: HTTP 503 etcd is unavailable")
        return await write(*args, **kwargs)

    monkeypatch.setattr(operator_cluster, "patch_status", status_write)
    cluster.start_operator()
    await create_model_deployment(
        cluster.api, NS, md_body(None, canary={"percent": 25, "manualPromote": True})
    )
    await cluster.wait(versions({"v1": 4}))
    await patch_model_deployment(cluster.api, NS, "mlp", {"spec": {"version": "v2"}})
    status = await cluster.wait(lambda s: "promote with annotation" in s.get("message", ""))
    token = status["message"].rsplit("=", 1)[1]
    failing["on"] = True
    patch = {"metadata": {"annotations": {PROMOTE: token}}}
    await patch_model_deployment(cluster.api, NS, "mlp", patch)
    async with asyncio.timeout(60):
        while failing["refused"] < 2:  # two passes acted, neither could write its status
            await asyncio.sleep(0.1)
    assert ((await cluster.md())["metadata"].get("annotations") or {}).get(PROMOTE) == token
    failing["on"] = False
    await cluster.wait(versions({"v2": 4}))
    async with asyncio.timeout(30):
        while PROMOTE in ((await cluster.md())["metadata"].get("annotations") or {}):
            await asyncio.sleep(0.1)


async def test_children_are_recreated_restored_and_never_adopted(cluster: Cluster) -> None:
    cluster.start_operator()
    services = f"/api/v1/namespaces/{NS}/services"
    foreign = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "other"},
               "spec": {"selector": {"app": "someone-else"}, "ports": [{"port": 81}]}}  # fmt: skip
    await cluster.api.request("POST", services, foreign)
    await create_model_deployment(cluster.api, NS, md_body(None, replicas=2))
    await cluster.wait(versions({"v1": 2}))

    await cluster.api.request("DELETE", f"{services}/mlp")  # deleted: created again
    configmap = f"/api/v1/namespaces/{NS}/configmaps/mlp-rollout"
    await cluster.api.merge_patch(configmap, {"data": {"target-version": "v9"}})  # drifted
    for _ in range(150):
        service = await cluster.api.request("GET", f"{services}/mlp")
        data = ((await cluster.api.request("GET", configmap)) or {}).get("data") or {}
        if service is not None and data.get("target-version") == "v1":
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError(f"children not restored: service {service}, configmap {data}")
    assert service["metadata"]["ownerReferences"][0]["name"] == "mlp"

    body = md_body(None, replicas=1)
    body["metadata"]["name"] = "other"
    await create_model_deployment(cluster.api, NS, body)
    status = await cluster.wait(
        lambda s: any(
            c["type"] == "ChildrenReady" and c["status"] == "False" for c in s.get("conditions", [])
        ),
        name="other",
    )
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and "Service/other" in status["foreignChildren"]
    untouched = await cluster.api.request("GET", f"{services}/other")
    assert untouched["spec"]["selector"] == {"app": "someone-else"}
    assert not untouched["metadata"].get("ownerReferences")
    events = await list_objects(cluster.api, f"/api/v1/namespaces/{NS}/events")
    assert any(e.get("reason") == "ForeignObject" and e.get("type") == "Warning" for e in events)
    mlp = await cluster.md()
    ready = next(c for c in mlp["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True" and ready["reason"] == "Available"


async def test_the_operator_reports_its_own_metrics(cluster: Cluster) -> None:
    port = free_port()
    cluster.start_operator(metrics_port=port)
    await create_model_deployment(cluster.api, NS, md_body(None, replicas=2))
    await cluster.wait(versions({"v1": 2}))
    await asyncio.sleep(0.5)
    text = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    )
    metrics = text.decode()
    assert (
        'model_operator_deployment_phase{name="mlp",namespace="ml",phase="Available"} 1.0'
        in metrics
    )
    assert (
        'model_operator_deployment_phase{name="mlp",namespace="ml",phase="Canary"} 0.0' in metrics
    )
    assert 'model_operator_deployment_pods{name="mlp",namespace="ml",version="v1"} 2.0' in metrics
    count = re.search(
        r'model_operator_reconcile_duration_seconds_count\{name="mlp",namespace="ml"\} (\d+)',
        metrics,
    )
    assert count is not None and int(count.group(1)) > 0
    assert "model_operator_api_errors" in metrics


LEADER_ELECTION = ["--leader-election", "--lease-namespace", NS, "--lease-seconds", "2"]


async def test_the_standby_takes_over_when_the_leader_dies_mid_rollout(cluster: Cluster) -> None:
    lease = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/model-rollout-operator"
    replicas = {
        name: OperatorProcess(
            cluster.api.url,
            NS,
            INTERVAL_S,
            cluster.log_dir / f"{name}.log",
            extra=[*LEADER_ELECTION, "--identity", name],
        ).start()
        for name in ("op-a", "op-b")
    }
    try:
        await create_model_deployment(cluster.api, NS, md_body(None))
        await cluster.wait(versions({"v1": 4}))
        cluster.pods.delay_s = 1.0
        await patch_model_deployment(cluster.api, NS, "mlp", {"spec": {"version": "v2"}})
        await cluster.wait(lambda s: s.get("phase") == "Progressing", timeout=60)
        leader = (await cluster.api.request("GET", lease))["spec"]["holderIdentity"]
        replicas[leader].kill()  # mid-rollout, without a word
        status = await cluster.wait(versions({"v2": 4}), timeout=90)
        assert (status["currentVersion"], status["previousVersion"]) == ("v2", "v1")
        spec = (await cluster.api.request("GET", lease))["spec"]
        assert spec["holderIdentity"] != leader and spec["leaseTransitions"] >= 1
        events = await list_objects(cluster.api, f"/api/v1/namespaces/{NS}/events")
        reasons = [e.get("reason") for e in events]
        counts = {
            r: reasons.count(r) for r in ("RolloutStarted", "CanaryStarted", "CanaryPromoted")
        }
        assert counts == {"RolloutStarted": 2, "CanaryStarted": 1, "CanaryPromoted": 1}, reasons
        assert reasons.count("RolloutComplete") == 2, reasons  # v1 at creation, then v2
    finally:
        for process in replicas.values():
            await asyncio.to_thread(process.stop)


async def test_an_unreachable_store_is_a_condition_and_holds_the_rollout(cluster: Cluster) -> None:
    cluster.start_operator()
    body = md_body(None)
    body["spec"]["store"] = {"url": "s3://models/p", "endpoint": f"http://127.0.0.1:{free_port()}"}
    await create_model_deployment(cluster.api, NS, body)

    def store(status: dict[str, Any]) -> dict[str, Any]:
        return next(c for c in status.get("conditions", []) if c["type"] == "StoreReachable")

    # the first version cannot be checked either: the children are created all the same
    await cluster.wait(versions({"v1": 4}), timeout=60)
    await patch_model_deployment(cluster.api, NS, "mlp", {"spec": {"version": "v2"}})
    status = await cluster.wait(lambda s: "holding" in s.get("message", ""))
    assert store(status)["status"] == "False" and "unreachable" in store(status)["message"]
    await asyncio.sleep(1)
    assert set((await cluster.pod_targets()).values()) == {"v1"}  # nothing moved to v2
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False"
    # back to the version it serves: never blocked by the store
    await patch_model_deployment(cluster.api, NS, "mlp", {"spec": {"version": "v1"}})
    status = await cluster.wait(
        lambda s: store(s)["status"] == "True" and s["phase"] == "Available"
    )


async def test_the_store_is_checked_with_the_resources_own_credentials(
    cluster: Cluster, store: S3Store
) -> None:
    from model_rollout_e2e.seaweed import CREDENTIALS

    wrong = {"AWS_ACCESS_KEY_ID": "not-these", "AWS_SECRET_ACCESS_KEY": "not-these"}
    cluster.operator = OperatorProcess(
        cluster.api.url, NS, INTERVAL_S, cluster.log_dir / "operator.log", env=wrong
    ).start()
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "store-credentials", "namespace": NS},
        "data": {
            "AWS_ACCESS_KEY_ID": base64.b64encode(
                CREDENTIALS["aws_access_key_id"].encode()
            ).decode(),
            "AWS_SECRET_ACCESS_KEY": base64.b64encode(
                CREDENTIALS["aws_secret_access_key"].encode()
            ).decode(),
        },
    }
    await cluster.api.request("POST", f"/api/v1/namespaces/{NS}/secrets", secret)
    body = md_body(store, replicas=1)
    body["spec"]["store"]["credentialsSecret"] = "store-credentials"
    await create_model_deployment(cluster.api, NS, body)
    await cluster.wait(versions({"v1": 1}), timeout=60)  # checked with the Secret's keys
    # with the operator's own (wrong) credentials the store refuses: a condition, no rollout
    await patch_model_deployment(
        cluster.api, NS, "mlp", {"spec": {"version": "v2", "store": {"credentialsSecret": None}}}
    )
    status = await cluster.wait(lambda s: "holding" in s.get("message", ""), timeout=60)
    # the manifest is read (its publish sequence is pinned): S3 names the refusal's code
    refused = ("403", "Forbidden", "InvalidAccessKeyId")
    assert any(word in status["message"] for word in refused), status["message"]
    await patch_model_deployment(
        cluster.api, NS, "mlp", {"spec": {"store": {"credentialsSecret": "store-credentials"}}}
    )
    await cluster.wait(versions({"v2": 1}), timeout=60)


async def test_a_pod_that_never_turns_ready_fails_the_rollout_at_its_deadline(
    cluster: Cluster,
) -> None:
    cluster.start_operator()
    body = md_body(
        None,
        canary={"percent": 0},
        rollout={"batchSize": 1, "jitterSeconds": 0, "progressDeadlineSeconds": 3},
    )
    await create_model_deployment(cluster.api, NS, body)
    await cluster.wait(versions({"v1": 4}))
    stuck = sorted(await cluster.pod_targets())[-1]
    cluster.kubelet.never_ready.add(stuck)  # its readiness probe stops passing
    await patch_model_deployment(cluster.api, NS, "mlp", {"spec": {"version": "v2"}})
    status = await cluster.wait(lambda s: s.get("phase") == "Degraded", timeout=60)
    assert "not ready for 3s" in status["message"] or stuck in status["message"], status["message"]
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "RolloutFailed"


def _condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions", []) if c["type"] == type_), {})


async def _sidecar_args(cluster: Cluster) -> list[list[str]]:
    [deployment] = await list_objects(cluster.api, f"/apis/apps/v1/namespaces/{NS}/deployments")
    pod = deployment["spec"]["template"]["spec"]
    return [
        c["args"] for c in [*pod["initContainers"], *pod["containers"]] if c["name"] != "server"
    ]


async def test_pods_run_unsigned_only_when_the_spec_says_so_and_then_it_shows(
    cluster: Cluster,
) -> None:
    """Without signingPublicKeySecret the sidecars used to run --allow-unsigned silently."""
    cluster.start_operator()
    body = md_body(None, replicas=2)
    del body["spec"]["signingPublicKeySecret"]
    await create_model_deployment(cluster.api, NS, body)
    status = await cluster.wait(lambda s: s.get("phase") == "Invalid")
    assert NO_SIGNING_KEY in status["message"]
    assert _condition(status, "SpecValid")["status"] == "False"
    await asyncio.sleep(0.6)
    assert await list_objects(cluster.api, f"/apis/apps/v1/namespaces/{NS}/deployments") == []
    assert await cluster.pod_targets() == {}  # no pod at all, so none unsigned

    await patch_model_deployment(cluster.api, NS, "mlp", {"spec": {"allowUnsigned": True}})
    status = await cluster.wait(versions({"v1": 2}))
    unsigned = _condition(status, "SignaturesVerified")
    assert (unsigned["status"], unsigned["reason"]) == ("False", "AllowUnsigned")
    assert _condition(status, "Ready")["status"] == "True"  # a choice, not a failure
    assert all("--allow-unsigned" in args for args in await _sidecar_args(cluster))

    await patch_model_deployment(
        cluster.api,
        NS,
        "mlp",
        {"spec": {"allowUnsigned": False, "signingPublicKeySecret": "model-signing-key"}},
    )
    status = await cluster.wait(
        lambda s: _condition(s, "SignaturesVerified").get("status") == "True"
    )
    for args in await _sidecar_args(cluster):
        assert "--allow-unsigned" not in args and "--public-key" in args
    events = await list_objects(cluster.api, f"/api/v1/namespaces/{NS}/events")
    warnings = [e for e in events if e.get("reason") == "AllowUnsigned"]
    assert [e.get("type") for e in warnings] == ["Warning"], events  # once, when it started
