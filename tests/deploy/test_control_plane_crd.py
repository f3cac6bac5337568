"""The ModelDeployment CRD as a real API server serves it (issue 28): ``kubectl apply``
refuses what the schema refuses with the schema's message, drops unknown fields with a
warning, and ``kubectl get md`` prints the CRD's columns. ``crd_validation``
re-implements these rules for the tests that run without a control plane; this is the
API server's own answer."""

from __future__ import annotations

import copy
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


@pytest.fixture(scope="module")
def admin(control_plane: ControlPlane) -> Kubectl:
    kubectl = control_plane.kubectl
    kubectl("apply", "--server-side", "-f", str(CRD))
    kubectl("wait", "--for=condition=Established", "--timeout=60s", "-f", str(CRD))
    return kubectl


@pytest.fixture
def namespace(admin: Kubectl) -> str:
    name = f"md-{uuid.uuid4().hex[:8]}"
    admin("create", "namespace", name)
    return name


def model_deployment(namespace: str, name: str = "resnet", **spec: Any) -> dict[str, Any]:
    """The README's example, in ``namespace``, with ``spec`` merged over its top level."""
    [doc] = yaml.safe_load_all(EXAMPLE.read_text())
    doc = copy.deepcopy(doc)
    doc["metadata"] = {"name": name, "namespace": namespace}
    doc["spec"].update(spec)
    return dict(doc)


def apply(admin: Kubectl, doc: dict[str, Any], *flags: str) -> tuple[int, str, str]:
    result = admin.run("apply", *flags, "-f", "-", stdin=json.dumps(doc))
    return result.code, result.out, result.err


def test_the_example_is_accepted(admin: Kubectl, namespace: str) -> None:
    code, out, err = apply(admin, model_deployment(namespace))
    assert code == 0, err
    assert "modeldeployment.serving.model-rollout.io/resnet created" in out
    stored = admin.get("md", "resnet", "-n", namespace)
    assert stored["spec"]["rollout"]["batchSize"] == 2


def _canary(percent: int) -> dict[str, Any]:
    [doc] = yaml.safe_load_all(EXAMPLE.read_text())
    return {**doc["spec"]["canary"], "percent": percent}


REFUSED = {
    "a canary of 150 percent": (
        {"canary": _canary(150)},
        "spec.canary.percent: Invalid value: 150: spec.canary.percent in body should be less"
        " than or equal to 100",
    ),
    "a version with a space": (
        {"version": "v 2"},
        'spec.version: Invalid value: "v 2": spec.version in body should match',
    ),
    "both store kinds": (
        {"store": {"url": "s3://models-prod/vision", "pvc": "models"}},
        '"spec.store" must validate one and only one schema (oneOf). Found 2 valid',
    ),
    "no store at all": (
        {"store": {}},
        '"spec.store" must validate one and only one schema (oneOf)',
    ),
    # issue 31: a shadow step asked for where it cannot run, refused naming the field
    "a shadow step with one version retained": (
        {
            "canary": {"percent": 25, "shadow": {"enabled": True}, "analysis": {}},
            "retainVersions": 1,
        },
        "spec.canary.shadow.enabled needs spec.retainVersions of at least 2",
    ),
    "a shadow step without analysis": (
        {"canary": {"percent": 25, "shadow": {"enabled": True}}},
        "spec.canary.shadow.enabled needs spec.canary.analysis",
    ),
}


@pytest.mark.parametrize("case", REFUSED.values(), ids=REFUSED.keys())
def test_kubectl_apply_refuses_with_the_crds_message(
    admin: Kubectl, namespace: str, case: tuple[dict[str, Any], str]
) -> None:
    spec, message = case
    code, _, err = apply(admin, model_deployment(namespace, **spec))
    assert code != 0
    assert 'The ModelDeployment "resnet" is invalid' in err, err
    assert message in err, err
    assert admin.run("get", "md", "resnet", "-n", namespace).code != 0  # nothing stored


def test_a_cel_rule_refuses_with_its_message(admin: Kubectl, namespace: str) -> None:
    doc = model_deployment(namespace)
    del doc["spec"]["signingPublicKeySecret"]
    code, _, err = apply(admin, doc)
    assert code != 0
    assert "spec.signingPublicKeySecret is required" in err, err


def test_an_unknown_field_is_dropped_with_a_warning(admin: Kubectl, namespace: str) -> None:
    """kubectl's default (``--validate=strict``) refuses it; a client asking the server to
    warn (``--validate=warn``, what the API does for a client that does not say) gets
    the object stored without the field and a warning naming it."""
    doc = model_deployment(namespace, replicaz=3)
    code, _, err = apply(admin, doc)
    assert code != 0
    assert 'unknown field "spec.replicaz"' in err, err
    code, _, err = apply(admin, doc, "--validate=warn")
    assert code == 0, err
    assert 'Warning: unknown field "spec.replicaz"' in err, err
    stored = admin.get("md", "resnet", "-n", namespace)
    assert "replicaz" not in stored["spec"]
    assert stored["spec"]["replicas"] == 8


def test_kubectl_get_md_prints_the_crds_columns(admin: Kubectl, namespace: str) -> None:
    assert apply(admin, model_deployment(namespace))[0] == 0
    status = {
        "status": {
            "currentVersion": "2026-11-01",
            "readyReplicas": 8,
            "updatedReplicas": 2,
            "phase": "Canary",
            "analysis": {"lastResult": "Passed"},
            "history": [
                {"version": "2026-11-30", "startedAt": "2026-12-01T10:00:00.000Z",
                 "result": "Progressing"}
            ],
        }
    }  # fmt: skip
    admin(
        "patch", "md", "resnet", "-n", namespace, "--subresource=status", "--type=merge",
        "-p", json.dumps(status),
    )  # fmt: skip
    header, row = admin("get", "md", "-n", namespace).splitlines()
    assert header.split() == [
        "NAME", "MODEL", "VERSION", "TARGET", "READY", "UPDATED", "PHASE", "ANALYSIS",
        "LAST-RESULT", "AGE",
    ]  # fmt: skip
    assert row.split()[:9] == [
        "resnet", "resnet50", "2026-11-01", "2026-11-30", "8", "2", "Canary", "Passed",
        "Progressing",
    ]  # fmt: skip
    crd = yaml.safe_load(CRD.read_text())
    shown = {c["name"].upper() for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert shown == set(header.split()) - {"NAME"}
