"""Unix-domain control socket for the sidecar: the messages of
:mod:`model_rollout_contract.control`, one JSON object per line each way.

The server re-hashes the file and compares it with ``sha256`` before loading, and only
accepts paths inside its trusted model directory. Access control is the socket file's
permissions (0600 by default); the peer's uid/pid go to the audit log.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
from pathlib import Path

from model_rollout_contract.control import (
    MAX_LINE,
    ErrorReply,
    LoadRequest,
    ProtocolError,
    Reply,
    RollbackRequest,
    StatusReply,
    StatusRequest,
    SwapReply,
    encode,
    parse_request,
)

from .data_plane import Caller, DataPlane
from .errors import BadRequest, ServingError

log = logging.getLogger(__name__)


def peer_identity(writer: asyncio.StreamWriter) -> str:
    sock = writer.get_extra_info("socket")
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", creds)
        return f"socket:uid={uid},pid={pid}"
    except (OSError, AttributeError):
        return "socket"


class ControlSocketServer:
    def __init__(self, plane: DataPlane, path: str | Path, mode: int = 0o600) -> None:
        self.plane = plane
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
                writer.write(encode(await self.handle_line(line, who)))
                await writer.drain()
        except (ConnectionError, asyncio.LimitOverrunError, ValueError) as exc:
            log.warning("control socket: dropped connection from %s: %s", who, exc)
        finally:
            writer.close()

    async def handle_line(self, line: bytes, who: str) -> Reply:
        try:
            try:
                request = parse_request(line)
            except ProtocolError as exc:
                raise BadRequest(str(exc)) from exc
            return await self._dispatch(request, who)
        except ServingError as exc:
            return ErrorReply(exc.message, exc.code)

    async def _dispatch(
        self, request: LoadRequest | RollbackRequest | StatusRequest, who: str
    ) -> SwapReply | StatusReply:
        caller = Caller(who, "socket")
        if isinstance(request, StatusRequest):
            return self.plane.status(request.model)
        if isinstance(request, LoadRequest):
            path = Path(request.path) if request.path is not None else None
            return await self.plane.load(
                request.model, request.version, caller, path, request.sha256
            )
        return await self.plane.rollback(request.model, request.version, caller)
