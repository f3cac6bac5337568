"""The few Kubernetes API operations the operator performs (plain REST through
:class:`KubeClient`, so the same code runs against a cluster and against kmock in tests)."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Mapping
from datetime import datetime, timezone
from enum import Enum
from typing import Any

from model_rollout_contract.pins import pins_text
from model_rollout_contract.tracks import DEFAULT_TRACK, TrackKeys

from .constants import GROUP, PLURAL, VERSION
from .errors import ApiError, ResourceGone
from .kube_client import KubeClient
from .manifests import OWNED_FIELDS, SPEC_KEYS, TEMPLATE_DIGEST
from .placement import quantity
from .planner import SetTarget
from .status import merge_patch

_PATHS = {
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "Service": ("/api/v1", "services"),
    "Pod": ("/api/v1", "pods"),
    "Event": ("/api/v1", "events"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
}
_MUTABLE = ("spec", "data", "rules", "roleRef", "subjects", "automountServiceAccountToken")
MAX_PARALLEL_PATCHES = 16  # pod annotations written at once: a large fleet never floods
# the fields under which the API server keeps resource quantities in its canonical form
# (a limit of 1 GPU written as 1 is stored as "1", 1024Mi as "1Gi", 0.5 CPU as "500m")
_QUANTITY_FIELDS = frozenset({"limits", "requests", "sizeLimit"})


def collection(kind: str, namespace: str) -> str:
    prefix, plural = _PATHS[kind]
    return f"{prefix}/namespaces/{namespace}/{plural}"


class ApplyResult(Enum):
    CREATED = "created"
    UPDATED = "updated"  # it had drifted from what the resource asks
    UNCHANGED = "unchanged"
    FOREIGN = "foreign"  # an object of that name that this resource does not control


def _contains(live: Any, desired: Any, quantities: bool = False, added: bool = False) -> bool:
    """Does ``live`` hold everything ``desired`` says? (The API server adds defaults, so
    a live object is compared on the fields the operator writes, lists item by item;
    resource quantities by value, as the server rewrites them in its canonical form.)
    ``added``: a list may hold other items between the desired ones, in their order
    (what a mutating webhook appends to a list the spec gives)."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(
            _contains(live.get(key), value, quantities or key in _QUANTITY_FIELDS, added)
            for key, value in desired.items()
        )
    if isinstance(desired, list):
        if not isinstance(live, list):
            return False
        if added:  # each desired item found after the last one's (an iterator consumed)
            rest = iter(live)
            return all(any(_contains(a, b, quantities, added) for a in rest) for b in desired)
        return len(live) == len(desired) and all(
            _contains(a, b, quantities) for a, b in zip(live, desired, strict=True)
        )
    if quantities and live != desired:
        value = quantity(desired)
        return value is not None and value == quantity(live)
    return bool(live == desired)


def _controller_uid(obj: dict[str, Any]) -> str | None:
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return next((r.get("uid") for r in refs if r.get("controller")), None)


async def apply(api: KubeClient, obj: dict[str, Any]) -> ApplyResult:
    """Create ``obj``, or restore what drifted in an object this resource controls. An
    object of the same name that it does not control is left alone (never adopted). A
    Deployment's pod template is written only when the template the operator rendered
    changed (its :data:`~.manifests.TEMPLATE_DIGEST`) or the live one lacks what it gives
    (an edit by hand), not whenever the live one differs: a mutating webhook's additions
    to it (a toleration appended to the spec's) would be taken away on every pass and
    written back by the webhook."""
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
    patch = with_removals(existing, patch, obj["kind"])
    if obj["kind"] == "Deployment" and _same_template(existing, obj):
        patch["spec"] = {k: v for k, v in patch["spec"].items() if k != "template"}
    if _contains(existing, patch):
        return ApplyResult.UNCHANGED
    await api.merge_patch(f"{base}/{meta['name']}", patch)
    return ApplyResult.UPDATED


def _same_template(live: dict[str, Any], desired: dict[str, Any]) -> bool:
    """Does the live Deployment run the pod template ``desired`` renders: the digest the
    operator stamped on both, and every field it gives still there (another tool's
    additions aside; a field edited by hand is not)? (None stamped: an older operator's,
    compared whole.)"""
    path = ("metadata", "annotations", TEMPLATE_DIGEST)
    template = ("spec", "template")
    return (
        _at(desired, path) is not None
        and _at(live, path) == _at(desired, path)
        and _contains(_at(live, template), _at(desired, template), added=True)
    )


