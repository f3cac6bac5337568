"""HTTP API: KServe v2 inference protocol plus v1 control endpoints, a thin transport
over :class:`~model_server.data_plane.DataPlane` (authentication and tenant routing
happen here; every answer is built there)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from model_rollout_contract.canary import PIN_HEADER
from model_rollout_contract.control import SwapReply
from model_rollout_contract.names import InvalidName, check_name

from .auth import AccessPolicy
from .data_plane import Caller, DataPlane, JsonBody
from .errors import BadRequest, ServingError
from .metrics import ServerMetrics
from .repository import model_key

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

PLANE = web.AppKey("plane", DataPlane)
POLICY = web.AppKey("policy", AccessPolicy)
METRICS = web.AppKey("metrics", ServerMetrics)


def error_response(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": message, "code": code}, status=status)


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure becomes a JSON body with a 4xx/5xx status, never an HTML page.
    While the server drains, every answer also closes its connection, so that clients
    holding kept-alive connections go elsewhere instead of finding them closed later."""
    try:
        response = await handler(request)
    except ServingError as exc:
        response = error_response(exc.status, exc.code, exc.message)
        if exc.retry_after_s is not None:
            response.headers["Retry-After"] = str(exc.retry_after_s)
    except InvalidName as exc:  # a name that breaks the contract's rule
        response = error_response(BadRequest.status, BadRequest.code, str(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = error_response(exc.status, exc.reason.lower().replace(" ", "_"), exc.reason)
    if request.app[PLANE].draining:
        response.force_close()
    return response


def _tenant_model(request: web.Request) -> str:
    tenant = request.app[POLICY].tenant_for(request.headers)
    return model_key(request.match_info["name"], tenant)


def _admin_model(request: web.Request) -> str:
    name = request.query.get("model")
    if name is None:
        served = request.app[PLANE].model_keys()
        if len(served) != 1:
            raise BadRequest(f"several models are served; name one with ?model= ({served})")
        return served[0]
    parts = name.split("/")
    if len(parts) > 2:
        raise BadRequest(f"invalid model {name!r}: use 'name' or 'tenant/name'")
    return model_key(parts[-1], parts[0] if len(parts) == 2 else None)


def _swap_json(reply: SwapReply) -> dict[str, Any]:
    return {"status": "ok", **reply.fields()}


async def live(request: web.Request) -> web.Response:
    return web.json_response({"live": True})


async def ready(request: web.Request) -> web.Response:
    is_ready = request.app[PLANE].ready()
    return web.json_response({"ready": is_ready}, status=200 if is_ready else 503)


async def model_metadata(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    return web.json_response(request.app[PLANE].model_metadata(_tenant_model(request), name))


async def model_ready(request: web.Request) -> web.Response:
    is_ready = request.app[PLANE].model_ready(_tenant_model(request))
    return web.json_response(
        {"name": request.match_info["name"], "ready": is_ready}, status=200 if is_ready else 503
    )


async def infer(request: web.Request) -> web.Response:
    plane, name = request.app[PLANE], request.match_info["name"]
    started, key = time.perf_counter(), name
    try:
        key = _tenant_model(request)
        plane.check_body_room(request.content_length)  # a full queue: 503 before reading
        body = await request.read()  # over client_max_size: aiohttp's 413
    except (ServingError, InvalidName, web.HTTPException) as exc:
        status = exc.status if isinstance(exc, ServingError | web.HTTPException) else 400
        plane.count_rejected(key, status, time.perf_counter() - started)
        raise
    answer = await plane.infer(
        key,
        name,
        JsonBody(plane.codec, body, request.charset or "utf-8"),
        request.headers.get(PIN_HEADER),
    )
    response = web.Response(body=answer.body, content_type="application/json")
    if answer.shadow is not None:  # mirrored to the candidate once the client has its answer
        if plane.draining:
            response.force_close()
        await response.prepare(request)
        await response.write_eof()
        plane.shadow(answer.shadow)
    return response


async def model_health(request: web.Request) -> web.Response:
    health = request.app[PLANE].health(_tenant_model(request))
    return web.json_response(health, status=503 if health["status"] == "loading" else 200)


async def reload(request: web.Request) -> web.Response:
    who = request.app[POLICY].check_admin(request.headers)
    key = _admin_model(request)
    target = request.query.get("target_version")
    if not target:
        raise BadRequest("reload needs ?target_version=<version>")
    check_name("version", target)
    plane = request.app[PLANE]
    previous = plane.status(key).version
    try:
        reply = await plane.load(key, target, Caller(who, "http"))
    except ServingError as exc:
        return web.json_response(
            {
                "status": "failed",
                "model": key,
                "from": previous,
                "to": target,
                "error": exc.message,
                "code": exc.code,
            },
            status=exc.status,
        )
    return web.json_response(_swap_json(reply))


async def rollback(request: web.Request) -> web.Response:
    who = request.app[POLICY].check_admin(request.headers)
    key = _admin_model(request)
    target = request.query.get("target_version")
    if target:
        check_name("version", target)
    reply = await request.app[PLANE].rollback(key, target, Caller(who, "http"))
    return web.json_response(_swap_json(reply))


async def list_models(request: web.Request) -> web.Response:
    tenant = request.app[POLICY].tenant_for(request.headers)
    return web.json_response({"models": request.app[PLANE].list_models(tenant)})


async def audit(request: web.Request) -> web.Response:
    request.app[POLICY].check_admin(request.headers)
    return web.json_response({"events": request.app[PLANE].audit_events()})


async def metrics_endpoint(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def add_routes(app: web.Application) -> None:
    app.add_routes(
        [
            web.get("/v2/health/live", live),
            web.get("/v2/health/ready", ready),
            web.get("/v2/models/{name}", model_metadata),
            web.get("/v2/models/{name}/ready", model_ready),
            web.post("/v2/models/{name}/infer", infer),
            web.get("/v1/models", list_models),
            web.get("/v1/models/{name}/health", model_health),
            web.post("/v1/reload", reload),
            web.post("/v1/rollback", rollback),
            web.get("/v1/audit", audit),
            web.get("/metrics", metrics_endpoint),
        ]
    )
