"""The sidecar admission policy (``model_operator.admission_policy``, the Helm chart's
ValidatingAdmissionPolicy) compiled and enforced by a real API server (issue 28):
``test_admission_policy.py`` evaluates its CEL with a library against requests shaped by
hand; here the API server type-checks it, authenticates a sidecar by a token bound to its
pod (TokenRequest), authorizes it with the operator's own Role, and runs the policy."""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from model_operator import admission_policy
from model_operator.manifests import deployment, pod_rbac
from model_operator.spec import ModelDeploymentSpec, parse_spec
from model_rollout_contract.annotations import PREVIOUS_VERSION, SIDECAR_STATUS, TARGET_VERSION
from model_rollout_e2e.control_plane import ControlPlane
from model_rollout_e2e.identities import Identity
from model_rollout_e2e.kubectl import Kubectl
from model_rollout_e2e.processes import wait_until

ROOT = Path(__file__).resolve().parents[2]
MD = "resnet"
ACCOUNT = admission_policy.sidecar_service_account(MD)
OWN, OTHER = "resnet-7f9c5d-abcde", "resnet-7f9c5d-fghij"
DENIED_BY_POLICY = f"ValidatingAdmissionPolicy '{admission_policy.POLICY_NAME}'"


def _spec() -> ModelDeploymentSpec:
    [doc] = yaml.safe_load_all((ROOT / "examples" / "modeldeployment.yaml").read_text())
    return parse_spec(doc["spec"])


def pod(name: str, namespace: str) -> dict[str, Any]:
    """A pod of the operator's Deployment mid-rollout (unscheduled: there is no node)."""
    template = copy.deepcopy(deployment(MD, namespace, _spec())["spec"]["template"])
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            **template["metadata"],
            "name": name,
            "namespace": namespace,
            "annotations": {TARGET_VERSION: "v2", PREVIOUS_VERSION: "v1", SIDECAR_STATUS: "{}"},
        },
        "spec": template["spec"],
    }


@pytest.fixture(scope="module")
def policy(control_plane: ControlPlane) -> dict[str, Any]:
    """The policy and its binding applied, once the API server has type-checked it."""
    admin = control_plane.kubectl
    admin.apply(*admission_policy.objects())

    def checked() -> dict[str, Any] | None:
        vap = admin.get("validatingadmissionpolicy", admission_policy.POLICY_NAME)
        status = vap.get("status", {})
        generation = vap["metadata"]["generation"]
        return vap if status.get("observedGeneration") == generation else None

    vap: dict[str, Any] = wait_until(checked, 60, interval_s=0.5, what="the policy's type check")
    return vap


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane, policy: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A namespace with the operator's pod RBAC, two of its pods, and the sidecar's
    token bound to the first (what the kubelet mounts into it); deleted afterwards, so
    that a later test's node agent is not given these pods to run."""
    admin = control_plane.kubectl
    namespace = f"ml-{uuid.uuid4().hex[:8]}"
    admin("create", "namespace", namespace)
    admin.apply(*pod_rbac(MD, namespace, _spec()))
    admin.apply(pod(OWN, namespace), pod(OTHER, namespace))
    own_uid = admin.get("pod", OWN, "-n", namespace)["metadata"]["uid"]
    sidecar = control_plane.service_account(namespace, ACCOUNT, pod=(OWN, own_uid))
    unbound = control_plane.service_account(namespace, ACCOUNT)
    # the policy is enforced once the API server's informers have it: probe with a
    # server-side dry run, which runs admission and changes nothing
    probe = ["patch", "pod", OWN, "--type=merge", "--dry-run=server", "-p", '{"metadata":'
             ' {"labels": {"probe": "1"}}}']  # fmt: skip
    wait_until(
        lambda: DENIED_BY_POLICY in sidecar.kubectl.run(*probe).err,
        60,
        interval_s=0.5,
        what="the policy to be enforced",
    )
    yield {"ns": namespace, "admin": admin, "sidecar": sidecar, "unbound": unbound}
    admin.run("delete", "namespace", namespace, "--wait=false")


