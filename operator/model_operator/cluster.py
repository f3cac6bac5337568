"""The few Kubernetes API operations the operator performs (plain REST through
:class:`KubeClient`, so the same code runs against a cluster and against kmock in tests)."""

from __future__ import annotations

import asyncio
from typing import Any

from model_rollout_contract.annotations import PREVIOUS_VERSION, PROMOTE, TARGET_VERSION

from .constants import GROUP, PLURAL, VERSION
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
MAX_PARALLEL_PATCHES = 16  # pod annotations written at once: a large fleet never floods


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


async def patch_status(
    api: KubeClient, namespace: str, name: str, patch: dict[str, Any]
) -> dict[str, Any]:
    """Merge-patch a ModelDeployment's status; returns the status the server now holds."""
    path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}/status"
    answer = await api.merge_patch(path, {"status": patch})
    return dict((answer or {}).get("status") or {})


async def clear_promotion(api: KubeClient, namespace: str, name: str) -> None:
    path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}"
    await api.merge_patch(path, {"metadata": {"annotations": {PROMOTE: None}}})


async def set_targets(api: KubeClient, namespace: str, actions: tuple[SetTarget, ...]) -> None:
    """Annotate pods with their targets, at most ``MAX_PARALLEL_PATCHES`` at a time."""
    limit = asyncio.Semaphore(MAX_PARALLEL_PATCHES)

    async def one(action: SetTarget) -> None:
        annotations = {TARGET_VERSION: action.version}
        if action.previous:
            annotations[PREVIOUS_VERSION] = action.previous
        async with limit:
            await api.merge_patch(
                f"{collection('Pod', namespace)}/{action.pod}",
                {"metadata": {"annotations": annotations}},
            )

    await asyncio.gather(*(one(a) for a in actions))
