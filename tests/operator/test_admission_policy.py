"""The ValidatingAdmissionPolicy that confines model pods' service accounts (issue 13,
"Pod and RBAC"): its own CEL expressions, taken from the generated object, evaluated
against admission requests shaped as the API server sends them, for pods shaped as the
operator generates them. Before it, the sidecar's Role let any model pod patch any pod of
its namespace: retarget it, forge its report, change its image."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import cel
import pytest
import yaml

from model_operator import admission_policy
from model_operator.admission_policy import POD_NAME_EXTRA, POD_UID_EXTRA
from model_operator.manifests import deployment, pod_rbac
from model_operator.spec import ModelDeploymentSpec, parse_spec
from model_rollout_contract.annotations import PREVIOUS_VERSION, SIDECAR_STATUS, TARGET_VERSION
from model_rollout_contract.report import SidecarReport
from model_rollout_contract.states import SidecarState
from model_rollout_contract.tracks import track_keys
from model_rollout_e2e import chart_policy
from tests.support.admission_review import Verdict, merge_patch, review
from tests.support.helm_chart import render_chart

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "model-rollout"
NS = "ml-serving"
MD = "resnet"
ACCOUNT = admission_policy.sidecar_service_account(MD)
POLICY, BINDING = admission_policy.objects()
OWN, OTHER = "resnet-7f9c5d-abcde", "resnet-7f9c5d-fghij"
UIDS = {OWN: "1f0c-own", OTHER: "9a3e-other"}


def _spec() -> ModelDeploymentSpec:
    [doc] = yaml.safe_load_all((ROOT / "examples" / "modeldeployment.yaml").read_text())
    return parse_spec(doc["spec"])


def report(state: SidecarState, serving: str) -> str:
    return SidecarReport("resnet50", "v2", serving, state, None, updated_at=1.0).to_json()


def pod(name: str) -> dict[str, Any]:
    """A pod of the operator's Deployment, as the API server holds it mid-rollout."""
    template = copy.deepcopy(deployment(MD, NS, _spec())["spec"]["template"])
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            **template["metadata"],
            "name": name,
            "namespace": NS,
            "uid": UIDS[name],
            "annotations": {
                TARGET_VERSION: "v2",
                PREVIOUS_VERSION: "v1",
                SIDECAR_STATUS: report(SidecarState.LOADING, "v1"),
            },
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "ReplicaSet",
                    "name": "resnet-7f9c5d",
                    "uid": "rs-1",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {**template["spec"], "nodeName": "node-1"},
        "status": {"phase": "Running"},
    }


def sidecar_of(
    pod_name: str | None, uid: str | None = None, account: str = ACCOUNT, namespace: str = NS
) -> dict[str, Any]:
    """The user a model pod's projected token authenticates as (``pod_name=None``: a
    legacy Secret token, bound to no pod)."""
    user: dict[str, Any] = {
        "username": f"system:serviceaccount:{namespace}:{account}",
        "uid": "sa-uid",
        "groups": ["system:serviceaccounts", f"system:serviceaccounts:{namespace}",
                   "system:authenticated"],
    }  # fmt: skip
    if pod_name is not None:
        user["extra"] = {
            POD_NAME_EXTRA: [pod_name],
            POD_UID_EXTRA: [uid or UIDS[pod_name]],
            "authentication.kubernetes.io/node-name": ["node-1"],
            "authentication.kubernetes.io/credential-id": ["JTI=6c1f"],
        }
    return user


OPERATOR = {
    "username": "system:serviceaccount:model-rollout-system:model-rollout-operator",
    "groups": ["system:serviceaccounts", "system:authenticated"],
}
KUBELET = {"username": "system:node:node-1", "groups": ["system:nodes", "system:authenticated"]}
DEFAULT_ACCOUNT = {
    "username": f"system:serviceaccount:{NS}:default",
    "groups": ["system:serviceaccounts", "system:authenticated"],
}


