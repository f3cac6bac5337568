"""Client of the server's Unix control socket, retrying while the server is down."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from .retry import Backoff, retry_async


class ServerUnavailable(Exception):
    pass


def _is_down(exc: BaseException) -> bool:
    return isinstance(exc, ServerUnavailable)


class ServerControl:
    def __init__(
        self, socket_path: Path, backoff: Backoff | None = None, timeout_s: float = 300.0
    ) -> None:
        self.socket_path = socket_path
        self.backoff = backoff or Backoff(attempts=8, base_s=0.2, max_s=5.0)
        self.timeout_s = timeout_s  # a load of a large engine can take minutes

    async def _once(self, request: dict[str, Any]) -> dict[str, Any]:
        try:
            reader, writer = await asyncio.open_unix_connection(str(self.socket_path))
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise ServerUnavailable(
                f"server socket {self.socket_path} not answering: {exc}"
            ) from exc
        try:
            writer.write(json.dumps(request).encode() + b"\n")
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), self.timeout_s)
        except ConnectionError as exc:
            raise ServerUnavailable(f"server closed the control connection: {exc}") from exc
        finally:
            writer.close()
        if not line:
            raise ServerUnavailable("server closed the control connection without answering")
        answer: dict[str, Any] = json.loads(line)
        return answer

    async def request(self, request: dict[str, Any]) -> dict[str, Any]:
        return await retry_async(
            lambda: self._once(request), _is_down, self.backoff, f"control {request.get('op')}"
        )

    async def status(self, model: str) -> dict[str, Any]:
        return await self.request({"op": "status", "model": model})

    async def load(self, model: str, version: str, path: Path, sha256: str) -> dict[str, Any]:
        return await self.request(
            {"op": "load", "model": model, "version": version, "path": str(path), "sha256": sha256}
        )