def _at(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def _put(obj: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    *parents, last = path
    for key in parents:
        obj = obj.setdefault(key, {})
    obj[last] = value


def _recorded(obj: Any) -> dict[str, list[str]]:
    """The :data:`~.manifests.SPEC_KEYS` record of a child (none: an empty one)."""
    try:
        record = json.loads(str(_at(obj, ("metadata", "annotations", SPEC_KEYS)) or "{}"))
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def with_removals(existing: dict[str, Any], patch: dict[str, Any], kind: str) -> dict[str, Any]:
    """``patch`` with what must go from ``existing`` as nulls (a merge patch's deletion):
    the keys the spec dropped of the fields the operator owns whole
    (:data:`~.manifests.OWNED_FIELDS`), and the keys of shared maps (and the pod spec's
    fields) that the spec gave before and gives no more (:data:`~.manifests.SPEC_KEYS`):
    never what only another tool wrote, which a mutating webhook would write back after
    each removal."""
    patch = copy.deepcopy(patch)
    for path in OWNED_FIELDS.get(kind, ()):
        live, want = _at(existing, path), _at(patch, path)
        if isinstance(live, dict) and isinstance(want, dict):
            _put(patch, path, merge_patch(live, want))
    now = _recorded(patch)
    # a map's keys before the fields that hold it: a field removed whole (the node
    # selector) is not then reached into
    recorded = sorted(_recorded(existing).items(), key=lambda item: -str(item[0]).count("."))
    for dotted, keys in recorded:
        path = tuple(dotted.split("."))
        live = _at(existing, path)
        if not isinstance(live, dict) or not isinstance(keys, list):
            continue
        for key in set(keys) - set(now.get(dotted) or ()) - {SPEC_KEYS}:
            if key in live:
                _put(patch, (*path, key), None)
    return patch


async def _owned_deployment(
    api: KubeClient, namespace: str, name: str, owner_uid: str | None
) -> tuple[str, dict[str, Any] | None]:
    """The Deployment ``name``'s path, and the live object if this resource
    (``owner_uid``) controls it (``None``: gone, or another tool's)."""
    path = f"{collection('Deployment', namespace)}/{name}"
    live = await api.request("GET", path)
    return path, live if live is not None and _controller_uid(live) == owner_uid else None


async def owned_deployment(
    api: KubeClient, namespace: str, name: str, owner_uid: str | None
) -> dict[str, Any] | None:
    """The Deployment ``name`` if this resource (``owner_uid``) controls it."""
    return (await _owned_deployment(api, namespace, name, owner_uid))[1]


async def scale_deployment(
    api: KubeClient, namespace: str, name: str, owner_uid: str, replicas: int
) -> bool:
    """Set the pods of an existing Deployment this resource controls (its template left
    as it is: an older pod template's Deployment during a template rollout). ``False``:
    there is none to scale."""
    path, live = await _owned_deployment(api, namespace, name, owner_uid)
    if live is None:
        return False
    if (live.get("spec") or {}).get("replicas") != replicas:
        await api.merge_patch(path, {"spec": {"replicas": replicas}})
    return True


async def delete_deployment(api: KubeClient, namespace: str, name: str, owner_uid: str) -> None:
    """Delete a Deployment this resource controls (one no pod template needs any more),
    its pods with it; one it does not control, or gone already, is left."""
    path, live = await _owned_deployment(api, namespace, name, owner_uid)
    if live is not None:
        await api.request("DELETE", path, {"propagationPolicy": "Background"})


async def pods_refused(
    api: KubeClient, namespace: str, name: str, owner_uid: str | None
) -> str | None:
    """Why the API server refuses the Deployment's pods (a priority class that does not
    exist, a quota, an admission webhook), as its ``ReplicaFailure`` condition says; no
    such pod waits for a node, so only the Deployment tells. ``None``: none refused, or
    the Deployment of that name is not this resource's (``owner_uid``'s: another tool's,
    whose refusals are not these pods')."""
    _, live = await _owned_deployment(api, namespace, name, owner_uid)
    for found in ((live or {}).get("status") or {}).get("conditions") or []:
        if found.get("type") == "ReplicaFailure" and found.get("status") == "True":
            return str(found.get("message") or found.get("reason") or "FailedCreate")
    return None


async def replace_status(
    api: KubeClient, namespace: str, name: str, uid: str, status: dict[str, Any]
) -> dict[str, Any]:
    """Write a ModelDeployment's whole status, onto the object ``uid`` only: a JSON patch
    that tests ``metadata.uid`` first, so that a status worked out for a resource that was
    deleted (and maybe created again under the same name) never lands on another one.
    Returns the status the server now holds; raises :class:`ResourceGone`."""
    path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}"
    patch = [
        {"op": "test", "path": "/metadata/uid", "value": uid},
        {"op": "add", "path": "/status", "value": status},
    ]
    try:
        answer = await api.request("PATCH", f"{path}/status", patch, "application/json-patch+json")
    except ApiError as exc:
        if exc.status not in (409, 422):
            raise
        live = await api.request("GET", path)  # the test failed, or the status is refused
        if live is None or (live.get("metadata") or {}).get("uid") != uid:
            raise ResourceGone(f"{namespace}/{name} (uid {uid}) is gone") from exc
        raise
    if answer is None:
        raise ResourceGone(f"{namespace}/{name} (uid {uid}) is gone")
    return dict(answer.get("status") or {})


async def get_secret(api: KubeClient, namespace: str, name: str) -> dict[str, Any] | None:
    """One Secret by name: the store credentials a ModelDeployment names (get only)."""
    answer = await api.request("GET", f"/api/v1/namespaces/{namespace}/secrets/{name}")
    return dict(answer) if answer is not None else None


async def read_status(api: KubeClient, namespace: str, name: str, uid: str) -> dict[str, Any]:
    """A ModelDeployment's status as the API server holds it now (not the watch's copy,
    which can lag behind the operator's own writes). Raises :class:`ResourceGone` when
    the object ``uid`` is gone."""
    path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}"
    answer = await api.request("GET", path)
    if answer is None or (answer.get("metadata") or {}).get("uid") != uid:
        raise ResourceGone(f"{namespace}/{name} (uid {uid}) is gone")
    return dict(answer.get("status") or {})


