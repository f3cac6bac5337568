"""The server's operations, independent of any transport (as KServe's
``protocol/dataplane.py``): the HTTP API and the control socket both call this class,
and a gRPC front end would be a third caller. Authentication and the mapping of names
to tenants stay in the transports; every answer is built here once.

An inference is answered by the version :mod:`.traffic` routes it to (a pinned one, or
under a canary's traffic policy the candidate or the stable one) and counted in that
version's series; an answer of the stable version may carry a shadow job, which the
transport submits once the client has the answer (:mod:`.shadow`)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from model_rollout_contract.canary import PIN_HEADER, TrafficPolicy
from model_rollout_contract.control import StatusReply, SwapReply
from model_rollout_contract.names import InvalidName, check_name

from .audit import AuditEvent
from .backends.base import TensorSpec
from .codec_workers import JsonCodec
from .engine_manager import EngineManager, SwapResult
from .errors import BadRequest, ModelNotFound, ServingError, Unavailable
from .metrics import ServerMetrics
from .model_slot import LoadedVersion, ModelSlot
from .shadow import ShadowJob, ShadowRunner
from .tensors import select_outputs, spec_to_json
from .traffic import Route, TrafficRouter
from .v2_codec import InferenceRequest

# decodes of one request when swaps keep changing the model's inputs meanwhile
DECODE_ATTEMPTS = 3
SHADOW_MAX_IN_FLIGHT = 2  # shadow runs at once, unless the server is told otherwise
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat()


def swap_reply(result: SwapResult) -> SwapReply:
    return SwapReply(
        result.model,
        result.from_version,
        result.to_version,
        round(result.duration_s * 1000, 3),
        result.instant,
    )


class RequestCodec(Protocol[R_co]):
    """One transport's request, as the data plane needs it: its body decoded against the
    input specs of the version it is routed to (which can change, so decoding may run
    more than once), and the answer encoded in the transport's own form."""

    async def decode(self, specs: tuple[TensorSpec, ...]) -> InferenceRequest: ...

    async def encode(
        self,
        name: str,
        version: str,
        request_id: str,
        outputs: dict[str, np.ndarray],
        request: InferenceRequest,
    ) -> R_co: ...


@dataclass(frozen=True)
class JsonBody:
    """A KServe v2 JSON body over HTTP (decoded off the loop when large)."""

    codec: JsonCodec
    body: bytes
    charset: str = "utf-8"

    async def decode(self, specs: tuple[TensorSpec, ...]) -> InferenceRequest:
        return await self.codec.decode(self.body, self.charset, specs)

    async def encode(
        self,
        name: str,
        version: str,
        request_id: str,
        outputs: dict[str, np.ndarray],
        request: InferenceRequest,
    ) -> bytes:
        return await self.codec.encode(name, version, request_id, outputs)


@dataclass(frozen=True)
class Answer(Generic[R]):
    body: R  # the response, as the transport's codec encoded it
    shadow: ShadowJob | None = None  # to submit once the client has ``body``


@dataclass
class _Served:
    """The version that ran a request (for its series), once it is pinned: a request
    refused before that (a full decode queue, a malformed body) is not that version's."""

    version: LoadedVersion | None = None


@dataclass(frozen=True)
class Caller:
    """Who asks, for the audit log: ``admin``, ``startup``, ``socket:uid=…,pid=…``."""

    who: str
    source: str  # http | socket | startup


