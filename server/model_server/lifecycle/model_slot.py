"""One model's versions in memory: the serving one behind one reference (double
buffering), reference counts, and the retained versions that make a rollback a pointer
swap. Its lifecycle follows Triton's ``model_lifecycle.h``: every version the slot has
seen has a :class:`VersionState` and the reason it is in it.

Requests pin the version they started on, so a version dropped from memory is closed only
when its last in-flight request finishes, never by a timer. Until then it still holds its
memory, and :meth:`ModelSlot.memory_bytes` counts it.

A canary's traffic policy (:class:`~model_rollout_contract.canary.TrafficPolicy`) is
kept here too, under the same lock as the versions it names, so that it holds only while
its candidate serves and its stable version is retained: any swap to another version (a
rollback to the stable one included) or the unloading of either clears it. A load that
carries a policy installs its version and the policy in one step under that lock (and
never evicts the policy's stable version for it), and each request is routed on one view
of both (:meth:`ModelSlot.route`): no request is answered by a candidate outside its
policy's share, not even one that arrived during the swap.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TypeVar

import numpy as np

from model_rollout_contract.canary import TrafficPolicy
from model_server.backends.base import Engine
from model_server.errors import BadRequest, Conflict, NotReady, VersionNotFound
from model_server.observability.version_metrics import VersionMetrics

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_STATES = 64  # lifecycle states (and closed versions) remembered per model


class VersionState(str, Enum):
    """As Triton's ModelReadyState."""

    LOADING = "LOADING"  # verifying, loading or warming up beside the serving version
    READY = "READY"  # loaded: serving, or retained for an instant rollback
    UNLOADING = "UNLOADING"  # dropped from the slot; in-flight requests still run on it
    UNAVAILABLE = "UNAVAILABLE"  # not in memory: refused, or unloaded and freed


@dataclass(frozen=True)
class VersionStatus:
    state: VersionState
    reason: str  # why it is in that state, for people


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
    # its per-version series: they live while it is loaded (see version_metrics)
    metrics: VersionMetrics = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.metrics = VersionMetrics(self.model, self.version)

    def run_engine(
        self, feeds: Mapping[str, np.ndarray], *, timed: bool = True
    ) -> dict[str, np.ndarray]:
        """Run the engine (on the caller's thread) and count its time in this version's
        series (``ENGINE_LATENCY``), so that a shadowed candidate's time, one request per
        run, can be compared with the stable version's: every run of one request, live
        or shadow. A run of several requests batched together (``timed=False``) is not
        timed: its time is that of all their rows, not like one shadow run. A run that
        raises is not timed."""
        started = time.perf_counter()
        outputs = self.engine.infer(feeds)
        if timed:
            self.metrics.engine_latency.observe(time.perf_counter() - started)
        return outputs

    def infer_if_quick(
        self, feeds: Mapping[str, np.ndarray], budget_s: float
    ) -> dict[str, np.ndarray] | None:
        """The engine's ``infer_if_quick`` (see ``Engine``), timed and counted as
        :meth:`infer` is; None where the engine has none or declines."""
        run = getattr(self.engine, "infer_if_quick", None)
        if run is None or budget_s <= 0:
            return None
        started = time.perf_counter()
        outputs: dict[str, np.ndarray] | None = run(feeds, budget_s)
        if outputs is None:
            return None
        self.metrics.engine_latency.observe(time.perf_counter() - started)
        self.metrics.outputs(outputs)
        return outputs

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """:meth:`run_engine`, its outputs counted in this version's series."""
        outputs = self.run_engine(feeds)
        self.metrics.outputs(outputs)
        return outputs


