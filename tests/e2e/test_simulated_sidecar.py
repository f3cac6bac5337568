"""The simulated sidecar (``model_rollout_e2e.simulated_sidecar``) on a real API server:
the operator's own pod template (Deployment, ConfigMap, the sidecar's ServiceAccount and
Role) run by a simulated node, and the reports its sidecars write, read from the API as
the operator reads them. The chart's sidecar admission policy is in force: a report
that lands was written with a token of the pod's ServiceAccount bound to that pod (the
node itself may not touch pod annotations; another token would be refused)."""

from __future__ import annotations

import asyncio
import copy
import json
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config

from model_operator.manifests import configmap, deployment, pod_rbac
from model_operator.spec import parse_spec
from model_rollout_contract.canary import TRAFFIC_POLICY
from model_rollout_contract.report import SidecarReport
from model_rollout_contract.states import SidecarState
from model_rollout_contract.tracks import track_keys
from model_rollout_e2e.control_plane import ControlPlane
from model_rollout_e2e.simulated_sidecar import (
    PodServer,
    SidecarBehaviour,
    model_store_claim,
    server_retain,
    sidecar_command,
)
from tests.support.cli import install_sidecar_policy

ROOT = Path(__file__).resolve().parents[2]
MD = "mlp"
TENANT = {"name": "acme-mlp", "tenant": "acme", "model": "mlp", "version": "a1"}
BEHAVIOUR = SidecarBehaviour(fetch_s=0.2, load_s=0.2, refuse={"v3": "bad_signature"})
HANG_GUARD_S = 120.0


def _spec() -> dict[str, Any]:
    [doc] = yaml.safe_load_all((ROOT / "examples" / "modeldeployment.yaml").read_text())
    spec: dict[str, Any] = copy.deepcopy(doc["spec"])
    spec.update({"model": MD, "version": "v1", "replicas": 2, "backend": "onnxruntime",
                 "store": {"pvc": "models"}, "resources": {"memory": "1Gi"}, "retainVersions": 2,
                 "tenants": {"secretName": "tenants", "models": [TENANT]}})  # fmt: skip
    spec.pop("precision", None)
    return spec


@pytest.fixture(scope="module")
def sidecar_policy(control_plane: ControlPlane) -> None:
    install_sidecar_policy(control_plane)


@pytest.fixture
def namespace(control_plane: ControlPlane, sidecar_policy: None) -> Iterator[str]:
    """The operator's children of one ModelDeployment, as it writes them (no operator
    runs: the test plays its part), and its volume store; deleted afterwards, pods and
    all (the PersistentVolume is released with its claim, then deleted)."""
    admin = control_plane.kubectl
    name = f"sim-{uuid.uuid4().hex[:8]}"
    admin("create", "namespace", name)
    spec = parse_spec(_spec())
    admin.apply(
        *model_store_claim(name),
        *pod_rbac(MD, name, spec),
        configmap(MD, name, spec, "v1"),
        deployment(MD, name, spec),
    )
    yield name
    admin.run("delete", "namespace", name, "--wait=false")


@pytest.fixture
async def core(control_plane: ControlPlane) -> AsyncIterator[Any]:
    """The admin's CoreV1Api on the test's loop."""
    configuration = k8s.Configuration()
    await k8s_config.load_kube_config(
        config_file=str(control_plane.kubeconfig), client_configuration=configuration
    )
    async with k8s.ApiClient(configuration) as api:
        yield k8s.CoreV1Api(api)


async def _pods(core: Any, namespace: str) -> list[dict[str, Any]]:
    answer = await core.list_namespaced_pod(namespace, _preload_content=False)
    return list(json.loads(await answer.read())["items"])


def _report(pod: dict[str, Any], track: str | None = None) -> SidecarReport | None:
    annotations = pod["metadata"].get("annotations") or {}
    return SidecarReport.from_json(annotations.get(track_keys(track).sidecar_status))


