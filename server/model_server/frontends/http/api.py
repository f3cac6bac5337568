"""HTTP API: the KServe v2 / Open Inference Protocol (health, server and model
metadata, inference with the binary tensor data extension, model configuration,
statistics, the model repository extension; each model route also under
``/versions/{version}``) plus v1 control endpoints, a thin transport over
:class:`~model_server.dataplane.data_plane.DataPlane` (authentication and tenant routing happen
here; every answer is built there).

``/v2/models/stats`` is the statistics of every model, as in Triton: a model named
``stats`` has its metadata at ``/v2/models/stats/versions/{v}`` only."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from model_rollout_contract.canary import PIN_HEADER
from model_rollout_contract.control import SwapReply
from model_rollout_contract.names import InvalidName, ModelKey, check_name
from model_server.dataplane.data_plane import CLIENT_CLOSED, Caller, DataPlane
from model_server.errors import BadRequest, RequestTimeout, ServingError, internal_error
from model_server.frontends.http.body import read_body
from model_server.frontends.http.codec import HttpInferBody
from model_server.frontends.http.codec_workers import JsonCodec
from model_server.observability.metrics import ServerMetrics
from model_server.protocol.binary_codec import HEADER_LENGTH, declared_header_length, header_length
from model_server.protocol.tensors import parameters_of
from model_server.protocol.v2_codec import parse_json
from model_server.security.auth import AccessPolicy

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

PLANE = web.AppKey("plane", DataPlane)
POLICY = web.AppKey("policy", AccessPolicy)
METRICS = web.AppKey("metrics", ServerMetrics)
BODY_TIMEOUT = web.AppKey("body_read_timeout_s", float)
JSON_CODEC = web.AppKey("json_codec", JsonCodec)  # the JSON worker processes: HTTP's alone
# a pool's worker answers /metrics and statistics for the whole pod: the pool installs these
MergedMetrics = Callable[[ServerMetrics], Awaitable[web.Response]]
MergedStatistics = Callable[[dict[str, Any], list[str], str | None], Awaitable[dict[str, Any]]]
MERGED_METRICS: web.AppKey[MergedMetrics] = web.AppKey("merged_metrics")
MERGED_STATISTICS: web.AppKey[MergedStatistics] = web.AppKey("merged_statistics")


def error_response(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": message, "code": code}, status=status)


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure becomes a JSON body with a 4xx/5xx status, never an HTML page or
    aiohttp's plain-text 500: an exception that is no ``ServingError`` (an engine failing
    at run time, a bug) is 500 ``internal_error`` with its message, logged with its
    traceback; a client that left mid-request is only logged. While the server drains,
    every answer also closes its connection, so that clients holding kept-alive
    connections go elsewhere instead of finding them closed later."""
    try:
        response = await handler(request)
    except RequestTimeout as exc:  # its client stalled mid-body
        return await _answer_and_close(request, error_response(exc.status, exc.code, exc.message))
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
    except Exception as exc:
        if isinstance(exc, ConnectionResetError) and _client_left(request):
            log.info("%s %s: the client left: %s", request.method, request.path, exc)
            response = web.Response(status=int(CLIENT_CLOSED))  # nobody reads it
        else:
            log.exception("%s %s failed", request.method, request.path)
            error = internal_error(exc)
            response = error_response(error.status, error.code, error.message)
    if request.app[PLANE].draining or response.status == TOO_LARGE:
        response.force_close()
    return response


TOO_LARGE = web.HTTPRequestEntityTooLarge.status_code  # the connection then ends (lingering)


async def _answer_and_close(request: web.Request, response: web.Response) -> web.Response:
    """Write ``response`` and close the connection at once: its client stalled mid-body,
    so lingering to read the rest of the body would hold the descriptor on for nothing."""
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    if request.transport is not None:
        request.transport.close()
    return response


def _client_left(request: web.Request) -> bool:
    """Whether the request's connection is gone (its body cut short, say)."""
    transport = request.transport
    return transport is None or transport.is_closing()


