"""The rollout planner: pure functions from (spec, stored rollout state, observed pods,
clock, random source) to (next state, pod actions, events, phase).

No I/O happens here, so every decision can be tested exhaustively; the operator only
observes, calls :func:`plan_rollout`, applies the actions and stores the new state in
``.status`` (which is why the operator can be restarted mid-rollout). Every decision is
derived from the live pods of this pass (the observation layer leaves out pods being
deleted and Failed or Succeeded ones), never from a memory of what was in flight: a
pod that disappears mid-batch is simply not there any more, and its replacement is
picked like any other pod.

Stages of a rollout from ``from_version`` to ``to_version``:

* ``canary``: retarget ``canary.percent`` of the pods (replacing canary pods that went
  away), wait until they serve the new version, hold for ``pauseSeconds`` or until
  promoted by the annotation ``serving.model-rollout.io/promote=<version>@<rollout id>``
  (``manualPromote``; the id is the rollout's start, so a promotion never carries over to
  another rollout, and the operator clears the annotation once used);
* ``batches``: retarget the rest in batches (``batchSize``/``batchPercent``, at most
  ``maxConcurrentLoads``), one batch at a time, with a random jitter pause between
  batches and ``maxUnavailable`` respected;
* ``complete``: every pod serves the version; it becomes the stable version;
* ``failed``: a pod refused the version, or a wait outlasted ``progressDeadlineSeconds``
  (a pod's deadline counts from when its sidecar reports seeing the target); nothing
  more is retargeted until ``spec.version`` changes.

A rollback is *fast* — no canary, no jitter, every pod at once — only when it is safe:
back to the version a rollout in progress started from, or to the previous stable
version, and only when every pod that must move reports holding that version already
(a pointer swap, no load). A version that was just rolled back from gets a canary again
when it is retried; a rollback to a version the pods no longer hold is an ordinary
rollout of batches, under ``maxConcurrentLoads``. Pods left on a version that a new
target abandoned go back to the stable version first.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from model_rollout_contract.annotations import PROMOTE
from model_rollout_contract.defaults import MAX_SIGNAL_DELAY_SECONDS
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
    batch_in_flight: bool = False  # a batch was started and its completion not yet seen
    batch_started_at: float | None = None
    next_batch_at: float = 0.0
    canary_healthy_at: float | None = None
    blocked_since: float | None = None  # waiting for unavailable pods since
    failure: str | None = None

    @property
    def promotion(self) -> str:
        """The promote annotation's value that promotes this rollout's canary."""
        return f"{self.to_version}@{int(self.started_at)}"


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
    promotion_used: bool = False  # the promote annotation was consumed: clear it


def _readiness_order(pod: PodView) -> tuple[bool, str]:
    return (not pod.ready, pod.name)


def _known_good(
    target: str, stable: str | None, previous: str | None, state: RolloutState | None
) -> bool:
    """A version it is safe to go back to without a canary."""
    in_progress = state is not None and state.stage != COMPLETE
    if state is not None and in_progress:
        return target in (state.from_version, stable)
    just_rolled_back_from = (
        state is not None and state.fast and state.from_version == target
    )  # v2 -> v1 (rollback) -> v2: v2 is what was rolled back; it needs a canary again
    return target == previous and not just_rolled_back_from


def _start(
    spec: ModelDeploymentSpec,
    stable: str | None,
    previous: str | None,
    state: RolloutState | None,
    pods: list[PodView],
    now: float,
) -> tuple[RolloutState, Event | None]:
    """A new rollout whenever ``spec.version`` differs from the rollout's target."""
    target = spec.version
    if stable is None:
        return RolloutState(target, None, BATCHES, fast=True, started_at=now), Event(
            "RolloutStarted", f"initial deployment of {spec.model}:{target}"
        )
    in_progress = state is not None and state.stage != COMPLETE
    current = state.to_version if state is not None and in_progress else stable
    if target == stable and not in_progress:
        return RolloutState(target, None, COMPLETE, started_at=now), None
    if _known_good(target, stable, previous, state):
        moving = [p for p in pods if not p.serves(target)]
        if all(p.holds(target) for p in moving):
            return RolloutState(target, current, BATCHES, fast=True, started_at=now), Event(
                "RollbackStarted", f"rolling back {spec.model} from {current} to {target}"
            )
        return RolloutState(target, current, BATCHES, started_at=now), Event(
            "RollbackStarted",
            f"rolling back {spec.model} from {current} to {target} in batches: "
            f"{sum(not p.holds(target) for p in moving)} pods no longer hold it",
        )
    stage = CANARY if spec.canary_pods() > 0 else BATCHES
    return RolloutState(target, stable, stage, started_at=now), Event(
        "RolloutStarted",
        f"rolling out {spec.model} {stable} -> {target}"
        + (f" with a {spec.canary.percent}% canary" if stage == CANARY else ""),
    )