async def _until(probe: Callable[[], Any]) -> Any:
    """``await probe()`` again until it is truthy; a hang guard only."""

    async def poll() -> Any:
        while not (value := await probe()):
            await asyncio.sleep(0.1)
        return value

    return await asyncio.wait_for(poll(), HANG_GUARD_S)


async def _reports(
    core: Any,
    namespace: str,
    name: str,
    annotations: dict[str, str | None],
    until: Callable[[SidecarReport], bool],
) -> list[SidecarReport]:
    """Set ``annotations`` on the pod; its default-track reports as a watch sees them
    from just before that, each change once, up to the first for which ``until`` holds.
    (The pod is read before the patch: read after it, a sidecar quicker than the read
    has already left the report the steps start from.)"""
    response = await core.read_namespaced_pod(name, namespace, _preload_content=False)
    pod = json.loads(await response.read())
    await _set(core, namespace, name, annotations)
    seen: list[SidecarReport] = []

    async def follow() -> list[SidecarReport]:
        version = pod["metadata"]["resourceVersion"]
        while True:
            response = await core.list_namespaced_pod(
                namespace, field_selector=f"metadata.name={name}", watch="true",
                resource_version=version, timeout_seconds=60, _preload_content=False,
            )  # fmt: skip
            async with response:
                while line := await response.content.readline():
                    event = json.loads(line)
                    version = event["object"]["metadata"]["resourceVersion"]
                    report = _report(event["object"])
                    if report is not None and not report.same_as(seen[-1] if seen else None):
                        seen.append(report)
                        if until(report):
                            return seen

    current = _report(pod)
    if current is not None:
        seen.append(current)
        if until(current):
            return seen
    return await asyncio.wait_for(follow(), HANG_GUARD_S)


async def _set(core: Any, namespace: str, name: str, annotations: dict[str, str | None]) -> None:
    await core.patch_namespaced_pod(
        name, namespace, {"metadata": {"annotations": annotations}},
        _content_type="application/merge-patch+json",
    )  # fmt: skip


