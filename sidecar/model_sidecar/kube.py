"""The sidecar's own pod through the Kubernetes API (``kubernetes_asyncio``): read it,
watch it, annotate it — over one API client (one HTTP session) for the sidecar's life.

In a cluster the credentials are the pod's projected service-account token, which the
client re-reads as the kubelet rotates it; ``--kube-api URL`` points at an API server
without credentials (tests, the emulated cluster).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.client.exceptions import ApiException

from .errors import KubeError, WatchExpired

_TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


@dataclass(frozen=True)
class PodSnapshot:
    annotations: dict[str, str]
    resource_version: str
    deleted: bool = False


def _snapshot(raw: dict[str, Any], deleted: bool = False) -> PodSnapshot:
    meta = raw.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    return PodSnapshot(
        {str(k): str(v) for k, v in annotations.items()},
        str(meta.get("resourceVersion") or ""),
        deleted,
    )


class PodApi:
    def __init__(self, api_client: k8s.ApiClient, namespace: str, name: str) -> None:
        self._client = api_client
        # raw JSON (``_preload_content=False``) rather than the generated models, whose
        # annotations do not cover those keyword arguments: hence Any
        self._core: Any = k8s.CoreV1Api(api_client)
        self.namespace = namespace
        self.name = name

    @classmethod
    def connect(
        cls, kube_api: str | None, namespace: str | None, name: str | None
    ) -> PodApi | None:
        """A client for this pod, or ``None`` when there is no API to talk to (no URL and
        not in a cluster) or the pod's name is unknown."""
        if not namespace or not name:
            return None
        configuration = k8s.Configuration()
        if kube_api:
            configuration.host = kube_api.rstrip("/")
        elif "KUBERNETES_SERVICE_HOST" in os.environ:
            k8s_config.load_incluster_config(client_configuration=configuration)
        else:
            return None
        return cls(k8s.ApiClient(configuration), namespace, name)

    async def close(self) -> None:
        await self._client.close()

    async def read(self) -> PodSnapshot:
        try:
            response = await self._core.read_namespaced_pod(
                self.name, self.namespace, _preload_content=False
            )
            return _snapshot(json.loads(await response.read()))
        except ApiException as exc:
            raise KubeError(int(exc.status or 0), f"read pod {self.name}: {exc.reason}") from exc
        except _TRANSPORT_ERRORS as exc:
            raise KubeError(0, f"read pod {self.name}: {exc or type(exc).__name__}") from exc

    async def events(self, resource_version: str, timeout_s: int) -> AsyncIterator[PodSnapshot]:
        """Changes of this pod after ``resource_version``, until the server ends the watch
        (after ``timeout_s``). Raises :class:`WatchExpired` when that version has been
        compacted away (410 Gone): the caller must read the pod again."""
        try:
            response = await self._core.list_namespaced_pod(
                self.namespace,
                field_selector=f"metadata.name={self.name}",
                watch="true",
                resource_version=resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=timeout_s,
                _preload_content=False,
                _request_timeout=timeout_s + 30,
            )
        except ApiException as exc:
            if exc.status == 410:
                raise WatchExpired(f"resourceVersion {resource_version} is gone") from exc
            raise KubeError(int(exc.status or 0), f"watch pod {self.name}: {exc.reason}") from exc
        except _TRANSPORT_ERRORS as exc:
            raise KubeError(0, f"watch pod {self.name}: {exc or type(exc).__name__}") from exc
        try:
            while line := await response.content.readline():
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, raw = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if raw.get("code") == 410:
                        raise WatchExpired(str(raw.get("message") or "resource version gone"))
                    raise KubeError(int(raw.get("code") or 0), f"watch pod: {raw.get('message')}")
                if (raw.get("metadata") or {}).get("name") not in (None, self.name):
                    continue  # a server that ignores the field selector
                yield _snapshot(raw, deleted=kind == "DELETED")
        except _TRANSPORT_ERRORS as exc:
            raise KubeError(0, f"watch pod {self.name}: {exc or type(exc).__name__}") from exc
        except json.JSONDecodeError as exc:
            raise KubeError(0, f"watch pod {self.name}: not a JSON event: {exc}") from exc
        finally:
            response.release()

    async def annotate(self, annotations: dict[str, str]) -> None:
        try:
            await self._core.patch_namespaced_pod(
                self.name,
                self.namespace,
                {"metadata": {"annotations": annotations}},
                _content_type="application/merge-patch+json",
                _preload_content=False,
            )
        except ApiException as exc:
            raise KubeError(
                int(exc.status or 0), f"annotate pod {self.name}: {exc.reason}"
            ) from exc
        except _TRANSPORT_ERRORS as exc:
            raise KubeError(0, f"annotate pod {self.name}: {exc or type(exc).__name__}") from exc