async def _tenant_model(request: web.Request) -> str:
    tenant = await request.app[POLICY].tenant_for(request.headers)
    return str(ModelKey.of(request.match_info["name"], tenant))


def _route_version(request: web.Request) -> str | None:
    """The version a ``/versions/{version}`` route names (None: the serving one)."""
    version = request.match_info.get("version")
    return check_name("version", version) if version is not None else None


def _repository_model(request: web.Request) -> str:
    """The model a repository call names: ``name``, or a tenant's as ``tenant/name``
    (two path segments, or one with the slash escaped): the admin token is no tenant's
    key, so the name carries the namespace."""
    name, tenant = request.match_info["name"], request.match_info.get("tenant")
    return str(ModelKey.parse(name) if tenant is None else ModelKey.of(name, tenant))


async def _json_object(request: web.Request, what: str) -> dict[str, Any]:
    """A small JSON object body (empty: ``{}``), as the repository calls take."""
    raw = await read_body(request, request.app[BODY_TIMEOUT])
    if not raw.nbytes:
        return {}
    body = parse_json(raw, request.charset or "utf-8")
    if not isinstance(body, dict):
        raise BadRequest(f"{what}: the body must be a JSON object")
    return body


def _admin_model(request: web.Request) -> str:
    name = request.query.get("model")
    if name is None:
        served = request.app[PLANE].model_keys()
        if len(served) != 1:
            raise BadRequest(f"several models are served; name one with ?model= ({served})")
        return served[0]
    return str(ModelKey.parse(name))


def _swap_json(reply: SwapReply) -> dict[str, Any]:
    return {"status": "ok", **reply.fields()}


async def live(request: web.Request) -> web.Response:
    return web.json_response({"live": True})


async def ready(request: web.Request) -> web.Response:
    is_ready = request.app[PLANE].ready()
    return web.json_response({"ready": is_ready}, status=200 if is_ready else 503)


async def server_metadata(request: web.Request) -> web.Response:
    return web.json_response(request.app[PLANE].server_metadata())


