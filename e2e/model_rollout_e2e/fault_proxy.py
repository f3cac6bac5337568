"""A fault proxy in front of the real API server (:mod:`.control_plane`), for the faults
the API server does not make on demand: an outage answered with error statuses, a cut
watch, connections dropped without an answer, watches that end at once or carry events the
API server would never send (garbage, an ERROR event of a given code), a watch whose
resourceVersion is gone (410, as after etcd's compaction).

Clients talk plain HTTP to :attr:`FaultProxy.url` with their own credentials (a bearer
token: the API server authenticates and authorizes them as it would directly); the proxy
forwards each request over TLS (the cluster's CA, no client certificate of its own) and
streams watches back line by line. Every request is recorded (:attr:`FaultProxy.calls`),
so a test can count what a client sent during a fault, and so is every watch bookmark
relayed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Literal

import aiohttp
from aiohttp import web

from model_rollout_e2e.processes import free_port

# hop-by-hop headers, and those aiohttp sets itself
_NOT_FORWARDED = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


@dataclass(frozen=True)
class Fault:
    """How the proxy answers instead of the API server: ``status`` with a ``Status`` body
    (and ``Retry-After``), ``drop`` the connection without an answer, ``events``: a
    watch answered 200 with ``events``, one line each (a string as it is, anything else
    as JSON), that then ends (no events: a watch that ends at once), or ``gone``: a watch
    answered 200 with the one ``ERROR`` event (410 Expired) that the API server sends when
    the watch's resourceVersion has been compacted away (for ``events`` and ``gone``
    other calls pass)."""

    kind: Literal["status", "drop", "events", "gone"] = "status"
    status: int = 503
    retry_after: str | None = None
    events: tuple[object, ...] = ()

    def status_body(self) -> dict[str, object]:
        reasons = {403: "Forbidden", 429: "TooManyRequests", 500: "InternalError"}
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": f"injected by the fault proxy: {self.status}",
            "reason": reasons.get(self.status, "ServiceUnavailable"),
            "code": self.status,
        }

    def gone_event(self, resource_version: str) -> dict[str, object]:
        """The watch event a real API server sends for a compacted resourceVersion."""
        return {
            "type": "ERROR",
            "object": {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": f"too old resource version: {resource_version or 0}",
                "reason": "Expired",
                "code": 410,
            },
        }


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    query: dict[str, str]
    status: int  # what the client was answered; 0: dropped or cut
    faulted: bool  # answered (or dropped) by the proxy, not the API server

    @property
    def kind(self) -> str:
        """read | watch | patch | other"""
        if self.method == "GET":
            return "watch" if self.query.get("watch") in ("true", "1") else "read"
        return "patch" if self.method == "PATCH" else "other"


@dataclass
class FaultProxy:
    """``async with FaultProxy(server, ca) as proxy:``; set :attr:`fault` to inject one
    (``None``: pass everything), and :attr:`only` to inject it only into the requests it
    selects (``only(method, path)``; ``None``: every request); :meth:`cut` to cut the
    watches open now."""

    upstream: str
    ca: Path
    fault: Fault | None = None
    only: Callable[[str, str], bool] | None = None
    calls: list[Call] = field(default_factory=list)
    bookmarks: list[str] = field(default_factory=list)  # the resourceVersion of each
    _open: dict[asyncio.Task[object], web.Request] = field(default_factory=dict)
    _session: aiohttp.ClientSession | None = None
    _runner: web.AppRunner | None = None
    url: str = ""

    async def __aenter__(self) -> FaultProxy:
        context = ssl.create_default_context(cafile=str(self.ca))
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=context),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            auto_decompress=False,
        )
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cut()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def cut(self) -> int:
        """Cut every watch open now (the connection dropped mid-stream); returns how
        many."""
        cut = 0
        for task, request in list(self._open.items()):
            if request.transport is not None:
                request.transport.abort()
            task.cancel()
            cut += 1
        return cut

    @property
    def open_watches(self) -> int:
        return len(self._open)

    def count(self, kind: str | None = None, faulted: bool | None = None) -> int:
        return sum(
            1
            for call in self.calls
            if (kind is None or call.kind == kind) and (faulted is None or call.faulted == faulted)
        )

    def _record(self, request: web.Request, status: int, faulted: bool) -> None:
        self.calls.append(Call(request.method, request.path, dict(request.query), status, faulted))

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        fault = self.fault
        watch = request.query.get("watch") in ("true", "1")
        if (
            fault is not None
            and self.only is not None
            and not self.only(request.method, request.path)
        ):
            fault = None
        if fault is not None and (fault.kind not in ("events", "gone") or watch):
            return await self._inject(request, fault)
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED}
        body = await request.read()
        async with self._session.request(
            request.method,
            f"{self.upstream}{request.path_qs}",
            headers=headers,
            data=body or None,
        ) as upstream:
            self._record(request, upstream.status, faulted=False)
            if not (watch and upstream.status == 200):
                return web.Response(
                    status=upstream.status, body=await upstream.read(), headers=_kept(upstream)
                )
            return await self._relay(request, upstream)

    async def _inject(self, request: web.Request, fault: Fault) -> web.StreamResponse:
        if fault.kind == "drop":
            self._record(request, 0, faulted=True)
            if request.transport is not None:
                request.transport.abort()
            raise asyncio.CancelledError  # nothing is answered
        if fault.kind in ("events", "gone"):
            self._record(request, 200, faulted=True)
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            await response.prepare(request)
            if fault.kind == "gone":
                event = fault.gone_event(request.query.get("resourceVersion", ""))
                await response.write(json.dumps(event).encode() + b"\n")
            for line in fault.events:
                text = line if isinstance(line, str) else json.dumps(line)
                await response.write(text.encode() + b"\n")
            await response.write_eof()
            return response
        self._record(request, fault.status, faulted=True)
        headers = {"Retry-After": fault.retry_after} if fault.retry_after else None
        return web.json_response(fault.status_body(), status=fault.status, headers=headers)

    async def _relay(
        self, request: web.Request, upstream: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        """A watch, line by line, until the API server ends it or :meth:`cut`."""
        task = asyncio.current_task()
        assert task is not None
        self._open[task] = request
        response = web.StreamResponse(headers=_kept(upstream))
        try:
            await response.prepare(request)
            while line := await upstream.content.readline():
                with contextlib.suppress(json.JSONDecodeError, UnicodeDecodeError):
                    event = json.loads(line)
                    if event.get("type") == "BOOKMARK":
                        meta = (event.get("object") or {}).get("metadata") or {}
                        self.bookmarks.append(str(meta.get("resourceVersion") or ""))
                await response.write(line)
            await response.write_eof()
        finally:
            self._open.pop(task, None)
        return response


def _kept(upstream: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: v for k, v in upstream.headers.items() if k.lower() not in _NOT_FORWARDED}
