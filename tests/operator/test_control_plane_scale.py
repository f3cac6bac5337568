"""The ModelDeployment's scale subresource on a real API server (issue 32): ``kubectl
scale``, a HorizontalPodAutoscaler run by the real controller-manager, and pods a scaler
adds in the middle of a rollout (on the kubelet stand-in, their sidecars' reports faked)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from model_operator import manifests
from model_operator.analysis_sources import pods_regex
from model_operator.spec import parse_spec
from model_rollout_contract.annotations import (
    DEPLOYMENT_LABEL,
    PROMOTE,
    TARGET_VERSION,
    promotion_id,
)
from model_rollout_e2e.control_plane import ControlPlane
from tests.support.control_plane_operator import (
    CRD,
    Operator,
    ReportingSidecars,
    get,
    model_deployment,
    settled_on,
    wait_for,
)

GROUP_VERSION = "serving.model-rollout.io/v1alpha1"
AUTOSCALING_DOC = Path(__file__).resolve().parents[2] / "docs" / "autoscaling.md"


def test_the_scale_subresource_names_fields_the_schema_has_and_the_pods_selector() -> None:
    """The CRD's scale paths are fields of its schema, and status.selector, as the operator
    writes it, selects exactly the Deployment's pods."""
    [crd] = yaml.safe_load_all(CRD.read_text())
    [version] = crd["spec"]["versions"]
    scale = version["subresources"]["scale"]
    schema = version["schema"]["openAPIV3Schema"]["properties"]
    assert scale == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert schema["spec"]["properties"]["replicas"]["type"] == "integer"
    assert schema["status"]["properties"]["replicas"]["type"] == "integer"
    assert schema["status"]["properties"]["selector"]["type"] == "string"
    spec = parse_spec(model_deployment("ns")["spec"])
    deployment = manifests.deployment("mlp", "ns", spec)
    wanted = dict(pair.split("=") for pair in manifests.selector_text("mlp").split(","))
    assert wanted == deployment["spec"]["selector"]["matchLabels"]
    assert wanted.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def _md(control_plane: ControlPlane, namespace: str) -> dict[str, Any]:
    return get(control_plane.kubectl, "md", "mlp", "-n", namespace) or {}


def _followed(control_plane: ControlPlane, namespace: str, replicas: int) -> dict[str, Any] | None:
    """The status once the operator has seen the spec's generation, the Deployment asks
    for ``replicas`` and as many pods exist (Pending, or run by the kubelet stand-in)."""
    md = _md(control_plane, namespace)
    status = md.get("status") or {}
    deployment = get(control_plane.kubectl, "deployment", "mlp", "-n", namespace) or {}
    followed = (
        md["spec"]["replicas"] == replicas
        and status.get("observedGeneration") == md["metadata"]["generation"]
        and status.get("replicas") == replicas
        and (deployment.get("spec") or {}).get("replicas") == replicas
    )
    return status if followed else None


def _replica_sets(control_plane: ControlPlane, namespace: str) -> list[str]:
    listed = control_plane.kubectl.get("replicasets", "-n", namespace)
    return sorted(r["metadata"]["name"] for r in listed["items"])


def _events(control_plane: ControlPlane, namespace: str, messages: bool = False) -> list[str]:
    """The ModelDeployment's events: their reasons, or their messages."""
    listed = control_plane.kubectl.get("events", "-n", namespace)
    return [
        e["message" if messages else "reason"]
        for e in listed["items"]
        if e["involvedObject"]["kind"] == "ModelDeployment"
    ]


