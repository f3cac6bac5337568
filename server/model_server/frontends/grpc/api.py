"""The KServe v2 gRPC API (``inference.GRPCInferenceService``, Triton's definition: what
``tritonclient.grpc`` calls) on a port of its own: a thin transport over
:class:`~model_server.dataplane.data_plane.DataPlane`, like :mod:`.http_api`, with the same
operations, authentication, tenants, metrics and audit.

A call's metadata stands for the HTTP headers: ``authorization: Bearer <key, JWT or
admin token>`` (or ``x-api-key``) for tenants and the repository extension, and
``x-model-version`` to pin a version as over HTTP. A refusal is the gRPC status of its
HTTP status (:data:`STATUS_CODES`), with the error's message as details and its stable
code in the trailing metadata ``error-code`` (plus ``retry-after`` in seconds when the
client should retry). Requests are counted in the metrics under the HTTP status code
they would have had, so that a version's error rate means one thing over both APIs.

This module imports grpcio: the server imports it only when started with
``--grpc-port``."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf import json_format
from grpc import aio
from multidict import CIMultiDict

from model_rollout_contract.canary import PIN_HEADER
from model_rollout_contract.names import InvalidName, ModelKey, check_name
from model_server.dataplane.data_plane import Caller, DataPlane
from model_server.errors import BadRequest, ServingError, internal_error
from model_server.frontends.grpc.codec import GrpcInferRequest
from model_server.frontends.grpc.protocol import grpc_service_pb2 as pb
from model_server.frontends.grpc.protocol import grpc_service_pb2_grpc as pb_grpc
from model_server.security.auth import AccessPolicy

log = logging.getLogger(__name__)
T = TypeVar("T")

# the gRPC status of each HTTP status a ServingError carries (anything else: INTERNAL)
STATUS_CODES: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,  # HTTP only: a request body that stalled
    409: grpc.StatusCode.ABORTED,  # another load or unload of the model won
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.FAILED_PRECONDITION,  # the version was refused; the old one serves
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,  # a tenant over its rate limit (retry-after)
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
    507: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
ERROR_CODE_KEY = "error-code"  # trailing metadata: the error's stable code
RETRY_AFTER_KEY = "retry-after"  # trailing metadata: seconds to wait before a retry
# the RPCs of the service this server does not offer, and why
UNIMPLEMENTED = {
    "ModelStreamInfer": "streaming inference is not supported: use ModelInfer",
    "SystemSharedMemoryStatus": "the shared-memory extension is not supported",
    "SystemSharedMemoryRegister": "the shared-memory extension is not supported",
    "SystemSharedMemoryUnregister": "the shared-memory extension is not supported",
    "CudaSharedMemoryStatus": "the CUDA shared-memory extension is not supported",
    "CudaSharedMemoryRegister": "the CUDA shared-memory extension is not supported",
    "CudaSharedMemoryUnregister": "the CUDA shared-memory extension is not supported",
    "TraceSetting": "the trace extension is not supported",
    "LogSettings": "the logging extension is not supported",
}


def grpc_status(error: ServingError) -> grpc.StatusCode:
    return STATUS_CODES.get(error.status, grpc.StatusCode.INTERNAL)


def call_headers(context: aio.ServicerContext) -> CIMultiDict[str]:
    """The call's metadata as the case-insensitive headers auth reads (``-bin`` keys,
    whose values are bytes, left out)."""
    return CIMultiDict(
        (key, value)
        for key, value in (context.invocation_metadata() or ())
        if not key.endswith("-bin")
    )


async def abort(context: aio.ServicerContext, error: ServingError) -> None:
    trailers = [(ERROR_CODE_KEY, error.code)]
    if error.retry_after_s is not None:
        trailers.append((RETRY_AFTER_KEY, str(error.retry_after_s)))
    context.set_trailing_metadata(tuple(trailers))
    await context.abort(grpc_status(error), error.message)


def _as_serving_error(exc: Exception) -> ServingError:
    """The error a call is refused with: an exception that is no ``ServingError`` (an
    engine failing at run time, a bug) is INTERNAL with its message, as over HTTP, and
    logged with its traceback."""
    if isinstance(exc, ServingError):
        return exc
    if isinstance(exc, InvalidName):  # a name that breaks the contract's rule
        return BadRequest(str(exc))
    log.exception("gRPC call failed")
    return internal_error(exc)


Rpc = Callable[[Any, Any, aio.ServicerContext], Awaitable[T]]


def _rpc(method: Rpc[T]) -> Rpc[T]:
    """Every refusal of ``method`` as its gRPC status, never an UNKNOWN with a trace."""

    @functools.wraps(method)
    async def handler(self: Any, request: Any, context: aio.ServicerContext) -> T:
        try:
            return await method(self, request, context)
        except aio.AbortError:
            raise
        except Exception as exc:
            error = _as_serving_error(exc)
        await abort(context, error)
        raise AssertionError("unreachable: abort raises")

    return handler


def _unimplemented(why: str) -> Callable[..., Awaitable[None]]:
    async def handler(self: Any, request: Any, context: aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, why)

    return handler


def _message(raw: Any, message: T) -> T:
    """A data-plane answer (the HTTP API's JSON shape) as its protobuf message: the
    protocol's JSON form is that message's JSON mapping."""
    return json_format.ParseDict(raw, message, ignore_unknown_fields=True)


class InferenceService(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, plane: DataPlane, policy: AccessPolicy) -> None:
        self.plane = plane
        self.policy = policy

    async def _key(self, name: str, context: aio.ServicerContext) -> str:
        """The model a caller's name stands for (its tenant's, by its API key or JWT)."""
        return str(ModelKey.of(name, await self.policy.tenant_for(call_headers(context))))

    def _admin(self, context: aio.ServicerContext) -> Caller:
        return Caller(self.policy.check_admin(call_headers(context)), "grpc")

    # -- health and metadata --------------------------------------------------
    async def ServerLive(self, request: pb.ServerLiveRequest, context: Any) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: Any) -> Any:
        return pb.ServerReadyResponse(ready=self.plane.ready())

    @_rpc
    async def ModelReady(self, request: pb.ModelReadyRequest, context: Any) -> Any:
        key = await self._key(request.name, context)
        return pb.ModelReadyResponse(ready=self.plane.model_ready(key, _version(request)))

    @_rpc
    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: Any) -> Any:
        return _message(self.plane.server_metadata(), pb.ServerMetadataResponse())

    @_rpc
    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Any) -> Any:
        key = await self._key(request.name, context)
        metadata = self.plane.model_metadata(key, request.name, _version(request))
        return _message(metadata, pb.ModelMetadataResponse())

    @_rpc
    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Any) -> Any:
        key = await self._key(request.name, context)
        config = self.plane.model_config(key, request.name, _version(request))
        return _message({"config": config}, pb.ModelConfigResponse())

    @_rpc
    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context: Any) -> Any:
        tenant = await self.policy.tenant_for(call_headers(context))
        if request.name:
            keys = [str(ModelKey.of(request.name, tenant))]
        else:  # every model of the caller's namespace
            keys = self.plane.namespace_keys(tenant)
        stats = self.plane.statistics(keys, _version(request))
        return _message(stats, pb.ModelStatisticsResponse())

    # -- inference ------------------------------------------------------------
    @_rpc
    async def ModelInfer(self, request: pb.ModelInferRequest, context: Any) -> Any:
        started, key = time.perf_counter(), request.model_name
        try:
            headers = call_headers(context)
            tenant = await self.policy.tenant_for(headers)
            key = str(ModelKey.of(request.model_name, tenant))
            self.policy.admit(tenant)  # over its rate limit: RESOURCE_EXHAUSTED
        except (ServingError, InvalidName) as exc:  # counted as the HTTP API counts them
            status = exc.status if isinstance(exc, ServingError) else BadRequest.status
            self.plane.count_rejected(key, status, time.perf_counter() - started)
            raise
        answer = await self.plane.infer(
            key,
            request.model_name,
            GrpcInferRequest(request),
            headers.get(PIN_HEADER),
            request.model_version or None,
        )
        shadow = answer.shadow
        if shadow is not None:  # mirrored to the candidate once the client has its answer
            context.add_done_callback(lambda _call: self.plane.shadow(shadow))
        return answer.body

    # -- model repository extension (admin calls, as over HTTP) ---------------------
    @_rpc
    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context: Any) -> Any:
        self._admin(context)
        _one_repository(request.repository_name)
        models = self.plane.repository_index(None, ready=request.ready)
        return _message({"models": models}, pb.RepositoryIndexResponse())

    @_rpc
    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: Any
    ) -> Any:
        caller = self._admin(context)
        _one_repository(request.repository_name)
        key, parameters = str(ModelKey.parse(request.model_name)), _values(request.parameters)
        await self.plane.repository_load(key, caller, parameters)
        return pb.RepositoryModelLoadResponse()

    @_rpc
    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: Any
    ) -> Any:
        caller = self._admin(context)
        _one_repository(request.repository_name)
        key, parameters = str(ModelKey.parse(request.model_name)), _values(request.parameters)
        await self.plane.repository_unload(key, caller, parameters)
        return pb.RepositoryModelUnloadResponse()


for _name, _why in UNIMPLEMENTED.items():
    setattr(InferenceService, _name, _unimplemented(_why))


def _version(request: Any) -> str | None:
    """The version a request names (empty: the one the server chooses), checked."""
    return check_name("version", request.version) if request.version else None


def _one_repository(name: str) -> None:
    if name:
        raise BadRequest(
            f"repository {name!r}: this server has one repository; leave repository_name empty"
        )


def _values(parameters: Any) -> dict[str, Any]:
    """A repository call's parameters as the JSON values the data plane checks."""
    return {
        key: getattr(value, value.WhichOneof("parameter_choice") or "bool_param")
        for key, value in parameters.items()
    }


