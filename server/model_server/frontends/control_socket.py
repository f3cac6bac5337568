"""Unix-domain control socket for the sidecar: the messages of
:mod:`model_rollout_contract.control`, one JSON object per line each way.

The server hashes the very bytes it loads and compares them with ``sha256``, and only
accepts paths inside its trusted model directory. Access control is the socket file's
permissions (0600 by default), which it has from the moment it appears at its path: it
is bound inside a private directory and renamed into place. The peer's uid/pid go to the
audit log. A connection that sends nothing for ``idle_timeout_s`` is closed, and at most
``max_connections`` are served at once: one more is answered ``busy`` and closed.

``traffic`` sets a canary's traffic policy (its candidate must be serving and its stable
version loaded, else ``conflict``) or clears it, and is answered with the status. A
``load`` may carry the policy too: it is then set with the swap, in one step.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import tempfile
from pathlib import Path

from model_rollout_contract.control import (
    BUSY,
    MAX_LINE,
    ErrorReply,
    LoadRequest,
    ProtocolError,
    Reply,
    Request,
    StatusReply,
    StatusRequest,
    SwapReply,
    TrafficRequest,
    encode,
    parse_request,
)
from model_server.dataplane.data_plane import Caller, DataPlane
from model_server.errors import BadRequest, ServingError

log = logging.getLogger(__name__)

IDLE_TIMEOUT_S = 60.0  # a connection silent this long (between requests) is closed
MAX_CONNECTIONS = 32  # the sidecar uses one at a time


def peer_identity(writer: asyncio.StreamWriter) -> str:
    sock = writer.get_extra_info("socket")
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", creds)
        return f"socket:uid={uid},pid={pid}"
    except (OSError, AttributeError):
        return "socket"


def bind_unix_socket(path: Path, mode: int) -> socket.socket:
    """A listening socket at ``path`` that never exists there with another mode: bound
    in a fresh 0700 directory beside ``path``, given ``mode``, then renamed over ``path``
    (which also replaces a stale socket of an earlier run)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    private = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        staged = private / "socket"
        sock.bind(str(staged))
        os.chmod(staged, mode)  # nobody else can reach it inside the 0700 directory
        sock.listen(socket.SOMAXCONN)
        os.replace(staged, path)
    except BaseException:
        sock.close()
        raise
    finally:
        for leftover in private.iterdir():
            leftover.unlink()
        private.rmdir()
    return sock


class LineServer:
    """The socket, its connections and their bounds; what a line is answered with is
    the subclass's (this server's own data plane, or a pool's relay: ``.pool_relay``)."""

    def __init__(
        self,
        path: str | Path,
        mode: int = 0o600,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.path = Path(path)
        self.mode = mode
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = max_connections
        self.connections = 0
        self._server: asyncio.AbstractServer | None = None
        self._inode: tuple[int, int] | None = None

    async def start(self) -> None:
        sock = bind_unix_socket(self.path, self.mode)
        info = self.path.stat()
        self._inode = (info.st_dev, info.st_ino)
        self._server = await asyncio.start_unix_server(self._serve, sock=sock, limit=MAX_LINE)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        try:  # only our own socket: a newer server may have taken the path meanwhile
            info = self.path.stat()
            if (info.st_dev, info.st_ino) == self._inode:
                self.path.unlink()
        except FileNotFoundError:
            pass

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        who = peer_identity(writer)
        if self.connections >= self.max_connections:
            log.warning("control socket: refused %s: %d connections open", who, self.connections)
            busy = ErrorReply(f"more than {self.max_connections} control connections", BUSY)
            self._close(writer, encode(busy))
            return
        self.connections += 1
        try:
            while line := await asyncio.wait_for(reader.readline(), self.idle_timeout_s):
                writer.write(encode(await self.handle_line(line, who)))
                await writer.drain()
        except TimeoutError:
            log.info("control socket: closed %s after %.0f s idle", who, self.idle_timeout_s)
        except (ConnectionError, asyncio.LimitOverrunError, ValueError) as exc:
            log.warning("control socket: dropped connection from %s: %s", who, exc)
        finally:
            self.connections -= 1
            self._close(writer)

    @staticmethod
    def _close(writer: asyncio.StreamWriter, last: bytes = b"") -> None:
        """Close the connection; the transport still sends what was written before."""
        if last and not writer.is_closing():
            writer.write(last)
        writer.close()

    async def handle_line(self, line: bytes, who: str) -> Reply:
        raise NotImplementedError


class ControlSocketServer(LineServer):
    def __init__(
        self,
        plane: DataPlane,
        path: str | Path,
        mode: int = 0o600,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        super().__init__(path, mode, idle_timeout_s, max_connections)
        self.plane = plane

    async def handle_line(self, line: bytes, who: str) -> Reply:
        try:
            try:
                request = parse_request(line)
            except ProtocolError as exc:
                raise BadRequest(str(exc)) from exc
            return await self._dispatch(request, who)
        except ServingError as exc:
            return ErrorReply(exc.message, exc.code)

    async def _dispatch(self, request: Request, who: str) -> SwapReply | StatusReply:
        caller = Caller(who, "socket")
        if isinstance(request, TrafficRequest):
            return self.plane.set_traffic(request.model, request.policy, caller)
        if isinstance(request, StatusRequest):
            return self.plane.status(request.model)
        if isinstance(request, LoadRequest):
            path = Path(request.path) if request.path is not None else None
            return await self.plane.load(
                request.model, request.version, caller, path, request.sha256, request.policy
            )
        return await self.plane.rollback(request.model, request.version, caller)