def test_the_api_server_type_checks_the_policy_cleanly(policy: dict[str, Any]) -> None:
    """No expression refers to a field a Pod or an admission request does not have."""
    checking = policy["status"].get("typeChecking", {})
    assert checking.get("expressionWarnings", []) == [], checking
    assert not [c for c in policy["status"].get("conditions", []) if c["status"] != "True"]


def patch(who: Identity, name: str, body: dict[str, Any]) -> tuple[int, str]:
    result = who.kubectl.run("patch", "pod", name, "--type=merge", "-p", json.dumps(body))
    return result.code, result.err


def annotate(annotations: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"annotations": annotations}}


def _annotations(admin: Kubectl, namespace: str, name: str) -> dict[str, str]:
    found: dict[str, str] = admin.get("pod", name, "-n", namespace)["metadata"]["annotations"]
    return found


def test_a_sidecar_reports_on_its_own_pod(cluster: dict[str, Any]) -> None:
    report = json.dumps({"state": "OK", "serving": "v2"})
    code, err = patch(cluster["sidecar"], OWN, annotate({SIDECAR_STATUS: report}))
    assert code == 0, err
    assert _annotations(cluster["admin"], cluster["ns"], OWN)[SIDECAR_STATUS] == report


DENIED = {
    "another pod's report": (OTHER, annotate({SIDECAR_STATUS: '{"state": "OK"}'}), "its own pod"),
    "another pod's target version": (OTHER, annotate({TARGET_VERSION: "v666"}), "its own pod"),
    "its own target version": (
        OWN, annotate({TARGET_VERSION: "v666"}), "annotations its sidecar owns"),
    "an annotation of its own making": (
        OWN, annotate({"example.com/x": "1"}), "annotations its sidecar owns"),
    "its own labels": (
        OWN, {"metadata": {"labels": {"serving.model-rollout.io/deployment": None}}}, "labels"),
}  # fmt: skip


@pytest.mark.parametrize("case", DENIED.values(), ids=DENIED.keys())
def test_a_sidecar_is_refused_anything_else(
    cluster: dict[str, Any], case: tuple[str, dict[str, Any], str]
) -> None:
    target, body, fragment = case
    before = cluster["admin"].get("pod", target, "-n", cluster["ns"])["metadata"]
    code, err = patch(cluster["sidecar"], target, body)
    assert code != 0
    assert "Forbidden" in err and DENIED_BY_POLICY in err and fragment in err, err
    after = cluster["admin"].get("pod", target, "-n", cluster["ns"])["metadata"]
    assert (after["annotations"], after["labels"]) == (before["annotations"], before["labels"])


def test_a_token_bound_to_no_pod_is_refused(cluster: dict[str, Any]) -> None:
    code, err = patch(cluster["unbound"], OWN, annotate({SIDECAR_STATUS: "{}"}))
    assert code != 0
    assert DENIED_BY_POLICY in err and "its own pod" in err, err


def test_rbac_refuses_what_the_role_does_not_grant(cluster: dict[str, Any]) -> None:
    """The operator's Role (get, watch, patch on pods) stops a delete before the policy."""
    result = cluster["sidecar"].kubectl.run("delete", "pod", OTHER, "--wait=false")
    assert result.code != 0
    assert 'cannot delete resource "pods"' in result.err, result
    assert DENIED_BY_POLICY not in result.err


def test_the_operator_is_not_confined(cluster: dict[str, Any]) -> None:
    """Anyone else (here the admin; the operator's account alike) is not matched."""
    cluster["admin"]("annotate", "pod", OTHER, "-n", cluster["ns"], "--overwrite",
                     f"{TARGET_VERSION}=v3")  # fmt: skip
    assert _annotations(cluster["admin"], cluster["ns"], OTHER)[TARGET_VERSION] == "v3"