async def test_a_simulated_node_runs_the_operators_pods_and_their_sidecars_report(
    node_agents: Any, namespace: str, core: Any
) -> None:
    """Init containers end, each track's sidecar reports its ConfigMap default as
    served; a new target goes fetching, loading, ok; a held one is swapped to at once;
    a refused one is refused with its code; a malformed traffic policy is reported
    beside ok; the report keeps the target's first sighting and what the server holds."""
    node_agents(sidecars=BEHAVIOUR)

    async def running() -> list[dict[str, Any]] | None:
        pods = await _pods(core, namespace)
        done = [p for p in pods if _report(p) and _report(p, "acme-mlp")]
        ready = [
            p for p in done
            if any(c["type"] == "Ready" and c["status"] == "True"
                   for c in p["status"].get("conditions") or [])
        ]  # fmt: skip
        return ready if len(ready) == 2 else None

    pods = await _until(running)
    for pod in pods:
        own, tenant = _report(pod), _report(pod, "acme-mlp")
        assert own is not None and tenant is not None
        assert (own.model, own.target, own.serving, own.state) == ("mlp", "v1", "v1", "ok")
        assert (tenant.model, tenant.target, tenant.serving) == ("acme/mlp", "a1", "a1")
        assert own.retained == () and own.target_seen_at and own.updated_at
        assert own.sha256 and own.code is None
        statuses = {s["name"]: s for s in pod["status"]["initContainerStatuses"]}
        assert statuses["prefetch"]["state"]["terminated"]["exitCode"] == 0
        assert statuses["prefetch-acme-mlp"]["state"]["terminated"]["exitCode"] == 0
    name = pods[0]["metadata"]["name"]
    keys = track_keys()

    seen = await _reports(
        core, namespace, name, {keys.target: "v2", keys.previous: "v1"}, lambda r: r.serving == "v2"
    )
    steps = [(r.target, r.serving, r.state) for r in seen]
    assert steps == [
        ("v1", "v1", SidecarState.OK), ("v2", "v1", SidecarState.FETCHING),
        ("v2", "v1", SidecarState.LOADING), ("v2", "v2", SidecarState.OK),
    ]  # fmt: skip
    assert seen[-1].retained == ("v1",) and seen[-1].target_seen_at == seen[1].target_seen_at
    assert seen[-1].target_seen_at != seen[0].target_seen_at

    seen = await _reports(
        core, namespace, name, {keys.target: "v1"}, lambda r: r.serving == "v1"
    )  # still loaded: a pointer swap
    assert [(r.serving, r.state) for r in seen] == [("v2", "ok"), ("v1", "ok")]
    assert seen[-1].retained == ("v2",)

    seen = await _reports(
        core, namespace, name, {keys.target: "v3"}, lambda r: r.state is SidecarState.REFUSED
    )
    assert [r.state for r in seen[1:]] == [SidecarState.FETCHING, SidecarState.REFUSED]
    refused = seen[-1]
    assert (refused.target, refused.serving, refused.code) == ("v3", "v1", "bad_signature")
    assert refused.reason == "bad_signature: mlp:v3: manifest signature does not verify"

    seen = await _reports(
        core,
        namespace,
        name,
        {keys.target: "v1", TRAFFIC_POLICY: "{not json"},
        lambda r: r.code == "bad_policy",
    )
    assert (seen[-1].serving, seen[-1].state) == ("v1", SidecarState.OK)
    assert seen[-1].reason and "ignored" in seen[-1].reason
    other = pods[1]["metadata"]["name"]  # the other pod's sidecar has nothing new to say
    response = await core.read_namespaced_pod(other, namespace, _preload_content=False)
    now = _report(json.loads(await response.read()))
    assert now is not None and now.same_as(_report(pods[1]))


def test_the_command_lines_are_read_as_the_operator_writes_them() -> None:
    """Every ``model-sidecar`` container of the operator's pod, and the server's
    ``--retain``, read from the pod template the operator generates."""
    spec = parse_spec(_spec())
    template = deployment(MD, "ns", spec)["spec"]["template"]
    pod = {"metadata": {"name": "p"}, "spec": template["spec"]}
    inits = [sidecar_command(c) for c in pod["spec"]["initContainers"]]
    watches = [sidecar_command(c) for c in pod["spec"]["containers"]]
    assert [(c.mode, c.model, c.track, c.configmap_key) for c in inits if c] == [
        ("init", "mlp", None, "target-version"),
        ("init", "acme/mlp", "acme-mlp", "target-version.acme-mlp"),
    ]
    assert [(c.mode, c.track) for c in watches if c] == [("watch", None), ("watch", "acme-mlp")]
    assert watches[0] is None  # the server
    assert server_retain(pod) == 2
    with pytest.raises(ValueError, match="no --model"):
        sidecar_command({"name": "x", "args": ["model-sidecar", "watch", "--store", "s"]})


def test_the_server_keeps_what_retain_allows_most_recent_first() -> None:
    server = PodServer(retain=2)
    server.swap(None, "v1")
    server.swap(None, "v2")
    server.swap(None, "v3")
    assert (server.serving[None], server.retained[None]) == ("v3", ("v2",))
    server.swap(None, "v2")  # held: swapped back, v3 kept beside it
    assert (server.serving[None], server.retained[None]) == ("v2", ("v3",))
    server.swap(None, "v4", keep=("v1",))  # a canary: its stable version beside it
    assert (server.serving[None], server.retained[None]) == ("v4", ("v1",))
    assert server.holds(None, "v1") and not server.holds(None, "v2")
    alone = PodServer(retain=1)
    alone.swap(None, "v1")
    alone.swap(None, "v2")
    assert (alone.serving[None], alone.retained[None]) == ("v2", ())
