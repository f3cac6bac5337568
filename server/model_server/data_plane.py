"""The server's operations, independent of any transport (as KServe's
``protocol/dataplane.py``): the HTTP API and the control socket both call this class,
and a gRPC front end would be a third caller. Authentication and the mapping of names
to tenants stay in the transports; every answer is built here once."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from model_rollout_contract.control import StatusReply, SwapReply

from .codec_workers import JsonCodec
from .engine_manager import EngineManager, SwapResult
from .errors import ModelNotFound, NotReady, ServingError, Unavailable
from .metrics import ServerMetrics
from .model_slot import LoadedVersion, ModelSlot
from .tensors import select_outputs, spec_to_json
from .v2_codec import InferenceRequest

# decodes of one request when swaps keep changing the model's inputs meanwhile
DECODE_ATTEMPTS = 3


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


@dataclass(frozen=True)
class Caller:
    """Who asks, for the audit log: ``admin``, ``startup``, ``socket:uid=…,pid=…``."""

    who: str
    source: str  # http | socket | startup


class DataPlane:
    def __init__(
        self, manager: EngineManager, metrics: ServerMetrics, codec: JsonCodec | None = None
    ) -> None:
        self.manager = manager
        self.metrics = metrics
        self.codec = codec or JsonCodec()
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
        return {
            "status": "ok",
            "version": current.version,
            "loaded_at": _iso(current.loaded_at),
            "sha256": current.sha256,
            "retained": [v.version for v in slot.loaded() if v is not current],
            "versions": states,
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
        self, slot: ModelSlot, body: bytes, charset: str
    ) -> tuple[LoadedVersion, InferenceRequest, dict[str, np.ndarray]]:
        """Decode against the serving version's input specs *without* pinning it (a large
        body can wait for a JSON worker: a pin would keep a dropped version's engine, and
        its memory, open meanwhile), then pin the serving version and run it if its
        inputs are still the ones decoded for; else decode again for the new ones."""
        for _attempt in range(DECODE_ATTEMPTS):
            current = slot.current
            if current is None:
                raise NotReady(f"model {slot.key!r} has no version loaded yet")
            specs = current.engine.inputs
            request = await self.codec.decode(body, charset, specs)
            with slot.pin() as pinned:
                if pinned.engine.inputs == specs:
                    return pinned, request, await self.manager.run(pinned, request.feeds)
        raise Unavailable(
            f"model {slot.key!r} changed its inputs {DECODE_ATTEMPTS} times while this request "
            "was decoded; retry",
            retry_after_s=1,
        )

    async def infer(self, key: str, name: str, body: bytes, charset: str | None) -> bytes:
        """A KServe v2 inference on a JSON body: validated against, and answered by, the
        one version pinned for this request. Returns the JSON response's bytes."""
        started = time.perf_counter()
        code = "500"
        self.metrics.in_flight.labels(key).inc()
        try:
            slot = self.manager.slot(key)
            pinned, request, results = await self._decode_and_run(slot, body, charset or "utf-8")
            outputs = select_outputs(results, request.outputs)
            response = await self.codec.encode(
                name, pinned.version, request.id or str(uuid.uuid4()), outputs
            )
            code = "200"
            return response
        except ServingError as exc:
            code = str(exc.status)
            raise
        finally:
            self.metrics.in_flight.labels(key).dec()
            self.metrics.requests.labels(key, code).inc()
            self.metrics.request_latency.labels(key).observe(time.perf_counter() - started)

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
