"""The ValidatingAdmissionPolicy that keeps a ModelDeployment's rollout editors to steering
its rollouts, written once here as plain dicts (the Helm chart's template is generated
from them, and a test checks it is up to date).

Why a policy on top of RBAC: the day-2 tools (promote, abort, retry, rollback,
``model-rollout release``) need ``patch`` on modeldeployments, and RBAC cannot say which
fields a patch may touch. With ``patch`` alone, the chart's rollout-editor role could
rewrite the whole spec: one editor patch once produced pods running another image, the
sidecar with ``--allow-unsigned`` and a Secret mounted (issue 29).

Who it applies to: every update of a ModelDeployment by a user whom the API server's own
authorizer does not allow the custom verb :data:`CONFIGURE_VERB` on that resource (an
RBAC rule may name any verb; the chart grants this one to its owner role and to the
operator, and ``*`` grants it too, so cluster admins and GitOps controllers bound to
``*`` keep full edit). What such a user may change: ``spec.version``, ``spec.paused``
(``kubectl model pause`` and ``resume``: whoever may promote or abort may hold a rollout)
and the rollout annotations the tools write (:data:`EDITOR_ANNOTATIONS`), nothing else of
the spec, the labels, the other annotations, the owner references or the finalizers. The status is a
subresource the policy does not match (RBAC keeps it the operator's); create and delete
are RBAC's alone (the editor role has neither), so the namespace controller's deletes
are never judged here.

Finalizers: once the resource is being deleted, removing finalizers is allowed to anyone,
as the garbage collector (which has no reason to hold the verb) removes
``foregroundDeletion`` and ``orphan`` from a resource deleted so; only removals, since the
API server adds none once deletion has begun.
"""

from __future__ import annotations

from typing import Any

from model_rollout_contract.annotations import ABORT, CHANGE_CAUSE, PROMOTE, RETRY
from model_rollout_contract.tracks import TRACK_PATTERN

from .admission_policy import literal_pattern, or_empty
from .constants import GROUP, PLURAL, VERSION
from .policy_binding import LABELS, with_binding

POLICY_NAME = "model-rollout-rollout-editors"
# the RBAC verb that allows changing any field (the chart's owner role and the operator)
CONFIGURE_VERB = "configure"
# the spec fields a rollout editor may change: version (release, rollback) and paused
# (pause, resume)
EDITOR_SPEC_FIELDS = ("version", "paused")
# every other field of the CRD's spec (a test checks this is the CRD's list): each must
# stay as it was. The spec keeps no unknown fields (no x-kubernetes-preserve-unknown-fields),
# so these are all there can be.
SPEC_FIELDS = (
    "model", "image", "sidecarImage", "replicas", "backend", "precision", "store",
    "resources", "canary", "rollout", "retainVersions", "signingPublicKeySecret",
    "allowUnsigned", "tenants", "sidecar", "server", "logging", "pod",
)  # fmt: skip
# the annotations the tools write: promote, abort and retry (the default track's and each
# tenant track's ``.<track>``) and the one change-cause
TRACKED = (PROMOTE, ABORT, RETRY)
EDITOR_ANNOTATIONS = (*TRACKED, *(f"{key}.<track>" for key in TRACKED), CHANGE_CAUSE)
_TRACK = f"(?:[.](?:{TRACK_PATTERN.pattern}))?"
EDITOR_ANNOTATION_PATTERN = (
    "^(?:"
    + "|".join([*(literal_pattern(key) + _TRACK for key in TRACKED), literal_pattern(CHANGE_CAUSE)])
    + ")$"
)
_K_IS_AN_EDITORS = f'k.matches("{EDITOR_ANNOTATION_PATTERN}")'

_MAY_CONFIGURE = (
    f'authorizer.group("{GROUP}").resource("{PLURAL}").namespace(request.namespace)'
    f'.name(request.name).check("{CONFIGURE_VERB}").allowed()'
)


def _when(changed: str, what: str) -> str:
    """``[what]`` when ``changed`` holds, else no name."""
    return f'(({changed}) ? ["{what}"] : [])'


