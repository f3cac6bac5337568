"""The server's operations, independent of any transport (as KServe's
``protocol/dataplane.py``): the HTTP API, the gRPC API and the control socket call this
class. Authentication and the mapping of names to tenants stay in the transports; every
answer is built here once, as the HTTP API's JSON (the gRPC API maps it to protobuf):
health, server and model metadata, model configuration, statistics, inference, and the
model repository extension (index, load, unload).

An inference is answered by the version :mod:`.traffic` routes it to (a pinned one, or
under a canary's traffic policy the candidate or the stable one) and counted in that
version's series; an answer of the stable version may carry a shadow job, which the
transport submits once the client has the answer (:mod:`.shadow`)."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from model_rollout_contract.canary import PIN_HEADER, TrafficPolicy
from model_rollout_contract.control import StatusReply, SwapReply
from model_rollout_contract.names import InvalidName, ModelKey, check_name
from model_rollout_contract.versions import newest, sorted_versions
from model_server.dataplane.inference_stats import RequestTiming, StatisticsBook
from model_server.dataplane.metadata import model_config, server_metadata
from model_server.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    ModelNotFound,
    ServingError,
    Unavailable,
    VersionNotFound,
)
from model_server.files.trusted_files import UntrustedPath
from model_server.lifecycle.engine_manager import EngineManager, SwapResult
from model_server.lifecycle.load_stages import milliseconds
from model_server.lifecycle.model_slot import LoadedVersion, ModelSlot, VersionState
from model_server.lifecycle.request_limits import RowLimits
from model_server.lifecycle.startup import load_resumed, resumed_policy
from model_server.observability.audit import AuditEvent
from model_server.observability.metrics import ServerMetrics
from model_server.protocol.tensor_spec import TensorSpec
from model_server.protocol.tensors import select_outputs, spec_to_json
from model_server.protocol.v2_codec import InferenceRequest
from model_server.scheduling.batching import request_rows
from model_server.scheduling.runner import Runner
from model_server.scheduling.shadow import ShadowJob, ShadowRunner
from model_server.scheduling.traffic import Route, TrafficRouter

# decodes of one request when swaps keep changing the model's inputs meanwhile
DECODE_ATTEMPTS = 3
SHADOW_MAX_IN_FLIGHT = 2  # shadow runs at once, unless the server is told otherwise
R = TypeVar("R")
# a request its client gave up on (a gRPC deadline, a cancelled call): nginx's code for it.
# The server counts it; the version's series do not, since the client left, not the model
CLIENT_CLOSED = "499"
# the model label of requests naming no model served here: a client choosing names must
# not add series (no model name has parentheses)
UNKNOWN_MODEL = "(unknown)"
R_co = TypeVar("R_co", covariant=True)


# an answer's id when its request gave none: unique per process start (a uuid4) and
# counter, without uuid4's os.urandom call on every request (3 % of its GIL time)
_ANSWER_ID_PREFIX = uuid.uuid4().hex
_ANSWER_IDS = itertools.count(1)


def next_answer_id() -> str:
    return f"{_ANSWER_ID_PREFIX}-{next(_ANSWER_IDS)}"


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat()


def swap_reply(result: SwapResult) -> SwapReply:
    return SwapReply(
        result.model,
        result.from_version,
        result.to_version,
        round(result.duration_s * 1000, 3),
        result.instant,
        tuple(milliseconds(result.stages_s).items()),
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
class Answer(Generic[R]):
    body: R  # the response, as the transport's codec encoded it
    shadow: ShadowJob | None = None  # to submit once the client has ``body``


@dataclass
class _Served:
    """The version that ran a request (for its series and statistics), once it is
    pinned: a request refused before that (a full decode queue, a malformed body) is not
    that version's; and where the request's time went."""

    version: LoadedVersion | None = None
    rows: int = 1  # what the statistics' inference_count counts it as
    decode_ns: int = 0
    run_ns: int = 0
    encode_ns: int = 0


@dataclass(frozen=True)
class Caller:
    """Who asks, for the audit log: ``admin``, ``startup``, ``socket:uid=…,pid=…``."""

    who: str
    source: str  # http | socket | startup


class DataPlane:
    def __init__(
        self,
        manager: EngineManager,
        runner: Runner,
        metrics: ServerMetrics,
        router: TrafficRouter | None = None,
        shadows: ShadowRunner | None = None,
        limits: RowLimits | None = None,
    ) -> None:
        self.manager = manager
        self.runner = runner
        self.limits = limits or manager.row_limits  # one for requests and their batches
        self.metrics = metrics
        self.router = router or TrafficRouter()
        self.shadows = shadows or ShadowRunner(SHADOW_MAX_IN_FLIGHT)
        self.statistics_book = StatisticsBook()
        self.draining = False  # after SIGTERM: unready, still serving
        # models an admin unloaded (repository extension): they serve nothing, and do
        # not hold the server's readiness back, until a version is loaded again
        self.unloaded: set[str] = set()
        # a worker of a pool (model_server.pool.supervisor) swaps versions only as its supervisor
        # tells it, so that every worker serves the same: this says why, to an admin
        self.admin_swaps_refused: str | None = None

    # -- health and metadata --------------------------------------------------
    def model_keys(self) -> list[str]:
        return sorted(self.manager.slots)

    def begin_drain(self) -> None:
        """Readiness turns false so that endpoints stop sending; serving goes on."""
        self.draining = True

    def ready(self) -> bool:
        """Every model of the server's own serves, but those an admin unloaded (as
        Triton, whose readiness does not wait for a model unloaded on request). Tenant
        models (``tenant/name``) do not hold the pod back: one tenant whose version cannot
        load must not take the pod from everybody else (its own readiness is
        ``/v2/models/{m}/ready``); a server of tenant models only is ready once one
        serves."""
        if self.draining:
            return False
        serving = {
            key: slot.current is not None or key in self.unloaded
            for key, slot in self.manager.slots.items()
        }
        own = [ok for key, ok in serving.items() if ModelKey.tenant_in(key) is None]
        return all(own) if own else any(serving.values())

    def _version(self, key: str, version: str | None) -> LoadedVersion:
        """The loaded ``version`` of ``key`` (None: the serving one): a version that is
        not loaded is ``VersionNotFound``, a model with none ``ModelNotFound`` (404)."""
        slot = self.manager.slot(key)
        if version is not None:
            found = slot.get(check_name("version", version))
            if found is None:
                loaded = [v.version for v in slot.loaded()]
                raise VersionNotFound(
                    f"model {key!r} has no version {version!r} loaded (loaded: {loaded})"
                )
            return found
        current = slot.current
        if current is None:
            raise ModelNotFound(f"model {key!r} has no version loaded")
        return current

    def model_ready(self, key: str, version: str | None = None) -> bool:
        """Whether the model serves; with ``version``: that version is loaded and ready
        (one that is not loaded is ``VersionNotFound``)."""
        if version is None:
            return self.manager.slot(key).current is not None
        self._version(key, version)
        return True

    def server_metadata(self) -> dict[str, Any]:
        return server_metadata()

    def model_metadata(self, key: str, name: str, version: str | None = None) -> dict[str, Any]:
        """KServe's model metadata of the serving version, or of a loaded ``version``."""
        chosen = self._version(key, version)
        return {
            "name": name,
            "versions": [v.version for v in self.manager.slot(key).loaded()],
            "platform": chosen.engine.platform,
            "inputs": [spec_to_json(s) for s in chosen.engine.inputs],
            "outputs": [spec_to_json(s) for s in chosen.engine.outputs],
        }

    def model_config(self, key: str, name: str, version: str | None = None) -> dict[str, Any]:
        """Triton's model configuration of the serving version, or of a loaded one."""
        chosen = self._version(key, version)
        batchers = self.runner.batchers
        batched = batchers.batches(chosen)
        return model_config(
            name,
            chosen.engine,
            self.manager.backend.name,
            self.manager.retain,
            batchers.policy.max_batch_size if batched else 0,
            round(batchers.policy.max_queue_delay_s * 1e6),
        )

    def statistics(self, keys: list[str], version: str | None = None) -> dict[str, Any]:
        """Triton's statistics (``model_stats``) of every loaded version of ``keys``, or
        of one loaded ``version``; each model named as its namespace knows it."""
        stats = []
        for key in keys:
            chosen = [self._version(key, version)] if version else self.manager.slot(key).loaded()
            name, by_version = ModelKey.name_in(key), {v.version: v for v in chosen}
            stats += [
                self.statistics_book.of(by_version[v]).to_json(name, v)
                for v in sorted_versions(by_version)
            ]
        return {"model_stats": stats}

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
            slot.policy,
            policy_reported=True,
        )

    def namespace_keys(self, tenant: str | None) -> list[str]:
        """The keys of the models of one namespace: a tenant's, or (``None``) the default
        one."""
        return [k for k in sorted(self.manager.slots) if ModelKey.tenant_in(k) == tenant]

    def list_models(self, tenant: str | None) -> list[dict[str, Any]]:
        """The models of one namespace: a tenant's, or (``None``) the default one."""
        models = []
        for key, slot in sorted(self.manager.slots.items()):
            if ModelKey.tenant_in(key) != tenant:
                continue
            current = slot.current
            models.append(
                {
                    "name": ModelKey.name_in(key),
                    "version": current.version if current else None,
                    "loaded": [v.version for v in slot.loaded()],
                    "available": self.manager.repository.versions(key),
                }
            )
        return models

    def audit_events(self, limit: int = 200) -> list[dict[str, Any]]:
        return self.manager.audit.events[-limit:]

    # -- inference ----------------------------------------------------------
    def metric_model(self, key: str) -> str:
        """The model label of a request for ``key``: itself if served here, else
        ``UNKNOWN_MODEL``."""
        return key if key in self.manager.slots else UNKNOWN_MODEL

    def count_rejected(self, key: str, status: int, seconds: float) -> None:
        """An inference refused before it reached a model (auth, name, unreadable body)."""
        label = self.metric_model(key)
        self.metrics.requests.labels(label, str(status)).inc()
        self.metrics.request_latency.labels(label).observe(seconds)

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
            decoding = time.perf_counter_ns()
            request = await codec.decode(specs)
            served.decode_ns = time.perf_counter_ns() - decoding
            with slot.pin(route.version, or_serving=lenient) as pinned:
                if pinned.engine.inputs == specs:
                    # the rows' bound is of the version pinned, before it runs: a refusal
                    # is the client's 400, not the version's error
                    self.limits.check(slot.key, pinned.engine, request.feeds)
                    served.version = pinned
                    if self.runner.batches(pinned):  # counted by rows, as Triton
                        served.rows = request_rows(request.feeds) or 1
                    running = time.perf_counter_ns()
                    results = await self.runner.run(pinned, request.feeds)
                    served.run_ns = time.perf_counter_ns() - running
                    return pinned, request, results
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
        started_ns = time.perf_counter_ns()
        code = "500"
        served = _Served()
        label = self.metric_model(key)
        self.metrics.in_flight.labels(label).inc()
        try:
            slot = self.manager.slot(key)
            route = self.router.route_in(slot, _named_version(version, pin))
            pinned, request, results = await self._decode_and_run(slot, route, codec, served)
            encoding = time.perf_counter_ns()
            outputs = select_outputs(results, request.outputs)
            response = await codec.encode(
                name, pinned.version, request.id or next_answer_id(), outputs, request
            )
            served.encode_ns = time.perf_counter_ns() - encoding
            code = "200"
            if route.shadow is not None and pinned.version == route.version:
                job = ShadowJob(slot, route.shadow, request.feeds, results, self.limits)
                return Answer(response, job)
            return Answer(response)
        except ServingError as exc:
            code = str(exc.status)
            raise
        except asyncio.CancelledError:
            code = CLIENT_CLOSED
            raise
        finally:
            elapsed = time.perf_counter() - started
            self.metrics.in_flight.labels(label).dec()
            self.metrics.requests.labels(label, code).inc()
            self.metrics.request_latency.labels(label).observe(elapsed)
            if served.version is not None and code != CLIENT_CLOSED:
                served.version.metrics.request(code, elapsed)
                self._count(served, code, time.perf_counter_ns() - started_ns)

    def _count(self, served: _Served, code: str, total_ns: int) -> None:
        """A request that reached its version, in that version's statistics."""
        assert served.version is not None
        stats = self.statistics_book.of(served.version)
        if code != "200":
            stats.failed(total_ns)
            return
        timing = RequestTiming(total_ns, served.decode_ns, served.run_ns, served.encode_ns)
        stats.succeeded(timing, served.rows)

    def shadow(self, job: ShadowJob) -> None:
        """Mirror an answered request to the candidate (call once the client has it)."""
        self.shadows.submit(job)

    def set_traffic(self, key: str, policy: TrafficPolicy | None, caller: Caller) -> StatusReply:
        """Set (or clear, ``None``) the model's traffic policy; see ``ModelSlot.set_policy``.
        The policy it has already is a no-op (not audited again): a sidecar may repeat it."""
        slot = self.manager.slot(key)
        slot.overtake_loads()  # whatever it sets: a load in progress is not swapped in
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
    def _check_admin_swap(self, caller: Caller) -> None:
        """An admin's load, rollback or unload over HTTP or gRPC, refused in a pool."""
        if self.admin_swaps_refused is not None and caller.source in ("http", "grpc"):
            raise Conflict(self.admin_swaps_refused)

    async def load(
        self,
        key: str,
        version: str,
        caller: Caller,
        path: Path | None = None,
        sha256: str | None = None,
        policy: TrafficPolicy | None = None,
    ) -> SwapReply:
        """Load and swap in ``version``; with ``policy`` (its candidate is ``version``)
        the traffic policy is set in the same step (``EngineManager.load``)."""
        self._check_admin_swap(caller)
        result = await self.manager.load(
            key, version, path=path, expected_sha256=sha256, who=caller.who,
            source=caller.source, policy=policy,
        )  # fmt: skip
        self.unloaded.discard(key)
        return swap_reply(result)

    async def rollback(self, key: str, version: str | None, caller: Caller) -> SwapReply:
        self._check_admin_swap(caller)
        result = await self.manager.rollback(key, version, who=caller.who, source=caller.source)
        self.unloaded.discard(key)
        return swap_reply(result)

    # -- model repository extension -------------------------------------------
    def repository_index(self, tenant: str | None, ready: bool = False) -> list[dict[str, Any]]:
        """Every version of the models served, on disk or in memory, with its state
        (Triton's ModelReadyState) and why: a tenant's models by name, or (``None``,
        the admin's view) every model by its key (``tenant/name`` for a tenant's).
        ``ready``: only the versions ready for inference."""
        index = []
        for key, slot in sorted(self.manager.slots.items()):
            if tenant is not None and ModelKey.tenant_in(key) != tenant:
                continue
            states = slot.states()
            on_disk = self.manager.repository.versions(key)
            for version in sorted_versions({*on_disk, *states}):
                status = states.get(version)
                state = status.state.value if status else VersionState.UNAVAILABLE.value
                if ready and state != VersionState.READY.value:
                    continue
                reason = status.reason if status else "not loaded"
                if version not in on_disk:
                    reason += "; no longer in the repository"
                index.append(
                    {
                        "name": key if tenant is None else ModelKey.name_in(key),
                        "version": version,
                        "state": state,
                        "reason": reason,
                    }
                )
        return index

    async def repository_load(
        self, key: str, caller: Caller, parameters: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Load (or load again) the model as a restart would: the version its ``CURRENT``
        file names (what the sidecar last swapped to, so what this pod should serve),
        else the newest in the repository, under the traffic policy of its ``TRAFFIC``
        file on a canary pod (:mod:`.startup`); audited as any load. One already serving
        so is a no-op."""
        self._check_admin_swap(caller)
        if parameters:
            raise BadRequest(
                f"load parameters are not supported (a model's files and configuration come "
                f"from its repository): {sorted(parameters)}"
            )
        self.manager.slot(key)  # a model this server does not serve is a 404
        repository = self.manager.repository
        try:
            version = repository.current_version(key) or newest(repository.versions(key))
        except InvalidName as exc:  # CURRENT names no version
            raise BadRequest(str(exc)) from None
        except UntrustedPath as exc:  # a link or a special file in CURRENT's place
            raise Forbidden(str(exc)) from None
        if version is None:
            on_disk = repository.versions(key)
            raise VersionNotFound(
                f"model {key!r} has no version in the repository"
                if not on_disk
                else f"model {key!r} has no CURRENT, and its versions {on_disk} follow no "
                "version order (PEP 440, SemVer) that says which is newest: load one by name"
            )
        policy = resumed_policy(repository, key, version)
        try:
            result = await load_resumed(
                self.manager, key, version, policy, who=caller.who, source=caller.source
            )
        finally:  # the policy's stable version may serve although its candidate failed
            if self.manager.slot(key).current is not None:
                self.unloaded.discard(key)
        return swap_reply(result).fields()

    async def repository_unload(
        self, key: str, caller: Caller, parameters: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Unload every version of the model (Triton's unload): requests to it are 503
        until it is loaded again (each version is freed once its requests in flight
        end); the server stays ready for its other models. ``unload_dependents`` is
        accepted: no model here has dependents."""
        self._check_admin_swap(caller)
        extra = sorted(set(parameters or {}) - {"unload_dependents"})
        if extra:
            raise BadRequest(f"unload parameters are not supported: {extra}")
        dependents = (parameters or {}).get("unload_dependents", False)
        if not isinstance(dependents, bool):
            raise BadRequest("'unload_dependents' must be a boolean")
        slot = self.manager.slot(key)
        current = slot.current.version if slot.current else ""
        dropped = [v.version for v in slot.unload_all("unloaded on request")]
        self.unloaded.add(key)
        self.manager.audit.record(
            AuditEvent(
                "unload", key, current, caller.who, caller.source,
                "success" if dropped else "noop", detail=",".join(dropped) or None,
            )
        )  # fmt: skip
        return {"model": key, "unloaded": dropped}


def _named_version(route_version: str | None, pin: str | None) -> str | None:
    """The version a request names (its route's or gRPC's ``model_version``, or its pin
    header's), checked like any version name: a bad one is the client's 400, counted so;
    a route and a header naming two versions contradict each other."""
    if pin is not None:
        try:
            pin = check_name("version", pin)
        except InvalidName as exc:
            raise BadRequest(f"{PIN_HEADER}: {exc}") from None
    if route_version is not None:
        try:
            route_version = check_name("version", route_version)
        except InvalidName as exc:
            raise BadRequest(str(exc)) from None
        if pin is not None and pin != route_version:
            raise BadRequest(f"the route names version {route_version!r} and {PIN_HEADER} {pin!r}")
    return route_version or pin