def request(user: dict[str, Any], operation: str, name: str, sub: str = "") -> dict[str, Any]:
    pods = {"group": "", "version": "v1", "resource": "pods"}
    body: dict[str, Any] = {
        "uid": "req-1",
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": pods,
        "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
        "requestResource": pods,
        "name": name,
        "namespace": NS,
        "operation": operation,
        "userInfo": user,
        "dryRun": False,
    }
    if sub:
        body["subResource"] = body["requestSubResource"] = sub
    return body


def patch_by(
    user: dict[str, Any], name: str, patch: dict[str, Any], sub: str = "", old: Any = None
) -> Verdict:
    """A merge patch of pod ``name`` (what ``kubectl patch`` and the sidecar send)."""
    before = old if old is not None else pod(name)
    return review(
        POLICY, BINDING, request(user, "UPDATE", name, sub), merge_patch(before, patch), before
    )


def annotate(annotations: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"annotations": annotations}}


OWN_REPORT = annotate({SIDECAR_STATUS: report(SidecarState.OK, "v2")})


def test_a_sidecar_reports_on_its_own_pod() -> None:
    verdict = patch_by(sidecar_of(OWN), OWN, OWN_REPORT)
    assert verdict.matched and verdict.allowed, verdict
    first = pod(OWN)  # its first report: the annotation did not exist yet
    del first["metadata"]["annotations"][SIDECAR_STATUS]
    assert patch_by(sidecar_of(OWN), OWN, OWN_REPORT, old=first).allowed
    no_annotations = pod(OWN)  # a pod created before the operator annotated it
    del no_annotations["metadata"]["annotations"]
    assert patch_by(sidecar_of(OWN), OWN, OWN_REPORT, old=no_annotations).allowed
    assert patch_by(sidecar_of(OWN), OWN, annotate({SIDECAR_STATUS: None})).allowed


def _deny(fragment: str, verdict: Verdict) -> None:
    assert verdict.matched and not verdict.allowed, verdict
    assert any(fragment in d for d in verdict.denials), verdict.denials


FORGED = annotate({SIDECAR_STATUS: report(SidecarState.OK, "v2")})
NEW_IMAGE = {"spec": {"containers": [{"name": "server", "image": "evil:latest"}]}}
NO_DEPLOYMENT_LABEL = {"metadata": {"labels": {"serving.model-rollout.io/deployment": None}}}
DENIED = {
    # (user, operation target, patch): what a compromised model pod would try
    "another pod's report (a faked healthy canary)": (
        sidecar_of(OWN), OTHER, FORGED, "its own pod"),
    "another pod's target version": (
        sidecar_of(OWN), OTHER, annotate({TARGET_VERSION: "v666"}), "its own pod"),
    "its own target version": (
        sidecar_of(OWN), OWN, annotate({TARGET_VERSION: "v666"}), "annotations its sidecar owns"),
    "its own previous version": (
        sidecar_of(OWN), OWN, annotate({PREVIOUS_VERSION: "v0"}), "annotations its sidecar owns"),
    "removing its target version": (
        sidecar_of(OWN), OWN, annotate({TARGET_VERSION: None}), "annotations its sidecar owns"),
    "an annotation of its own making": (
        sidecar_of(OWN), OWN, annotate({"example.com/x": "1"}), "annotations its sidecar owns"),
    "the report and the target at once": (
        sidecar_of(OWN), OWN, annotate({SIDECAR_STATUS: "{}", TARGET_VERSION: "v9"}),
        "annotations its sidecar owns"),
    "its own image": (sidecar_of(OWN), OWN, NEW_IMAGE, "spec"),
    "another pod's image": (sidecar_of(OWN), OTHER, NEW_IMAGE, "spec"),
    "its own labels (leaving the Service)": (sidecar_of(OWN), OWN, NO_DEPLOYMENT_LABEL, "labels"),
    "a finalizer on its pod": (
        sidecar_of(OWN), OWN, {"metadata": {"finalizers": ["example.com/stay"]}}, "finalizers"),
    "a token bound to no pod (a legacy Secret token)": (
        sidecar_of(None), OWN, OWN_REPORT, "its own pod"),
    "a token of an earlier pod of the same name": (
        sidecar_of(OWN, uid="0000-gone"), OWN, OWN_REPORT, "its own pod"),
    "a sidecar of another ModelDeployment": (
        sidecar_of(OTHER, account=admission_policy.sidecar_service_account("other")), OWN,
        OWN_REPORT, "its own pod"),
}  # fmt: skip


