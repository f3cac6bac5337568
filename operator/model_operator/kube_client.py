"""The operator's Kubernetes REST client: one long-lived HTTP session for all of its
calls (opened at start-up, closed at clean-up), against a cluster or an emulated API.

Errors follow one rule: 404 is ``None`` (absent), a refusal the caller can act on
(403, 409, 422, …) is :class:`ApiError`, and anything transient — a 429/5xx answer, a
connection failure, a time-out — is :class:`TransientApiError`, which the handlers turn
into ``kopf.TemporaryError`` so that kopf retries the reconcile later.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from .errors import ApiError, TransientApiError

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
_TRANSIENT_STATUSES = frozenset({429, 500, 502, 503, 504})


@dataclass(frozen=True)
class ApiEndpoint:
    url: str
    token: str | None = None
    ssl_context: ssl.SSLContext | None = None

    @classmethod
    def from_url_or_cluster(cls, url: str | None) -> ApiEndpoint | None:
        if url:
            return cls(url.rstrip("/"))
        if "KUBERNETES_SERVICE_HOST" in os.environ and (SERVICE_ACCOUNT / "token").exists():
            host = os.environ["KUBERNETES_SERVICE_HOST"]
            port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            context = ssl.create_default_context(cafile=str(SERVICE_ACCOUNT / "ca.crt"))
            token = (SERVICE_ACCOUNT / "token").read_text().strip()
            return cls(f"https://{host}:{port}", token, context)
        return None


class KubeClient:
    def __init__(
        self,
        endpoint: ApiEndpoint,
        timeout_s: float = 15.0,
        on_error: Callable[[int], None] | None = None,
    ) -> None:
        """``on_error(status)`` is told of every failed call (0: the API was not reached)."""
        self.endpoint = endpoint
        self.on_error = on_error or (lambda status: None)
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return self.endpoint.url

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = (
                {"Authorization": f"Bearer {self.endpoint.token}"} if self.endpoint.token else {}
            )
            self._session = aiohttp.ClientSession(timeout=self._timeout, headers=headers)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> Any:
        """One API call: the decoded JSON, ``None`` for 404; raises :class:`ApiError`."""
        try:
            async with self._open().request(
                method,
                f"{self.endpoint.url}{path}",
                data=json.dumps(body) if body is not None else None,
                headers={"Content-Type": content_type},
                ssl=self.endpoint.ssl_context or True,
            ) as response:
                text = await response.text()
                status = response.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self.on_error(0)
            raise TransientApiError(0, f"{method} {path}: {exc or type(exc).__name__}") from exc
        if status == 404:
            return None
        if status >= 300:
            self.on_error(status)
            error = TransientApiError if status in _TRANSIENT_STATUSES else ApiError
            raise error(status, f"{method} {path}: HTTP {status} {text[:300]}")
        return json.loads(text) if text else {}

    async def merge_patch(self, path: str, patch: dict[str, Any]) -> Any:
        return await self.request("PATCH", path, patch, "application/merge-patch+json")