def next_deadline(spec: ModelDeploymentSpec, state: RolloutState) -> float | None:
    """The next moment at which time alone changes a plan (the end of a canary's pause,
    of a jitter pause, or a deadline): the operator wakes up then, and otherwise only
    when the resource or one of its pods changes."""
    deadline = spec.rollout.progress_deadline_seconds
    moments: list[float] = []
    paused = state.stage == CANARY and state.canary_healthy_at is not None
    if paused and state.canary_healthy_at is not None and not spec.canary.manual_promote:
        moments.append(state.canary_healthy_at + spec.canary.pause_seconds)
    if state.stage in (CANARY, BATCHES) and state.batch_started_at is not None:
        moments.append(state.batch_started_at + deadline)  # the earliest a pod can fail
    if state.stage == BATCHES and not state.batch_in_flight:
        moments.append(state.next_batch_at)
    if state.blocked_since is not None:
        moments.append(state.blocked_since + deadline)
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
    pods = sorted(pods, key=lambda p: p.name)
    if state is None or state.to_version != target:
        state, started = _start(spec, stable, previous, state, pods, now)
        if started:
            events.append(started)
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
        self.spec, self.state, self.now, self.rng = spec, state, now, rng
        self.stable, self.previous = stable, previous
        self.events = events
        self.actions: list[SetTarget] = []
        self.version = state.to_version
        self.promotion_used = False
        self.pods = pods
        # pods on a version that no target wants any more (a rollout abandoned for
        # another) go back to the stable version before anything else moves
        abandoned = [
            p
            for p in pods
            if stable is not None
            and p.target is not None
            and p.target not in (self.version, stable)
        ]
        if abandoned and stable is not None:
            self.actions += [SetTarget(p.name, stable, self.previous) for p in abandoned]
        self.moved = {p.name for p in abandoned}  # decided for this pass already

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
            self.promotion_used,
        )

    def retarget(self, pods: list[PodView]) -> None:
        previous = self.state.from_version or self.previous
        self.actions += [SetTarget(p.name, self.version, previous) for p in pods]

    def _progress_phase(self) -> Phase:
        rolling_back = self.state.fast and self.state.from_version
        return Phase.ROLLING_BACK if rolling_back else Phase.PROGRESSING

    def _overdue(self, loading: list[PodView]) -> list[str]:
        """Loading pods past the deadline, counted from when each sidecar reported seeing
        the target (or, for one that has not, from when it must have)."""
        deadline = self.spec.rollout.progress_deadline_seconds
        started = self.state.batch_started_at or self.state.started_at
        late = []
        for pod in loading:
            seen = pod.seen_at if pod.reported_target == self.version else None
            since = seen if seen is not None else started + MAX_SIGNAL_DELAY_SECONDS
            if self.now - max(since, started) > deadline:
                late.append(pod.name)
        return late

    def _check_failure(self, loading: list[PodView]) -> Plan | None:
        refused = [p for p in self.pods if p.refused(self.version)]
        if refused:
            pod = refused[0]
            why = f"pod {pod.name} refused {self.spec.model}:{self.version}: {pod.reason}"
            return self._fail(why)
        late = self._overdue(loading)
        if late:
            deadline = self.spec.rollout.progress_deadline_seconds
            return self._fail(f"not serving {self.version} after {deadline:.0f}s: {late}")
        return None

    def _fail(self, why: str) -> Plan:
        self.state = replace(self.state, stage=FAILED, failure=why, batch_in_flight=False)
        self.events.append(Event("RolloutFailed", f"{why}; rollout stopped", warning=True))
        return self.plan(Phase.DEGRADED, "RolloutFailed", why)

    def canary(self, promoted_version: str | None) -> Plan:
        wanted = self.spec.canary_pods()
        targeted = [p for p in self.pods if p.target == self.version]
        if failed := self._check_failure([p for p in targeted if p.loading(self.version)]):
            return failed
        if len(targeted) < wanted:  # the first pick, or canary pods that went away
            others = sorted(
                (p for p in self.pods if p.target != self.version and p.name not in self.moved),
                key=_readiness_order,
            )
            picked = others[: wanted - len(targeted)]
            if picked:
                self.retarget(picked)
                targeted += picked
                first = self.state.batch_started_at is None
                self.state = replace(
                    self.state,
                    batch_in_flight=True,
                    batch_started_at=self.now,
                    canary_healthy_at=None,
                )
                self.events.append(
                    Event(
                        "CanaryStarted" if first else "CanaryReplaced",
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
            if promoted_version != self.state.promotion:
                return self.plan(
                    Phase.CANARY,
                    "AwaitingPromotion",
                    f"canary healthy; promote with annotation {PROMOTE}={self.state.promotion}",
                )
            self.promotion_used = True
        elif self.now < healthy_at + self.spec.canary.pause_seconds:
            left = healthy_at + self.spec.canary.pause_seconds - self.now
            return self.plan(
                Phase.CANARY, "CanaryPause", f"canary healthy; {left:.0f}s of pause left"
            )
        self.state = replace(self.state, stage=BATCHES, next_batch_at=self.now)
        self.events.append(Event("CanaryPromoted", f"canary of {self.version} promoted"))
        return self.batches()

    def batches(self) -> Plan:
        loading = [p for p in self.pods if p.loading(self.version)]
        if failed := self._check_failure(loading):
            return failed
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
        remaining = [p for p in remaining if p.name not in self.moved]
        if not remaining:
            return self.plan(
                self._progress_phase(),
                "ReturningToStable",
                f"{len(self.moved)} pods go back to {self.stable} before {self.version} moves on",
            )
        if self.now < self.state.next_batch_at:
            return self.plan(
                self._progress_phase(),
                "BatchJitter",
                f"{serving}/{len(self.pods)} pods serve {self.version}; next "
                f"batch in {self.state.next_batch_at - self.now:.1f}s",
            )
        unavailable = sum(not p.ready for p in self.pods)
        if not self.state.fast and unavailable > self.spec.rollout.max_unavailable:
            since = self.state.blocked_since or self.now
            deadline = self.spec.rollout.progress_deadline_seconds
            if self.now - since > deadline:
                return self._fail(
                    f"{unavailable} pods not ready for {deadline:.0f}s (maxUnavailable "
                    f"{self.spec.rollout.max_unavailable})"
                )
            self.state = replace(self.state, blocked_since=since)
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
            self.state,
            batch=self.state.batch + 1,
            batch_in_flight=True,
            batch_started_at=self.now,
            blocked_since=None,
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
        stray = [p for p in self.pods if p.target != self.version and p.name not in self.moved]
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
