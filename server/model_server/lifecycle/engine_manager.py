"""Double-buffered engine management: the models' slots (:mod:`.model_slot`), the load
pipeline (:mod:`.load_pipeline`), the memory budget (:mod:`.memory_budget`) and the
reporting of what happened (:mod:`.reporting`).

A new version is loaded *beside* the serving one, warmed up, and only then swapped in by
replacing one reference under a lock held for a few instructions. Up to ``retain``
versions stay loaded, so rolling back to one of them is a pointer swap, and such a swap
never waits for a load in progress: a load that a swap overtook is not installed, nor one
overtaken by a request to keep the serving version (a load or rollback of it) or by a
traffic policy set or cleared meanwhile (``ModelSlot.overtake_loads``).

A load may carry a canary's traffic policy (its candidate is the loaded version): the
policy is checked before any work, set in the same step as the swap, and the policy's
stable version is neither evicted for the load nor given up to the memory budget; so the
candidate never answers outside the policy's share, from the first request on.

Nothing is evicted for a load that fails: retained versions leave memory after the new
version is in (``retain``), or before the load when the memory budget leaves no other
way, and then a failed load reloads them from the repository (checked against the digest
they were loaded with), so the rollback target is held again; not after the model was
unloaded meanwhile: an unloaded model stays unloaded, its memory freed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from model_rollout_contract import defaults
from model_rollout_contract.canary import TrafficPolicy
from model_rollout_contract.names import ModelKey
from model_server.backends.base import Backend
from model_server.errors import Conflict, ModelNotFound, ServingError
from model_server.lifecycle.load_pipeline import CheckedVersion, LoadPipeline, normalized_digest
from model_server.lifecycle.load_stages import SWAP, LoadStages
from model_server.lifecycle.memory_budget import MemoryBudget, Reservation
from model_server.lifecycle.model_slot import LoadedVersion, ModelSlot
from model_server.lifecycle.reporting import LifecycleEvent, Reporter
from model_server.lifecycle.repository import ModelRepository
from model_server.lifecycle.request_limits import RowLimits
from model_server.observability.audit import AuditEvent, AuditLog
from model_server.observability.metrics import ServerMetrics, VersionRow
from model_server.observability.version_metrics import VersionMetrics, VersionSeries

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SwapResult:
    model: str
    from_version: str | None
    to_version: str
    duration_s: float
    instant: bool  # True when the version was already loaded (retained)
    # a load's seconds per stage (load_stages: they add up to duration_s); empty for a
    # swap to a retained version
    stages_s: Mapping[str, float] = field(default_factory=dict)


class EngineManager:
    def __init__(
        self,
        backend: Backend,
        repository: ModelRepository,
        metrics: ServerMetrics,
        audit: AuditLog,
        retain: int = 2,
        memory_budget_bytes: int | None = None,
        tenant_memory_caps: Mapping[str, int] | None = None,
        row_limits: RowLimits | None = None,
    ) -> None:
        self.backend = backend
        self.repository = repository
        self.metrics = metrics
        self.audit = audit
        self.retain = retain
        # the models' bounds on a request (rows, memory): of a batch too
        self.row_limits = row_limits or RowLimits(defaults.REQUEST_MEMORY_MB * 2**20)
        self.pipeline = LoadPipeline(backend, repository)
        self.budget = MemoryBudget(memory_budget_bytes, self.memory_bytes, tenant_memory_caps)
        self.reporter = Reporter(metrics, audit)
        self.slots: dict[str, ModelSlot] = {}
        self._restoring: set[asyncio.Task[None]] = set()
        metrics.watch_versions(self._version_rows)
        metrics.watch_version_series(VersionSeries(self._version_metrics))

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
        return self.memory_bytes(None)

    def memory_bytes(self, tenant: str | None) -> int:
        """What the open engines hold: every model's (``None``), or one tenant's models'."""
        return sum(
            slot.memory_bytes()
            for key, slot in self.slots.items()
            if tenant is None or ModelKey.tenant_in(key) == tenant
        )

    def _version_rows(self) -> Iterator[VersionRow]:
        for key, slot in list(self.slots.items()):
            current = slot.current
            for version in slot.loaded():
                yield VersionRow(key, version.version, version is current, version.memory_bytes)

    def _version_metrics(self) -> Iterator[VersionMetrics]:
        for slot in list(self.slots.values()):
            for version in slot.loaded():
                yield version.metrics

    # -- inference ------------------------------------------------------------
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
        policy: TrafficPolicy | None = None,
    ) -> SwapResult:
        """Load ``version`` beside the serving one and swap it in if it warms up; a
        version already loaded with that digest is a pointer swap. With ``policy`` (a
        canary's, naming ``version`` as its candidate) the policy is set with the swap,
        or on the serving version when that is ``version`` already.

        On any failure the serving version is untouched and a ``ServingError`` is raised."""
        slot = self.slot(key)
        started = time.monotonic()
        event = _Event(self, slot, version, who, source, started)
        try:
            expected = normalized_digest(expected_sha256)
            if path is not None:  # the same checks whether or not the version is held
                self.repository.check_model_path(path)
            if policy is not None:
                slot.check_load_policy(version, policy)
        except ServingError as exc:
            raise event.failed(exc) from None
        retained = slot.get(version)
        if retained is not None and expected in (None, retained.sha256):
            return self._swap_to_retained(slot, retained, started, who, source, policy=policy)
        async with slot.load_lock:
            retained = slot.get(version)  # the load this one waited for may have been it
            if retained is not None and expected in (None, retained.sha256):
                return self._swap_to_retained(slot, retained, started, who, source, policy=policy)
            return await self._load_new(slot, version, path, expected, event, policy)

    async def _load_new(
        self,
        slot: ModelSlot,
        version: str,
        path: Path | None,
        expected: str | None,
        event: _Event,
        policy: TrafficPolicy | None = None,
    ) -> SwapResult:
        generation, unloads = slot.generation, slot.unloads
        slot.loading(version)
        reservation: Reservation | None = None
        # the policy's stable version must stay: it answers the requests the candidate
        # does not, so it is never made room of
        evictable = [v for v in slot.retained() if policy is None or v.version != policy.stable]
        checked: CheckedVersion | None = None  # read, and not yet handed to the load
        try:
            checked = await self.pipeline.read(slot.key, version, path, expected, event.stages)
            event.digest = checked.model.sha256
            estimate = self.backend.estimate_memory_bytes(checked.model)
            reservation = self.budget.reserve(
                slot.key,
                version,
                estimate,
                evictable,
                lambda old: slot.evict(old, f"evicted to make room for {version}"),
            )
            handed, checked = checked, None  # the load lets its bytes go, whatever happens
            loaded = await self.pipeline.load(slot.key, version, handed, estimate, event.stages)
            del handed
        except asyncio.CancelledError:
            self.pipeline.discard(checked)
            slot.refused(version, "load cancelled")
            if reservation is not None:
                reservation.release()
                self._restore_later(slot, version, reservation.evicted, unloads)
            raise
        except ServingError as exc:
            self.pipeline.discard(checked)
            slot.refused(version, exc.message)
            if reservation is not None:
                reservation.release()
                await self._restore(slot, version, reservation.evicted, unloads)
            raise event.failed(exc) from None
        reservation.release()  # the loaded version's memory is now counted as held
        if slot.generation != generation:  # a swap, rollback or policy change overtook it
            loaded.engine.close()
            current = slot.current.version if slot.current else None
            overtaken = Conflict(
                f"{slot.key}:{version} loaded but not swapped in: a later request (a swap, a "
                f"rollback or a traffic policy change) overtook it; serving {current}"
            )
            slot.refused(version, overtaken.message)
            await self._restore(slot, version, reservation.evicted, unloads)
            raise event.failed(overtaken)
        try:
            with event.stages.stage(SWAP):
                previous, _evicted = slot.install(loaded, policy)
                self._audit_policy(slot, policy, event)
        except Conflict as refused:  # its stable version left memory while it loaded
            loaded.engine.close()
            slot.refused(version, refused.message)
            await self._restore(slot, version, reservation.evicted, unloads)
            raise event.failed(refused) from None
        return event.succeeded(previous, loaded.sha256, instant=False)

    def _audit_policy(self, slot: ModelSlot, policy: TrafficPolicy | None, event: _Event) -> None:
        """A policy set by a load is audited as the ``traffic`` op's are."""
        if policy is None:
            return
        set_by_load = AuditEvent(
            "traffic", slot.key, policy.candidate, event.who, event.source, "success",
            from_version=policy.stable, detail=policy.to_annotation(),
        )  # fmt: skip
        self.audit.record(set_by_load)

    async def _restore(
        self, slot: ModelSlot, failed: str, evicted: list[LoadedVersion], unloads: int
    ) -> None:
        """Load again, as retained versions, what was evicted for a load that failed;
        nothing once the model was unloaded since the load began (``unloads``)."""
        for old in reversed(evicted):  # each goes back in front: the original order
            if slot.unloads != unloads:
                return
            reason = f"evicted to make room for {failed}, which was not swapped in"
            try:
                reservation = self.budget.reserve(
                    slot.key, old.version, old.memory_bytes, (), lambda _: None
                )
                try:
                    checked = await self.pipeline.read(slot.key, old.version, old.path, old.sha256)
                    loaded = await self.pipeline.load(
                        slot.key, old.version, checked, old.memory_bytes
                    )
                finally:
                    reservation.release()
            except ServingError as exc:
                slot.refused(old.version, f"{reason}; reloading it failed: {exc.message}")
                log.warning("%s:%s not restored: %s", slot.key, old.version, exc.message)
                continue
            if not slot.restore(loaded, unloads):
                loaded.engine.close()
            else:
                log.info("%s:%s restored after %s failed", slot.key, old.version, failed)

    def _restore_later(
        self, slot: ModelSlot, failed: str, evicted: list[LoadedVersion], unloads: int
    ) -> None:
        if evicted:
            restoring = self._restore(slot, failed, evicted, unloads)
            task = asyncio.get_running_loop().create_task(restoring)
            self._restoring.add(task)
            task.add_done_callback(self._restoring.discard)

    async def rollback(
        self, key: str, version: str | None = None, *, who: str = "system", source: str = "http"
    ) -> SwapResult:
        """Swap back to a retained version (the most recently served one unless named).
        Never waits for a load in progress: that load is then not installed."""
        slot = self.slot(key)
        started = time.monotonic()
        current = slot.current
        candidates = slot.retained()
        if version is not None:
            candidates = [v for v in candidates if v.version == version]
        if not candidates:
            if version is not None and current is not None and current.version == version:
                return self._swap_to_retained(slot, current, started, who, source, "rollback")
            retained = [v.version for v in slot.retained()]
            wanted = f"version {version!r}" if version else "version"
            error = Conflict(
                f"model {key!r} has no retained {wanted} to roll back to (retained: {retained})"
            )
            raise _Event(self, slot, version or "", who, source, started, "rollback").failed(error)
        return self._swap_to_retained(slot, candidates[-1], started, who, source, "rollback")

    def _swap_to_retained(
        self,
        slot: ModelSlot,
        target: LoadedVersion,
        started: float,
        who: str,
        source: str,
        action: str = "load",
        *,
        policy: TrafficPolicy | None = None,
    ) -> SwapResult:
        event = _Event(self, slot, target.version, who, source, started, action)
        try:
            if target is slot.current:
                slot.overtake_loads()  # keeping this version is not the load in progress
                if policy is not None and policy != slot.policy:
                    slot.set_policy(policy)
                    self._audit_policy(slot, policy, event)
                return event.noop(target.sha256)
            previous, _ = slot.install(target, policy)
        except ServingError as exc:
            raise event.failed(exc) from None
        self._audit_policy(slot, policy, event)
        return event.succeeded(previous, target.sha256, instant=True)

    def close(self) -> None:
        for task in self._restoring:
            task.cancel()
        for slot in self.slots.values():
            slot.close_all()
        self.pipeline.close()


