"""The rollout planner: pure functions from (spec, stored rollout state, observed pods,
clock, random source) to (next state, pod actions, events, phase).

No I/O happens here, so every decision can be tested exhaustively; the kopf handler only
observes, calls :func:`plan_rollout`, applies the actions and stores the new state in
``.status`` (which is why the operator can be restarted mid-rollout).

Stages of a rollout from ``from_version`` to ``to_version``:

* ``canary``: retarget ``canary.percent`` of the pods, wait until they serve the new
  version, hold for ``pauseSeconds`` (or until promoted by annotation);
* ``batches``: retarget the rest in batches (``batchSize``/``batchPercent``, at most
  ``maxConcurrentLoads``), one batch in flight at a time, with a random jitter pause
  between batches;
* ``complete``: every pod serves the version; it becomes the stable version;
* ``failed``: a pod refused the version or a batch missed its deadline; nothing more is
  retargeted until ``spec.version`` changes (editing it back is a rollback).

A rollback (back to the stable or previous version) is "fast": no canary, no jitter,
all remaining pods in one batch; the old version is usually still loaded in each
server, so each swap is a pointer swap.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from model_rollout_contract.annotations import PROMOTE
from model_rollout_contract.states import Phase, RolloutStage

from .pods import PodView
from .spec import ModelDeploymentSpec

CANARY, BATCHES = RolloutStage.CANARY, RolloutStage.BATCHES
COMPLETE, FAILED = RolloutStage.COMPLETE, RolloutStage.FAILED


@dataclass(frozen=True)
class RolloutState:
    """Where one rollout stands; kept in ``.status.rollout`` (see :mod:`.status`)."""

    to_version: str
    from_version: str | None = None
    stage: RolloutStage = BATCHES
    fast: bool = False
    started_at: float = 0.0
    batch: int = 0
    batch_in_flight: bool = False
    batch_started_at: float | None = None
    next_batch_at: float = 0.0
    canary_healthy_at: float | None = None
    failure: str | None = None


@dataclass(frozen=True)
class SetTarget:
    pod: str
    version: str
    previous: str | None


@dataclass(frozen=True)
class Event:
    reason: str
    message: str
    warning: bool = False


@dataclass(frozen=True)
class Plan:
    state: RolloutState
    stable_version: str | None
    previous_version: str | None
    actions: tuple[SetTarget, ...]
    events: tuple[Event, ...]
    phase: Phase
    reason: str
    message: str


def _readiness_order(pod: PodView) -> tuple[bool, str]:
    return (not pod.ready, pod.name)


def _start(
    spec: ModelDeploymentSpec,
    stable: str | None,
    previous: str | None,
    state: RolloutState | None,
    now: float,
) -> tuple[RolloutState, Event | None]:
    """A new rollout whenever ``spec.version`` differs from the rollout's target."""
    target = spec.version
    if stable is None:
        return RolloutState(target, None, BATCHES, fast=True, started_at=now), Event(
            "RolloutStarted", f"initial deployment of {spec.model}:{target}"
        )
    in_progress = state is not None and state.stage not in (COMPLETE,)
    current = state.to_version if state is not None and in_progress else stable
    if target == stable and not in_progress:
        return RolloutState(target, None, COMPLETE, started_at=now), None
    rollback = target in (stable, previous) or (
        in_progress and state is not None and target == state.from_version
    )
    if rollback:
        return RolloutState(target, current, BATCHES, fast=True, started_at=now), Event(
            "RollbackStarted", f"rolling back {spec.model} from {current} to {target}"
        )
    stage = CANARY if spec.canary_pods() > 0 else BATCHES
    return RolloutState(target, stable, stage, started_at=now), Event(
        "RolloutStarted",
        f"rolling out {spec.model} {stable} -> {target}"
        + (f" with a {spec.canary.percent}% canary" if stage == CANARY else ""),
    )


def next_deadline(spec: ModelDeploymentSpec, state: RolloutState) -> float | None:
    """The next moment at which time alone changes a plan (the end of a canary's pause,
    of a jitter pause, or a batch's deadline): the operator wakes up then, and otherwise
    only when the resource or one of its pods changes."""
    moments: list[float] = []
    paused = state.stage == CANARY and state.canary_healthy_at is not None
    if paused and state.canary_healthy_at is not None and not spec.canary.manual_promote:
        moments.append(state.canary_healthy_at + spec.canary.pause_seconds)
    if state.stage in (CANARY, BATCHES) and state.batch_in_flight and state.batch_started_at:
        moments.append(state.batch_started_at + spec.rollout.progress_deadline_seconds)
    if state.stage == BATCHES and not state.batch_in_flight:
        moments.append(state.next_batch_at)
    return min(moments) if moments else None


