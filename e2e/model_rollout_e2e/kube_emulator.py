"""A stateful Kubernetes API over HTTP (kmock's ``KubernetesEmulator``) with every
resource the operator and the harness use, plus a small client for tests and the demo.

On top of kmock, it keeps what clients of a real API server rely on: a
``resourceVersion`` on every write and on lists, watches that resume from a
``resourceVersion`` (and answer 410 Gone once it has been compacted away),
``fieldSelector``/``labelSelector`` on lists and watches, and ``timeoutSeconds`` on
watches."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import jsonpatch
import kmock

from .api_client import HarnessApi

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
    "coordination.k8s.io/v1/leases": {"kind": "Lease", "namespaced": True},
    "policy/v1/poddisruptionbudgets": {"kind": "PodDisruptionBudget", "namespaced": True},
    "admissionregistration.k8s.io/v1/validatingadmissionpolicies": {
        "kind": "ValidatingAdmissionPolicy",
        "namespaced": False,
    },
    "admissionregistration.k8s.io/v1/validatingadmissionpolicybindings": {
        "kind": "ValidatingAdmissionPolicyBinding",
        "namespaced": False,
    },
}


def _selected(params: Any, raw: dict[str, Any]) -> bool:
    """Does ``raw`` match the request's ``fieldSelector`` and ``labelSelector``?
    (equality, inequality and existence terms: what this project's clients send)."""
    meta = raw.get("metadata", {})
    involved = raw.get("involvedObject") or {}  # an Event's subject
    fields = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "involvedObject.name": involved.get("name"),
        "involvedObject.kind": involved.get("kind"),
    }
    labels = meta.get("labels") or {}
    for selector, values in (
        (params.get("fieldSelector"), fields),
        (params.get("labelSelector"), labels),
    ):
        for term in filter(None, (selector or "").split(",")):
            if "!=" in term:
                key, value = term.split("!=", 1)
                if values.get(key.strip()) == value.strip():
                    return False
            elif "=" in term:
                key, value = term.replace("==", "=").split("=", 1)
                if values.get(key.strip()) != value.strip():
                    return False
            elif term.strip() not in values:
                return False
    return True


def _version(raw: dict[str, Any]) -> int:
    value = str(raw.get("metadata", {}).get("resourceVersion") or "0")
    return int(value) if value.isdigit() else 0


MD_PATH = "/apis/serving.model-rollout.io/v1alpha1/namespaces/{ns}/modeldeployments"


class ApiServerEmulator(kmock.KubernetesEmulator):
    """kmock's emulator plus the metadata a real API server maintains: ``uid``,
    ``creationTimestamp``, a ``resourceVersion`` bumped on every write, and a
    ``generation`` bumped when ``spec`` changes (not on ``/status`` writes)."""

    _versions = itertools.count(1)
    last_version = 0  # the newest resourceVersion handed out
    compacted_before = 0  # watches resuming from an older resourceVersion get 410 Gone

    def compact(self) -> None:
        """Forget history, as etcd compaction does: resuming watches must re-list."""
        self.compacted_before = self.last_version + 1

    def _stamp(self, request: Any) -> None:
        if request.resource is None or request.data is None:
            return
        self.last_version = next(self._versions)
        version = str(self.last_version)
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

    async def _serve_list(self, request: Any) -> Any:
        payload: Any = await super()._serve_list(request)  # kmock's payloads are loosely typed
        payload["metadata"]["resourceVersion"] = str(self.last_version)
        payload["items"] = [o for o in payload["items"] if _selected(request.params, o)]
        return payload

    async def _serve_watch(self, request: Any) -> AsyncIterator[Any]:
        params = request.params
        raw_since = str(params.get("resourceVersion") or "")
        since = int(raw_since) if raw_since.isdigit() else 0
        if since and since < self.compacted_before:
            yield b""
            yield {
                "type": "ERROR",
                "object": {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "status": "Failure",
                    "reason": "Expired",
                    "code": 410,
                    "message": f"too old resource version: {since} ({self.compacted_before})",
                },
            }
            return
        timeout = float(params.get("timeoutSeconds") or 0)
        deadline = time.monotonic() + timeout if timeout else None
        events: Any = super()._serve_watch(request)
        try:
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                try:
                    item = await asyncio.wait_for(events.__anext__(), left)
                except (StopAsyncIteration, asyncio.TimeoutError):
                    return
                if isinstance(item, dict):
                    raw = item.get("object") or {}
                    if not _selected(params, raw):
                        continue
                    if since and item.get("type") == "ADDED" and _version(raw) <= since:
                        continue  # kmock replays what exists; a resumed watch has seen it
                yield item
        finally:
            await events.aclose()

    async def _handle(self, request: Any) -> Any:
        # kmock keeps every request for assertions and matches each new one against that
        # whole history (quadratic: 67 ms a PATCH after 1000 of them, 191 ms after 2000);
        # this emulator serves long runs and asserts on objects, not on requests
        del self._requests[:-1]
        self._stamp(request)
        try:
            return await super()._handle(request)
        except jsonpatch.JsonPatchException as exc:
            # a failed "test" op (optimistic concurrency): 422, as a real API server answers
            raise kmock.KubernetesError(422, "Invalid", str(exc)) from exc


@dataclass(frozen=True)
class EmulatedCluster(HarnessApi):
    """A client of the emulated API, with a handle on the emulator (for faults)."""

    emulator: ApiServerEmulator | None = None


@contextlib.asynccontextmanager
async def kube_emulator() -> AsyncIterator[EmulatedCluster]:
    """Serve an empty emulated cluster on 127.0.0.1; yields a client pointed at it."""
    emulator = ApiServerEmulator()
    for key, info in RESOURCES.items():
        emulator.resources[key] = kmock.ResourceInfo(verbs=VERBS, **info)
    async with emulator, kmock.Server(emulator) as server:
        yield EmulatedCluster(str(server.url).rstrip("/"), emulator)


async def create_model_deployment(api: HarnessApi, namespace: str, body: dict[str, Any]) -> Any:
    body = {"apiVersion": "serving.model-rollout.io/v1alpha1", "kind": "ModelDeployment", **body}
    body["metadata"] = {"namespace": namespace, **body.get("metadata", {})}
    return await api.request("POST", MD_PATH.format(ns=namespace), body)


async def get_model_deployment(api: HarnessApi, namespace: str, name: str) -> Any:
    return await api.request("GET", f"{MD_PATH.format(ns=namespace)}/{name}")


async def patch_model_deployment(
    api: HarnessApi, namespace: str, name: str, patch: dict[str, Any]
) -> Any:
    return await api.merge_patch(f"{MD_PATH.format(ns=namespace)}/{name}", patch)


async def list_objects(api: HarnessApi, path: str) -> list[dict[str, Any]]:
    answer = await api.request("GET", path)
    return list((answer or {}).get("items", []))


async def wait_for_status(
    api: HarnessApi,
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


async def _serve_forever(port: int) -> None:
    emulator = ApiServerEmulator()
    for key, info in RESOURCES.items():
        emulator.resources[key] = kmock.ResourceInfo(verbs=VERBS, **info)
    async with emulator, kmock.Server(emulator, port=port) as server:
        print(str(server.url).rstrip("/"), flush=True)
        await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> int:
    """``python -m model_rollout_e2e.kube_emulator --port P``: the emulated API server as
    a process of its own (as an API server is), for benchmarks."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m model_rollout_e2e.kube_emulator")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve_forever(args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
