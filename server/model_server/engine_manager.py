"""Double-buffered engine management: the models' slots (:mod:`.model_slot`), the load
pipeline (:mod:`.load_pipeline`) and the reporting of what happened (:mod:`.reporting`).

A new version is loaded *beside* the serving one, warmed up, and only then swapped in by
replacing one reference under a lock held for a few instructions. Up to ``retain``
versions stay loaded, so rolling back to one of them is a pointer swap.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .audit import AuditLog
from .backends.base import Backend
from .errors import Conflict, ModelNotFound
from .load_pipeline import LoadPipeline
from .metrics import ServerMetrics
from .model_slot import LoadedVersion, ModelSlot
from .reporting import LifecycleEvent, Reporter
from .repository import ModelRepository


@dataclass(frozen=True)
class SwapResult:
    model: str
    from_version: str | None
    to_version: str
    duration_s: float
    instant: bool  # True when the version was already loaded (retained)


class EngineManager:
    def __init__(
        self,
        backend: Backend,
        repository: ModelRepository,
        metrics: ServerMetrics,
        audit: AuditLog,
        retain: int = 2,
        memory_budget_bytes: int | None = None,
        executor: Executor | None = None,
    ) -> None:
        self.backend = backend
        self.repository = repository
        self.metrics = metrics
        self.audit = audit
        self.retain = retain
        self.executor = executor  # inference threads
        self.pipeline = LoadPipeline(
            backend, repository, self.total_memory_bytes, memory_budget_bytes
        )
        self.reporter = Reporter(metrics, audit)
        self.slots: dict[str, ModelSlot] = {}

    # -- lookup ---------------------------------------------------------------
    def register(self, key: str) -> ModelSlot:
        return self.slots.setdefault(key, ModelSlot(key, self.retain))

    def slot(self, key: str) -> ModelSlot:
        slot = self.slots.get(key)
        if slot is None:
            raise ModelNotFound(f"model {key!r} is not served here")
        return slot

    def ready(self) -> bool:
        return bool(self.slots) and all(s.current is not None for s in self.slots.values())

    def total_memory_bytes(self) -> int:
        return sum(slot.memory_bytes() for slot in self.slots.values())

    # -- inference ------------------------------------------------------------
    async def run(
        self, version: LoadedVersion, feeds: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """Run one inference on a pinned version, off the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, version.engine.infer, feeds)

    async def infer(
        self, key: str, feeds: Mapping[str, np.ndarray]
    ) -> tuple[LoadedVersion, dict[str, np.ndarray]]:
        with self.slot(key).pin() as version:
            return version, await self.run(version, feeds)

    # -- loading and swapping -------------------------------------------------
    async def load(
        self,
        key: str,
        version: str,
        *,
        path: Path | None = None,
        expected_sha256: str | None = None,
        who: str = "system",
        source: str = "http",
    ) -> SwapResult:
        """Load ``version`` beside the serving one and swap it in if it warms up.

        On any failure the serving version is untouched and ``LoadRefused`` is raised."""
        slot = self.slot(key)
        async with slot.swap_lock:
            previous = slot.current.version if slot.current else None
            started = time.monotonic()
            retained = slot.get(version)
            if retained is not None and expected_sha256 in (None, retained.sha256):
                return self._swap_to_retained(slot, retained, previous, started, who, source)
            slot.loading(version)
            try:
                loaded, digest, error = await self.pipeline.run(
                    slot, version, path, expected_sha256
                )
            except asyncio.CancelledError:
                slot.refused(version, "load cancelled")
                raise
            if error is not None or loaded is None:
                assert error is not None
                slot.refused(version, error.message)
                self.reporter.report(
                    LifecycleEvent(
                        "load",
                        slot,
                        version,
                        who,
                        source,
                        result="failure",
                        from_version=previous,
                        digest=digest,
                        duration_s=time.monotonic() - started,
                        error=error,
                    )
                )
                raise error
            previous, _evicted = slot.install(loaded)
            duration = time.monotonic() - started
            self.reporter.report(
                LifecycleEvent(
                    "load",
                    slot,
                    version,
                    who,
                    source,
                    result="success",
                    from_version=previous,
                    digest=loaded.sha256,
                    duration_s=duration,
                )
            )
            return SwapResult(key, previous, version, duration, instant=False)

    async def rollback(
        self, key: str, version: str | None = None, *, who: str = "system", source: str = "http"
    ) -> SwapResult:
        """Swap back to a retained version (the most recent one unless named)."""
        slot = self.slot(key)
        async with slot.swap_lock:
            current = slot.current
            candidates = [v for v in slot.loaded() if v is not current]
            if version is not None:
                candidates = [v for v in candidates if v.version == version]
            if not candidates:
                retained = [v.version for v in slot.loaded() if v is not current]
                raise Conflict(
                    f"model {key!r} has no retained version {version or ''} to roll back to "
                    f"(retained: {retained})".replace("  ", " ")
                )
            previous = current.version if current else None
            return self._swap_to_retained(
                slot, candidates[-1], previous, time.monotonic(), who, source, action="rollback"
            )

    def _swap_to_retained(
        self,
        slot: ModelSlot,
        target: LoadedVersion,
        previous: str | None,
        started: float,
        who: str,
        source: str,
        action: str = "load",
    ) -> SwapResult:
        if target is slot.current:
            self.reporter.report(
                LifecycleEvent(
                    action,
                    slot,
                    target.version,
                    who,
                    source,
                    result="noop",
                    from_version=previous,
                    digest=target.sha256,
                )
            )
            return SwapResult(slot.key, previous, target.version, 0.0, instant=True)
        previous, _ = slot.install(target)
        duration = time.monotonic() - started
        self.reporter.report(
            LifecycleEvent(
                action,
                slot,
                target.version,
                who,
                source,
                result="success",
                from_version=previous,
                digest=target.sha256,
                duration_s=duration,
            )
        )
        return SwapResult(slot.key, previous, target.version, duration, instant=True)

    def close(self) -> None:
        for slot in self.slots.values():
            slot.close_all()
        self.pipeline.close()
