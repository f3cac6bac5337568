"""The ValidatingAdmissionPolicy that confines a model pod's service account to reporting
on its own pod, written once here as plain dicts (the Helm chart's template is generated
from them, and a test checks it is up to date).

Why a policy on top of RBAC: the sidecar must patch its own pod's status annotation, but
RBAC cannot name pods that do not exist yet (``resourceNames`` is fixed when the Role is
written, and pods of a Deployment get random names later), so the Role grants ``patch``
on every pod of the namespace. Without this policy any model pod could rewrite another
pod's target version, forge a healthy canary's report, or change a pod's image.

Who it applies to: every ServiceAccount named ``model-sidecar-<ModelDeployment>`` (the
operator names each resource's pod account so, :func:`sidecar_service_account`),
recognised by its username ``system:serviceaccount:<namespace>:model-sidecar-...``: an
admission request carries the username and groups, not the account's labels, so a name
pattern is what a policy can match on. Anyone else (the operator, the kubelet, people)
is not matched. What it allows such an account: UPDATE (PATCH) of the very pod its token
is bound to (the kubelet's projected token puts the pod's name and uid in the request's
``userInfo.extra``), changing nothing but the annotations the sidecar owns.

A known limit: all sidecars of a pod (the default track's and each tenant model's) share
the pod's one service account, so the policy cannot tell them apart: one track's sidecar
could write another track's report on its own pod, though never a target, previous
version or traffic policy.
"""

from __future__ import annotations

from typing import Any

from model_rollout_contract.annotations import SIDECAR_STATUS
from model_rollout_contract.tracks import TRACK_PATTERN

from .policy_binding import LABELS, with_binding

POLICY_NAME = "model-rollout-sidecar-pods"
SIDECAR_SA_PREFIX = "model-sidecar-"
# what a bound (projected) service-account token adds to the request's userInfo.extra
POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
POD_UID_EXTRA = "authentication.kubernetes.io/pod-uid"
# the pod annotations the sidecars write: the default track's report and each named
# track's (``track_keys(track).sidecar_status``); targets, previous versions and traffic
# policies are the operator's alone
SIDECAR_ANNOTATIONS = (SIDECAR_STATUS, f"{SIDECAR_STATUS}.<track>")
SIDECAR_USERNAME = rf"^system:serviceaccount:[^:]+:{SIDECAR_SA_PREFIX}[^:]+$"


def literal_pattern(text: str) -> str:
    """``text`` as a regex matching only itself, without backslashes (which a CEL string
    and the YAML around it would each need escaped): a dot becomes ``[.]``."""
    if not all(c.isalnum() or c in "-/." for c in text):
        raise ValueError(f"not a plain annotation key: {text!r}")
    return text.replace(".", "[.]")


# the report keys (``matches`` is RE2 in the API server; the track rule is the contract's)
SIDECAR_ANNOTATION_PATTERN = (
    f"^{literal_pattern(SIDECAR_STATUS)}(?:[.](?:{TRACK_PATTERN.pattern}))?$"
)
# a literal pattern, not a variable: the API server compiles it once, when the policy is
# written, and refuses the policy if it does not compile
_K_IS_A_SIDECAR_REPORT = f'k.matches("{SIDECAR_ANNOTATION_PATTERN}")'


def sidecar_service_account(name: str) -> str:
    """The ServiceAccount of a ModelDeployment's pods: a name this policy matches."""
    return f"{SIDECAR_SA_PREFIX}{name}"


def or_empty(path: str, empty: str) -> str:
    """``path`` when the field is there, else ``empty`` (absent lists and maps are empty)."""
    return f"(has({path}) ? {path} : {empty})"


def _token_extra(key: str) -> str:
    extra = "request.userInfo.extra"
    return f'has({extra}) && "{key}" in {extra} ? {extra}["{key}"] : []'


def _unchanged(field: str, empty: str) -> str:
    return (
        f"{or_empty(f'object.metadata.{field}', empty)} =="
        f" {or_empty(f'oldObject.metadata.{field}', empty)}"
    )


VARIABLES = {
    "isPodUpdate": (
        'request.operation == "UPDATE" && (!has(request.subResource) || request.subResource == "")'
    ),
    "tokenPodName": _token_extra(POD_NAME_EXTRA),
    "tokenPodUid": _token_extra(POD_UID_EXTRA),
    # only an UPDATE has both objects (CREATE has no old one, DELETE no new one)
    "oldAnnotations": (
        f"variables.isPodUpdate ? {or_empty('oldObject.metadata.annotations', '{}')} : {{}}"
    ),
    "newAnnotations": (
        f"variables.isPodUpdate ? {or_empty('object.metadata.annotations', '{}')} : {{}}"
    ),
}

VALIDATIONS = [
    (
        "variables.isPodUpdate",
        "a model pod's service account may only patch pods (no create, delete, subresource"
        " or connect)",
    ),
    (
        "!variables.isPodUpdate || (\n"
        "  size(variables.tokenPodName) == 1 && variables.tokenPodName[0] == request.name &&\n"
        "  size(variables.tokenPodUid) == 1 && variables.tokenPodUid[0] == oldObject.metadata.uid\n"
        ")",
        "a model pod may change only its own pod: the one its service-account token is bound"
        f" to ({POD_NAME_EXTRA} and {POD_UID_EXTRA})",
    ),
    (
        "!variables.isPodUpdate || object.spec == oldObject.spec",
        "a model pod may not change a pod's spec (containers, images, anything)",
    ),
    (
        "!variables.isPodUpdate || (\n"
        + " &&\n".join(
            f"  {_unchanged(field, empty)}"
            for field, empty in (("labels", "{}"), ("finalizers", "[]"), ("ownerReferences", "[]"))
        )
        + "\n)",
        "a model pod may not change a pod's labels, finalizers or owner references",
    ),
    (
        "!variables.isPodUpdate || (\n"
        f"  variables.newAnnotations.all(k, {_K_IS_A_SIDECAR_REPORT} ||\n"
        "    (k in variables.oldAnnotations &&"
        " variables.oldAnnotations[k] == variables.newAnnotations[k])) &&\n"
        f"  variables.oldAnnotations.all(k, {_K_IS_A_SIDECAR_REPORT} ||"
        " k in variables.newAnnotations)\n"
        ")",
        "a model pod may change only the annotations its sidecar owns: "
        + ", ".join(SIDECAR_ANNOTATIONS),
    ),
]


def policy() -> dict[str, Any]:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": POLICY_NAME, "labels": LABELS},
        "spec": {
            "failurePolicy": "Fail",  # an expression that cannot be evaluated denies
            "matchConstraints": {
                "resourceRules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "resources": ["pods", "pods/*"],
                        "operations": ["*"],
                    }
                ]
            },
            "matchConditions": [
                {
                    "name": "model-sidecar-service-account",
                    "expression": f'request.userInfo.username.matches("{SIDECAR_USERNAME}")',
                }
            ],
            "variables": [
                {"name": name, "expression": expression} for name, expression in VARIABLES.items()
            ],
            "validations": [
                {"expression": expression, "message": message, "reason": "Forbidden"}
                for expression, message in VALIDATIONS
            ],
        },
    }


def objects() -> list[dict[str, Any]]:
    """What the cluster needs, in the order to apply it: bound in every namespace, as the
    account names are this project's own."""
    return with_binding(policy())
