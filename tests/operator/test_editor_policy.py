"""The ValidatingAdmissionPolicy that keeps the rollout-editor role to steering rollouts
(issue 29: one editor patch produced pods running another image, unsigned, with a Secret
mounted): its own CEL expressions, taken from the generated object, evaluated against
admission requests shaped as the API server sends them, for the README's example
resource; the API server's authorizer answered per test. ``tests/cli/test_user_roles.py``
runs it on the real API server, with the chart's roles."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import cel
import pytest
import yaml

from model_operator import editor_policy
from model_operator.constants import GROUP, PLURAL
from model_rollout_contract.annotations import ABORT, CHANGE_CAUSE, PROMOTE, RETRY
from model_rollout_contract.tracks import track_keys
from tests.support.admission_review import Check, Verdict, merge_patch, review
from tests.support.crd_validation import load_crd_schema

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "deploy" / "crds" / "modeldeployment.yaml"
NS, MD = "ml-serving", "resnet"
POLICY, BINDING = editor_policy.objects()
TENANT = track_keys("acme-resnet")
EDITOR = {
    "username": f"system:serviceaccount:{NS}:release-bot",
    "groups": ["system:serviceaccounts", f"system:serviceaccounts:{NS}", "system:authenticated"],
}
CONFIGURE = Check(editor_policy.CONFIGURE_VERB, GROUP, PLURAL, NS, MD)


def editor(check: Check) -> bool:
    """The rollout editor: patch, but not configure."""
    return check.verb != editor_policy.CONFIGURE_VERB


def owner(check: Check) -> bool:
    return True


def resource() -> dict[str, Any]:
    """The README's example as the API server holds it, with a release's cause, a tenant
    track and a label and annotation of its owners'."""
    [doc] = yaml.safe_load_all((ROOT / "examples" / "modeldeployment.yaml").read_text())
    doc = copy.deepcopy(doc)
    doc["metadata"].update(
        uid="md-1",
        resourceVersion="41",
        generation=3,
        labels={"team": "vision"},
        annotations={
            CHANGE_CAUSE: "2026-11-30: release by ci@runner at 2026-12-04T19:20:01.250Z",
            "example.com/owner": "vision-team",
        },
    )
    doc["spec"]["tenants"] = {"models": [
        {"name": TENANT.track, "tenant": "acme", "model": "resnet", "version": "a2"}]}  # fmt: skip
    doc["status"] = {"phase": "Available", "currentVersion": "2026-11-30"}
    return dict(doc)


def request(operation: str, sub: str = "") -> dict[str, Any]:
    kind = {"group": GROUP, "version": "v1alpha1", "kind": "ModelDeployment"}
    mds = {"group": GROUP, "version": "v1alpha1", "resource": PLURAL}
    body: dict[str, Any] = {
        "uid": "req-1", "kind": kind, "resource": mds, "requestKind": kind,
        "requestResource": mds, "name": MD, "namespace": NS, "operation": operation,
        "userInfo": EDITOR, "dryRun": False,
    }  # fmt: skip
    if sub:
        body["subResource"] = body["requestSubResource"] = sub
    return body


def patch_by(authorizes: Any, patch: dict[str, Any], old: Any = None, sub: str = "") -> Verdict:
    """A merge patch of the resource (what the tools and ``kubectl patch`` send)."""
    before = old if old is not None else resource()
    after = merge_patch(before, patch)
    return review(POLICY, BINDING, request("UPDATE", sub), after, before, authorizes)


def annotate(annotations: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"annotations": annotations}}


ALLOWED = {  # what the tools write, and their removal
    "release / rollback: spec.version and the change-cause": {
        "metadata": {"annotations": {CHANGE_CAUSE: "v3: rollback by alice@laptop"}},
        "spec": {"version": "v3"},
    },
    "spec.version alone (kubectl patch)": {"spec": {"version": "v3"}},
    "pause": {"spec": {"paused": True}},
    "resume": {"spec": {"paused": False}},
    "resume by removing spec.paused": {"spec": {"paused": None}},
    "promote --full, resuming": {
        "metadata": {"annotations": {PROMOTE: "v3@1700000000+full"}},
        "spec": {"paused": False},
    },
    "promote": annotate({PROMOTE: "v3@1700000000"}),
    "abort": annotate({ABORT: "v3"}),
    "retry with its cause": annotate({RETRY: "v3", CHANGE_CAUSE: "v3: retry by bob"}),
    "a tenant's promote": annotate({TENANT.promote: "a3@1700000000"}),
    "a tenant's abort": annotate({TENANT.abort: "a3"}),
    "a tenant's retry": annotate({TENANT.retry: "a3"}),
    "removing the change-cause": annotate({CHANGE_CAUSE: None}),
    "nothing at all (a no-op patch)": {},
}


