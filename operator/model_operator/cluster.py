"""The few Kubernetes API operations the operator performs (plain REST through
:class:`KubeClient`, so the same code runs against a cluster and against kmock in tests)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from enum import Enum
from typing import Any

from model_rollout_contract.pins import pins_text
from model_rollout_contract.tracks import DEFAULT_TRACK, TrackKeys

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
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
}
_MUTABLE = ("spec", "data", "rules", "roleRef", "subjects", "automountServiceAccountToken")
MAX_PARALLEL_PATCHES = 16  # pod annotations written at once: a large fleet never floods


def collection(kind: str, namespace: str) -> str:
    prefix, plural = _PATHS[kind]
    return f"{prefix}/namespaces/{namespace}/{plural}"


class ApplyResult(Enum):
    CREATED = "created"
    UPDATED = "updated"  # it had drifted from what the resource asks
    UNCHANGED = "unchanged"
    FOREIGN = "foreign"  # an object of that name that this resource does not control


def _contains(live: Any, desired: Any) -> bool:
    """Does ``live`` hold everything ``desired`` says? (The API server adds defaults, so
    a live object is compared on the fields the operator writes, lists item by item.)"""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(
            _contains(live.get(key), value) for key, value in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(live) == len(desired)
            and all(_contains(a, b) for a, b in zip(live, desired, strict=True))
        )
    return bool(live == desired)


def _controller_uid(obj: dict[str, Any]) -> str | None:
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return next((r.get("uid") for r in refs if r.get("controller")), None)


async def apply(api: KubeClient, obj: dict[str, Any]) -> ApplyResult:
    """Create ``obj``, or restore what drifted in an object this resource controls. An
    object of the same name that it does not control is left alone (never adopted)."""
    meta = obj["metadata"]
    base = collection(obj["kind"], meta["namespace"])
    existing = await api.request("GET", f"{base}/{meta['name']}")
    if existing is None:
        await api.request("POST", base, obj)
        return ApplyResult.CREATED
    if _controller_uid(existing) != _controller_uid(obj):
        return ApplyResult.FOREIGN
    patch: dict[str, Any] = {
        "metadata": {k: meta[k] for k in ("labels", "annotations", "ownerReferences") if k in meta}
    }
    patch.update({k: obj[k] for k in _MUTABLE if k in obj})
    if _contains(existing, patch):
        return ApplyResult.UNCHANGED
    await api.merge_patch(f"{base}/{meta['name']}", patch)
    return ApplyResult.UPDATED


async def patch_status(
    api: KubeClient, namespace: str, name: str, patch: dict[str, Any]
) -> dict[str, Any]:
    """Merge-patch a ModelDeployment's status; returns the status the server now holds."""
    path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}/status"
    answer = await api.merge_patch(path, {"status": patch})
    return dict((answer or {}).get("status") or {})


async def get_secret(api: KubeClient, namespace: str, name: str) -> dict[str, Any] | None:
    """One Secret by name: the store credentials a ModelDeployment names (get only)."""
    answer = await api.request("GET", f"/api/v1/namespaces/{namespace}/secrets/{name}")
    return dict(answer) if answer is not None else None


async def clear_annotations(
    api: KubeClient, namespace: str, name: str, keys: tuple[str, ...]
) -> None:
    """Remove annotations of a ModelDeployment the operator has acted on (promote, abort,
    retry): each acts once."""
    path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}"
    await api.merge_patch(path, {"metadata": {"annotations": dict.fromkeys(keys)}})


async def set_targets(
    api: KubeClient,
    namespace: str,
    actions: tuple[SetTarget, ...],
    keys: TrackKeys = DEFAULT_TRACK,
    pins: Mapping[str, int] | None = None,
) -> None:
    """Annotate pods with their targets, traffic policies and the track's pinned publish
    sequences (one patch a pod: the sidecar sees them at once), at most
    ``MAX_PARALLEL_PATCHES`` at a time; ``keys``: the track's annotations (a tenant
    model's rollout touches only its own)."""
    limit = asyncio.Semaphore(MAX_PARALLEL_PATCHES)
    pinned = pins_text(pins) if pins else None  # None: removed

    async def one(action: SetTarget) -> None:
        annotations: dict[str, str | None] = {
            keys.target: action.version,
            keys.traffic: action.policy,  # None: removed
            keys.pins: pinned,
        }
        if action.previous:
            annotations[keys.previous] = action.previous
        async with limit:
            await api.merge_patch(
                f"{collection('Pod', namespace)}/{action.pod}",
                {"metadata": {"annotations": annotations}},
            )

    await asyncio.gather(*(one(a) for a in actions))
