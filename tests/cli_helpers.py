"""Running the day-2 tools as a user does: their console scripts as processes, with a
kubeconfig file naming the (emulated) API server and a namespace."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import yaml
from aiohttp import web

from model_rollout_e2e.processes import free_port

BIN = Path(sys.executable).parent  # the venv's scripts: kubectl-model, model-rollout
TOOL_TIMEOUT_S = 600.0  # a hang guard only
# two tenants' models of one deployment, as `spec.tenants.models` lists them
TENANT_MODELS = [
    {"name": "acme-mlp", "tenant": "acme", "model": "mlp", "version": "a2"},
    {"name": "globex-mlp", "tenant": "globex", "model": "mlp", "version": "g1"},
]


def write_kubeconfig(path: Path, server: str, namespace: str | None) -> Path:
    context: dict[str, str] = {"cluster": "emulated", "user": "tester"}
    if namespace is not None:
        context["namespace"] = namespace
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emulated", "cluster": {"server": server}}],
        "users": [{"name": "tester", "user": {"token": "test-token"}}],
        "contexts": [{"name": "test", "context": context}],
        "current-context": "test",
    }
    path.write_text(yaml.safe_dump(config))
    return path


async def run_tool(
    program: str, *args: str, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``program`` (a script beside the interpreter, or
    a path); it runs beside the test's event loop, which serves the emulated API."""
    path = program if os.sep in program else str(BIN / program)
    proc = await asyncio.create_subprocess_exec(
        path,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "NO_COLOR": "1", **(env or {})},
    )
    out, err = await asyncio.wait_for(proc.communicate(), TOOL_TIMEOUT_S)
    return proc.returncode if proc.returncode is not None else -1, out.decode(), err.decode()


@contextlib.asynccontextmanager
async def intercepting_proxy(
    upstream: str, intercept: Callable[[web.Request], web.Response | None]
) -> AsyncIterator[str]:
    """An HTTP proxy in front of the API server at ``upstream`` that answers what
    ``intercept(request)`` gives, or forwards the request when it gives ``None``. Its
    URL."""
    session = aiohttp.ClientSession()

    async def forward(request: web.Request) -> web.StreamResponse:
        answer_here = intercept(request)
        if answer_here is not None:
            return answer_here
        async with session.request(
            request.method,
            upstream + request.path_qs,
            headers={k: v for k, v in request.headers.items() if k.lower() != "host"},
            data=await request.read(),
        ) as answer:
            headers = {"Content-Type": answer.headers.get("Content-Type", "application/json")}
            return web.Response(status=answer.status, body=await answer.read(), headers=headers)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
        await session.close()


@contextlib.asynccontextmanager
async def flaky_proxy(upstream: str, fail: Callable[[str, str], int | None]) -> AsyncIterator[str]:
    """An HTTP proxy in front of the API server at ``upstream`` that answers the status
    ``fail(method, path)`` picks (a Kubernetes ``Status``) instead of forwarding, and
    forwards when it picks ``None``: an API server failing over (500), a write that lost
    a race (409). Its URL."""

    def injected(request: web.Request) -> web.Response | None:
        status = fail(request.method, request.path)
        if status is None:
            return None
        body = {"kind": "Status", "code": status, "message": f"injected {status}"}
        return web.json_response(body, status=status)

    async with intercepting_proxy(upstream, injected) as url:
        yield url
