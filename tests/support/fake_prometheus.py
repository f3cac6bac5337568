"""A fake Prometheus for the analysis tests that need no real one (a real one is
``model_rollout_e2e.prometheus``): the instant query API answers each PromQL query with
the one sample, or none, that the test's function of the query gives."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

from aiohttp import web
from aiohttp.test_utils import TestServer


@contextlib.asynccontextmanager
async def fake_prometheus(value: Callable[[str], float | None]) -> AsyncIterator[str]:
    """Its base URL, while open: ``/api/v1/query`` answers a vector of one sample,
    ``value(query)``, or an empty one where that is None."""

    async def query(request: web.Request) -> web.Response:
        v = value(request.query["query"])
        result = [] if v is None else [{"metric": {}, "value": [0, str(v)]}]
        return web.json_response(
            {"status": "success", "data": {"resultType": "vector", "result": result}}
        )

    app = web.Application()
    app.router.add_get("/api/v1/query", query)
    async with TestServer(app) as server:
        yield str(server.make_url("/"))
