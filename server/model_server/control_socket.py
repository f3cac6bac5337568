"""Unix-domain control socket for the sidecar.

Protocol: one JSON object per line each way. Requests::

    {"op": "load", "model": "m", "version": "v2", "path": "/vol/m/v2/model.onnx",
     "sha256": "<hex>"}
    {"op": "rollback", "model": "m", "version": "v1"}     # version optional
    {"op": "status", "model": "m"}

Answers are ``{"ok": true, ...}`` or ``{"ok": false, "error": "...", "code": "..."}``.
The server re-hashes the file and compares it with ``sha256`` before loading, and only
accepts paths inside its trusted model directory. Access control is the socket file's
permissions (0600 by default); the peer's uid/pid go to the audit log.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import struct
from pathlib import Path
from typing import Any

from .engine_manager import EngineManager
from .errors import BadRequest, ServingError
from .repository import check_name

log = logging.getLogger(__name__)
MAX_LINE = 64 * 1024


def peer_identity(writer: asyncio.StreamWriter) -> str:
    sock = writer.get_extra_info("socket")
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", creds)
        return f"socket:uid={uid},pid={pid}"
    except (OSError, AttributeError):
        return "socket"


class ControlSocketServer:
    def __init__(self, manager: EngineManager, path: str | Path, mode: int = 0o600) -> None:
        self.manager = manager
        self.path = Path(path)
        self.mode = mode
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)  # a stale socket from a previous run
        self._server = await asyncio.start_unix_server(
            self._serve, path=str(self.path), limit=MAX_LINE
        )
        os.chmod(self.path, self.mode)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        self.path.unlink(missing_ok=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        who = peer_identity(writer)
        try:
            while line := await reader.readline():
                answer = await self.handle_line(line, who)
                writer.write(json.dumps(answer).encode() + b"\n")
                await writer.drain()
        except (ConnectionError, asyncio.LimitOverrunError, ValueError) as exc:
            log.warning("control socket: dropped connection from %s: %s", who, exc)
        finally:
            writer.close()

    async def handle_line(self, line: bytes, who: str) -> dict[str, Any]:
        try:
            try:
                request = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise BadRequest(f"not a JSON line: {exc}") from exc
            if not isinstance(request, dict):
                raise BadRequest("a request must be a JSON object")
            return {"ok": True, **await self._dispatch(request, who)}
        except ServingError as exc:
            return {"ok": False, "error": exc.message, "code": exc.code}

    async def _dispatch(self, request: dict[str, Any], who: str) -> dict[str, Any]:
        op = request.get("op")
        model = request.get("model")
        if not isinstance(model, str):
            raise BadRequest("'model' is required")
        slot = self.manager.slot(model)
        if op == "status":
            current = slot.current
            return {
                "model": model,
                "version": current.version if current else None,
                "sha256": current.sha256 if current else None,
                "loaded": [v.version for v in slot.loaded()],
            }
        version = request.get("version")
        if op == "load":
            if not isinstance(version, str) or not isinstance(request.get("sha256"), str):
                raise BadRequest("'load' needs 'version' and 'sha256'")
            path = request.get("path")
            result = await self.manager.load(
                model,
                check_name("version", version),
                path=Path(path) if isinstance(path, str) else None,
                expected_sha256=request["sha256"],
                who=who,
                source="socket",
            )
        elif op == "rollback":
            result = await self.manager.rollback(
                model,
                check_name("version", version) if isinstance(version, str) else None,
                who=who,
                source="socket",
            )
        else:
            raise BadRequest(f"unknown op {op!r}; expected load, rollback or status")
        return {
            "model": model,
            "from": result.from_version,
            "to": result.to_version,
            "duration_ms": round(result.duration_s * 1000, 3),
            "instant": result.instant,
        }