class _Event:
    """One load, swap or rollback being reported (audit log, metrics, log)."""

    def __init__(
        self,
        manager: EngineManager,
        slot: ModelSlot,
        version: str,
        who: str,
        source: str,
        started: float,
        action: str = "load",
    ) -> None:
        self.reporter = manager.reporter
        self.slot = slot
        self.version = version
        self.who = who
        self.source = source
        self.started = started
        self.action = action
        self.from_version = slot.current.version if slot.current else None
        self.digest: str | None = None
        self.stages = LoadStages()  # filled by a load of a new version only

    def _report(
        self,
        result: str,
        digest: str | None,
        from_version: str | None = None,
        duration_s: float = 0.0,
        error: ServingError | None = None,
        stages_s: Mapping[str, float] | None = None,
    ) -> None:
        self.reporter.report(
            LifecycleEvent(
                self.action,
                self.slot,
                self.version,
                self.who,
                self.source,
                result,
                from_version=from_version,
                digest=digest,
                duration_s=duration_s,
                error=error,
                stages_s=stages_s or {},
            )
        )

    def failed(self, error: ServingError) -> ServingError:
        duration = time.monotonic() - self.started
        self._report("failure", self.digest, self.from_version, duration, error)
        return error

    def noop(self, digest: str) -> SwapResult:
        self._report("noop", digest, self.from_version)
        return SwapResult(self.slot.key, self.from_version, self.version, 0.0, instant=True)

    def succeeded(self, previous: str | None, digest: str, instant: bool) -> SwapResult:
        duration = time.monotonic() - self.started
        stages = {} if instant else self.stages.closed(duration)
        self._report("success", digest, previous, duration, stages_s=stages)
        return SwapResult(self.slot.key, previous, self.version, duration, instant, stages)
