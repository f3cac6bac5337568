"""The sidecar's own pod through the Kubernetes API (``kubernetes_asyncio``): read it,
watch it, annotate it — over one API client (one HTTP session) for the sidecar's life.

Calls return raw JSON (``_preload_content=False``), which skips the client's own status
check, so every answer's status is checked here: an error answer (a 503, a 429 from API
Priority and Fairness, a 403 from admission) raises :class:`KubeError` with its status,
the Status body's message and its ``Retry-After``, and is never read as a pod. Every
error is counted (``model_sidecar_kube_api_errors_total``) by call and status.

In a cluster the credentials are the pod's projected service-account token, which the
client re-reads as the kubelet rotates it; ``--kube-api URL`` points at an API server
without credentials (tests, the emulated cluster).
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.client.exceptions import ApiException

from .errors import KubeError, WatchExpired
from .metrics import SidecarMetrics
from .retry import Backoff

_TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)
# between API calls that failed in a row (the pod watch's, the status patches'): 0.5-1 s
# after the first, doubling up to 15-30 s: through a long outage at most one call in 15 s
# of each (client-go's reflector: 0.8 s to 30 s)
API_BACKOFF = Backoff(base_s=1.0, max_s=30.0, floor=0.5)
# a watch the server ends sooner than this with nothing in it is a failure, not the
# server's timeout (client-go's "very short watch"): resuming at once would spin
SHORT_WATCH_S = 1.0
# what json.loads raises for text that is not JSON (too deeply nested: RecursionError)
_NOT_JSON = (json.JSONDecodeError, UnicodeDecodeError, RecursionError)
# the longest Retry-After taken as it is: a longer one (or a date far ahead) is cut to it,
# so that one odd answer cannot stop the sidecar following its pod
RETRY_AFTER_MAX_S = 300.0


@dataclass(frozen=True)
class PodSnapshot:
    annotations: dict[str, str]
    resource_version: str
    deleted: bool = False


@dataclass(frozen=True)
class Bookmark:
    """A watch bookmark: how far the watch has got, and nothing about the pod (its
    object has no name and no annotations)."""

    resource_version: str


def _snapshot(raw: dict[str, Any], deleted: bool = False) -> PodSnapshot | str:
    """The pod in ``raw``, or why it is not one: annotations that are not a map of strings
    are no pod's (the API server never sends them), never a pod without its target."""
    meta = raw.get("metadata")
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        return f"metadata is a {type(meta).__name__}, not a map"
    annotations = meta.get("annotations")
    if annotations is None:
        annotations = {}
    if not isinstance(annotations, dict):
        return f"annotations are a {type(annotations).__name__}, not a map"
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in annotations.items()):
        return "annotations are not all strings"
    return PodSnapshot(dict(annotations), str(meta.get("resourceVersion") or ""), deleted)


def _error_code(raw: dict[str, Any]) -> int:
    """The HTTP status of a watch's ERROR event (a ``Status``); 0 for one without a number
    there (no API server sends that: it is an answer that is not one)."""
    code = raw.get("code")
    return code if isinstance(code, int) and not isinstance(code, bool) else 0


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """A ``Retry-After`` header in seconds (delta-seconds or an HTTP date), at most
    :data:`RETRY_AFTER_MAX_S`; ``None`` without one or for one that is not either form."""
    if not value:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():  # not "²" or "١٢": digits to str, not to HTTP
        seconds = float(value)
    else:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:  # not an HTTP date (those are GMT)
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    return min(max(seconds, 0.0), RETRY_AFTER_MAX_S)


def _status_message(body: bytes, reason: str) -> str:
    """The message of a ``Status`` body, else the start of the body, else the reason."""
    try:
        status = json.loads(body)
    except _NOT_JSON:
        status = None
    if isinstance(status, dict) and status.get("message"):
        return str(status["message"])[:500]
    return body.decode(errors="replace").strip()[:200] or reason


