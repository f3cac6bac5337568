"""Client of the server's Unix control socket, retrying while the server is down.

Only "not answering" (no socket yet, connection refused or dropped) is retried here.
Everything else is a :class:`~model_sidecar.errors.ControlFailure` with its own code —
``control_denied`` (no permission on the socket), ``load_timeout`` / ``control_timeout``
(no answer in time), ``protocol_error`` (an answer outside the protocol: not JSON, too
long, the wrong kind) — which the watch loop reports and backs off from."""

from __future__ import annotations

import asyncio
from pathlib import Path

from model_rollout_contract.canary import TrafficPolicy
from model_rollout_contract.control import (
    BUSY,
    ControlClosed,
    ControlDenied,
    ControlLineTooLong,
    ControlUnreachable,
    ErrorReply,
    LoadRequest,
    ProtocolError,
    Reply,
    Request,
    RollbackRequest,
    StatusReply,
    StatusRequest,
    SwapReply,
    TrafficRequest,
    exchange,
    parse_reply,
)

from .errors import ControlFailure, ServerUnavailable
from .retry import Backoff, retry_async


def _is_down(exc: BaseException) -> bool:
    return isinstance(exc, ServerUnavailable)


class ServerControl:
    def __init__(
        self,
        socket_path: Path,
        backoff: Backoff | None = None,
        load_timeout_s: float = 300.0,
        request_timeout_s: float = 30.0,
    ) -> None:
        self.socket_path = socket_path
        self.backoff = backoff or Backoff(attempts=8, base_s=0.2, max_s=5.0)
        self.load_timeout_s = load_timeout_s  # a load of a large engine can take minutes
        self.request_timeout_s = request_timeout_s  # status and pointer swaps are quick

    async def _once(self, request: Request) -> Reply:
        timeout = (
            self.load_timeout_s if isinstance(request, LoadRequest) else self.request_timeout_s
        )
        try:
            line = await asyncio.wait_for(self._exchange(request), timeout)
        except asyncio.TimeoutError:
            code = "load_timeout" if isinstance(request, LoadRequest) else "control_timeout"
            raise ControlFailure(
                code, f"server gave no answer to {request.op} of {request.model} in {timeout:g}s"
            ) from None
        try:
            reply = parse_reply(line)
        except ProtocolError as exc:
            raise ControlFailure(
                "protocol_error", f"server answered {request.op} outside the protocol: {exc}"
            ) from exc
        if isinstance(reply, ErrorReply) and reply.code == BUSY:  # nothing done: retried
            raise ServerUnavailable(f"server busy: {reply.error}")
        return reply

    async def _exchange(self, request: Request) -> bytes:
        """The reply line; the contract's typed errors as the sidecar's (module docstring)."""
        try:
            return await exchange(self.socket_path, request)
        except (ControlUnreachable, ControlClosed) as exc:
            raise ServerUnavailable(f"server {exc}") from exc
        except ControlDenied as exc:
            raise ControlFailure("control_denied", f"server {exc}") from exc
        except ControlLineTooLong as exc:
            raise ControlFailure("protocol_error", f"server {exc}") from exc

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
            raise ControlFailure("protocol_error", f"status of {model} answered with {reply}")
        return reply

    async def swap_to_retained(self, model: str, version: str) -> SwapReply | ErrorReply:
        """A pointer swap to a version the server still holds (no file, no load)."""
        reply = await self.request(RollbackRequest(model, version))
        if isinstance(reply, StatusReply):
            raise ControlFailure(
                "protocol_error", f"swap of {model}:{version} answered with a status: {reply}"
            )
        return reply

    async def traffic(self, model: str, policy: TrafficPolicy | None) -> StatusReply | ErrorReply:
        """Set the model's traffic policy (``None``: clear it); answered with a status."""
        reply = await self.request(TrafficRequest(model, policy))
        if isinstance(reply, SwapReply):
            raise ControlFailure(
                "protocol_error", f"traffic policy of {model} answered with a swap: {reply}"
            )
        return reply

    async def load(
        self,
        model: str,
        version: str,
        path: Path,
        sha256: str,
        policy: TrafficPolicy | None = None,
    ) -> SwapReply | ErrorReply:
        """Load ``version`` and swap it in; with ``policy`` (whose candidate it is) the
        server sets the traffic policy in the same step."""
        reply = await self.request(LoadRequest(model, version, str(path), sha256, policy))
        if isinstance(reply, StatusReply):
            raise ControlFailure(
                "protocol_error", f"load of {model}:{version} answered with a status: {reply}"
            )
        return reply