async def model_metadata(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    metadata = request.app[PLANE].model_metadata(
        await _tenant_model(request), name, _route_version(request)
    )
    return web.json_response(metadata)


async def model_ready(request: web.Request) -> web.Response:
    version = _route_version(request)
    is_ready = request.app[PLANE].model_ready(await _tenant_model(request), version)
    answer: dict[str, Any] = {"name": request.match_info["name"], "ready": is_ready}
    if version is not None:
        answer["version"] = version
    return web.json_response(answer, status=200 if is_ready else 503)


async def model_config(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    key = await _tenant_model(request)
    config = request.app[PLANE].model_config(key, name, _route_version(request))
    return web.json_response(config)


async def statistics(request: web.Request) -> web.Response:
    plane = request.app[PLANE]
    tenant = await request.app[POLICY].tenant_for(request.headers)
    name = request.match_info.get("name")
    keys = [str(ModelKey.of(name, tenant))] if name is not None else plane.namespace_keys(tenant)
    version = _route_version(request)
    answer = plane.statistics(keys, version)
    merged = request.app.get(MERGED_STATISTICS)
    if merged is not None:  # one worker of a pool: the pod's numbers are every worker's
        answer = await merged(answer, keys, version)
    return web.json_response(answer)


async def infer(request: web.Request) -> web.Response:
    plane, name = request.app[PLANE], request.match_info["name"]
    started, key = time.perf_counter(), name
    try:
        policy = request.app[POLICY]
        tenant = await policy.tenant_for(request.headers)
        key = str(ModelKey.of(name, tenant))
        policy.admit(tenant)  # over its rate limit: 429 before the body is read
        version = _route_version(request)
        declared = request.headers.get(HEADER_LENGTH)
        json_part = declared_header_length(declared)  # where the binary part starts (checked)
        # a full queue: 503 before reading (only the JSON part may wait for a worker)
        request.app[JSON_CODEC].check_room(json_part or request.content_length)
        body = await read_body(request, request.app[BODY_TIMEOUT], json_part)  # too large: 413
        length = header_length(declared, body.nbytes)
    except (ServingError, InvalidName, web.HTTPException) as exc:
        status = exc.status if isinstance(exc, ServingError | web.HTTPException) else 400
        plane.count_rejected(key, status, time.perf_counter() - started)
        raise
    codec = HttpInferBody(request.app[JSON_CODEC], body, request.charset or "utf-8", length)
    answer = await plane.infer(key, name, codec, request.headers.get(PIN_HEADER), version)
    response = web.Response(body=answer.body.body, content_type=answer.body.content_type)
    if answer.body.header_length is not None:
        response.headers[HEADER_LENGTH] = str(answer.body.header_length)
    if answer.shadow is not None:  # mirrored to the candidate once the client has its answer
        if plane.draining:
            response.force_close()
        await response.prepare(request)
        await response.write_eof()
        plane.shadow(answer.shadow)
    return response


async def model_health(request: web.Request) -> web.Response:
    health = request.app[PLANE].health(await _tenant_model(request))
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
    tenant = await request.app[POLICY].tenant_for(request.headers)
    return web.json_response({"models": request.app[PLANE].list_models(tenant)})


async def audit(request: web.Request) -> web.Response:
    request.app[POLICY].check_admin(request.headers)
    return web.json_response({"events": request.app[PLANE].audit_events()})


async def repository_index(request: web.Request) -> web.Response:
    request.app[POLICY].check_admin(request.headers)
    body = await _json_object(request, "repository index")
    ready = body.get("ready", False)
    if not isinstance(ready, bool):
        raise BadRequest("repository index: 'ready' must be a boolean")
    return web.json_response(request.app[PLANE].repository_index(None, ready=ready))


async def repository_load(request: web.Request) -> web.Response:
    who = request.app[POLICY].check_admin(request.headers)
    key = _repository_model(request)
    parameters = parameters_of(await _json_object(request, "load"), "load")
    reply = await request.app[PLANE].repository_load(key, Caller(who, "http"), parameters)
    return web.json_response({"status": "ok", **reply})


async def repository_unload(request: web.Request) -> web.Response:
    who = request.app[POLICY].check_admin(request.headers)
    key = _repository_model(request)
    parameters = parameters_of(await _json_object(request, "unload"), "unload")
    reply = await request.app[PLANE].repository_unload(key, Caller(who, "http"), parameters)
    return web.json_response({"status": "ok", **reply})


async def metrics_endpoint(request: web.Request) -> web.Response:
    merged = request.app.get(MERGED_METRICS)
    if merged is not None:  # one worker of a pool: the pod's series are every worker's
        return await merged(request.app[METRICS])
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


MODEL = "/v2/models/{name}"
VERSION = "/v2/models/{name}/versions/{version}"
REPOSITORY_MODEL = ("/v2/repository/models/{name}", "/v2/repository/models/{tenant}/{name}")


def add_routes(app: web.Application) -> None:
    app.add_routes(
        [
            web.get("/v2", server_metadata),
            web.get("/v2/health/live", live),
            web.get("/v2/health/ready", ready),
            web.get("/v2/models/stats", statistics),  # before {name}: Triton's route
            *(
                route
                for base in (MODEL, VERSION)
                for route in (
                    web.get(base, model_metadata),
                    web.get(f"{base}/ready", model_ready),
                    web.post(f"{base}/infer", infer),
                    web.get(f"{base}/config", model_config),
                    web.get(f"{base}/stats", statistics),
                )
            ),
            web.post("/v2/repository/index", repository_index),
            *(web.post(f"{base}/load", repository_load) for base in REPOSITORY_MODEL),
            *(web.post(f"{base}/unload", repository_unload) for base in REPOSITORY_MODEL),
            web.get("/v1/models", list_models),
            web.get("/v1/models/{name}/health", model_health),
            web.post("/v1/reload", reload),
            web.post("/v1/rollback", rollback),
            web.get("/v1/audit", audit),
            web.get("/metrics", metrics_endpoint),
        ]
    )
