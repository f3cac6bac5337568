"""The harness's own small REST client for the emulated API (tests, the kubelet
stand-in, the demo): one call per request, JSON in and out, ``None`` for 404."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import aiohttp


class ApiCallFailed(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class HarnessApi:
    url: str

    async def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> Any:
        timeout = aiohttp.ClientTimeout(total=15)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.request(
                method,
                f"{self.url}{path}",
                data=json.dumps(body) if body is not None else None,
                headers={"Content-Type": content_type},
            ) as response,
        ):
            if response.status == 404:
                return None
            text = await response.text()
            if response.status >= 300:
                raise ApiCallFailed(
                    response.status, f"{method} {path}: HTTP {response.status} {text[:300]}"
                )
            return json.loads(text) if text else {}

    async def merge_patch(self, path: str, patch: dict[str, Any]) -> Any:
        return await self.request("PATCH", path, patch, "application/merge-patch+json")
