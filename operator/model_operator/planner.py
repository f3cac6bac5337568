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
  another rollout, and the operator clears the annotation once used; with ``analysis``
  the annotation approves, and the promotion waits for a passed check too). With
  ``trafficPercent`` or ``shadowPercent`` the canary pods also carry the traffic policy
  (their servers split or mirror requests between the two versions), removed as soon as
  the canary ends, whichever way. With ``analysis`` the pause is also a series of checks
  of the canary's own figures (:mod:`.analysis`; measured by the operator, handed in as a
  :class:`~.analysis.Sample`): the pause ends in a promotion only after a passed check,
  and ``failureLimit`` failed checks send every canary pod back to the stable version
  (a pointer swap: they hold it) and stop the rollout;
  with ``canary.shadow`` (on by default with analysis) the canary has two steps
  (``RolloutState.canary_step``): ``shadow``, whose policy gives the candidate no live
  share and mirrors ``shadow.percent`` of the stable answers to it, ends on its first
  passed check (or rolls back as above), before any user got an answer of the candidate;
  then ``live``, the canary just described, with its own pause and passed check. A
  promote annotation read in the shadow step is kept, not used: it approves the canary,
  and skips neither step's check;
* ``batches``: retarget the rest in batches (``batchSize``/``batchPercent``), one batch
  at a time, with a random jitter pause between batches and ``maxUnavailable`` respected;
