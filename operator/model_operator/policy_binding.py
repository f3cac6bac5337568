"""How each of this project's ValidatingAdmissionPolicies is installed: the labels its
objects carry, and a binding that applies it, denying, in every namespace (the sidecar
policy, :mod:`.admission_policy`, and the rollout editors', :mod:`.editor_policy`), so
that both are installed alike."""

from __future__ import annotations

from typing import Any

LABELS = {"app.kubernetes.io/part-of": "model-rollout"}


def binding(policy_name: str) -> dict[str, Any]:
    """The binding of policy ``policy_name``: every namespace, denials refuse the request."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": policy_name, "labels": LABELS},
        "spec": {"policyName": policy_name, "validationActions": ["Deny"]},
    }


def with_binding(policy: dict[str, Any]) -> list[dict[str, Any]]:
    """``policy`` and its binding: what the cluster needs, in the order to apply it."""
    return [policy, binding(policy["metadata"]["name"])]