def plan_rollout(
    spec: ModelDeploymentSpec,
    stable: str | None,
    previous: str | None,
    state: RolloutState | None,
    pods: list[PodView],
    now: float,
    rng: random.Random,
    promoted_version: str | None = None,
) -> Plan:
    events: list[Event] = []
    target = spec.version
    if state is None or state.to_version != target:
        state, started = _start(spec, stable, previous, state, now)
        if started:
            events.append(started)
    pods = sorted(pods, key=lambda p: p.name)
    planner = _Tick(spec, state, pods, now, rng, stable, previous, events)
    if state.stage == CANARY:
        return planner.canary(promoted_version)
    if state.stage == BATCHES:
        return planner.batches()
    if state.stage == FAILED:
        return planner.plan(Phase.DEGRADED, "RolloutFailed", state.failure or "rollout failed")
    return planner.complete()


class _Tick:
    """One planning step; a class only to share the inputs between the stage methods."""

    def __init__(
        self,
        spec: ModelDeploymentSpec,
        state: RolloutState,
        pods: list[PodView],
        now: float,
        rng: random.Random,
        stable: str | None,
        previous: str | None,
        events: list[Event],
    ) -> None:
        self.spec, self.state, self.pods, self.now, self.rng = spec, state, pods, now, rng
        self.stable, self.previous = stable, previous
        self.events = events
        self.actions: list[SetTarget] = []
        self.version = state.to_version

    def plan(self, phase: Phase, reason: str, message: str) -> Plan:
        return Plan(
            self.state,
            self.stable,
            self.previous,
            tuple(self.actions),
            tuple(self.events),
            phase,
            reason,
            message,
        )

    def retarget(self, pods: list[PodView]) -> None:
        previous = self.state.from_version or self.previous
        self.actions += [SetTarget(p.name, self.version, previous) for p in pods]

    def _progress_phase(self) -> Phase:
        return (
            Phase.ROLLING_BACK if self.state.fast and self.state.from_version else Phase.PROGRESSING
        )

    def _check_failure(self) -> Plan | None:
        refused = [p for p in self.pods if p.refused(self.version)]
        if refused:
            pod = refused[0]
            why = f"pod {pod.name} refused {self.spec.model}:{self.version}: {pod.reason}"
            return self._fail(why)
        started = self.state.batch_started_at
        deadline = self.spec.rollout.progress_deadline_seconds
        if self.state.batch_in_flight and started is not None and self.now - started > deadline:
            slow = [p.name for p in self.pods if p.loading(self.version)]
            return self._fail(
                f"batch {self.state.batch} not serving {self.version} after {deadline:.0f}s: {slow}"
            )
        return None

    def _fail(self, why: str) -> Plan:
        self.state = replace(self.state, stage=FAILED, failure=why, batch_in_flight=False)
        self.events.append(Event("RolloutFailed", f"{why}; rollout stopped", warning=True))
        return self.plan(Phase.DEGRADED, "RolloutFailed", why)

    def canary(self, promoted_version: str | None) -> Plan:
        if failed := self._check_failure():
            return failed
        wanted = self.spec.canary_pods()
        targeted = [p for p in self.pods if p.target == self.version]
        if len(targeted) < wanted and not self.state.batch_in_flight:
            others = sorted(
                (p for p in self.pods if p.target != self.version), key=_readiness_order
            )
            picked = others[: wanted - len(targeted)]
            if picked:
                self.retarget(picked)
                targeted += picked
                self.state = replace(self.state, batch_in_flight=True, batch_started_at=self.now)
                self.events.append(
                    Event(
                        "CanaryStarted",
                        f"canary: {len(targeted)} of {len(self.pods)} pods to "
                        f"{self.version}: {[p.name for p in picked]}",
                    )
                )
        loading = [p for p in targeted if not p.serves(self.version)]
        if loading or not targeted:
            return self.plan(
                Phase.CANARY,
                "CanaryLoading",
                f"canary: {len(targeted) - len(loading)}/{len(targeted)} pods serve {self.version}",
            )
        if self.state.batch_in_flight or self.state.canary_healthy_at is None:
            self.state = replace(self.state, batch_in_flight=False, canary_healthy_at=self.now)
            self.events.append(Event("CanaryHealthy", f"canary pods serve {self.version}; holding"))
        healthy_at = self.state.canary_healthy_at or self.now
        if self.spec.canary.manual_promote:
            if promoted_version != self.version:
                return self.plan(
                    Phase.CANARY,
                    "AwaitingPromotion",
                    f"canary healthy; promote with annotation {PROMOTE}={self.version}",
                )
        elif self.now < healthy_at + self.spec.canary.pause_seconds:
            left = healthy_at + self.spec.canary.pause_seconds - self.now
            return self.plan(
                Phase.CANARY, "CanaryPause", f"canary healthy; {left:.0f}s of pause left"
            )
        self.state = replace(self.state, stage=BATCHES, next_batch_at=self.now)
        self.events.append(Event("CanaryPromoted", f"canary of {self.version} promoted"))
        return self.batches()

    def batches(self) -> Plan:
        if failed := self._check_failure():
            return failed
        loading = [p for p in self.pods if p.loading(self.version)]
        serving = sum(p.serves(self.version) for p in self.pods)
        if loading:
            return self.plan(
                self._progress_phase(),
                "BatchLoading",
                f"batch {self.state.batch}: {len(loading)} pods loading "
                f"{self.version}; {serving}/{len(self.pods)} serve it",
            )
        if self.state.batch_in_flight:
            jitter = (
                0.0 if self.state.fast else self.rng.uniform(0, self.spec.rollout.jitter_seconds)
            )
            self.state = replace(self.state, batch_in_flight=False, next_batch_at=self.now + jitter)
            self.events.append(
                Event(
                    "BatchComplete",
                    f"batch {self.state.batch} serves {self.version}; next batch in {jitter:.1f}s",
                )
            )
        remaining = sorted((p for p in self.pods if p.target != self.version), key=_readiness_order)
        if not remaining:
            return self._complete()
        if self.now < self.state.next_batch_at:
            return self.plan(
                self._progress_phase(),
                "BatchJitter",
                f"{serving}/{len(self.pods)} pods serve {self.version}; next "
                f"batch in {self.state.next_batch_at - self.now:.1f}s",
            )
        unavailable = sum(not p.ready for p in self.pods)
        if not self.state.fast and unavailable > self.spec.rollout.max_unavailable:
            return self.plan(
                self._progress_phase(),
                "WaitingForAvailability",
                f"{unavailable} pods not ready (maxUnavailable "
                f"{self.spec.rollout.max_unavailable})",
            )
        size = len(remaining) if self.state.fast else self.spec.rollout.batch(self.spec.replicas)
        batch = remaining[:size]
        self.retarget(batch)
        self.state = replace(
            self.state, batch=self.state.batch + 1, batch_in_flight=True, batch_started_at=self.now
        )
        self.events.append(
            Event(
                "BatchStarted",
                f"batch {self.state.batch}: {[p.name for p in batch]} -> {self.version}",
            )
        )
        return self.plan(
            self._progress_phase(),
            "BatchLoading",
            f"batch {self.state.batch}: {len(batch)} pods loading {self.version}",
        )

    def _complete(self) -> Plan:
        from_version = self.state.from_version
        if self.stable != self.version:
            self.previous = self.stable if self.stable is not None else from_version
        self.stable = self.version
        self.state = replace(self.state, stage=COMPLETE, batch_in_flight=False)
        self.events.append(
            Event(
                "RolloutComplete",
                f"all {len(self.pods)} pods serve {self.spec.model}:{self.version}",
            )
        )
        return self.complete()

    def complete(self) -> Plan:
        """Steady state: pods without the target (new replicas) are pointed at it."""
        stray = [p for p in self.pods if p.target != self.version]
        self.retarget(stray)
        serving = sum(p.serves(self.version) for p in self.pods)
        if serving < len(self.pods) or len(self.pods) < self.spec.replicas:
            return self.plan(
                Phase.PROGRESSING,
                "PodsStarting",
                f"{serving}/{self.spec.replicas} pods serve {self.version}",
            )
        return self.plan(
            Phase.AVAILABLE,
            "RolloutComplete",
            f"{serving}/{self.spec.replicas} pods serve {self.version}",
        )
