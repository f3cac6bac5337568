"""Where the pods run, on the session's real control plane (issue 32, item 1): two Nodes
registered by the kubelet stand-in, a GPU node tainted as GPU nodes are and a CPU node;
the real scheduler places each ModelDeployment's pods only where its ``spec.pod``
allows, a pod it cannot place is a condition on the ModelDeployment that says why, and
a namespace whose LimitRange requires limits admits the pods (every container has
them)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from model_rollout_contract.annotations import DEPLOYMENT_LABEL
from model_rollout_e2e.control_plane import ControlPlane
from model_rollout_e2e.identities import Identity
from model_rollout_e2e.node_agent import NodeAgent
from tests.support.control_plane_operator import (
    Operator,
    get,
    model_deployment,
    wait_for,
)

GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
S3 = {"url": "s3://models/resnet50"}  # no claim to bind: only the placement decides


@pytest.fixture
def operator(operator_identity: Identity, namespace: str, tmp_path: Path) -> Iterator[Operator]:
    started = Operator(
        operator_identity.kubeconfig, namespace, tmp_path / "op.log", 0.5,
        extra=["--no-store-check"],
    ).start()  # fmt: skip
    yield started
    started.stop()


def _pods(admin: Any, namespace: str, name: str) -> list[dict[str, Any]]:
    found = get(admin, "pods", "-n", namespace, "-l", f"{DEPLOYMENT_LABEL}={name}") or {}
    return list(found.get("items") or [])


def _placed(admin: Any, namespace: str, name: str, count: int) -> dict[str, str] | None:
    """Pod name -> its node, once ``count`` pods are all bound."""
    pods = _pods(admin, namespace, name)
    nodes = {p["metadata"]["name"]: p["spec"].get("nodeName") for p in pods}
    return nodes if len(nodes) == count and all(nodes.values()) else None


def _condition(admin: Any, namespace: str, name: str, kind: str) -> dict[str, Any] | None:
    md = get(admin, "md", name, "-n", namespace) or {}
    conditions = (md.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), None)


def test_the_scheduler_places_pods_only_where_the_spec_allows(
    control_plane: ControlPlane,
    namespace: str,
    operator: Operator,
    node_agents: Callable[..., NodeAgent],
) -> None:
    admin = control_plane.kubectl
    pool = uuid.uuid4().hex[:8]  # this test's nodes only, whatever else the session runs
    gpu = node_agents(gpus=3, labels={"pool": f"gpu-{pool}"}, taints=[GPU_TAINT])
    cpu = node_agents(gpus=0, labels={"pool": f"cpu-{pool}"})
    ours = {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [
                {"key": "pool", "operator": "In", "values": [f"gpu-{pool}", f"cpu-{pool}"]},
            ]},
        ]}},
    }  # fmt: skip
    # tolerates the taint and selects the GPU pool: both pods there (a GPU each)
    admin.apply(model_deployment(
        namespace, "gpu", store=S3, resources={"gpu": 1, "memory": "1Gi"},
        pod={"nodeSelector": {"pool": f"gpu-{pool}"}, "tolerations": [TOLERATION]},
    ))  # fmt: skip
    # no GPU, no toleration, either pool: the taint keeps them off the GPU node
    admin.apply(model_deployment(
        namespace, "cpu", store=S3, resources={"gpu": 0, "memory": "1Gi"}, pod={"affinity": ours},
    ))  # fmt: skip
    # the GPU pool without the toleration: nowhere
    admin.apply(model_deployment(
        namespace, "stuck", store=S3, replicas=1, resources={"gpu": 1, "memory": "1Gi"},
        pod={"nodeSelector": {"pool": f"gpu-{pool}"}},
    ))  # fmt: skip

    on_gpu = wait_for("the GPU pods placed", lambda: _placed(admin, namespace, "gpu", 2), operator)
    assert set(on_gpu.values()) == {gpu.name}, on_gpu
    on_cpu = wait_for("the CPU pods placed", lambda: _placed(admin, namespace, "cpu", 2), operator)
    assert set(on_cpu.values()) == {cpu.name}, on_cpu
    [pod] = wait_for("the stuck pod", lambda: _pods(admin, namespace, "stuck") or None, operator)
    assert not pod["spec"].get("nodeName")

    def unschedulable() -> dict[str, Any] | None:
        found = _condition(admin, namespace, "stuck", "PodsSchedulable")
        return found if found and found["status"] == "False" else None

    condition = wait_for("PodsSchedulable=False", unschedulable, operator)
    assert condition["reason"] == "Unschedulable"
    message = condition["message"]
    assert message.startswith(f"pod {pod['metadata']['name']} cannot be scheduled: "), message
    assert "1 node(s) had untolerated taint(s)" in message, message
    assert "didn't match Pod's node affinity/selector" in message, message
    placed = wait_for(
        "PodsSchedulable=True where all are placed",
        lambda: _condition(admin, namespace, "gpu", "PodsSchedulable"),
        operator,
    )
    assert (placed["status"], placed["reason"]) == ("True", "Scheduled")

    # tolerated now: the operator's next template places it, and the condition clears
    admin(
        "patch", "md", "stuck", "-n", namespace, "--type=merge", "-p",
        '{"spec": {"pod": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]}}}',
    )  # fmt: skip
    cleared = wait_for(
        "the condition cleared",
        lambda: (
            (_condition(admin, namespace, "stuck", "PodsSchedulable") or {}).get("status") == "True"
        ),
        operator,
    )
    assert cleared


def test_a_mig_slice_is_asked_by_its_own_resource_name(
    control_plane: ControlPlane,
    namespace: str,
    operator: Operator,
    node_agents: Callable[..., NodeAgent],
) -> None:
    """``gpuResource: nvidia.com/mig-1g.10gb``: only the node offering that slice takes
    the pod (the other has whole GPUs only)."""
    admin = control_plane.kubectl
    pool = uuid.uuid4().hex[:8]
    selector = {"nodeSelector": {"pool": pool}}
    node_agents(gpus=8, labels={"pool": pool})
    mig = node_agents(gpus=0, labels={"pool": pool}, extended={"nvidia.com/mig-1g.10gb": "7"})
    admin.apply(model_deployment(
        namespace, "mig", store=S3, replicas=2, pod=selector,
        resources={"gpu": 1, "gpuResource": "nvidia.com/mig-1g.10gb", "memory": "1Gi"},
    ))  # fmt: skip
    placed = wait_for("the MIG pods placed", lambda: _placed(admin, namespace, "mig", 2), operator)
    assert set(placed.values()) == {mig.name}, placed
    [pod, _] = _pods(admin, namespace, "mig")
    [server] = [c for c in pod["spec"]["containers"] if c["name"] == "server"]
    assert server["resources"]["limits"]["nvidia.com/mig-1g.10gb"] == "1"
    assert "nvidia.com/gpu" not in server["resources"]["limits"]


def test_a_limit_range_that_requires_limits_admits_the_pods(
    control_plane: ControlPlane,
    namespace: str,
    operator: Operator,
    node_agents: Callable[..., NodeAgent],
) -> None:
    """A LimitRange with a maximum and no default refuses any container without limits:
    before, the sidecar and the init container had none, and the ReplicaSet could create
    no pod at all."""
    admin = control_plane.kubectl
    admin.apply({
        "apiVersion": "v1", "kind": "LimitRange",
        "metadata": {"name": "limits-required", "namespace": namespace},
        "spec": {"limits": [{"type": "Container", "max": {"cpu": "16", "memory": "64Gi"}}]},
    })  # fmt: skip
    node_agents()
    admin.apply(model_deployment(
        namespace, store=S3, resources={"gpu": 1, "cpu": "2", "memory": "4Gi"},
    ))  # fmt: skip
    placed = wait_for("the pods created", lambda: _placed(admin, namespace, "mlp", 2), operator)
    assert len(placed) == 2
    for pod in _pods(admin, namespace, "mlp"):
        spec = pod["spec"]
        for container in [*spec["initContainers"], *spec["containers"]]:
            limits = (container.get("resources") or {}).get("limits") or {}
            assert {"cpu", "memory"} <= set(limits), container["name"]


def test_pods_the_api_server_refuses_are_a_condition_that_says_why(
    control_plane: ControlPlane, namespace: str, operator: Operator
) -> None:
    """A priority class that does not exist: the ReplicaSet creates no pod (the API
    server's Priority admission refuses each), so none waits for a node; the condition
    says so in the API server's words, and clears once the class exists."""
    admin = control_plane.kubectl
    missing = f"serving-{uuid.uuid4().hex[:8]}"
    admin.apply(model_deployment(
        namespace, "typo", store=S3, replicas=1, resources={"gpu": 0, "memory": "1Gi"},
        pod={"priorityClassName": missing},
    ))  # fmt: skip

    def refused() -> dict[str, Any] | None:
        found = _condition(admin, namespace, "typo", "PodsSchedulable")
        return found if found and found["reason"] == "FailedCreate" else None

    condition = wait_for("PodsSchedulable=False, FailedCreate", refused, operator, timeout_s=90)
    assert condition["status"] == "False"
    assert condition["message"].startswith("pods cannot be created: "), condition
    assert f"no PriorityClass with name {missing} was found" in condition["message"], condition
    assert not _pods(admin, namespace, "typo")
    admin.apply({
        "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
        "metadata": {"name": missing}, "value": 1000,
    })  # fmt: skip
    try:
        wait_for(
            "the condition cleared",
            lambda: (
                (_condition(admin, namespace, "typo", "PodsSchedulable") or {}).get("reason")
                != "FailedCreate"
            ),
            operator,
            timeout_s=120,
        )
    finally:
        admin("delete", "priorityclass", missing, "--wait=false")


def test_what_the_spec_drops_leaves_the_deployment_and_the_account(
    control_plane: ControlPlane, namespace: str, operator: Operator
) -> None:
    """A merge patch alone only adds: a label, a node selector key or an account's
    annotation the spec no longer gives would stay (and keep pods off nodes). They go;
    what another tool wrote (``kubectl rollout restart``'s annotation) stays."""
    admin = control_plane.kubectl
    role = {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/models"}
    admin.apply(model_deployment(namespace, store=S3, pod={
        "nodeSelector": {"pool": "a", "zone": "z1"}, "labels": {"team": "vision"},
        "serviceAccountAnnotations": role,
    }))  # fmt: skip

    def template() -> dict[str, Any]:
        found = get(admin, "deployment", "mlp", "-n", namespace) or {}
        return dict((found.get("spec") or {}).get("template") or {})

    def account() -> dict[str, str]:
        found = get(admin, "serviceaccount", "model-sidecar-mlp", "-n", namespace) or {}
        return dict(found.get("metadata", {}).get("annotations") or {})

    wait_for("the labelled template", lambda: template().get("metadata", {}).get("labels", {})
             .get("team") == "vision", operator)  # fmt: skip
    assert account().items() >= role.items()
    admin("rollout", "restart", "deployment/mlp", "-n", namespace)
    admin(
        "patch", "md", "mlp", "-n", namespace, "--type=merge", "-p",
        '{"spec": {"pod": {"nodeSelector": {"pool": "b", "zone": null}, "labels": null,'
        ' "serviceAccountAnnotations": null}}}',  # a merge patch of the resource: null drops
    )  # fmt: skip

    def dropped() -> dict[str, Any] | None:
        now = template()
        return now if now["spec"].get("nodeSelector") == {"pool": "b"} else None

    now = wait_for("the template without what the spec dropped", dropped, operator)
    assert "team" not in now["metadata"]["labels"], now["metadata"]["labels"]
    assert "kubectl.kubernetes.io/restartedAt" in now["metadata"]["annotations"]
    wait_for("the account without its role", lambda: not account().keys() & role.keys(),
             operator)  # fmt: skip
