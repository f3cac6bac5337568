"""The HTTP requests being handled, counted so that shutdown waits for exactly them, for
at most the grace the pod leaves (``--inflight-grace-seconds``), and can say how many it
had to give up on."""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web

from model_server.frontends.http.api import Handler


class InFlightRequests:
    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        self.count += 1
        self._idle.clear()
        try:
            return await handler(request)
        finally:
            self.count -= 1
            if self.count == 0:
                self._idle.set()

    async def wait(self, timeout_s: float) -> int:
        """Wait until no request is in flight, or ``timeout_s``; return how many still are."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        return self.count