@pytest.mark.parametrize("patch", ALLOWED.values(), ids=ALLOWED.keys())
def test_a_rollout_editor_steers_rollouts(patch: dict[str, Any]) -> None:
    verdict = patch_by(editor, patch)
    assert verdict.matched and verdict.allowed, verdict


def test_removing_a_rollout_annotation_is_allowed() -> None:
    """The operator clears them once acted on; an editor may take one back too."""
    promoted = merge_patch(resource(), annotate({PROMOTE: "v3@1", TENANT.abort: "a3"}))
    assert patch_by(editor, annotate({PROMOTE: None, TENANT.abort: None}), old=promoted).allowed


# the spec fields a rollout editor may not touch, each with a change the CRD accepts
SPEC_CHANGES: dict[str, Any] = {
    "model": "other-model",
    "image": "attacker.example/shell:latest",
    "sidecarImage": "attacker.example/sidecar:latest",
    "replicas": 80,
    "backend": "onnxruntime",
    "precision": "fp32",
    "store": {"credentialsSecret": "prod-database-password"},
    "resources": {"gpu": 8},
    "canary": {"percent": 100},
    "rollout": {"batchSize": 8},
    "retainVersions": 5,
    "signingPublicKeySecret": "attackers-key",
    "allowUnsigned": True,
    "tenants": {"models": []},
    "sidecar": {"maxConcurrentDownloads": 16},
    "server": {"processes": 16},
    "logging": {"level": "debug"},
    "pod": {"nodeSelector": {"kubernetes.io/hostname": "attackers-node"}},
}


def test_every_spec_field_but_version_and_paused_is_guarded() -> None:
    """The policy's list is the CRD's: a field added to the CRD fails here until the
    policy guards it (the spec keeps no unknown fields)."""
    spec = load_crd_schema(CRD)["properties"]["spec"]
    assert "x-kubernetes-preserve-unknown-fields" not in spec
    properties = set(spec["properties"])
    assert set(editor_policy.EDITOR_SPEC_FIELDS) == {"version", "paused"} <= properties
    assert set(editor_policy.SPEC_FIELDS) == properties - set(editor_policy.EDITOR_SPEC_FIELDS)
    assert len(editor_policy.SPEC_FIELDS) == len(set(editor_policy.SPEC_FIELDS))
    assert set(SPEC_CHANGES) == set(editor_policy.SPEC_FIELDS)


def _deny(verdict: Verdict, *named: str) -> None:
    """Refused with the policy's words, naming what else the request changed."""
    assert verdict.matched and not verdict.allowed, verdict
    [denial] = verdict.denials
    assert denial.startswith("a rollout editor may change only spec.version and spec.paused")
    assert "this request also changes " + ", ".join(named) + ";" in denial, denial
    assert f"needs the verb '{editor_policy.CONFIGURE_VERB}'" in denial


@pytest.mark.parametrize("field", SPEC_CHANGES)
def test_a_rollout_editor_may_not_change_another_spec_field(field: str) -> None:
    _deny(patch_by(editor, {"spec": {field: SPEC_CHANGES[field]}}), f"spec.{field}")
    if field in resource()["spec"]:  # nor remove it
        _deny(patch_by(editor, {"spec": {field: None}}), f"spec.{field}")
    else:  # nor remove it where it is
        had = merge_patch(resource(), {"spec": {field: SPEC_CHANGES[field]}})
        _deny(patch_by(editor, {"spec": {field: None}}, old=had), f"spec.{field}")


def test_the_issues_patch_is_refused_naming_each_change() -> None:
    """Issue 29's editor patch: another image, unsigned, a Secret mounted; with a new
    version, so that the version is not what gives it away."""
    attack = {"spec": {
        "version": "v9", "image": "attacker.example/shell:latest", "allowUnsigned": True,
        "signingPublicKeySecret": None, "store": {"credentialsSecret": "prod-db-password"},
    }}  # fmt: skip
    _deny(patch_by(editor, attack), "spec.image", "spec.store", "spec.signingPublicKeySecret",
          "spec.allowUnsigned")  # fmt: skip


