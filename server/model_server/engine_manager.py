"""Double-buffered engine management.

Each model has a :class:`ModelSlot` with the serving version behind one reference.
A new version is loaded *beside* the serving one, warmed up with an inference and only
then swapped in by replacing that reference under a lock held for a few instructions.
Requests pin the version they started on (reference count), so a version dropped from
memory is closed only when its last in-flight request finishes, never by a timer.
Up to ``retain`` versions stay loaded, so rolling back to one of them is a pointer swap.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from model_rollout_contract.manifest import sha256_file

from .audit import AuditEvent, AuditLog
from .backends.base import Backend, Engine
from .errors import (
    Conflict,
    LoadRefused,
    MemoryBudgetExceeded,
    ModelNotFound,
    NotReady,
    ServingError,
)
from .metrics import ServerMetrics
from .repository import ModelRepository

log = logging.getLogger(__name__)


@dataclass(eq=False)
class LoadedVersion:
    model: str
    version: str
    path: Path
    sha256: str
    engine: Engine
    memory_bytes: int
    loaded_at: float = field(default_factory=time.time)
    in_flight: int = 0
    retired: bool = False
    closed: bool = False


@dataclass(frozen=True)
class SwapResult:
    model: str
    from_version: str | None
    to_version: str
    duration_s: float
    instant: bool  # True when the version was already loaded (retained)


class ModelSlot:
    """The versions of one model held in memory; ``current`` is the serving one."""

    def __init__(self, key: str, retain: int) -> None:
        self.key = key
        self.retain = max(1, retain)
        self._lock = threading.Lock()  # guards the reference and the counts; held briefly
        self._loaded: OrderedDict[str, LoadedVersion] = OrderedDict()  # oldest first
        self._current: LoadedVersion | None = None
        self.swap_lock = asyncio.Lock()  # one load or swap per model at a time
        self.closed_versions: list[str] = []  # for observability and tests

    @property
    def current(self) -> LoadedVersion | None:
        return self._current

    def loaded(self) -> list[LoadedVersion]:
        with self._lock:
            return list(self._loaded.values())

    def get(self, version: str) -> LoadedVersion | None:
        with self._lock:
            return self._loaded.get(version)

    def memory_bytes(self) -> int:
        return sum(v.memory_bytes for v in self.loaded())

    @contextlib.contextmanager
    def pin(self) -> Iterator[LoadedVersion]:
        """Pin the serving version for one request."""
        with self._lock:
            current = self._current
            if current is None:
                raise NotReady(f"model {self.key!r} has no version loaded yet")
            current.in_flight += 1
        try:
            yield current
        finally:
            self._unpin(current)

    def _unpin(self, version: LoadedVersion) -> None:
        with self._lock:
            version.in_flight -= 1
            drained = version.retired and version.in_flight == 0 and not version.closed
            if drained:
                version.closed = True
        if drained:
            self._close(version)

    def install(self, version: LoadedVersion) -> tuple[str | None, list[LoadedVersion]]:
        """Make ``version`` the serving one (atomically) and evict beyond ``retain``.

        Returns the previous serving version and the evicted ones."""
        with self._lock:
            previous = self._current.version if self._current else None
            self._loaded[version.version] = version
            self._loaded.move_to_end(version.version)
            self._current = version
            evicted = []
            while len(self._loaded) > self.retain:
                _, oldest = self._loaded.popitem(last=False)
                evicted.append(oldest)
        for old in evicted:
            self.retire(old)
        return previous, evicted

    def evict_oldest_retained(self) -> LoadedVersion | None:
        """Drop the least recently served non-serving version (to make room)."""
        with self._lock:
            for name, candidate in self._loaded.items():
                if candidate is not self._current:
                    del self._loaded[name]
                    break
            else:
                return None
        self.retire(candidate)
        return candidate

    def retire(self, version: LoadedVersion) -> None:
        with self._lock:
            version.retired = True
            drained = version.in_flight == 0 and not version.closed
            if drained:
                version.closed = True
        if drained:
            self._close(version)

    def _close(self, version: LoadedVersion) -> None:
        try:
            version.engine.close()
        finally:
            self.closed_versions.append(version.version)
            log.info("freed %s:%s after its last request", self.key, version.version)

    def close_all(self) -> None:
        for version in self.loaded():
            self.retire(version)
        with self._lock:
            self._loaded.clear()
            self._current = None


def warm_up(engine: Engine) -> None:
    """Run one inference with zeros; refuse engines that fail or produce NaN/inf."""
    feeds = {spec.name: spec.example() for spec in engine.inputs}
    outputs = engine.infer(feeds)
    for spec in engine.outputs:
        if spec.name not in outputs:
            raise ValueError(f"warm-up produced no output {spec.name!r}")
        out = np.asarray(outputs[spec.name])
        if out.dtype.kind == "f" and not np.all(np.isfinite(out)):
            raise ValueError(f"warm-up output {spec.name!r} is not finite")


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
        self.memory_budget_bytes = memory_budget_bytes
        self.executor = executor
        # loads get their own threads: a long load or warm-up never takes an inference thread
        self._loader = ThreadPoolExecutor(max_workers=2, thread_name_prefix="load")
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
            digest: str | None = None
            try:
                model_path, digest = await self._verify(key, version, path, expected_sha256)
                self._make_room(slot, self.backend.estimate_memory_bytes(model_path))
                loaded = await asyncio.get_running_loop().run_in_executor(
                    self._loader, self._load_and_warm, key, version, model_path, digest
                )
            except ServingError as exc:
                self._refused(key, version, previous, digest, started, who, source, exc)
                raise
            except Exception as exc:  # a corrupt engine can raise anything from the runtime
                refused = LoadRefused(f"{key}:{version} failed to load: {exc}")
                self._refused(key, version, previous, digest, started, who, source, refused)
                raise refused from exc
            previous, _evicted = slot.install(loaded)
            duration = time.monotonic() - started
            self._served(slot, previous, loaded, duration, "load", who, source)
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
            target = candidates[-1]
            previous = current.version if current else None
            return self._swap_to_retained(
                slot, target, previous, time.monotonic(), who, source, action="rollback"
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
            self.audit.record(
                AuditEvent(
                    action,
                    slot.key,
                    target.version,
                    who,
                    source,
                    "noop",
                    from_version=previous,
                    digest=target.sha256,
                    duration_s=0.0,
                )
            )
            return SwapResult(slot.key, previous, target.version, 0.0, instant=True)
        previous, _ = slot.install(target)
        duration = time.monotonic() - started
        self._served(slot, previous, target, duration, action, who, source)
        return SwapResult(slot.key, previous, target.version, duration, instant=True)

    async def _verify(
        self, key: str, version: str, path: Path | None, expected_sha256: str | None
    ) -> tuple[Path, str]:
        if path is None:
            resolved = self.repository.resolve(key, version)
            path = resolved.path
            if expected_sha256 is None and resolved.manifest is not None:
                expected_sha256 = resolved.manifest.sha256
        else:
            path = self.repository.check_trusted(path)
            if not path.is_file():
                raise LoadRefused(f"{path} does not exist")
        digest = await asyncio.get_running_loop().run_in_executor(self._loader, sha256_file, path)
        if expected_sha256 is not None and digest != expected_sha256.lower():
            raise LoadRefused(
                f"{key}:{version}: sha256 of {path.name} is {digest}, expected {expected_sha256}"
            )
        return path, digest

    def _make_room(self, slot: ModelSlot, needed: int) -> None:
        budget = self.memory_budget_bytes
        if budget is None:
            return
        while self.total_memory_bytes() + needed > budget:
            if slot.evict_oldest_retained() is None:
                held = self.total_memory_bytes()
                raise MemoryBudgetExceeded(
                    f"loading {slot.key} needs about {needed / 2**20:.1f} MiB beside the "
                    f"{held / 2**20:.1f} MiB already held; the memory budget is "
                    f"{budget / 2**20:.1f} MiB"
                )

    def _load_and_warm(self, key: str, version: str, path: Path, digest: str) -> LoadedVersion:
        engine = self.backend.load(path)
        try:
            warm_up(engine)
        except Exception as exc:
            engine.close()
            raise LoadRefused(f"{key}:{version} failed its warm-up inference: {exc}") from exc
        memory = getattr(engine, "device_memory_bytes", None) or self.backend.estimate_memory_bytes(
            path
        )
        return LoadedVersion(key, version, path, digest, engine, int(memory))

    def _served(
        self,
        slot: ModelSlot,
        previous: str | None,
        new: LoadedVersion,
        duration: float,
        action: str,
        who: str,
        source: str,
    ) -> None:
        self.metrics.reload_success.labels(slot.key).inc()
        if action == "load":
            self.metrics.load_duration.labels(slot.key).observe(duration)
        self.metrics.serving(slot.key, new.version, previous)
        self.metrics.versions_loaded.labels(slot.key).set(len(slot.loaded()))
        self.metrics.memory_bytes.labels(slot.key).set(slot.memory_bytes())
        self.audit.record(
            AuditEvent(
                action,
                slot.key,
                new.version,
                who,
                source,
                "success",
                from_version=previous,
                digest=new.sha256,
                duration_s=round(duration, 6),
            )
        )
        log.info(
            "%s now serves %s (was %s) after %.1f ms",
            slot.key,
            new.version,
            previous,
            duration * 1000,
        )

    def _refused(
        self,
        key: str,
        version: str,
        previous: str | None,
        digest: str | None,
        started: float,
        who: str,
        source: str,
        exc: ServingError,
    ) -> None:
        self.metrics.reload_failure.labels(key, exc.code).inc()
        self.audit.record(
            AuditEvent(
                "load",
                key,
                version,
                who,
                source,
                "failure",
                from_version=previous,
                digest=digest,
                duration_s=round(time.monotonic() - started, 6),
                error=exc.message,
            )
        )
        log.warning("refused %s:%s, still serving %s: %s", key, version, previous, exc.message)

    def close(self) -> None:
        for slot in self.slots.values():
            slot.close_all()
        self._loader.shutdown(wait=False, cancel_futures=True)