def test_kubectl_scale_moves_the_deployment_and_starts_no_rollout(
    control_plane: ControlPlane, namespace: str, operator: Operator
) -> None:
    """``kubectl scale md``: the Deployment follows spec.replicas, status.replicas counts
    the pods, and nothing else changes (no new ReplicaSet: the pod template is the same;
    no rollout). The scale subresource shows the selector an autoscaler uses. Scaling
    the Deployment itself is drift: the ModelDeployment is what is scaled."""
    admin = control_plane.kubectl
    admin.apply(model_deployment(namespace, replicas=2))
    before = wait_for("2 replicas", lambda: _followed(control_plane, namespace, 2), operator)
    replica_sets = _replica_sets(control_plane, namespace)

    admin("scale", "modeldeployment/mlp", "--replicas", "3", "-n", namespace)
    after = wait_for("3 replicas", lambda: _followed(control_plane, namespace, 3), operator)
    assert _replica_sets(control_plane, namespace) == replica_sets  # no pod restarted
    assert after["rollout"] == before["rollout"] and after["history"] == before["history"]
    assert after["selector"] == f"{DEPLOYMENT_LABEL}=mlp"
    path = f"/apis/{GROUP_VERSION}/namespaces/{namespace}/modeldeployments/mlp/scale"
    scale = json.loads(admin("get", "--raw", path))
    assert scale["kind"] == "Scale" and scale["spec"] == {"replicas": 3}
    assert scale["status"] == {"replicas": 3, "selector": f"{DEPLOYMENT_LABEL}=mlp"}
    pods = admin.get("pods", "-n", namespace, "-l", scale["status"]["selector"])
    assert len(pods["items"]) == 3

    admin("scale", "deployment/mlp", "--replicas", "5", "-n", namespace)  # not the way
    wait_for("the Deployment back at 3",
             lambda: _followed(control_plane, namespace, 3) is not None
             and (get(admin, "deployment", "mlp", "-n", namespace) or {}).get("status", {})
             .get("replicas") == 3, operator)  # fmt: skip
    admin("scale", "modeldeployment/mlp", "--replicas", "1", "-n", namespace)
    wait_for("1 replica", lambda: _followed(control_plane, namespace, 1), operator)
    assert _replica_sets(control_plane, namespace) == replica_sets
    assert _events(control_plane, namespace).count("RolloutStarted") == 1  # the first only
    assert "Traceback" not in operator.log_path.read_text()


def test_the_docs_keda_query_counts_this_deployments_pods_only() -> None:
    """``pod=~"resnet-.*"`` also sums the pods of a ModelDeployment named resnet-large in
    the namespace: the KEDA example selects the pods as the analysis queries do."""
    blocks = re.findall(r"```yaml\n(.*?)```", AUTOSCALING_DOC.read_text(), re.DOTALL)
    [scaled] = [yaml.safe_load(b) for b in blocks if "kind: ScaledObject" in b]
    [trigger] = scaled["spec"]["triggers"]
    found = re.search(r'pod=~"([^"]*)"', trigger["metadata"]["query"])
    assert found is not None
    pattern = found.group(1)  # PromQL's regular expressions are anchored at both ends
    assert pattern == pods_regex("resnet")
    assert re.fullmatch(pattern, "resnet-7f9c8d4b6-x2k4z")
    assert re.fullmatch(pattern, "resnet-7806968c9d-7f9c8d4b6-x2k4z")  # a later template's
    assert not re.fullmatch(pattern, "resnet-large-7f9c8d4b6-x2k4z")


def _hpa(namespace: str, min_replicas: int, max_replicas: int) -> dict[str, Any]:
    """docs/autoscaling.md's HorizontalPodAutoscaler (a Pods metric that prometheus-adapter
    would serve: none here, the metric is missing), aimed at this test's resource."""
    blocks = re.findall(r"```yaml\n(.*?)```", AUTOSCALING_DOC.read_text(), re.DOTALL)
    [hpa] = [yaml.safe_load(b) for b in blocks if "kind: HorizontalPodAutoscaler" in b]
    hpa["metadata"] = {"name": "mlp", "namespace": namespace}
    hpa["spec"]["scaleTargetRef"]["name"] = "mlp"
    hpa["spec"].update(minReplicas=min_replicas, maxReplicas=max_replicas)
    assert hpa["spec"]["scaleTargetRef"]["apiVersion"] == GROUP_VERSION
    return dict(hpa)


