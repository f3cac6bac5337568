"""The HTTP requests being handled, counted so that shutdown can say how many it had to
give up on once the grace the pod leaves (``--inflight-grace-seconds``) is over (it waits
for their connections: :func:`.drain.finish_connections`)."""

from __future__ import annotations

from aiohttp import web

from model_server.frontends.http.api import Handler


class InFlightRequests:
    def __init__(self) -> None:
        self.count = 0

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        self.count += 1
        try:
            return await handler(request)
        finally:
            self.count -= 1