METADATA_CHANGES = {
    "a label": ({"metadata": {"labels": {"team": "attackers"}}}, "metadata.labels"),
    "a label removed": ({"metadata": {"labels": None}}, "metadata.labels"),
    "another annotation": (annotate({"example.com/x": "1"}), "metadata.annotations[example.com/x]"),
    "an owner's annotation removed": (
        annotate({"example.com/owner": None}), "metadata.annotations[example.com/owner]"),
    "kubectl's last-applied-configuration": (
        annotate({"kubectl.kubernetes.io/last-applied-configuration": "{}"}),
        "metadata.annotations[kubectl.kubernetes.io/last-applied-configuration]"),
    "a pod annotation's key on the resource": (
        annotate({TENANT.target: "v9"}), f"metadata.annotations[{TENANT.target}]"),
    "a promote of a track that breaks the track rule": (
        annotate({f"{PROMOTE}.Bad_Track": "x"}), f"metadata.annotations[{PROMOTE}.Bad_Track]"),
    "a key that only starts like promote": (
        annotate({f"{PROMOTE}d": "x"}), f"metadata.annotations[{PROMOTE}d]"),
    "a key with any character for the dots": (
        annotate({PROMOTE.replace(".", "x"): "x"}),
        f"metadata.annotations[{PROMOTE.replace('.', 'x')}]"),
    "a change-cause of a track (there is one)": (
        annotate({f"{CHANGE_CAUSE}.acme": "x"}), f"metadata.annotations[{CHANGE_CAUSE}.acme]"),
    "a finalizer": ({"metadata": {"finalizers": ["example.com/keep"]}}, "metadata.finalizers"),
    "an owner reference": (
        {"metadata": {"ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap",
                                           "name": "x", "uid": "u"}]}},
        "metadata.ownerReferences"),
}  # fmt: skip


@pytest.mark.parametrize("case", METADATA_CHANGES.values(), ids=METADATA_CHANGES.keys())
def test_a_rollout_editor_may_not_change_other_metadata(case: tuple[dict[str, Any], str]) -> None:
    patch, named = case
    _deny(patch_by(editor, patch), named)
    with_version = merge_patch(patch, {"spec": {"version": "v3"}})  # with an allowed change
    _deny(patch_by(editor, with_version), named)


def test_the_policy_asks_the_authorizer_about_this_very_resource() -> None:
    """``configure`` on this ModelDeployment (a Role may grant it by resourceNames)."""
    asked: list[Check] = []

    def recording(check: Check) -> bool:
        asked.append(check)
        return False

    assert patch_by(recording, {"spec": {"version": "v3"}}).matched
    assert asked == [CONFIGURE]


def test_whoever_may_configure_is_not_matched() -> None:
    """The owner role, the operator, ``*``: full edit, as without the policy."""
    everything = {"spec": SPEC_CHANGES, "metadata": {"labels": {"a": "b"}}}
    assert patch_by(owner, everything) == Verdict(matched=False)
    by_name = lambda c: c == CONFIGURE  # noqa: E731 - a Role with resourceNames: [resnet]
    assert patch_by(by_name, everything) == Verdict(matched=False)


def test_status_create_and_delete_are_not_matched() -> None:
    """The status is the operator's (RBAC); create and delete are RBAC's alone, so the
    namespace controller's deletes are never judged."""
    status = {"status": {"phase": "Degraded"}}
    assert patch_by(editor, status, sub="status") == Verdict(matched=False)
    created = review(POLICY, BINDING, request("CREATE"), resource(), None, editor)
    assert created == Verdict(matched=False)
    deleted = review(POLICY, BINDING, request("DELETE"), None, resource(), editor)
    assert deleted == Verdict(matched=False)


def deleting(finalizers: list[str]) -> dict[str, Any]:
    md = resource()
    md["metadata"].update(deletionTimestamp="2026-12-05T10:00:00Z", finalizers=finalizers)
    return md


def test_finalizers_may_only_go_once_deletion_has_begun() -> None:
    """The garbage collector (no 'configure') removes foregroundDeletion from a resource
    deleted in the foreground; anything else with its finalizers stays refused."""
    old = deleting(["foregroundDeletion", "example.com/cleanup"])
    removed = {"metadata": {"finalizers": ["example.com/cleanup"]}}
    assert patch_by(editor, removed, old=old).allowed
    assert patch_by(editor, {"metadata": {"finalizers": None}}, old=old).allowed
    swapped = {"metadata": {"finalizers": ["example.com/other"]}}
    _deny(patch_by(editor, swapped, old=old), "metadata.finalizers")
    _deny(patch_by(editor, {"metadata": {"finalizers": ["x"]}}), "metadata.finalizers")


def test_every_expression_compiles() -> None:
    spec = POLICY["spec"]
    expressions = [
        *(c["expression"] for c in spec["matchConditions"]),
        *(v["expression"] for v in spec["variables"]),
        *(v["expression"] for v in spec["validations"]),
        *(v["messageExpression"] for v in spec["validations"]),
    ]
    assert len(expressions) == 1 + len(editor_policy.VARIABLES) + 2
    for expression in expressions:
        cel.compile(expression)  # ValueError on a syntax error


def test_the_message_falls_back_when_its_expression_fails() -> None:
    """The API server's behaviour, kept by the harness: a broken messageExpression
    gives the static message, which says the same without naming the changes."""
    broken = copy.deepcopy(POLICY)
    broken["spec"]["validations"][0]["messageExpression"] = "variables.nothing.join(', ')"
    before = resource()
    verdict = review(broken, BINDING, request("UPDATE"), merge_patch(before, {"spec": {
        "image": "x"}}), before, editor)  # fmt: skip
    assert verdict.denials == (editor_policy.MESSAGE,)