async def read_annotations(api: KubeClient, namespace: str, name: str) -> dict[str, str]:
    """A ModelDeployment's annotations as the API server holds them now (not the watch's
    copy, which can lag behind the operator's own writes); none if it is gone."""
    path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}"
    answer = await api.request("GET", path)
    return dict(((answer or {}).get("metadata") or {}).get("annotations") or {})


async def clear_annotations(
    api: KubeClient, namespace: str, name: str, uid: str, keys: tuple[str, ...]
) -> None:
    """Remove annotations of a ModelDeployment the operator has acted on (promote, abort,
    retry): each acts once. Only from the object ``uid`` (a JSON patch that tests it, as
    :func:`replace_status`): one created again under the name keeps its own. Raises
    :class:`ResourceGone`."""
    path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}"
    for attempt in range(2):  # again if one was removed meanwhile (a 422 for its 'remove')
        live = await api.request("GET", path)
        if live is None or (live.get("metadata") or {}).get("uid") != uid:
            raise ResourceGone(f"{namespace}/{name} (uid {uid}) is gone")
        present = [k for k in keys if k in ((live.get("metadata") or {}).get("annotations") or {})]
        if not present:
            return
        patch = [
            {"op": "test", "path": "/metadata/uid", "value": uid},
            *({"op": "remove", "path": f"/metadata/annotations/{_pointer(k)}"} for k in present),
        ]
        try:
            await api.request("PATCH", path, patch, "application/json-patch+json")
            return
        except ApiError as exc:
            if exc.status != 422 or attempt:
                raise


def _pointer(key: str) -> str:
    """``key`` as one JSON pointer segment (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")


async def remove_finalizer(
    api: KubeClient, namespace: str, name: str, finalizers: list[str], finalizer: str
) -> None:
    """Remove ``finalizer`` from a ModelDeployment whose finalizers are ``finalizers``
    (a JSON patch that tests them first: one changed meanwhile is a 422, not lost)."""
    path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}"
    patch = [
        {"op": "test", "path": "/metadata/finalizers", "value": finalizers},
        {"op": "replace", "path": "/metadata/finalizers",
         "value": [f for f in finalizers if f != finalizer]},
    ]  # fmt: skip
    await api.request("PATCH", path, patch, "application/json-patch+json")


EVENT_COMPONENT = "model-rollout-operator"  # the Events' source (kubectl's "From")
MAX_EVENT_MESSAGE = 1024  # longer messages are cut in the middle


async def post_event(
    api: KubeClient,
    owner: dict[str, Any],
    reason: str,
    message: str,
    warning: bool = False,
    instance: str = "",
) -> None:
    """A core/v1 Event about ``owner`` (a ModelDeployment), as ``kubectl describe`` and
    ``kubectl get events`` show them; ``instance``: this operator replica."""
    meta = owner.get("metadata", {})
    if len(message) > MAX_EVENT_MESSAGE:
        half = MAX_EVENT_MESSAGE // 2 - 2
        message = f"{message[:half]}...{message[-half:]}"
    now = datetime.now(timezone.utc)
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta.get('name')}.", "namespace": meta.get("namespace")},
        "involvedObject": {
            "apiVersion": owner.get("apiVersion"),
            "kind": owner.get("kind"),
            "name": meta.get("name"),
            "namespace": meta.get("namespace"),
            "uid": meta.get("uid"),
        },
        "type": "Warning" if warning else "Normal",
        "reason": reason,
        "message": message,
        "action": reason,
        "source": {"component": EVENT_COMPONENT},
        "reportingComponent": EVENT_COMPONENT,
        "reportingInstance": instance or EVENT_COMPONENT,
        "firstTimestamp": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "lastTimestamp": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "eventTime": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "count": 1,
    }
    await api.request("POST", f"{collection('Event', str(meta.get('namespace')))}", event)


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