class PodApi:
    def __init__(
        self,
        api_client: k8s.ApiClient,
        namespace: str,
        name: str,
        metrics: SidecarMetrics | None = None,
    ) -> None:
        self._client = api_client
        # raw JSON (``_preload_content=False``) rather than the generated models, whose
        # annotations do not cover those keyword arguments: hence Any
        self._core: Any = k8s.CoreV1Api(api_client)
        self.namespace = namespace
        self.name = name
        self.metrics = metrics

    @classmethod
    def connect(
        cls,
        kube_api: str | None,
        namespace: str | None,
        name: str | None,
        metrics: SidecarMetrics | None = None,
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
        return cls(k8s.ApiClient(configuration), namespace, name, metrics)

    async def close(self) -> None:
        await self._client.close()

    def _error(
        self, call: str, status: int, message: str, retry_after_s: float | None = None
    ) -> KubeError:
        """The error to raise for a failed ``call``, counted."""
        if self.metrics is not None:
            self.metrics.kube_errors.labels(call, str(status)).inc()
        text = f"{call} pod {self.namespace}/{self.name}: {message}"
        if status == 410:
            return WatchExpired(text)
        return KubeError(status, text, retry_after_s)

    async def _checked(self, call: str, response: Any) -> None:
        """Raise for an answer that is not a success (its body read and released)."""
        if 200 <= response.status <= 299:
            return
        try:
            body = await response.read()
        except _TRANSPORT_ERRORS:
            body = b""
        finally:
            response.release()
        raise self._error(
            call,
            int(response.status),
            f"{response.status} {_status_message(body, str(response.reason))}",
            retry_after_seconds(response.headers.get("Retry-After")),
        )

    async def _send(self, call: str, pending: Any) -> Any:
        """The response of an API call, its status checked."""
        try:
            response = await pending
        except ApiException as exc:  # the client refused the call before sending it
            raise self._error(call, int(exc.status or 0), str(exc.reason)) from exc
        except _TRANSPORT_ERRORS as exc:
            raise self._error(call, 0, str(exc) or type(exc).__name__) from exc
        await self._checked(call, response)
        return response

    async def read(self) -> PodSnapshot:
        response = await self._send(
            "read",
            self._core.read_namespaced_pod(self.name, self.namespace, _preload_content=False),
        )
        try:
            raw = json.loads(await response.read())
        except _TRANSPORT_ERRORS as exc:
            raise self._error("read", 0, str(exc) or type(exc).__name__) from exc
        except _NOT_JSON as exc:
            raise self._error("read", 0, f"not a JSON pod: {exc}") from exc
        finally:
            response.release()
        meta = raw.get("metadata") if isinstance(raw, dict) else None
        if not isinstance(meta, dict) or raw.get("kind") not in (None, "Pod"):
            raise self._error("read", 0, "the answer is not a pod")
        if meta.get("name") != self.name:
            raise self._error("read", 0, f"the answer is pod {meta.get('name')!r}")
        snapshot = _snapshot(raw)
        if isinstance(snapshot, str):
            raise self._error("read", 0, f"the answer is not a pod: {snapshot}")
        return snapshot

    @contextlib.asynccontextmanager
    async def watch(
        self, resource_version: str, timeout_s: int
    ) -> AsyncIterator[AsyncIterator[PodSnapshot | Bookmark]]:
        """``async with pod.watch(version, timeout) as events:`` — the watch is open (the
        server answered 200) inside the block; ``events`` are this pod's changes after
        ``resource_version`` and bookmarks, until the server ends the watch (after
        ``timeout_s``). Raises :class:`WatchExpired` when that version has been compacted
        away (410 Gone): the caller must read the pod again, and :class:`KubeError` for a
        watch that ends at once with nothing in it."""
        started = time.monotonic()
        response = await self._send(
            "watch",
            self._core.list_namespaced_pod(
                self.namespace,
                field_selector=f"metadata.name={self.name}",
                watch="true",
                resource_version=resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=timeout_s,
                _preload_content=False,
                _request_timeout=timeout_s + 30,
            ),
        )
        try:
            yield self._events(response, started)
        finally:
            response.release()

    async def _events(self, response: Any, started: float) -> AsyncIterator[PodSnapshot | Bookmark]:
        items = 0
        try:
            while line := await response.content.readline():
                if not line.strip():
                    continue
                event = json.loads(line)
                if not isinstance(event, dict) or not isinstance(event.get("object"), dict):
                    raise self._error("watch", 0, f"not a watch event: {line[:200]!r}")
                kind, raw = event.get("type"), event["object"]
                if kind == "ERROR":
                    code, message = _error_code(raw), str(raw.get("message") or "watch error")
                    if code == 0:
                        message = f"an ERROR event of code {raw.get('code')!r}: {message}"
                    raise self._error("watch", code, message[:500])
                items += 1
                if kind == "BOOKMARK":
                    meta = raw.get("metadata") or {}
                    if not isinstance(meta, dict):
                        raise self._error("watch", 0, "not a bookmark: metadata is not a map")
                    yield Bookmark(str(meta.get("resourceVersion") or ""))
                    continue
                if kind not in ("ADDED", "MODIFIED", "DELETED"):
                    raise self._error("watch", 0, f"not a watch event: type {kind!r}")
                snapshot = _snapshot(raw, deleted=kind == "DELETED")
                if isinstance(snapshot, str):
                    raise self._error("watch", 0, f"not a pod in a watch event: {snapshot}")
                if (raw.get("metadata") or {}).get("name") not in (None, self.name):
                    continue  # a server that ignores the field selector
                yield snapshot
            if items == 0 and time.monotonic() - started < SHORT_WATCH_S:
                raise self._error("watch", 0, "the server ended the watch at once, empty")
        except _TRANSPORT_ERRORS as exc:
            raise self._error("watch", 0, str(exc) or type(exc).__name__) from exc
        except _NOT_JSON as exc:
            raise self._error("watch", 0, f"not a JSON event: {exc}") from exc

    async def annotate(self, annotations: dict[str, str]) -> None:
        response = await self._send(
            "annotate",
            self._core.patch_namespaced_pod(
                self.name,
                self.namespace,
                {"metadata": {"annotations": annotations}},
                _content_type="application/merge-patch+json",
                _preload_content=False,
            ),
        )
        response.release()