class DataPlane:
    def __init__(
        self,
        manager: EngineManager,
        metrics: ServerMetrics,
        codec: JsonCodec | None = None,
        router: TrafficRouter | None = None,
        shadows: ShadowRunner | None = None,
    ) -> None:
        self.manager = manager
        self.metrics = metrics
        self.codec = codec or JsonCodec()
        self.router = router or TrafficRouter()
        self.shadows = shadows or ShadowRunner(SHADOW_MAX_IN_FLIGHT)
        self.draining = False  # after SIGTERM: unready, still serving

    # -- health -------------------------------------------------------------
    def model_keys(self) -> list[str]:
        return sorted(self.manager.slots)

    def begin_drain(self) -> None:
        """Readiness turns false so that endpoints stop sending; serving goes on."""
        self.draining = True

    def ready(self) -> bool:
        return not self.draining and self.manager.ready()

    def model_ready(self, key: str) -> bool:
        return self.manager.slot(key).current is not None

    def model_metadata(self, key: str, name: str) -> dict[str, Any]:
        slot = self.manager.slot(key)
        current = slot.current
        if current is None:
            raise ModelNotFound(f"model {key!r} has no version loaded yet")
        return {
            "name": name,
            "versions": [v.version for v in slot.loaded()],
            "platform": current.engine.platform,
            "inputs": [spec_to_json(s) for s in current.engine.inputs],
            "outputs": [spec_to_json(s) for s in current.engine.outputs],
        }

    def health(self, key: str) -> dict[str, Any]:
        """The serving version, its digest, the retained ones, and every version's
        lifecycle state with its reason."""
        slot = self.manager.slot(key)
        current = slot.current
        states = {v: {"state": s.state.value, "reason": s.reason} for v, s in slot.states().items()}
        if current is None:
            return {"status": "loading", "version": None, "loaded_at": None, "versions": states}
        policy = slot.policy
        return {
            "status": "ok",
            "version": current.version,
            "loaded_at": _iso(current.loaded_at),
            "sha256": current.sha256,
            "retained": [v.version for v in slot.loaded() if v is not current],
            "versions": states,
            "traffic": policy.to_json() if policy else None,
        }

    def status(self, key: str) -> StatusReply:
        slot = self.manager.slot(key)
        current = slot.current
        return StatusReply(
            key,
            current.version if current else None,
            current.sha256 if current else None,
            tuple(v.version for v in slot.loaded()),
        )

    def list_models(self, tenant: str | None) -> list[dict[str, Any]]:
        """The models of one namespace: a tenant's, or (``None``) the default one."""
        prefix = f"{tenant}/" if tenant else ""
        models = []
        for key, slot in sorted(self.manager.slots.items()):
            if (tenant is None and "/" in key) or (tenant and not key.startswith(prefix)):
                continue
            current = slot.current
            models.append(
                {
                    "name": key.removeprefix(prefix),
                    "version": current.version if current else None,
                    "loaded": [v.version for v in slot.loaded()],
                    "available": self.manager.repository.versions(key),
                }
            )
        return models

    def audit_events(self, limit: int = 200) -> list[dict[str, Any]]:
        return self.manager.audit.events[-limit:]

    # -- inference ----------------------------------------------------------
    def count_rejected(self, key: str, status: int, seconds: float) -> None:
        """An inference refused before it reached a model (auth, name, unreadable body)."""
        self.metrics.requests.labels(key, str(status)).inc()
        self.metrics.request_latency.labels(key).observe(seconds)

    def check_body_room(self, body_bytes: int | None) -> None:
        """Refuse (503, Retry-After) a body that would wait behind a full decode queue."""
        self.codec.check_room(body_bytes)

    async def _decode_and_run(
        self, slot: ModelSlot, route: Route, codec: RequestCodec[Any], served: _Served
    ) -> tuple[LoadedVersion, InferenceRequest, dict[str, np.ndarray]]:
        """Decode against the routed version's input specs *without* pinning it (a large
        body can wait for a JSON worker: a pin would keep a dropped version's engine, and
        its memory, open meanwhile), then pin that version and run it if its inputs are
        still the ones decoded for; else decode again for the new ones. A version the
        policy routed to but that is gone meanwhile is replaced by the serving one: a
        policy never fails a request; a pinned one that is not loaded is a 404."""
        lenient = not route.pinned
        for _attempt in range(DECODE_ATTEMPTS):
            specs = slot.resolve(route.version, or_serving=lenient).engine.inputs
            request = await codec.decode(specs)
            with slot.pin(route.version, or_serving=lenient) as pinned:
                if pinned.engine.inputs == specs:
                    served.version = pinned
                    return pinned, request, await self.manager.run(pinned, request.feeds)
        raise Unavailable(
            f"model {slot.key!r} changed its inputs {DECODE_ATTEMPTS} times while this request "
            "was decoded; retry",
            retry_after_s=1,
        )

    async def infer(
        self,
        key: str,
        name: str,
        codec: RequestCodec[R],
        pin: str | None = None,
        version: str | None = None,
    ) -> Answer[R]:
        """A KServe v2 inference, validated against and answered by the one version pinned
        for it: ``version`` (a versioned route) or ``pin`` (the pin header) names it, else
        the traffic policy or the serving version chooses."""
        started = time.perf_counter()
        code = "500"
        served = _Served()
        self.metrics.in_flight.labels(key).inc()
        try:
            slot = self.manager.slot(key)
            route = self.router.route(slot.policy, _named_version(version, pin))
            pinned, request, results = await self._decode_and_run(slot, route, codec, served)
            outputs = select_outputs(results, request.outputs)
            response = await codec.encode(
                name, pinned.version, request.id or str(uuid.uuid4()), outputs, request
            )
            code = "200"
            if route.shadow is not None and pinned.version == route.version:
                return Answer(response, ShadowJob(slot, route.shadow, request.feeds, results))
            return Answer(response)
        except ServingError as exc:
            code = str(exc.status)
            raise
        finally:
            elapsed = time.perf_counter() - started
            self.metrics.in_flight.labels(key).dec()
            self.metrics.requests.labels(key, code).inc()
            self.metrics.request_latency.labels(key).observe(elapsed)
            if served.version is not None:
                served.version.metrics.request(code, elapsed)

    def shadow(self, job: ShadowJob) -> None:
        """Mirror an answered request to the candidate (call once the client has it)."""
        self.shadows.submit(job)

    def set_traffic(self, key: str, policy: TrafficPolicy | None, caller: Caller) -> StatusReply:
        """Set (or clear, ``None``) the model's traffic policy; see ``ModelSlot.set_policy``.
        The policy it has already is a no-op (not audited again): a sidecar may repeat it."""
        slot = self.manager.slot(key)
        if policy == slot.policy:
            return self.status(key)
        detail = policy.to_annotation() if policy else "cleared"
        current = slot.current.version if slot.current else ""
        event = AuditEvent(
            "traffic", key, policy.candidate if policy else current, caller.who, caller.source,
            "success", from_version=policy.stable if policy else None, detail=detail,
        )  # fmt: skip
        try:
            slot.set_policy(policy)
        except ServingError as exc:
            event.result, event.error = "failure", exc.message
            raise
        finally:
            self.manager.audit.record(event)
        return self.status(key)

    # -- versions -----------------------------------------------------------
    async def load(
        self,
        key: str,
        version: str,
        caller: Caller,
        path: Path | None = None,
        sha256: str | None = None,
    ) -> SwapReply:
        result = await self.manager.load(
            key, version, path=path, expected_sha256=sha256, who=caller.who, source=caller.source
        )
        return swap_reply(result)

    async def rollback(self, key: str, version: str | None, caller: Caller) -> SwapReply:
        result = await self.manager.rollback(key, version, who=caller.who, source=caller.source)
        return swap_reply(result)


def _named_version(route_version: str | None, pin: str | None) -> str | None:
    """The version a request names (its route's, or its pin header's), checked like any
    version name; a route and a header naming two versions contradict each other."""
    if pin is not None:
        try:
            pin = check_name("version", pin)
        except InvalidName as exc:
            raise BadRequest(f"{PIN_HEADER}: {exc}") from None
    if route_version is not None:
        route_version = check_name("version", route_version)
        if pin is not None and pin != route_version:
            raise BadRequest(f"the route names version {route_version!r} and {PIN_HEADER} {pin!r}")
    return route_version or pin
