"""A stateful Kubernetes API over HTTP (kmock's ``KubernetesEmulator``) with every
resource the operator and the harness use, plus a small client for tests and the demo."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timezone
from typing import Any

import jsonpatch
import kmock

from model_sidecar.kube import KubeApi

VERBS = ["list", "watch", "get", "patch", "create", "update", "delete"]
RESOURCES: dict[str, dict[str, Any]] = {
    "serving.model-rollout.io/v1alpha1/modeldeployments": {
        "kind": "ModelDeployment",
        "namespaced": True,
        "subresources": {"status"},
        "shortnames": {"md"},
    },
    "v1/namespaces": {"kind": "Namespace", "namespaced": False},
    "apiextensions.k8s.io/v1/customresourcedefinitions": {
        "kind": "CustomResourceDefinition",
        "namespaced": False,
    },
    "v1/pods": {"kind": "Pod", "namespaced": True, "subresources": {"status"}},
    "v1/services": {"kind": "Service", "namespaced": True},
    "v1/configmaps": {"kind": "ConfigMap", "namespaced": True},
    "v1/serviceaccounts": {"kind": "ServiceAccount", "namespaced": True},
    "v1/events": {"kind": "Event", "namespaced": True},
    "apps/v1/deployments": {"kind": "Deployment", "namespaced": True, "subresources": {"status"}},
    "rbac.authorization.k8s.io/v1/roles": {"kind": "Role", "namespaced": True},
    "rbac.authorization.k8s.io/v1/rolebindings": {"kind": "RoleBinding", "namespaced": True},
    "rbac.authorization.k8s.io/v1/clusterroles": {"kind": "ClusterRole", "namespaced": False},
    "rbac.authorization.k8s.io/v1/clusterrolebindings": {
        "kind": "ClusterRoleBinding",
        "namespaced": False,
    },
    "v1/secrets": {"kind": "Secret", "namespaced": True},
}
MD_PATH = "/apis/serving.model-rollout.io/v1alpha1/namespaces/{ns}/modeldeployments"


class ApiServerEmulator(kmock.KubernetesEmulator):
    """kmock's emulator plus the metadata a real API server maintains: ``uid``,
    ``creationTimestamp``, a ``resourceVersion`` bumped on every write, and a
    ``generation`` bumped when ``spec`` changes (not on ``/status`` writes)."""

    _versions = itertools.count(1)

    def _stamp(self, request: Any) -> None:
        if request.resource is None or request.data is None:
            return
        version = str(next(self._versions))
        if request.action == kmock.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:5]}"
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault(
                "creationTimestamp", datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            )
            meta.setdefault("generation", 1)
            meta["resourceVersion"] = version
        elif request.action == kmock.action.UPDATE and request.name is not None:
            if isinstance(request.data, list):  # JSON patch
                request.data.append(
                    {"op": "add", "path": "/metadata/resourceVersion", "value": version}
                )
            elif isinstance(request.data, dict):  # merge patch
                meta = request.data.setdefault("metadata", {})
                meta["resourceVersion"] = version
                if "spec" in request.data and not request.subresource:
                    current = self._current(request)
                    meta["generation"] = int(current.get("generation", 1)) + 1

    def _current(self, request: Any) -> dict[str, Any]:
        for (resource, namespace, name), obj in self.objects.items():
            if (resource, namespace, name) == (
                request.resource,
                request.namespace,
                request.name,
            ) and not obj.deleted:
                return dict(obj.raw.get("metadata", {}))
        return {}

    async def _serve_version(self, request: Any) -> Any:
        """Discovery of one group version; the core group is ``v1``, not ``/v1``."""
        payload = await super()._serve_version(request)
        if isinstance(payload, dict) and payload.get("groupVersion", "").startswith("/"):
            payload = {**payload, "groupVersion": payload["groupVersion"].lstrip("/")}
        return payload

    async def _handle(self, request: Any) -> Any:
        self._stamp(request)
        try:
            return await super()._handle(request)
        except jsonpatch.JsonPatchException as exc:
            # a failed "test" op (optimistic concurrency): 422, as a real API server answers
            raise kmock.KubernetesError(422, "Invalid", str(exc)) from exc


@contextlib.asynccontextmanager
async def kube_emulator() -> AsyncIterator[KubeApi]:
    """Serve an empty emulated cluster on 127.0.0.1; yields a client pointed at it."""
    emulator = ApiServerEmulator()
    for key, info in RESOURCES.items():
        emulator.resources[key] = kmock.ResourceInfo(verbs=VERBS, **info)
    async with emulator, kmock.Server(emulator) as server:
        yield KubeApi(str(server.url).rstrip("/"))


async def create_model_deployment(api: KubeApi, namespace: str, body: dict[str, Any]) -> Any:
    body = {"apiVersion": "serving.model-rollout.io/v1alpha1", "kind": "ModelDeployment", **body}
    body["metadata"] = {"namespace": namespace, **body.get("metadata", {})}
    return await api.request("POST", MD_PATH.format(ns=namespace), body)


async def get_model_deployment(api: KubeApi, namespace: str, name: str) -> Any:
    return await api.request("GET", f"{MD_PATH.format(ns=namespace)}/{name}")


async def patch_model_deployment(
    api: KubeApi, namespace: str, name: str, patch: dict[str, Any]
) -> Any:
    return await api.merge_patch(f"{MD_PATH.format(ns=namespace)}/{name}", patch)


async def list_objects(api: KubeApi, path: str) -> list[dict[str, Any]]:
    answer = await api.request("GET", path)
    return list((answer or {}).get("items", []))


async def wait_for_status(
    api: KubeApi,
    namespace: str,
    name: str,
    predicate: Callable[[dict[str, Any]], bool],
    timeout_s: float,
    on_status: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Poll a ModelDeployment's status until ``predicate`` holds; TimeoutError otherwise."""
    deadline = time.monotonic() + timeout_s
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        md = await get_model_deployment(api, namespace, name)
        status = dict((md or {}).get("status") or {})
        if on_status is not None:
            on_status(status)
        if predicate(status):
            return status
        await asyncio.sleep(0.1)
    raise TimeoutError(f"status of {namespace}/{name} never matched; last: {status}")
