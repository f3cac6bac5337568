"""The few Kubernetes API operations the operator performs (plain REST through
:class:`KubeClient`, so the same code runs against a cluster and against kmock in tests)."""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import quote

from model_rollout_contract.annotations import DEPLOYMENT_LABEL, PREVIOUS_VERSION, TARGET_VERSION

from .kube_client import KubeClient
from .planner import SetTarget

_PATHS = {
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "Service": ("/api/v1", "services"),
    "Pod": ("/api/v1", "pods"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
}
_MUTABLE = ("spec", "data", "rules", "roleRef", "subjects")


def collection(kind: str, namespace: str) -> str:
    prefix, plural = _PATHS[kind]
    return f"{prefix}/namespaces/{namespace}/{plural}"


async def apply(api: KubeClient, obj: dict[str, Any]) -> None:
    """Create ``obj``, or merge-patch its labels, annotations, owners and content."""
    meta = obj["metadata"]
    base = collection(obj["kind"], meta["namespace"])
    existing = await api.request("GET", f"{base}/{meta['name']}")
    if existing is None:
        await api.request("POST", base, obj)
        return
    patch: dict[str, Any] = {
        "metadata": {k: meta[k] for k in ("labels", "annotations", "ownerReferences") if k in meta}
    }
    patch.update({k: obj[k] for k in _MUTABLE if k in obj})
    await api.merge_patch(f"{base}/{meta['name']}", patch)


async def list_pods(api: KubeClient, namespace: str, deployment: str) -> list[dict[str, Any]]:
    selector = quote(f"{DEPLOYMENT_LABEL}={deployment}")
    answer = await api.request("GET", f"{collection('Pod', namespace)}?labelSelector={selector}")
    items = (answer or {}).get("items", [])
    # filter here too: the selector is a hint some API servers (and test doubles) ignore
    return [
        p
        for p in items
        if (p.get("metadata", {}).get("labels") or {}).get(DEPLOYMENT_LABEL) == deployment
        and not p.get("metadata", {}).get("deletionTimestamp")
    ]


async def set_targets(api: KubeClient, namespace: str, actions: tuple[SetTarget, ...]) -> None:
    async def one(action: SetTarget) -> None:
        annotations = {TARGET_VERSION: action.version}
        if action.previous:
            annotations[PREVIOUS_VERSION] = action.previous
        await api.merge_patch(
            f"{collection('Pod', namespace)}/{action.pod}",
            {"metadata": {"annotations": annotations}},
        )

    await asyncio.gather(*(one(a) for a in actions))