* ``complete``: every pod serves the version; it becomes the stable version;
* ``failed``: a pod refused the version, or a wait outlasted ``progressDeadlineSeconds``
  (a pod's deadline counts from when its sidecar reports seeing the target); nothing
  more is retargeted until ``spec.version`` changes.

Two annotations act on the rollout in progress (the kubectl plugin writes them; the
operator clears each once read): ``abort=<version>`` sends every pod of a running rollout
to that version back to the stable version at once, the path a failed analysis takes
(stage ``failed``, phase ``Degraded``, reason ``Aborted``); ``retry=<version>`` forgets
the failure of the failed rollout to ``spec.version`` (the ``failed`` stage is the only
memory of it) and starts that rollout again, canary first.

``spec.paused`` (``kubectl model pause``, as Argo Rollouts' ``spec.paused``) holds a
running rollout where it is: no canary pick, no batch, no promotion out of the canary
hold (the promote annotation waits), no progress of the canary's pause or of a jitter
pause. Loads in flight finish; a pod's refusal still fails the rollout, but no deadline
does: on resume each timer goes on from where the pause found it and the
``progressDeadlineSeconds`` of the pods loading restarts. What takes pods back to the
stable version still acts: an abort, a failed (or inconclusive) analysis of a held canary
(it goes on checking), pods of an abandoned target, and the *fast* rollouts, which pause
never holds (a fast rollback: pointer swaps back to a version the pods hold; a first
deployment, which has nothing to stay on). A rollback that needs loads is a rollout like
any other: it waits for the resume.

``promote=<version>@<rollout id>+full`` (``kubectl model promote --full``) skips what
remains of a running rollout: the canary hold and its analysis, the remaining batches
and their jitter. Every pod not yet on the version moves at once, as
``maxConcurrentLoads`` allows (a cap on resources, not a step: a pod moves as soon as a
load ends, not batch by batch); the state records ``full``. It skips a shadow step
that has not passed too (the user's explicit choice: the candidate answers users
untested), recorded as the step's result, so that no view says no user saw it.

A rollback is *fast* — no canary, no jitter, every pod at once — only when it is safe:
back to the version a rollout in progress started from, or to the previous stable
version, and only when every pod that must move reports holding that version already
(a pointer swap, no load). A version that was just rolled back from gets a canary again
when it is retried; a rollback to a version the pods no longer hold is an ordinary
rollout of batches, under ``maxConcurrentLoads``. Pods left on a version that a new
target abandoned go back to the stable version first.

``maxConcurrentLoads`` caps every load in flight, whatever it is for: canary pods, a
batch, pods going back to a version their servers no longer hold, new pods pointed at
the version. A load is a pod pointed at a version its server does not hold (a pointer
swap is none); what would exceed the cap waits for loads to finish (a canary is then
picked in waves, a batch is smaller).

``spec.replicas`` follows a scaler (the scale subresource): a pod created mid-rollout,
pointed nowhere yet, is pointed at once at the version its stage wants for it (stable
during a canary or after a failure, the target once the canary is promoted, but
stable while ``spec.paused`` holds the rollout), so that its
init container pre-pulls that version; a pod removed is simply not there any more.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from model_rollout_contract.annotations import (
    ABORT,
    PROMOTE,
    RETRY,
    parse_promotion,
    promotion_id,
)
from model_rollout_contract.canary import TrafficPolicy
from model_rollout_contract.defaults import MAX_SIGNAL_DELAY_SECONDS
from model_rollout_contract.states import CanaryStep, Phase, RolloutStage

from .analysis import AnalysisState, Result, Sample, last_check_passed, verdict_of
from .pods import PodView
from .spec import AnalysisSpec, ModelDeploymentSpec

CANARY, BATCHES = RolloutStage.CANARY, RolloutStage.BATCHES
COMPLETE, FAILED = RolloutStage.COMPLETE, RolloutStage.FAILED
SHADOW, LIVE = CanaryStep.SHADOW, CanaryStep.LIVE


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
    canary_picked: int | None = None  # canary pods picked so far (in waves under the cap)
    blocked_since: float | None = None  # waiting for unavailable pods since
    failure: str | None = None
    rolled_back: bool = False  # failed by the canary analysis: canary pods went back
    aborted: bool = False  # ended by the abort annotation: every pod went back
    inconclusive: bool = False  # rolled back: its analysis could not conclude
    full: bool = False  # fully promoted (promote --full): no canary hold, batches or jitter
    paused_at: float | None = None  # held by spec.paused since (its timers resume later)
    # the canary's step (a state stored before there were steps was live); and how its
    # shadow step ended (None: it had none, or it runs)
    canary_step: CanaryStep = LIVE
    shadow_result: str | None = None

    @property
    def promotion(self) -> str:
        """The promote annotation's value that promotes this rollout's canary."""
        return promotion_id(self.to_version, self.started_at)


@dataclass(frozen=True)
class SetTarget:
    """A pod's annotations: its target, the version to keep for a rollback (``None``:
    left as it is) and its traffic policy (``None``: none)."""

    pod: str
    version: str
    previous: str | None
    policy: str | None = None


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
    analysis: AnalysisState | None = None  # for .status.analysis
    cleared: tuple[str, ...] = ()  # the abort/retry annotations read: the operator clears them


# the reason (phase as the stage's) of a rollout that spec.paused holds
PAUSED_REASON = "Paused"
# the reason of a rollout fully promoted, while its pods move
FULL_PROMOTION_REASON = "FullPromotion"

# the events of a rollout's start: each begins one entry of the rollout history
START_EVENTS = ("RolloutStarted", "RollbackStarted")
RETRIED_EVENT = "RolloutRetried"  # a failed rollout of spec.version run again
# the reason (phase Degraded) of an analysis that could not conclude in time
INCONCLUSIVE_REASON = "AnalysisInconclusive"


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
    step = spec.canary.first_step()
    return RolloutState(target, stable, stage, started_at=now, canary_step=step), Event(
        "RolloutStarted",
        f"rolling out {spec.model} {stable} -> {target}"
        + (f" with a {spec.canary.percent}% canary" if stage == CANARY else "")
        + (", shadow step first" if stage == CANARY and step is SHADOW else ""),
    )


def pause_holds(spec: ModelDeploymentSpec, state: RolloutState) -> bool:
    """Does ``spec.paused`` hold this rollout? Every running one but the fast ones (a fast
    rollback, a first deployment)."""
    return spec.paused and state.stage in (CANARY, BATCHES) and not state.fast


def _resume(
    spec: ModelDeploymentSpec, state: RolloutState, now: float, events: list[Event]
) -> RolloutState:
    """A rollout that ``spec.paused`` held, once it no longer does: the canary's pause and
    a jitter pause go on from where they were (the time paused does not count), and the
    deadline of the pods loading, and of a wait for unavailable pods, starts again."""
    if state.paused_at is None or pause_holds(spec, state):
        return state
    shift = max(0.0, now - state.paused_at)
    healthy = state.canary_healthy_at
    if state.stage in (CANARY, BATCHES):
        events.append(Event("RolloutResumed", f"rollout of {state.to_version} resumed"))
    return replace(
        state,
        paused_at=None,
        canary_healthy_at=None if healthy is None else healthy + shift,
        next_batch_at=state.next_batch_at + shift,
        batch_started_at=None if state.batch_started_at is None else now,
        blocked_since=None,
    )


def _full_promotion(state: RolloutState, promoted: str | None) -> bool:
    """Does the promote annotation fully promote this running rollout?"""
    promotion, full = parse_promotion(promoted)
    return full and promotion == state.promotion and state.stage in (CANARY, BATCHES)


def analysing(
    spec: ModelDeploymentSpec, state: RolloutState | None, analysis: AnalysisState | None
) -> AnalysisState | None:
    """The analysis of the canary that is held now, if it has one."""
    if state is None or state.stage != CANARY or state.canary_healthy_at is None:
        return None
    if spec.canary.analysis is None or analysis is None or state.to_version != spec.version:
        return None
    return analysis if analysis.rollout == state.promotion else None


def next_deadline(
    spec: ModelDeploymentSpec, state: RolloutState, analysis: AnalysisState | None = None
) -> float | None:
    """The next moment at which time alone changes a plan (the end of a canary's pause,
    its next analysis check, the end of a jitter pause, or a deadline): the operator wakes
    up then, and otherwise only when the resource or one of its pods changes."""
    if pause_holds(spec, state):  # only a held canary's analysis checks (resume wakes it)
        checking = analysing(spec, state, analysis)
        return None if checking is None else checking.next_check_at
    deadline = spec.rollout.progress_deadline_seconds
    moments: list[float] = []
    paused = state.stage == CANARY and state.canary_healthy_at is not None
    if paused and state.canary_healthy_at is not None and not spec.canary.manual_promote:
        moments.append(state.canary_healthy_at + spec.canary.pause_seconds)
    held = analysing(spec, state, analysis)
    if held is not None:
        moments.append(held.next_check_at)
    if state.stage in (CANARY, BATCHES) and state.batch_started_at is not None:
        moments.append(state.batch_started_at + deadline)  # the earliest a pod can fail
    if state.stage == BATCHES and not state.batch_in_flight and not state.full:
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
    analysis: AnalysisState | None = None,
    sample: Sample | None = None,
    aborted_version: str | None = None,
    retried_version: str | None = None,
) -> Plan:
    """``analysis``: as the last plan left it; ``sample``: what the operator read of
    the canary, when :func:`analysing` said a check was due; ``aborted_version`` and
    ``retried_version``: the abort and retry annotations' values."""
    events: list[Event] = []
    cleared: list[str] = []
    target = spec.version
    pods = sorted(pods, key=lambda p: p.name)
    if retried_version is not None:
        cleared.append(RETRY)
        if _retry(spec, state, retried_version, events):
            state = None  # the failure forgotten: the rollout starts again below
    if state is None or state.to_version != target:
        state, started = _start(spec, stable, previous, state, pods, now)
        if started:
            events.append(started)
    abort = False
    if aborted_version is not None:
        cleared.append(ABORT)
        abort = _abortable(stable, state, aborted_version, events)
    state = _resume(spec, state, now, events)
    planner = _Tick(spec, state, pods, now, rng, stable, previous, events, analysis, cleared)
    if abort:
        return planner.abort()
    if pause_holds(spec, state):
        return planner.paused(sample)
    if _full_promotion(state, promoted_version):
        return planner.promote_fully()
    if state.stage == BATCHES and state.full:
        return planner.full()
    if state.stage == CANARY:
        return planner.canary(promoted_version, sample)
    if state.stage == BATCHES:
        return planner.batches()
    if state.stage == FAILED:
        return planner.failed()
    return planner.complete()


def _retry(
    spec: ModelDeploymentSpec, state: RolloutState | None, version: str, events: list[Event]
) -> bool:
    """Does the retry annotation restart the failed rollout to ``spec.version``? A retry
    of a rollout that runs already (the annotation read again before its removal is
    seen) is dropped quietly; one of another version, or of a success, with an Event."""
    why = None
    if version != spec.version:
        why = f"it names {version}, not spec.version {spec.version}"
    elif state is not None and state.to_version == version and state.stage == FAILED:
        events.append(
            Event(RETRIED_EVENT, f"retrying {spec.model}:{version} (was: {state.failure})")
        )
        return True
    elif state is not None and state.to_version == version and state.stage == COMPLETE:
        why = f"the rollout of {version} succeeded; nothing to retry"
    if why is not None:
        events.append(Event("RetryIgnored", f"retry of {version} ignored: {why}", warning=True))
    return False


def _abortable(stable: str | None, state: RolloutState, version: str, events: list[Event]) -> bool:
    """Does the abort annotation stop the rollout that runs now? An abort of another
    version, or one that arrives after its rollout ended, is ignored with an Event (the
    user learns that it did nothing); one read again after it acted, quietly."""
    why = None
    if version != state.to_version:
        why = f"the current rollout is of {state.to_version}"
    elif state.stage == COMPLETE:
        why = f"the rollout of {version} completed; use kubectl model rollback"
    elif state.stage in (CANARY, BATCHES):
        if stable is not None and stable != version:
            return True
        why = f"no stable version to go back to from {version}"
    elif not state.aborted:
        why = f"the rollout of {version} is not running ({state.stage})"
    if why is not None:
        events.append(Event("AbortIgnored", f"abort of {version} ignored: {why}", warning=True))
    return False


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
        analysis: AnalysisState | None = None,
        cleared: list[str] | None = None,
    ) -> None:
        self.spec, self.state, self.now, self.rng = spec, state, now, rng
        self.stable, self.previous = stable, previous
        self.events = events
        self.analysis = analysis
        self.actions: list[SetTarget] = []
        self._targets: dict[str, str] = {}  # pod -> its target once the actions are applied
        self.version = state.to_version
        self.promotion_used = False
        self.cleared = cleared or []  # annotations this pass read and acted on (or ignored)
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
            self._point(self._admit(abandoned, stable), stable, self.previous)
        # decided for this pass already: back now, or once loads in flight allow
        self.moved = {p.name for p in abandoned}

    def plan(self, phase: Phase, reason: str, message: str) -> Plan:
        self._place_new()
        self._set_policies()
        if self.state.stage == CANARY and self._stepped():
            message = f"canary step {self.state.canary_step}: {message}"
        analysis = self.analysis
        if analysis is not None and analysis.baseline is not None and self.state.stage != CANARY:
            analysis = replace(analysis, baseline=None)  # that canary is over
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
            analysis,
            tuple(self.cleared),
        )

    def _place_new(self) -> None:
        """Pods pointed nowhere yet (created since: a scale-up, a replacement) are pointed
        at once, as ``maxConcurrentLoads`` allows, at the version this stage wants for
        them, so that their init container pre-pulls it rather than the ConfigMap's
        default: the rollout's target once its canary is promoted (a new pod serves nothing
        yet: no batch of its own, and no load of the version it would leave), the stable
        version before that or once the rollout failed. A first deployment's batches and
        the steady state (:meth:`complete`) point them already. While ``spec.paused``
        holds the rollout, the stable version too: a pause exposes no more pods to the
        target (they move on resume, as the rest do)."""
        stage = self.state.stage
        if self.stable is None or stage == COMPLETE:
            return
        if stage == BATCHES and not pause_holds(self.spec, self.state):
            version, previous = self.version, self.state.from_version or self.previous
        else:  # canary, failed
            version, previous = self.stable, self.previous
        new = [p for p in self.pods if p.target is None and p.name not in self._targets]
        self._point(self._admit(new, version), version, previous)

    def _policy(self) -> str | None:
        """The traffic policy of this rollout's canary pods, while they are a canary: in
        the shadow step no live share, only mirrored requests."""
        canary = self.spec.canary
        step = self.state.canary_step
        if self.state.stage != CANARY or not canary.holds_both(step):
            return None
        if self.stable is None or self.stable == self.version:
            return None
        if step is SHADOW:
            policy = TrafficPolicy(self.stable, self.version, 0, canary.shadow.percent)
        else:
            policy = TrafficPolicy(
                self.stable, self.version, canary.traffic_percent, canary.shadow_percent
            )
        return policy.to_annotation()

    def _set_policies(self) -> None:
        """Every pod's policy annotation as this plan leaves the pods: the canary's on its
        pods, none anywhere else (after a promotion, a rollback, an abandoned rollout)."""
        wanted = self._policy()
        actions = {a.pod: i for i, a in enumerate(self.actions)}
        for pod in self.pods:
            index = actions.get(pod.name)
            target = self.actions[index].version if index is not None else pod.target
            policy = wanted if target == self.version else None
            if index is not None:
                self.actions[index] = replace(self.actions[index], policy=policy)
            elif pod.policy != policy and pod.target is not None:
                self.actions.append(SetTarget(pod.name, pod.target, None, policy))

    def retarget(self, pods: list[PodView]) -> None:
        self._point(pods, self.version, self.state.from_version or self.previous)

    def _point(self, pods: list[PodView], version: str, previous: str | None) -> None:
        self.actions += [SetTarget(p.name, version, previous) for p in pods]
        self._targets.update((p.name, version) for p in pods)

    def _loads(self) -> int:
        """Loads in flight once this pass's actions are applied."""
        return sum(p.loads(self._targets.get(p.name, p.target)) for p in self.pods)

    def _admit(self, pods: list[PodView], version: str, limit: int | None = None) -> list[PodView]:
        """Those of ``pods``, in order and at most ``limit``, that can be pointed at
        ``version`` without more than ``maxConcurrentLoads`` loads in flight: a pointer
        swap always, a move that ends a load for another always, a new load while the cap
        allows."""
        cap = self.spec.rollout.max_concurrent_loads
        loads = self._loads() if cap else 0
        admitted: list[PodView] = []
        for pod in pods:
            if limit is not None and len(admitted) >= limit:
                break
            if cap:
                more = int(pod.loads(version)) - int(
                    pod.loads(self._targets.get(pod.name, pod.target))
                )
                if more > 0 and loads + more > cap:
                    continue
                loads += more
            admitted.append(pod)
        return admitted

    def _waiting_for_loads(self) -> str:
        return (
            f"{self._loads()} loads in flight (maxConcurrentLoads "
            f"{self.spec.rollout.max_concurrent_loads})"
        )

    def _progress_phase(self) -> Phase:
        rolling_back = self.state.fast and self.state.from_version
        return Phase.ROLLING_BACK if rolling_back else Phase.PROGRESSING

    def _overdue(self, loading: list[PodView]) -> list[str]:
        """Loading pods past the deadline, counted from when each sidecar reported seeing
        the target (or, for one that has not, from when it must have: a pod created after
        the batch started, from its creation)."""
        deadline = self.spec.rollout.progress_deadline_seconds
        batch = self.state.batch_started_at or self.state.started_at
        late = []
        for pod in loading:
            started = max(batch, pod.created_at or batch)
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

    def canary(self, promoted_version: str | None, sample: Sample | None = None) -> Plan:
        wanted = self.spec.canary_pods()
        targeted = [p for p in self.pods if p.target == self.version]
        if failed := self._check_failure([p for p in targeted if p.loading(self.version)]):
            return failed
        held_back = 0  # canary pods still to pick once loads in flight allow
        if len(targeted) < wanted:  # the first pick, canary pods that went away, a wave
            others = sorted(
                (p for p in self.pods if p.target != self.version and p.name not in self.moved),
                key=_readiness_order,
            )
            picked = self._admit(others, self.version, wanted - len(targeted))
            held_back = min(wanted - len(targeted), len(others)) - len(picked)
            if picked:
                self._pick_canary(picked, targeted, wanted, held_back)
                targeted += picked
        loading = [p for p in targeted if not p.serves(self.version)]
        if loading or not targeted or held_back:
            waiting = f"; {held_back} more wait: {self._waiting_for_loads()}" if held_back else ""
            return self.plan(
                Phase.CANARY,
                "CanaryLoading",
                f"canary: {len(targeted) - len(loading)}/{len(targeted)} pods serve "
                f"{self.version}{waiting}",
            )
        spec = self.spec.canary.analysis
        if self.state.batch_in_flight or self.state.canary_healthy_at is None:
            self.state = replace(self.state, batch_in_flight=False, canary_healthy_at=self.now)
            self.events.append(Event("CanaryHealthy", f"canary pods serve {self.version}; holding"))
            if spec is not None:
                self._start_analysis(spec)
        healthy_at = self.state.canary_healthy_at or self.now
        verdict = ""
        if spec is not None:
            if failed := self._analyse(spec, sample):
                return failed
            verdict = f"; analysis {verdict_of(self.analysis)}"
            if (why := self._undecided(spec)) is not None:  # onInconclusive: hold
                return self.plan(
                    Phase.DEGRADED,
                    INCONCLUSIVE_REASON,
                    f"canary of {self.version} held (onInconclusive: hold): {why}; a "
                    "conclusive check ends it, or abort",
                )
        if self.state.canary_step is SHADOW:
            return self._shadow_step(spec, verdict, promoted_version)
        if self.spec.canary.manual_promote:
            if promoted_version != self.state.promotion:
                return self.plan(
                    Phase.CANARY,
                    "AwaitingPromotion",
                    f"canary healthy{verdict}; promote with annotation "
                    f"{PROMOTE}={self.state.promotion}"
                    + (" (it promotes after a passed check)" if spec is not None else ""),
                )
            if spec is not None and not last_check_passed(self.analysis):
                checked = self.analysis is not None and self.analysis.last_result is not None
                return self.plan(  # the annotation stays: it approves, the analysis decides
                    Phase.CANARY,
                    "AwaitingAnalysis",
                    "canary healthy; approved; waiting for analysis to pass (last: "
                    f"{verdict_of(self.analysis) if checked else 'no check yet'})",
                )
            self.promotion_used = True
        elif self.now < healthy_at + self.spec.canary.pause_seconds:
            left = healthy_at + self.spec.canary.pause_seconds - self.now
            return self.plan(
                Phase.CANARY, "CanaryPause", f"canary healthy{verdict}; {left:.0f}s of pause left"
            )
        elif spec is not None and not last_check_passed(self.analysis):
            return self.plan(
                Phase.CANARY,
                "AnalysisHolding",
                f"canary healthy{verdict}; promoted after a passed check",
            )
        self.state = replace(self.state, stage=BATCHES, next_batch_at=self.now)
        self.events.append(Event("CanaryPromoted", f"canary of {self.version} promoted"))
        return self.batches()

    def _stepped(self) -> bool:
        """Whether this rollout's canary has steps to name (a shadow step, now or past)."""
        return self.state.canary_step is SHADOW or self.state.shadow_result is not None

    def _in_step(self) -> str:
        return f" in the {self.state.canary_step} step" if self._stepped() else ""

    def _step_prefix(self) -> str:
        return f"{self.state.canary_step} step: " if self._stepped() else ""

    def _shadow_step(
        self, spec: AnalysisSpec | None, verdict: str, promoted_version: str | None
    ) -> Plan:
        """The canary's first step: the candidate answers only mirrored requests, and
        goes live on the step's first passed check. A promote annotation read now is
        kept: it approves the canary, it never skips the shadow or the live step's check."""
        shadow = self.spec.canary.shadow
        if spec is not None and shadow.enabled and not last_check_passed(self.analysis):
            approved = (
                "; approved: promoted once the live step passes a check too"
                if self.spec.canary.manual_promote and promoted_version == self.state.promotion
                else ""
            )
            return self.plan(
                Phase.CANARY,
                "ShadowAnalysis",
                f"{self.version} answers only mirrored requests ({shadow.percent}% of the "
                f"canary pods' stable answers), no user{verdict}; live after a passed check"
                f"{approved}",
            )
        return self._go_live(spec)

    def _go_live(self, spec: AnalysisSpec | None) -> Plan:
        """The shadow step passed (or is no longer asked for): the canary pods get their
        live share, held and judged afresh as a canary without a shadow step is."""
        a = self.analysis
        shadow_passed = spec is not None and a is not None and last_check_passed(self.analysis)
        if shadow_passed and a is not None:
            result = f"passed at check {a.checks} ({a.failures} failed): {a.message}"
        else:
            result = "skipped: spec.canary no longer asks for it"
        self.state = replace(
            self.state, canary_step=LIVE, shadow_result=result, canary_healthy_at=self.now
        )
        if spec is not None and a is not None and a.rollout == self.state.promotion:
            self.analysis = a.restart_window(self.now, spec)  # the live step's own checks
        canary = self.spec.canary
        share = (
            f"{canary.traffic_percent}% of the canary pods' requests"
            if canary.in_pod
            else "every request of the canary pods"
        )
        self.events.append(
            Event(
                "ShadowPassed" if shadow_passed else "ShadowSkipped",
                f"shadow step of {self.version} {result}; it now answers {share}",
            )
        )
        return self.plan(
            Phase.CANARY, "CanaryLive", f"shadow step {result}; {self.version} answers {share}"
        )

    def _pick_canary(
        self, picked: list[PodView], targeted: list[PodView], wanted: int, held_back: int
    ) -> None:
        """Retarget canary pods: the first pick (``CanaryStarted``), a later wave of it
        under ``maxConcurrentLoads`` (``CanaryExtended``), or replacements for canary
        pods that went away (``CanaryReplaced``)."""
        self.retarget(picked)
        before = self.state.canary_picked
        if self.state.batch_started_at is None:
            reason, before = "CanaryStarted", 0
        elif before is not None and before < wanted:
            reason = "CanaryExtended"
        else:
            reason = "CanaryReplaced"
        self.state = replace(
            self.state,
            batch_in_flight=True,
            batch_started_at=self.now,
            canary_healthy_at=None,
            canary_picked=min(wanted, (wanted if before is None else before) + len(picked)),
        )
        later = f"; {held_back} more as loads finish" if held_back else ""
        self.events.append(
            Event(
                reason,
                f"canary: {len(targeted) + len(picked)} of {len(self.pods)} pods to "
                f"{self.version}: {[p.name for p in picked]}{later}",
            )
        )

    def _start_analysis(self, spec: AnalysisSpec) -> None:
        """The canary turned healthy: measure from now on (a canary whose pods changed
        keeps its count of checks and failures)."""
        held = self.analysis
        if held is not None and held.rollout == self.state.promotion:
            self.analysis = held.restart_window(self.now, spec)
        else:
            self.analysis = AnalysisState.start(self.state.promotion, self.now, spec)

    def _analyse(self, spec: AnalysisSpec, sample: Sample | None) -> Plan | None:
        """Record ``sample``; roll the canary back when that makes ``failureLimit``."""
        if self.analysis is None or self.analysis.rollout != self.state.promotion:
            self._start_analysis(spec)  # analysis asked for while the canary was held
        analysis = self.analysis
        assert analysis is not None and self.stable is not None
        if sample is None or not analysis.due(sample.at):
            return None
        before, held_before = analysis.last_result, self._undecided(spec)
        self.analysis, check = analysis.advance(sample, spec, self.stable, self.version)
        if check is None:
            return None
        if (why := self._undecided(spec)) is not None:
            if spec.on_inconclusive == "rollback":
                return self._analysis_inconclusive(why)
            if held_before is None:
                self.events.append(
                    Event("AnalysisInconclusive", f"{why}; canary held", warning=True)
                )
            return None
        if check.result is Result.FAILED:
            failures = self.analysis.failures
            self.events.append(
                Event(
                    "AnalysisCheckFailed",
                    f"check {self.analysis.checks} failed{self._in_step()} ({failures} of "
                    "failureLimit "
                    f"{spec.failure_limit}): {check.message}",
                    warning=True,
                )
            )
            if failures >= spec.failure_limit:
                return self._analysis_failed(spec)
        elif check.result != before:
            self.events.append(
                Event(f"Analysis{check.result}", f"{self._step_prefix()}{check.message}")
            )
        return None

    def _undecided(self, spec: AnalysisSpec) -> str | None:
        """Why this canary's analysis has gone on too long without concluding."""
        if self.analysis is None or self.analysis.rollout != self.state.promotion:
            return None
        return self.analysis.undecided(spec, spec.inconclusive_deadline(self.spec.rollout))

    def _analysis_inconclusive(self, why: str) -> Plan:
        """``onInconclusive: rollback``: an unproven candidate goes, as a failed one does."""
        why = (
            f"canary analysis of {self.version} inconclusive{self._in_step()}: {why}: "
            f"{verdict_of(self.analysis)}"
        )
        self.state = replace(
            self.state,
            stage=FAILED,
            failure=why,
            rolled_back=True,
            inconclusive=True,
            batch_in_flight=False,
        )
        back = self._back_to_stable()
        self.events.append(
            Event(
                INCONCLUSIVE_REASON,
                f"{why}; {back} canary pods back to {self.stable}",
                warning=True,
            )
        )
        return self.plan(Phase.DEGRADED, INCONCLUSIVE_REASON, why)

    def _analysis_failed(self, spec: AnalysisSpec) -> Plan:
        assert self.analysis is not None
        why = (
            f"canary analysis of {self.version} failed{self._in_step()} "
            f"{self.analysis.failures} of {self.analysis.checks} checks (failureLimit "
            f"{spec.failure_limit}): {self.analysis.message}"
        )
        self.state = replace(
            self.state, stage=FAILED, failure=why, rolled_back=True, batch_in_flight=False
        )
        back = self._back_to_stable()
        self.events.append(
            Event(
                "AnalysisFailed", f"{why}; {back} canary pods back to {self.stable}", warning=True
            )
        )
        return self.plan(Phase.DEGRADED, "AnalysisFailed", why)

    def _back_to_stable(self) -> int:
        """Every pod on the rolled-back version goes back to the stable one (those whose
        servers no longer hold it as ``maxConcurrentLoads`` allows): how many."""
        assert self.stable is not None
        back = [p for p in self.pods if p.target == self.version and p.name not in self.moved]
        self._point(self._admit(back, self.stable), self.stable, None)
        self.moved |= {p.name for p in back}  # the rest next time, as loads allow
        return len(back)

    def abort(self) -> Plan:
        """The abort annotation: every pod of this rollout back to stable now."""
        why = f"rollout of {self.spec.model}:{self.version} aborted"
        self.state = replace(
            self.state,
            stage=FAILED,
            failure=why,
            rolled_back=True,
            aborted=True,
            batch_in_flight=False,
        )
        back = self._back_to_stable()
        self.events.append(
            Event("RolloutAborted", f"{why}; {back} pods back to {self.stable}", warning=True)
        )
        return self.plan(Phase.DEGRADED, "Aborted", why)

    def failed(self) -> Plan:
        """Nothing moves until ``spec.version`` changes (or a retry), but that a rollout
        the analysis failed or an abort stopped stays rolled back (a pod that went back to
        it, say, is sent back again)."""
        why = self.state.failure or "rollout failed"
        if self.state.rolled_back and self.stable is not None:
            self._back_to_stable()
            reason = "Aborted" if self.state.aborted else "AnalysisFailed"
            if self.state.inconclusive:
                reason = INCONCLUSIVE_REASON
            return self.plan(Phase.DEGRADED, reason, why)
        return self.plan(Phase.DEGRADED, "RolloutFailed", why)

    def paused(self, sample: Sample | None = None) -> Plan:
        """``spec.paused``: nothing new starts; loads in flight finish; a refusal still
        fails the rollout (no deadline does) and a held canary's analysis goes on."""
        if self.state.paused_at is None:
            self.state = replace(self.state, paused_at=self.now)
            self.events.append(Event("RolloutPaused", f"rollout of {self.version} paused"))
        if failed := self._check_failure([]):  # a refusal: no deadline while paused
            return failed
        spec = self.spec.canary.analysis
        healthy = self.state.canary_healthy_at is not None and not self.state.batch_in_flight
        checking = self.state.stage == CANARY and spec is not None and healthy
        if checking and spec is not None and (failed := self._analyse(spec, sample)):
            return failed
        serving = sum(p.serves(self.version) for p in self.pods)
        loading = sum(p.loading(self.version) for p in self.pods)
        shadow = self.state.stage == CANARY and self.state.canary_step is SHADOW
        serve = "hold" if shadow else "serve"  # in the shadow step no user gets its answers
        return self.plan(
            Phase.CANARY if self.state.stage == CANARY else self._progress_phase(),
            PAUSED_REASON,
            f"paused (spec.paused) at the {self.state.stage} stage: {serving}/"
            f"{len(self.pods)} pods {serve} {self.version}"
            + (" (it answers only mirrored requests)" if shadow else "")
            + (f", {loading} loading (loads in flight finish)" if loading else "")
            + "; it goes on once spec.paused is false",
        )

    def promote_fully(self) -> Plan:
        """The full promotion annotation: what remains is skipped (used once, cleared)."""
        self.promotion_used = True
        if not self.state.full:
            skipped = "the canary hold and its analysis, " if self.state.stage == CANARY else ""
            if self.state.stage == CANARY and self.state.canary_step is SHADOW:
                # users get the candidate's answers now: the step never passed, and a
                # later rollback must not say that no user got one
                skipped = "the shadow step (no check passed), " + skipped
                self.state = replace(
                    self.state,
                    canary_step=LIVE,
                    shadow_result="skipped: fully promoted (promote --full)",
                )
            self.state = replace(self.state, stage=BATCHES, full=True, next_batch_at=self.now)
            self.events.append(
                Event(
                    "FullyPromoted",
                    f"rollout of {self.version} fully promoted: {skipped}the remaining "
                    "batches and their jitter skipped",
                )
            )
        return self.full()

    def _start_batch(self, pods: list[PodView], label: str | None = None) -> None:
        """Point ``pods`` at the version as the next batch (``label``: the event's name
        for it, else ``batch <n>``)."""
        self.retarget(pods)
        self.state = replace(
            self.state,
            batch=self.state.batch + 1,
            batch_in_flight=True,
            batch_started_at=self.now,
            blocked_since=None,
        )
        named = label or f"batch {self.state.batch}"
        self.events.append(
            Event("BatchStarted", f"{named}: {[p.name for p in pods]} -> {self.version}")
        )

    def full(self) -> Plan:
        """A fully promoted rollout: every pod not yet on the version moves now, as
        ``maxConcurrentLoads`` allows, each as soon as a load ends (no batches)."""
        loading = [p for p in self.pods if p.loading(self.version)]
        if failed := self._check_failure(loading):
            return failed
        if not self.pods and self.spec.replicas > 0:  # nothing serves it yet: not complete
            return self.plan(
                self._progress_phase(),
                "PodsStarting",
                f"0/{self.spec.replicas} pods exist to serve {self.version}",
            )
        remaining = [p for p in self.pods if p.target != self.version]
        if not remaining and not loading:
            return self._complete()
        waiting = sorted((p for p in remaining if p.name not in self.moved), key=_readiness_order)
        moving = self._admit(waiting, self.version)
        if moving:
            self._start_batch(moving, "full promotion")
        serving = sum(p.serves(self.version) for p in self.pods)
        left = len(waiting) - len(moving)
        return self.plan(
            self._progress_phase(),
            FULL_PROMOTION_REASON,
            f"full promotion: {serving}/{len(self.pods)} pods serve {self.version}"
            + (f"; {left} wait: {self._waiting_for_loads()}" if left else ""),
        )

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
        if not self.pods and self.spec.replicas > 0:  # nothing serves it yet: not complete
            return self.plan(
                self._progress_phase(),
                "PodsStarting",
                f"0/{self.spec.replicas} pods exist to serve {self.version}",
            )
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
        batch = self._admit(remaining, self.version, size)
        if not batch:
            return self.plan(
                self._progress_phase(),
                "WaitingForLoads",
                f"batch {self.state.batch + 1} waits: {self._waiting_for_loads()}",
            )
        self._start_batch(batch)
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
        self.retarget(self._admit(stray, self.version))
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
