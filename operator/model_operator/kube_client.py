"""The operator's Kubernetes API client: ``kubernetes_asyncio``'s ApiClient (as the
sidecar's), one long-lived HTTP session for all of its calls (opened at start-up, closed
at clean-up), against a cluster or an emulated API.

Where the credentials come from, first found (as controller-runtime): ``--kube-api URL``
(an API server without credentials: kmock in tests), ``--kubeconfig``, ``KUBECONFIG``,
the pod's ServiceAccount (its token re-read as the kubelet rotates it: the library's
in-cluster loader checks the file every minute, as client-go does), ``~/.kube/config``.
kopf's own connection is made from the same configuration (:func:`connection_info`).

Errors follow one rule: 404 is ``None`` (absent), a refusal the caller can act on
(401, 403, 409, 422, …) is :class:`ApiError` with the API server's own message, and
anything transient — a 429/5xx answer, a connection failure, a time-out — is
:class:`TransientApiError`, after which the rollout's pass is run again a little later.

With leader election every write first asks the fence (``fence``) whether this replica
still leads: one that does not never sends it, and one that does is given no longer than
the fence has left (its time-out), while the fence's watchdog counts it in flight
(:mod:`.leader`). A 429's or 503's ``Retry-After`` is passed on with the error.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager, asynccontextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import kopf
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.config import incluster_config

from .errors import ApiError, TransientApiError

# where Kubernetes mounts a pod's token and CA: the in-cluster loader's own paths
SERVICE_ACCOUNT = Path(incluster_config.SERVICE_TOKEN_FILENAME).parent
DEFAULT_KUBECONFIG = Path("~/.kube/config")
_TRANSIENT_STATUSES = frozenset({429, 500, 502, 503, 504})
_TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


class WriteFence(Protocol):
    def writing(self) -> AbstractContextManager[float]:
        """Around one write: returns only while it may be sent, with the seconds left."""


class NoApiServer(Exception):
    """Nothing says where the API server is."""


def _in_cluster() -> bool:
    return "KUBERNETES_SERVICE_HOST" in os.environ and (SERVICE_ACCOUNT / "token").exists()


async def load_configuration(kube_api: str | None, kubeconfig: str | None) -> k8s.Configuration:
    """The API server and credentials (see the module's docstring); each call reads the
    files anew. Raises :class:`NoApiServer` when there is nothing to read."""
    configuration = k8s.Configuration()
    if kube_api:
        configuration.host = kube_api.rstrip("/")
        return configuration
    kubeconfig = kubeconfig or os.environ.get("KUBECONFIG")
    if not kubeconfig and not _in_cluster() and DEFAULT_KUBECONFIG.expanduser().exists():
        kubeconfig = str(DEFAULT_KUBECONFIG.expanduser())
    if kubeconfig:
        await k8s_config.load_kube_config(kubeconfig, client_configuration=configuration)
    elif _in_cluster():
        k8s_config.load_incluster_config(
            client_configuration=configuration,
            token_filename=str(SERVICE_ACCOUNT / "token"),
            cert_filename=str(SERVICE_ACCOUNT / "ca.crt"),
        )
    else:
        raise NoApiServer(
            "no Kubernetes API server: give --kube-api or --kubeconfig, set KUBECONFIG,"
            " or run in a cluster"
        )
    return configuration


async def connection_info(configuration: k8s.Configuration) -> kopf.ConnectionInfo:
    """kopf's login from the same configuration. A token that the in-cluster loader
    re-reads expires for kopf as often, so kopf logs in again and follows a rotation."""
    token = await configuration.get_api_key_with_prefix("BearerToken")
    scheme, _, value = (token or "").partition(" ")
    rotated = configuration.refresh_api_key_hook is not None
    return kopf.ConnectionInfo(
        server=str(configuration.host),
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        scheme=scheme if value else None,
        token=value or None,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
        expiration=(
            datetime.now(timezone.utc) + incluster_config.TOKEN_REFRESH_PERIOD if rotated else None
        ),
    )


def retry_after(value: str | None) -> float | None:
    """A ``Retry-After`` of delay-seconds (what the API server sends), else ``None``."""
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and 0 <= seconds < 3600 else None


def _api_message(text: str) -> str:
    """The ``message`` of the API server's Status answer, else the text itself."""
    try:
        answer = json.loads(text)
    except ValueError:
        return text[:300]
    message = answer.get("message") if isinstance(answer, dict) else None
    return str(message) if message else text[:300]


class KubeClient:
    def __init__(
        self,
        configuration: k8s.Configuration,
        timeout_s: float = 15.0,
        on_error: Callable[[int], None] | None = None,
        fence: WriteFence | None = None,
    ) -> None:
        """``on_error(status)`` is told of every failed call (0: the API was not reached);
        ``fence`` guards each call that is not a GET (the leader's fence: the call is sent
        only while it holds, with a time-out of what it has left)."""
        self.configuration = configuration
        self.on_error = on_error or (lambda status: None)
        self.fence = fence
        self.timeout_s = timeout_s
        self._client: k8s.ApiClient | None = None

    @property
    def url(self) -> str:
        return str(self.configuration.host)

    def _open(self) -> k8s.ApiClient:
        if self._client is None:  # in the running loop: its HTTP session belongs to it
            self._client = k8s.ApiClient(self.configuration)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> Any:
        """One API call: the decoded JSON, ``None`` for 404; raises :class:`ApiError`."""
        if method == "GET" or self.fence is None:
            return await self._call(method, path, body, content_type, self.timeout_s)
        with self.fence.writing() as left:  # the last moment before the request goes out
            return await self._call(method, path, body, content_type, min(self.timeout_s, left))

    async def _call(
        self, method: str, path: str, body: Any, content_type: str, timeout_s: float
    ) -> Any:
        client = self._open()
        try:
            response = await client.call_api(
                path,
                method,
                header_params={"Content-Type": content_type, "Accept": "application/json"},
                body=body,
                auth_settings=["BearerToken"],
                _preload_content=False,
                _request_timeout=timeout_s,
            )
            try:
                status, text = response.status, await response.text()
                wait = retry_after(response.headers.get("Retry-After"))
            finally:
                response.release()
        except _TRANSPORT_ERRORS as exc:
            self.on_error(0)
            raise TransientApiError(0, f"{method} {path}: {exc or type(exc).__name__}") from exc
        if status == 404:
            return None
        if status >= 300:
            self.on_error(status)
            error = TransientApiError if status in _TRANSIENT_STATUSES else ApiError
            message = _api_message(text)
            raise error(status, f"{method} {path}: HTTP {status}: {message}", message, wait)
        return json.loads(text) if text else {}

    @asynccontextmanager
    async def stream(self, path: str, timeout_s: float) -> AsyncIterator[AsyncIterator[bytes]]:
        """A GET whose answer is read line by line (a watch): ``async with
        api.stream(path, t) as lines: async for line in lines``; empty lines skipped.
        The errors are :meth:`request`'s."""
        client = self._open()
        try:
            response = await client.call_api(
                path, "GET", header_params={"Accept": "application/json"},
                auth_settings=["BearerToken"], _preload_content=False,
                _request_timeout=timeout_s,
            )  # fmt: skip
        except _TRANSPORT_ERRORS as exc:
            self.on_error(0)
            raise TransientApiError(0, f"GET {path}: {exc or type(exc).__name__}") from exc
        try:
            if response.status >= 300:
                self.on_error(response.status)
                transient = response.status in _TRANSIENT_STATUSES
                error = TransientApiError if transient else ApiError
                message = _api_message(await response.text())
                raise error(response.status, f"GET {path}: HTTP {response.status}: {message}")

            async def lines() -> AsyncIterator[bytes]:
                try:
                    while line := await response.content.readline():
                        if line.strip():
                            yield line
                except _TRANSPORT_ERRORS as exc:
                    self.on_error(0)
                    raise TransientApiError(0, f"GET {path}: {exc!r}") from exc

            yield lines()
        finally:
            response.release()

    async def merge_patch(self, path: str, patch: dict[str, Any]) -> Any:
        return await self.request("PATCH", path, patch, "application/merge-patch+json")