@pytest.mark.parametrize("case", DENIED.values(), ids=DENIED.keys())
def test_a_sidecar_cannot_change_anything_else(case: tuple[Any, ...]) -> None:
    user, target, patch, fragment = case
    _deny(fragment, patch_by(user, target, patch))


def test_a_sidecar_cannot_create_delete_or_use_subresources() -> None:
    own = pod(OWN)
    user = sidecar_of(OWN)
    _deny("only patch pods", review(POLICY, BINDING, request(user, "DELETE", OWN), None, own))
    copy_ = {**own, "metadata": {**own["metadata"], "name": "resnet-evil"}}
    _deny(
        "only patch pods",
        review(POLICY, BINDING, request(user, "CREATE", "resnet-evil"), copy_, None),
    )
    status = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    _deny("only patch pods", patch_by(user, OWN, status, sub="status"))
    eviction = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": OTHER}}
    evict = request(user, "CREATE", OTHER, sub="eviction")
    _deny("only patch pods", review(POLICY, BINDING, evict, eviction, None))
    execute = {"kind": "PodExecOptions", "command": ["sh"], "container": "server"}
    _deny(
        "only patch pods",
        review(POLICY, BINDING, request(user, "CONNECT", OTHER, "exec"), execute, None),
    )


OTHERS = {
    "the operator sets a target": (OPERATOR, annotate({TARGET_VERSION: "v3"})),
    "the operator, anything": (OPERATOR, NEW_IMAGE),
    "the kubelet": (KUBELET, {"metadata": {"labels": {"a": "b"}}}),
    "another account of the namespace": (DEFAULT_ACCOUNT, annotate({TARGET_VERSION: "v3"})),
    "a person named like the accounts": (
        {"username": f"{admission_policy.SIDECAR_SA_PREFIX}x", "groups": ["system:authenticated"]},
        annotate({TARGET_VERSION: "v3"})),
}  # fmt: skip


@pytest.mark.parametrize("case", OTHERS.values(), ids=OTHERS.keys())
def test_everyone_else_is_not_matched(case: tuple[dict[str, Any], dict[str, Any]]) -> None:
    user, patch = case
    assert patch_by(user, OTHER, patch) == Verdict(matched=False)


def test_the_policy_applies_to_the_accounts_the_operator_creates() -> None:
    """The policy matches by name, so the operator's names and the policy's pattern are
    checked together: the account of the generated pods, in any namespace."""
    [account, role, binding] = pod_rbac(MD, NS, _spec())
    assert account["metadata"]["name"] == ACCOUNT
    assert deployment(MD, NS, _spec())["spec"]["template"]["spec"]["serviceAccountName"] == ACCOUNT
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": ACCOUNT, "namespace": NS}]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "watch", "patch"]}
    ]
    for namespace in (NS, "team-b"):
        user = sidecar_of(OWN, account=ACCOUNT, namespace=namespace)
        verdict = patch_by(user, OWN, annotate({TARGET_VERSION: "v666"}))
        assert verdict.matched and not verdict.allowed


def test_every_expression_compiles() -> None:
    spec = POLICY["spec"]
    expressions = [
        *(c["expression"] for c in spec["matchConditions"]),
        *(v["expression"] for v in spec["variables"]),
        *(v["expression"] for v in spec["validations"]),
    ]
    assert len(expressions) == 1 + len(admission_policy.VARIABLES) + len(
        admission_policy.VALIDATIONS
    )
    for expression in expressions:
        cel.compile(expression)  # ValueError on a syntax error
    with pytest.raises(ValueError):  # and the check itself can fail
        cel.compile("request.userInfo.username.matches(")