class ModelSlot:
    """The versions of one model held in memory; ``current`` is the serving one."""

    def __init__(self, key: str, retain: int) -> None:
        self.key = key
        self.retain = max(1, retain)
        self._lock = threading.Lock()  # guards the reference and the counts; held briefly
        self._loaded: OrderedDict[str, LoadedVersion] = OrderedDict()  # oldest first
        self._current: LoadedVersion | None = None
        # dropped from the slot, still open: pinned by requests in flight
        self._draining: set[LoadedVersion] = set()
        self._states: dict[str, VersionStatus] = {}
        # one full load per model at a time; swaps to retained versions never wait for it
        self.load_lock = asyncio.Lock()
        # counts what a load in progress must not outlast: swaps, and requests for another
        # serving state (overtake_loads); a load that sees it change is not swapped in
        self.generation = 0
        # counts the repository unloads: what a load evicted is not restored across one
        self.unloads = 0
        self.closed_versions: list[str] = []  # for observability and tests
        self._policy: TrafficPolicy | None = None

    @property
    def current(self) -> LoadedVersion | None:
        return self._current

    def loaded(self) -> list[LoadedVersion]:
        with self._lock:
            return list(self._loaded.values())

    def get(self, version: str) -> LoadedVersion | None:
        with self._lock:
            return self._loaded.get(version)

    def retained(self) -> list[LoadedVersion]:
        """The loaded versions other than the serving one, least recently served first."""
        with self._lock:
            return [v for v in self._loaded.values() if v is not self._current]

    def memory_bytes(self) -> int:
        """What this model's engines hold: the loaded versions and those dropped but still
        open for their requests in flight."""
        with self._lock:
            held = [*self._loaded.values(), *self._draining]
        return sum(v.memory_bytes for v in held)

    def draining(self) -> list[LoadedVersion]:
        """Versions dropped from the slot whose requests in flight keep them open."""
        with self._lock:
            return list(self._draining)

    def states(self) -> dict[str, VersionStatus]:
        with self._lock:
            return dict(self._states)

    def _set_state(self, version: str, state: VersionState, reason: str) -> None:
        self._states.pop(version, None)
        self._states[version] = VersionStatus(state, reason)  # newest last
        while len(self._states) > MAX_STATES:  # forget the oldest version no longer held
            stale = next(
                (v for v, s in self._states.items() if s.state is VersionState.UNAVAILABLE), None
            )
            if stale is None:
                break
            del self._states[stale]

    def loading(self, version: str) -> None:
        with self._lock:
            if version not in self._loaded:
                self._set_state(version, VersionState.LOADING, "loading beside the serving one")

    def refused(self, version: str, reason: str) -> None:
        """A load failed: the version is unavailable unless an older copy is still held."""
        with self._lock:
            if version not in self._loaded:
                self._set_state(version, VersionState.UNAVAILABLE, reason)

    def overtake_loads(self) -> None:
        """A request asked for a serving state other than a load in progress would give
        (a traffic policy set or cleared, the serving version kept): that load, when it
        ends, is not swapped in."""
        with self._lock:
            self.generation += 1

    @property
    def policy(self) -> TrafficPolicy | None:
        return self._policy

    def set_policy(self, policy: TrafficPolicy | None) -> None:
        """Split this model's requests by ``policy`` (None: no split). Refused
        (``Conflict``) unless its candidate serves and its stable version is loaded."""
        with self._lock:
            if policy is not None:
                if policy.stable == policy.candidate:
                    raise BadRequest(
                        f"a traffic policy splits between two versions, not {policy.stable!r} "
                        "and itself"
                    )
                problem = self._policy_problem(policy)
                if problem:
                    raise Conflict(f"traffic policy for {self.key!r} refused: {problem}")
            self._policy = policy

    def check_load_policy(self, version: str, policy: TrafficPolicy) -> None:
        """Refuse, before any work, a load of ``version`` carrying ``policy`` that
        :meth:`install` could not honour: ``BadRequest`` for a policy that is not this
        version's, ``Conflict`` for one the slot cannot hold (its stable version not
        loaded, or no room to keep it beside the candidate)."""
        if policy.candidate != version:
            raise BadRequest(
                f"a load's traffic policy has {version!r} as its candidate, not "
                f"{policy.candidate!r}"
            )
        if policy.stable == version:
            raise BadRequest(
                f"a traffic policy splits between two versions, not {version!r} and itself"
            )
        with self._lock:
            problem = self._install_problem(version, policy)
        if problem:
            raise Conflict(f"{self.key}:{version} with a traffic policy refused: {problem}")

    def _install_problem(self, version: str, policy: TrafficPolicy) -> str | None:
        """Why ``version`` cannot be installed under ``policy`` (called under the lock)."""
        if policy.candidate != version or policy.stable == version:
            return f"the policy {policy.to_annotation()} is not one for {version!r}"
        if self.retain < 2:
            return (
                f"the server keeps {self.retain} version per model; a traffic policy needs "
                f"its stable version {policy.stable!r} held beside the candidate {version!r}"
            )
        if policy.stable not in self._loaded:
            return f"its stable version {policy.stable!r} is not loaded ({list(self._loaded)})"
        return None

    def _policy_problem(self, policy: TrafficPolicy) -> str | None:
        """Why ``policy`` cannot hold now (None: it can); called under the lock."""
        current = self._current.version if self._current else None
        if current != policy.candidate:
            return f"its candidate {policy.candidate!r} is not serving (serving: {current})"
        if policy.stable not in self._loaded:
            return f"its stable version {policy.stable!r} is not loaded ({list(self._loaded)})"
        return None

    def _keep_policy_consistent(self) -> None:
        """After the versions changed (under the lock): drop a policy that no longer holds."""
        policy = self._policy
        problem = self._policy_problem(policy) if policy is not None else None
        if policy is not None and problem:
            self._policy = None
            log.info("%s: traffic policy %s cleared: %s", self.key, policy.to_annotation(), problem)

    def decide(self, choose: Callable[[TrafficPolicy | None, str | None], T]) -> T:
        """``choose(policy, serving version)`` on one view of both, under the lock that
        swaps them: where one request goes (:meth:`.TrafficRouter.route_in`)."""
        with self._lock:
            serving = self._current.version if self._current is not None else None
            return choose(self._policy, serving)

    def resolve(self, version: str | None = None, *, or_serving: bool = False) -> LoadedVersion:
        """The loaded ``version`` (None: the serving one). One not loaded raises
        ``VersionNotFound``, unless ``or_serving``: then the serving one is returned."""
        with self._lock:
            return self._resolve(version, or_serving)

    def _resolve(self, version: str | None, or_serving: bool) -> LoadedVersion:
        chosen = self._loaded.get(version) if version is not None else None
        if chosen is None and version is not None and not or_serving:
            raise VersionNotFound(
                f"model {self.key!r} has no version {version!r} loaded "
                f"(loaded: {list(self._loaded)})"
            )
        chosen = chosen or self._current
        if chosen is None:
            raise NotReady(f"model {self.key!r} has no version loaded yet")
        return chosen

    @contextlib.contextmanager
    def pin(
        self, version: str | None = None, *, or_serving: bool = False
    ) -> Iterator[LoadedVersion]:
        """Pin, for one request, what :meth:`resolve` returns: it stays open (its memory
        held) until the request lets go, even if it is unloaded meanwhile."""
        with self._lock:
            chosen = self._resolve(version, or_serving)
            chosen.in_flight += 1
        try:
            yield chosen
        finally:
            self._unpin(chosen)

    def _unpin(self, version: LoadedVersion) -> None:
        with self._lock:
            version.in_flight -= 1
            drained = version.retired and version.in_flight == 0 and not version.closed
            if drained:
                version.closed = True
                self._draining.discard(version)
        if drained:
            self._close(version)

    def install(
        self, version: LoadedVersion, policy: TrafficPolicy | None = None
    ) -> tuple[str | None, list[LoadedVersion]]:
        """Make ``version`` the serving one (atomically) and evict beyond ``retain``.
        With ``policy`` (whose candidate is ``version``), the policy is set in the same
        step and its stable version is not evicted; a policy that cannot hold is refused
        (``Conflict``) and nothing changes.

        Returns the previous serving version and the evicted ones."""
        with self._lock:
            problem = self._install_problem(version.version, policy) if policy else None
            if problem:
                raise Conflict(
                    f"{self.key}:{version.version} not swapped in with its traffic policy: "
                    f"{problem}"
                )
            previous = self._current.version if self._current else None
            replaced = self._loaded.get(version.version)  # the same version, other bytes
            self._loaded[version.version] = version
            self._loaded.move_to_end(version.version)
            self._current = version
            self.generation += 1
            self._set_state(version.version, VersionState.READY, "serving")
            if previous is not None and previous != version.version:
                self._set_state(previous, VersionState.READY, "retained for rollback")
            kept = {version.version, policy.stable} if policy else {version.version}
            evicted = []
            while len(self._loaded) > self.retain:
                oldest = next((v for v in self._loaded if v not in kept), None)
                if oldest is None:  # only what the policy needs: retain >= 2 holds it
                    break
                evicted.append(self._loaded.pop(oldest))
            if policy is not None:
                self._policy = policy
            self._keep_policy_consistent()
        if replaced is not None and replaced is not version:
            self.retire(replaced, "replaced by a new load of the same version")
        for old in evicted:
            self.retire(old, f"evicted: more than {self.retain} versions retained")
        return previous, evicted

    def evict(self, version: LoadedVersion, reason: str) -> None:
        """Drop a retained (non-serving) version from memory, once its requests end."""
        with self._lock:
            if version is self._current or self._loaded.get(version.version) is not version:
                return
            del self._loaded[version.version]
            self._keep_policy_consistent()
        self.retire(version, reason)

    def restore(self, version: LoadedVersion, unloads: int) -> bool:
        """Hold ``version`` again as the least recently served retained one (after the
        load it was evicted for failed); ``False`` if its place was taken meanwhile, or
        if the model was unloaded since the load began (``unloads`` was then counted):
        an unloaded model stays so."""
        with self._lock:
            if (
                unloads != self.unloads
                or version.version in self._loaded
                or len(self._loaded) >= self.retain
            ):
                return False
            self._loaded[version.version] = version
            self._loaded.move_to_end(version.version, last=False)
            self._set_state(version.version, VersionState.READY, "retained for rollback")
        return True

    def retire(self, version: LoadedVersion, reason: str) -> None:
        with self._lock:
            version.retired = True
            drained = version.in_flight == 0 and not version.closed
            if drained:
                version.closed = True
                self._draining.discard(version)
            elif not version.closed:
                self._draining.add(version)
            if version.version not in self._loaded:  # not when another copy serves it
                self._set_state(version.version, VersionState.UNLOADING, reason)
        if drained:
            self._close(version)

    def _close(self, version: LoadedVersion) -> None:
        try:
            version.engine.close()
        finally:
            with self._lock:
                if version.version not in self._loaded:
                    self._set_state(version.version, VersionState.UNAVAILABLE, "unloaded")
            self.closed_versions.append(version.version)
            del self.closed_versions[:-MAX_STATES]
            log.info("freed %s:%s after its last request", self.key, version.version)

    def close_all(self) -> None:
        with self._lock:
            held = list(self._loaded.values())
            self._loaded.clear()
            self._current = None
            self._policy = None
        for version in held:
            self.retire(version, "server shutting down")

    def unload_all(self, reason: str) -> list[LoadedVersion]:
        """Drop every version, the serving one too (the model repository's unload): the
        model serves nothing until a version is loaded again, each version closes once
        its requests in flight end, and a load in progress is overtaken (not swapped
        in). Returns the versions dropped."""
        with self._lock:
            held = list(self._loaded.values())
            self._loaded.clear()
            self._current = None
            self._policy = None
            self.generation += 1
            self.unloads += 1
        for version in held:
            self.retire(version, reason)
        return held
