"""HTTP API: KServe v2 inference protocol plus v1 control endpoints."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from model_rollout_contract.names import InvalidName, check_name

from .auth import AccessPolicy
from .engine_manager import EngineManager, SwapResult
from .errors import BadRequest, ModelNotFound, ServingError
from .metrics import ServerMetrics
from .repository import model_key
from .tensors import decode_inputs, encode_outputs, spec_to_json

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

MANAGER = web.AppKey("manager", EngineManager)
POLICY = web.AppKey("policy", AccessPolicy)
METRICS = web.AppKey("metrics", ServerMetrics)


def error_response(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": message, "code": code}, status=status)


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure becomes a JSON body with a 4xx/5xx status, never an HTML page."""
    try:
        return await handler(request)
    except ServingError as exc:
        return error_response(exc.status, exc.code, exc.message)
    except InvalidName as exc:  # a name that breaks the contract's rule
        return error_response(BadRequest.status, BadRequest.code, str(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, exc.reason.lower().replace(" ", "_"), exc.reason)


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat()


async def _json_body(request: web.Request) -> Any:
    try:
        return await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc


def _tenant_model(request: web.Request) -> str:
    tenant = request.app[POLICY].tenant_for(request.headers)
    return model_key(request.match_info["name"], tenant)


def _admin_model(request: web.Request) -> str:
    manager = request.app[MANAGER]
    name = request.query.get("model")
    if name is None:
        if len(manager.slots) != 1:
            raise BadRequest(
                f"several models are served; name one with ?model= ({sorted(manager.slots)})"
            )
        return next(iter(manager.slots))
    parts = name.split("/")
    if len(parts) > 2:
        raise BadRequest(f"invalid model {name!r}: use 'name' or 'tenant/name'")
    return model_key(parts[-1], parts[0] if len(parts) == 2 else None)


def _swap_json(result: SwapResult) -> dict[str, Any]:
    return {
        "status": "ok",
        "model": result.model,
        "from": result.from_version,
        "to": result.to_version,
        "duration_ms": round(result.duration_s * 1000, 3),
        "instant": result.instant,
    }


async def live(request: web.Request) -> web.Response:
    return web.json_response({"live": True})


async def ready(request: web.Request) -> web.Response:
    is_ready = request.app[MANAGER].ready()
    return web.json_response({"ready": is_ready}, status=200 if is_ready else 503)


async def model_metadata(request: web.Request) -> web.Response:
    manager = request.app[MANAGER]
    key = _tenant_model(request)
    slot = manager.slot(key)
    current = slot.current
    if current is None:
        raise ModelNotFound(f"model {key!r} has no version loaded yet")
    return web.json_response(
        {
            "name": request.match_info["name"],
            "versions": [v.version for v in slot.loaded()],
            "platform": current.engine.platform,
            "inputs": [spec_to_json(s) for s in current.engine.inputs],
            "outputs": [spec_to_json(s) for s in current.engine.outputs],
        }
    )


async def model_ready(request: web.Request) -> web.Response:
    slot = request.app[MANAGER].slot(_tenant_model(request))
    is_ready = slot.current is not None
    return web.json_response(
        {"name": request.match_info["name"], "ready": is_ready}, status=200 if is_ready else 503
    )


async def infer(request: web.Request) -> web.Response:
    manager, metrics = request.app[MANAGER], request.app[METRICS]
    started = time.perf_counter()
    key = request.match_info["name"]
    code = "500"
    try:
        key = _tenant_model(request)
        metrics.in_flight.labels(key).inc()
        try:
            body = await _json_body(request)
            with manager.slot(key).pin() as pinned:  # validate against the answering version
                feeds = decode_inputs(body, pinned.engine.inputs)
                outputs = await manager.run(pinned, feeds)
            response = {
                "model_name": request.match_info["name"],
                "model_version": pinned.version,
                "id": str(body.get("id") or uuid.uuid4()),
                "outputs": encode_outputs(outputs, body.get("outputs")),
            }
        finally:
            metrics.in_flight.labels(key).dec()
        code = "200"
        return web.json_response(response)
    except ServingError as exc:
        code = str(exc.status)
        raise
    finally:
        metrics.requests.labels(key, code).inc()
        metrics.request_latency.labels(key).observe(time.perf_counter() - started)


async def model_health(request: web.Request) -> web.Response:
    slot = request.app[MANAGER].slot(_tenant_model(request))
    current = slot.current
    if current is None:
        return web.json_response(
            {"status": "loading", "version": None, "loaded_at": None}, status=503
        )
    return web.json_response(
        {
            "status": "ok",
            "version": current.version,
            "loaded_at": _iso(current.loaded_at),
            "sha256": current.sha256,
            "retained": [v.version for v in slot.loaded() if v is not current],
        }
    )


async def reload(request: web.Request) -> web.Response:
    who = request.app[POLICY].check_admin(request.headers)
    key = _admin_model(request)
    target = request.query.get("target_version")
    if not target:
        raise BadRequest("reload needs ?target_version=<version>")
    check_name("version", target)
    manager = request.app[MANAGER]
    slot = manager.slot(key)
    previous = slot.current.version if slot.current else None
    try:
        result = await manager.load(key, target, who=who, source="http")
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
    return web.json_response(_swap_json(result))


async def rollback(request: web.Request) -> web.Response:
    who = request.app[POLICY].check_admin(request.headers)
    key = _admin_model(request)
    target = request.query.get("target_version")
    if target:
        check_name("version", target)
    result = await request.app[MANAGER].rollback(key, target, who=who, source="http")
    return web.json_response(_swap_json(result))


async def list_models(request: web.Request) -> web.Response:
    manager = request.app[MANAGER]
    tenant = request.app[POLICY].tenant_for(request.headers)
    prefix = f"{tenant}/" if tenant else ""
    models = []
    for key, slot in sorted(manager.slots.items()):
        if (tenant is None and "/" in key) or (tenant and not key.startswith(prefix)):
            continue
        current = slot.current
        models.append(
            {
                "name": key.removeprefix(prefix),
                "version": current.version if current else None,
                "loaded": [v.version for v in slot.loaded()],
                "available": manager.repository.versions(key),
            }
        )
    return web.json_response({"models": models})


async def audit(request: web.Request) -> web.Response:
    request.app[POLICY].check_admin(request.headers)
    return web.json_response({"events": request.app[MANAGER].audit.events[-200:]})


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