def _condition(hpa: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    conditions = ((hpa or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), None)


def test_a_horizontal_pod_autoscaler_scales_a_model_deployment(
    control_plane: ControlPlane, namespace: str, operator: Operator
) -> None:
    """An autoscaling/v2 HPA whose target is the ModelDeployment: the API server takes
    it, and the controller-manager's HPA controller reads the scale subresource and
    writes it (below minReplicas it scales up with no metric at all); the operator
    follows. Its metric is missing (no metrics adapter): scaling on it is not active,
    but not for want of a selector."""
    admin = control_plane.kubectl
    admin.apply(model_deployment(namespace, replicas=2))
    wait_for("2 replicas", lambda: _followed(control_plane, namespace, 2), operator)
    admin("apply", "--server-side", "-f", "-", stdin=json.dumps(_hpa(namespace, 3, 4)))
    wait_for("the HPA's scale-up to minReplicas",
             lambda: _followed(control_plane, namespace, 3), operator, timeout_s=120)  # fmt: skip

    def active() -> dict[str, Any] | None:
        hpa = get(admin, "hpa", "mlp", "-n", namespace)
        able, scaling = _condition(hpa, "AbleToScale"), _condition(hpa, "ScalingActive")
        return hpa if able and able["status"] == "True" and scaling else None

    hpa = wait_for("the HPA's conditions", active, operator, timeout_s=120)
    scaling = _condition(hpa, "ScalingActive") or {}
    assert scaling["status"] == "False" and scaling["reason"] != "InvalidSelector", scaling
    assert hpa["status"]["currentReplicas"] == 3
    assert _md(control_plane, namespace)["spec"]["replicas"] == 3  # the operator left it


def _status(control_plane: ControlPlane, namespace: str) -> dict[str, Any]:
    return dict(_md(control_plane, namespace).get("status") or {})


def _held(control_plane: ControlPlane, namespace: str) -> bool:
    """The canary of v2 serves it, and the rollout holds it (for a promotion)."""
    rollout = _status(control_plane, namespace).get("rollout") or {}
    return rollout.get("toVersion") == "v2" and rollout.get("canaryHealthyAt") is not None


def _batch_done(control_plane: ControlPlane, namespace: str) -> bool:
    """Batch 1 of v2 serves it, and no other batch has started."""
    status = _status(control_plane, namespace)
    rollout = status.get("rollout") or {}
    done = rollout.get("batch") == 1 and not rollout.get("batchInFlight")
    return bool(done and (status.get("versions") or {}).get("v2") == 2)


def _targets(control_plane: ControlPlane, namespace: str) -> dict[str, str | None]:
    pods = control_plane.kubectl.get("pods", "-n", namespace)["items"]
    return {
        p["metadata"]["name"]: (p["metadata"].get("annotations") or {}).get(TARGET_VERSION)
        for p in pods
        if not p["metadata"].get("deletionTimestamp")
    }


def _new_pod_target(
    control_plane: ControlPlane, namespace: str, known: set[str], version: str
) -> str | None:
    """The pod that is not one of ``known``, once it is pointed at ``version``."""
    new = {n: t for n, t in _targets(control_plane, namespace).items() if n not in known}
    return next(iter(new), None) if list(new.values()) == [version] else None


def test_a_pod_a_scaler_adds_mid_rollout_starts_on_the_version_its_stage_wants(
    control_plane: ControlPlane, namespace: str, node_agent: Any, operator: Operator
) -> None:
    """Scaled up while the canary of v2 is held, the new pod is pointed at stable v1 at
    once (so its init container pre-pulls v1; the canary, 20%, stays one pod); scaled up
    again between two batches (a long jitter pause), the new pod is pointed at v2 at
    once, with no batch of its own, and no rollout restarts."""
    admin = control_plane.kubectl
    sidecars = ReportingSidecars(control_plane, namespace, "v1").start()
    try:
        admin.apply(model_deployment(
            namespace, replicas=4, store={"url": "s3://models/resnet50"},
            canary={"percent": 20, "manualPromote": True},  # 1 pod of 4, and of 5
            rollout={"batchSize": 1, "jitterSeconds": 3600},
        ))  # fmt: skip
        wait_for("v1 everywhere",
                 lambda: settled_on(_status(control_plane, namespace), "v1", 4),
                 operator)  # fmt: skip
        admin("patch", "md", "mlp", "-n", namespace, "--type=merge", "-p",
              '{"spec": {"version": "v2"}}')  # fmt: skip
        wait_for("the canary of v2 held", lambda: _held(control_plane, namespace), operator)
        started = _status(control_plane, namespace)["rollout"]["startedAt"]
        known = set(_targets(control_plane, namespace))

        admin("scale", "modeldeployment/mlp", "--replicas", "5", "-n", namespace)
        pointed = lambda: _new_pod_target(control_plane, namespace, known, "v1")  # noqa: E731
        wait_for("the new pod pointed at v1", pointed, operator)
        assert list(_targets(control_plane, namespace).values()).count("v2") == 1
        assert _status(control_plane, namespace)["rollout"]["startedAt"] == started

        admin("annotate", "md", "mlp", "-n", namespace, f"{PROMOTE}={promotion_id('v2', started)}")
        # the jitter pause before batch 2 (up to an hour) keeps the rest on v1
        wait_for("batch 1 done", lambda: _batch_done(control_plane, namespace), operator)
        known = set(_targets(control_plane, namespace))
        admin("scale", "modeldeployment/mlp", "--replicas", "6", "-n", namespace)
        newer = wait_for(
            "the next new pod pointed at v2",
            lambda: _new_pod_target(control_plane, namespace, known, "v2"),
            operator,
        )
        assert _status(control_plane, namespace)["rollout"]["startedAt"] == started
        assert all(newer not in m for m in _events(control_plane, namespace, messages=True))
    finally:
        sidecars.stop()