class GrpcServer:
    """The gRPC API's listener: started once the models are loaded, stopped after the
    HTTP drain (in-flight calls finish within the grace, later ones are refused)."""

    def __init__(
        self,
        plane: DataPlane,
        policy: AccessPolicy,
        host: str,
        port: int,
        max_message_bytes: int,
        reuse_port: bool = False,
    ) -> None:
        self.service = InferenceService(plane, policy)
        self.reuse_port = reuse_port  # the workers of a pool share the port
        self.host = host
        self.requested_port = port
        self.max_message_bytes = max_message_bytes
        self.port: int | None = None  # bound (0 asks for any free one)
        self._server: aio.Server | None = None

    async def start(self) -> int:
        server = aio.server(
            options=[
                ("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.max_send_message_length", -1),
                # a port in use is an error, not a shared port, except within a pool
                ("grpc.so_reuseport", 1 if self.reuse_port else 0),
            ]
        )
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(self.service, server)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.port = server.add_insecure_port(f"{host}:{self.requested_port}")
        await server.start()
        self._server = server
        log.info("serving gRPC on %s:%d", self.host, self.port)
        return self.port

    async def stop(self, grace_s: float | None) -> None:
        """Refuse new calls, give those in flight ``grace_s`` (``None``: all the time
        they take; 0: none), then cancel the rest."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace_s)