def _spec_field_changed(field: str) -> str:
    new, old = f"object.spec.{field}", f"oldObject.spec.{field}"
    return _when(f"has({new}) != has({old}) || (has({new}) && {new} != {old})", f"spec.{field}")


def _metadata_changed(field: str, empty: str) -> str:
    return _when(
        f"{or_empty(f'object.metadata.{field}', empty)} !="
        f" {or_empty(f'oldObject.metadata.{field}', empty)}",
        f"metadata.{field}",
    )


_ANNOTATIONS_CHANGED = (
    f"variables.newAnnotations.filter(k, !{_K_IS_AN_EDITORS} &&"
    " (!(k in variables.oldAnnotations) ||"
    " variables.oldAnnotations[k] != variables.newAnnotations[k]))"
    '.map(k, "metadata.annotations[" + k + "]") +\n'
    f"variables.oldAnnotations.filter(k, !{_K_IS_AN_EDITORS} && !(k in variables.newAnnotations))"
    '.map(k, "metadata.annotations[" + k + "]")'
)
_FINALIZERS_CHANGED = _when(
    "has(oldObject.metadata.deletionTimestamp) ?"
    " !variables.newFinalizers.all(f, f in variables.oldFinalizers) :"
    " variables.newFinalizers != variables.oldFinalizers",
    "metadata.finalizers",
)

VARIABLES = {
    "oldAnnotations": or_empty("oldObject.metadata.annotations", "{}"),
    "newAnnotations": or_empty("object.metadata.annotations", "{}"),
    "oldFinalizers": or_empty("oldObject.metadata.finalizers", "[]"),
    "newFinalizers": or_empty("object.metadata.finalizers", "[]"),
    # what the request changes beyond an editor's fields, by name, for the refusal
    "changed": " +\n".join(
        [
            *(_spec_field_changed(field) for field in SPEC_FIELDS),
            _metadata_changed("labels", "{}"),
            _ANNOTATIONS_CHANGED,
            _FINALIZERS_CHANGED,
            _metadata_changed("ownerReferences", "[]"),
        ]
    ),
}

_ALLOWED = (
    "a rollout editor may change only "
    + " and ".join(f"spec.{field}" for field in EDITOR_SPEC_FIELDS)
    + " of a ModelDeployment and its"
    f" rollout annotations {PROMOTE}, /{ABORT.partition('/')[2]}, /{RETRY.partition('/')[2]}"
    f" (each also as .<track>) and /{CHANGE_CAUSE.partition('/')[2]}"
)
_NEEDS = (
    f"changing anything else needs the verb '{CONFIGURE_VERB}' on {PLURAL}.{GROUP}"
    " (the chart's owner role)"
)
MESSAGE = f"{_ALLOWED}; {_NEEDS}"
# the same, naming what the request changed (the API server falls back to MESSAGE if
# this cannot be evaluated)
MESSAGE_EXPRESSION = (
    f'"{_ALLOWED}; this request also changes " + variables.changed.join(", ") + "; {_NEEDS}"'
)


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
                        "apiGroups": [GROUP],
                        # the CRD's version, so that the API server type-checks against
                        # its schema; a request to another version is matched too (the
                        # default matchPolicy: Equivalent)
                        "apiVersions": [VERSION],
                        # the resource itself: not /status (the operator's, by RBAC)
                        "resources": [PLURAL],
                        "operations": ["UPDATE"],
                    }
                ]
            },
            "matchConditions": [
                {"name": f"may-not-{CONFIGURE_VERB}", "expression": f"!{_MAY_CONFIGURE}"}
            ],
            "variables": [
                {"name": name, "expression": expression} for name, expression in VARIABLES.items()
            ],
            "validations": [
                {
                    "expression": "size(variables.changed) == 0",
                    "message": MESSAGE,
                    "messageExpression": MESSAGE_EXPRESSION,
                    "reason": "Forbidden",
                }
            ],
        },
    }


def objects() -> list[dict[str, Any]]:
    """What the cluster needs, in the order to apply it: bound in every namespace, as a
    ModelDeployment anywhere is this project's."""
    return with_binding(policy())
