"""Just enough of the Kubernetes API for the sidecar to annotate its own pod."""

from __future__ import annotations

import json
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from .errors import KubeError

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(frozen=True)
class KubeApi:
    url: str
    token: str | None = None
    ssl_context: ssl.SSLContext | None = None

    @classmethod
    def in_cluster(cls) -> KubeApi:
        host = os.environ["KUBERNETES_SERVICE_HOST"]
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        context = ssl.create_default_context(cafile=str(SERVICE_ACCOUNT / "ca.crt"))
        return cls(
            f"https://{host}:{port}", (SERVICE_ACCOUNT / "token").read_text().strip(), context
        )

    @classmethod
    def from_url_or_cluster(cls, url: str | None) -> KubeApi | None:
        if url:
            return cls(url.rstrip("/"))
        if "KUBERNETES_SERVICE_HOST" in os.environ and (SERVICE_ACCOUNT / "token").exists():
            return cls.in_cluster()
        return None

    def headers(self, content_type: str = "application/json") -> dict[str, str]:
        headers = {"Content-Type": content_type}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    async def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> Any:
        """One API call; returns the decoded JSON, ``None`` for 404, raises otherwise."""
        timeout = aiohttp.ClientTimeout(total=15)
        data = json.dumps(body) if body is not None else None
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.request(
                method,
                f"{self.url}{path}",
                data=data,
                headers=self.headers(content_type),
                ssl=self.ssl_context or True,
            ) as response,
        ):
            if response.status == 404:
                return None
            text = await response.text()
            if response.status >= 300:
                raise KubeError(
                    response.status, f"{method} {path}: HTTP {response.status} {text[:300]}"
                )
            return json.loads(text) if text else {}

    async def merge_patch(self, path: str, patch: dict[str, Any]) -> Any:
        return await self.request("PATCH", path, patch, "application/merge-patch+json")

    async def merge_patch_pod(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        await self.merge_patch(f"/api/v1/namespaces/{namespace}/pods/{name}", patch)