@pytest.mark.parametrize("policy", chart_policy.POLICIES, ids=lambda p: p.module)
def test_the_chart_templates_are_generated_from_the_policies(
    policy: chart_policy.ChartPolicy,
) -> None:
    assert policy.template.read_text() == chart_policy.render(policy), (
        "run: .venv/bin/python -m model_rollout_e2e.chart_policy"
    )


KINDS = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")


def _canonical(obj: dict[str, Any]) -> str:
    return json.dumps(obj, sort_keys=True)


def test_the_chart_installs_exactly_the_generated_policies() -> None:
    """The sidecar's and the editors' policies, each turned off by its own value."""
    rendered = [d for d in render_chart(CHART) if d["kind"] in KINDS]
    generated = [obj for policy in chart_policy.POLICIES for obj in policy.objects()]
    assert sorted(map(_canonical, rendered)) == sorted(map(_canonical, generated))
    for policy in chart_policy.POLICIES:
        off = render_chart(CHART, {policy.value: False})
        left = [d for d in off if d["kind"] in KINDS]
        others = [o for p in chart_policy.POLICIES if p is not policy for o in p.objects()]
        assert sorted(map(_canonical, left)) == sorted(map(_canonical, others))


TENANT = "acme-resnet"  # a named track (model_rollout_contract.tracks)
TENANT_KEYS = track_keys(TENANT)


def test_a_tenant_sidecar_reports_on_its_own_track() -> None:
    """Issue 15: a tenant model's sidecar writes ``sidecar-status.<track>``; the policy
    used to list only the default track's key, so every tenant report was Forbidden."""
    tenant_report = annotate({TENANT_KEYS.sidecar_status: report(SidecarState.OK, "a7")})
    verdict = patch_by(sidecar_of(OWN), OWN, tenant_report)
    assert verdict.matched and verdict.allowed, verdict
    reported = merge_patch(pod(OWN), tenant_report)
    assert patch_by(sidecar_of(OWN), OWN, annotate({TENANT_KEYS.sidecar_status: None}),
                    old=reported).allowed  # fmt: skip
    both = annotate({SIDECAR_STATUS: "{}", track_keys("x").sidecar_status: "{}"})
    assert patch_by(sidecar_of(OWN), OWN, both).allowed


TENANT_DENIED = {
    "a tenant's target version": annotate({TENANT_KEYS.target: "v666"}),
    "a tenant's previous version": annotate({TENANT_KEYS.previous: "v0"}),
    "a tenant's traffic policy": annotate({TENANT_KEYS.traffic: "{}"}),
    "a tenant's report and its target at once": annotate(
        {TENANT_KEYS.sidecar_status: "{}", TENANT_KEYS.target: "v9"}
    ),
    "a report of a track that breaks the track rule": annotate(
        {f"{SIDECAR_STATUS}.Bad_Name": "{}"}
    ),
    "a report with an empty track": annotate({f"{SIDECAR_STATUS}.": "{}"}),
    "a report with a track then more": annotate({f"{TENANT_KEYS.sidecar_status}/x": "{}"}),
    "a report of a nested track": annotate({f"{TENANT_KEYS.sidecar_status}.b": "{}"}),
    "a report key with a prefix": annotate({f"x{SIDECAR_STATUS}": "{}"}),
    "a report key with any character for its dots": annotate(
        {SIDECAR_STATUS.replace(".", "x") + ".acme": "{}"}
    ),
    "a report of a track longer than 40": annotate({f"{SIDECAR_STATUS}.{'a' * 41}": "{}"}),
}


@pytest.mark.parametrize("patch", TENANT_DENIED.values(), ids=TENANT_DENIED.keys())
def test_a_tenant_sidecar_cannot_change_anything_else(patch: dict[str, Any]) -> None:
    _deny("annotations its sidecar owns", patch_by(sidecar_of(OWN), OWN, patch))


@pytest.mark.parametrize("track", ["a", "acme-resnet", "0-9", "a" * 40])
def test_every_track_the_contract_allows_may_report(track: str) -> None:
    """The policy's pattern and the contract's track rule are one rule."""
    verdict = patch_by(sidecar_of(OWN), OWN, annotate({track_keys(track).sidecar_status: "{}"}))
    assert verdict.allowed, verdict
