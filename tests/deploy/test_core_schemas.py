"""The CRD's core-type fields (``spec.pod``, ``spec.resources.sidecar``/``prefetch``) are
the API server's own schemas (``tools/core_schemas.py``): the CRD holds exactly what the
session's real API server serves, made structural, so the two cannot drift apart; and
that API server refuses bad placement input with its own message, naming the field."""

from __future__ import annotations

import copy
import importlib.util
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from model_rollout_e2e.control_plane import ControlPlane
from model_rollout_e2e.kubectl import Kubectl

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "deploy" / "crds" / "modeldeployment.yaml"
EXAMPLE = ROOT / "examples" / "modeldeployment.yaml"
PLACEMENT_EXAMPLE = ROOT / "examples" / "modeldeployment-gpu-placement.yaml"
_spec = importlib.util.spec_from_file_location("core_schemas", ROOT / "tools" / "core_schemas.py")
assert _spec is not None and _spec.loader is not None
core_schemas = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(core_schemas)


@pytest.fixture(scope="module")
def served(control_plane: ControlPlane) -> dict[str, Any]:
    raw = control_plane.kubectl("get", "--raw", core_schemas.OPENAPI_PATH)
    loaded: dict[str, Any] = json.loads(raw)
    return loaded


def _crd_field(path: str) -> dict[str, Any]:
    [crd] = [d for d in yaml.safe_load_all(CRD.read_text()) if d]
    [version] = crd["spec"]["versions"]
    node = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for key in path.split("."):
        node = node["properties"][key]
    return dict(node)


@pytest.mark.parametrize("fragment", core_schemas.FRAGMENTS, ids=lambda f: f[0])
def test_the_crd_holds_what_the_api_server_serves(
    served: dict[str, Any], fragment: tuple[str, str, str | None, tuple[str, ...] | None]
) -> None:
    path, type_name, prop, keep = fragment
    field = _crd_field(path)
    field.pop("description", None)  # the CRD's own words, above the markers
    assert field == core_schemas.fragment(served, type_name, prop, keep)


def test_the_tool_would_not_change_the_crd(served: dict[str, Any]) -> None:
    """What ``python tools/core_schemas.py`` writes is what is committed (both copies)."""
    schemas = core_schemas.fragments(served)
    for crd in core_schemas.CRDS:
        text = crd.read_text()
        assert core_schemas.rewrite(text, schemas) == text, crd


@pytest.fixture(scope="module")
def admin(control_plane: ControlPlane) -> Kubectl:
    kubectl = control_plane.kubectl
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    kubectl("wait", "--for=condition=Established", "--timeout=60s", "-f", str(CRD))
    return kubectl


def _md(namespace: str, **spec: Any) -> dict[str, Any]:
    [doc] = yaml.safe_load_all(EXAMPLE.read_text())
    doc = copy.deepcopy(doc)
    doc["metadata"] = {"name": "resnet", "namespace": namespace}
    doc["spec"].update(spec)
    return dict(doc)


def _apply(admin: Kubectl, doc: dict[str, Any]) -> tuple[int, str]:
    result = admin.run("apply", "-f", "-", stdin=json.dumps(doc))
    return result.code, result.err


TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
REFUSED = {
    "a toleration's seconds as text": (
        {"pod": {"tolerations": [{**TOLERATION, "tolerationSeconds": "soon"}]}},
        "spec.pod.tolerations[0].tolerationSeconds: Invalid value: \"string\"",
    ),
    "a spread constraint without its topology key": (
        {"pod": {"topologySpreadConstraints": [
            {"maxSkew": 1, "whenUnsatisfiable": "DoNotSchedule"}]}},
        "spec.pod.topologySpreadConstraints[0].topologyKey: Required value",
    ),
    "an affinity term without a key": (
        {"pod": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"operator": "In"}]}]}}}}},
        "spec.pod.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
        ".nodeSelectorTerms[0].matchExpressions[0].key: Required value",
    ),
    "a quantity that is none": (
        {"resources": {"gpu": 1, "sidecar": {"limits": {"memory": "lots"}}}},
        "spec.resources.sidecar.limits.memory: Invalid value: \"lots\"",
    ),
    "the operator's selector label": (
        {"pod": {"labels": {"serving.model-rollout.io/deployment": "other"}}},
        "spec.pod.labels: Forbidden: spec.pod.labels may not set the operator's own labels",
    ),
    "the operator's annotation": (
        {"pod": {"annotations": {"serving.model-rollout.io/target-version": "v9"}}},
        "spec.pod.annotations: Forbidden: spec.pod.annotations may not set the operator's own",
    ),
    "a label value with a space": (
        {"pod": {"labels": {"team": "vision ops"}}},
        "spec.pod.labels.team: Invalid value: \"vision ops\"",
    ),
    "a GPU in kubernetes.io": (
        {"resources": {"gpu": 1, "gpuResource": "kubernetes.io/gpu"}},
        "spec.resources.gpuResource: Invalid value: \"kubernetes.io/gpu\":"
        " spec.resources.gpuResource must be an extended resource",
    ),
    "a priority class that is no name": (
        {"pod": {"priorityClassName": "High Priority"}},
        "spec.pod.priorityClassName: Invalid value: \"High Priority\"",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", REFUSED.values(), ids=REFUSED.keys())
def test_the_api_server_refuses_bad_placement_naming_the_field(
    admin: Kubectl, case: tuple[dict[str, Any], str]
) -> None:
    namespace = f"md-{uuid.uuid4().hex[:8]}"
    admin("create", "namespace", namespace)
    change, message = case
    code, err = _apply(admin, _md(namespace, **change))
    assert code != 0
    assert message in err, err


def test_the_api_server_takes_every_placement_field(admin: Kubectl) -> None:
    namespace = f"md-{uuid.uuid4().hex[:8]}"
    admin("create", "namespace", namespace)
    pod = {
        "nodeSelector": {"pool": "gpu"},
        "tolerations": [TOLERATION],
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 10, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname"}}]}},
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                       "whenUnsatisfiable": "ScheduleAnyway"}],
        "priorityClassName": "serving", "runtimeClassName": "nvidia",
        "imagePullSecrets": [{"name": "registry"}],
        "labels": {"team": "vision"}, "annotations": {"note": "any text"},
        "serviceAccountAnnotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/m"},
    }  # fmt: skip
    resources = {"gpu": 1, "gpuResource": "nvidia.com/mig-1g.10gb",
                 "sidecar": {"limits": {"cpu": "1", "memory": "1Gi"}},
                 "prefetch": {"requests": {"cpu": "100m"}}}  # fmt: skip
    code, err = _apply(admin, _md(namespace, pod=pod, resources=resources))
    assert code == 0, err
    stored = admin.get("md", "resnet", "-n", namespace)
    assert stored["spec"]["pod"]["tolerations"] == [TOLERATION]
    assert stored["spec"]["resources"]["gpuResource"] == "nvidia.com/mig-1g.10gb"


def test_the_placement_example_is_accepted(admin: Kubectl) -> None:
    namespace = f"md-{uuid.uuid4().hex[:8]}"
    admin("create", "namespace", namespace)
    [doc] = yaml.safe_load_all(PLACEMENT_EXAMPLE.read_text())
    doc["metadata"]["namespace"] = namespace
    code, err = _apply(admin, doc)
    assert code == 0, err
    stored = admin.get("md", "ranker", "-n", namespace)
    assert stored["spec"]["pod"] == doc["spec"]["pod"]
