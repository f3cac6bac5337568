"""Client of the server's Unix control socket, retrying while the server is down."""

from __future__ import annotations

import asyncio
from pathlib import Path

from model_rollout_contract.control import (
    MAX_LINE,
    ErrorReply,
    LoadRequest,
    ProtocolError,
    Reply,
    Request,
    RollbackRequest,
    StatusReply,
    StatusRequest,
    SwapReply,
    encode,
    parse_reply,
)

from .errors import ServerUnavailable
from .retry import Backoff, retry_async


def _is_down(exc: BaseException) -> bool:
    return isinstance(exc, ServerUnavailable)


class ServerControl:
    def __init__(
        self, socket_path: Path, backoff: Backoff | None = None, timeout_s: float = 300.0
    ) -> None:
        self.socket_path = socket_path
        self.backoff = backoff or Backoff(attempts=8, base_s=0.2, max_s=5.0)
        self.timeout_s = timeout_s  # a load of a large engine can take minutes

    async def _once(self, request: Request) -> Reply:
        try:
            reader, writer = await asyncio.open_unix_connection(
                str(self.socket_path), limit=MAX_LINE
            )
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise ServerUnavailable(
                f"server socket {self.socket_path} not answering: {exc}"
            ) from exc
        try:
            writer.write(encode(request))
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), self.timeout_s)
        except ConnectionError as exc:
            raise ServerUnavailable(f"server closed the control connection: {exc}") from exc
        finally:
            writer.close()
        if not line:
            raise ServerUnavailable("server closed the control connection without answering")
        try:
            return parse_reply(line)
        except ProtocolError as exc:
            raise ServerUnavailable(f"server answered outside the protocol: {exc}") from exc

    async def request(self, request: Request) -> Reply:
        return await retry_async(
            lambda: self._once(request), _is_down, self.backoff, f"control {request.op}"
        )

    async def status(self, model: str) -> StatusReply:
        """What the server holds. A server that refuses the question (it does not serve
        the model, say) holds nothing of it: the load that follows is then refused with
        the server's reason, so the rollout fails fast instead of waiting for a deadline."""
        reply = await self.request(StatusRequest(model))
        if isinstance(reply, ErrorReply):
            return StatusReply(model, None, None, ())
        if not isinstance(reply, StatusReply):
            raise ServerUnavailable(f"status of {model} answered with {reply}")
        return reply

    async def swap_to_retained(self, model: str, version: str) -> SwapReply | ErrorReply:
        """A pointer swap to a version the server still holds (no file, no load)."""
        reply = await self.request(RollbackRequest(model, version))
        if isinstance(reply, StatusReply):
            raise ServerUnavailable(f"swap of {model}:{version} answered with a status: {reply}")
        return reply

    async def load(
        self, model: str, version: str, path: Path, sha256: str
    ) -> SwapReply | ErrorReply:
        reply = await self.request(LoadRequest(model, version, str(path), sha256))
        if isinstance(reply, StatusReply):
            raise ServerUnavailable(f"load of {model}:{version} answered with a status: {reply}")
        return reply
