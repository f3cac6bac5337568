"""The pod template's rollout planner: a change of what the pods run (the server or sidecar
image, their arguments, resources, placement) moves pods from one Deployment to another
under the same canary, batches and ``maxConcurrentLoads`` as a version, instead of the
Deployment controller's rolling update.

Each pod template has a Deployment of its own: the first the operator created is named
after the ModelDeployment; every later template ``<name>-<digest>``, its pods labelled
:data:`~.manifests.TEMPLATE_LABEL` (a template edited back reuses its Deployment). A
rollout scales the candidate up and the stable Deployment down by as many pods as the
candidate has *ready*, so no more pods are unavailable than before it started (within the
PodDisruptionBudget); a new pod not yet ready is a load, capped by
``maxConcurrentLoads``. Stages:

* ``canary``: ``canary.percent`` of the pods on the new template, held ``pauseSeconds``
  or until ``kubectl model promote`` (``manualPromote``); with ``canary.analysis`` the
  hold is also a series of checks (:mod:`.analysis`, unchanged) of the target template's
  pods against the stable template's on the version both serve (the figures' two sides
  are the groups ``stable`` and ``candidate``, not two versions): it ends only after a
  passed check, ``failureLimit`` failed ones fail the rollout (as below), an
  inconclusive run as ``onInconclusive`` says. No shadow step: the two groups are
  different pods, and no server mirrors requests to another pod;
* ``batches``: ``batchSize``/``batchPercent`` more pods at a time, a jitter between;
* complete: every pod on the new template: it becomes the stable one, the old Deployment
  stays at zero pods for a rollback (an edit of the template back), older ones go;
* ``failed``: no more new pods ready for ``progressDeadlineSeconds`` (a pod that does not
  start, a refused one), or the abort annotation named it: the stable Deployment is
  scaled back up and the candidate *drains*, until the template changes again or the
  retry annotation names it (a new rollout from the canary, with a fresh deadline).

The abort and retry annotations name a template rollout by its id (:attr:`TemplateRollout.id`,
``<deployment>@<start>``): a version's name holds no ``@``, so a value tells which kind
of rollout it is about (:func:`names_template`).

A Deployment that has pods but is neither the stable one nor the candidate (a candidate
abandoned by an edit back or to a third template, a failed one, one an earlier operator
left) drains: it keeps only as many pods as the stable and candidate Deployments lack
ready ones, so an edit back never takes away ready pods before others replace them, and
is deleted once empty (unless it is the previous template's, kept for a rollback).

It waits while a version rollout runs (of any track), and version rollouts wait while it
runs (one kind of rollout at a time: each counts its loads alone). ``spec.paused`` holds
it where it is, its deadline too. Pure, as :mod:`.planner`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any

from model_rollout_contract.annotations import ABORT, FULL_PROMOTION_SUFFIX, RETRY, promotion_id
from model_rollout_contract.states import Phase

from .analysis import (
    CANDIDATE_GROUP,
    STABLE_GROUP,
    AnalysisState,
    Result,
    Sample,
    last_check_passed,
    verdict_of,
)
from .manifests import deployment_name, template_label
from .planner import INCONCLUSIVE_REASON, Event
from .pods import PodView
from .spec import AnalysisSpec, ModelDeploymentSpec

CANARY = "canary"
BATCHES = "batches"
FAILED = "failed"
STARTED_EVENT = "TemplateRolloutStarted"
COMPLETE_EVENT = "TemplateRolloutComplete"
FAILED_REASON = "TemplateRolloutFailed"
ABORTED_REASON = "TemplateRolloutAborted"
RETRIED_EVENT = "TemplateRolloutRetried"
WAITING_REASON = "TemplateRolloutWaiting"


@dataclass(frozen=True)
class TemplateRef:
    """A pod template and the Deployment that runs it (``status.template``)."""

    deployment: str
    digest: str

    def to_status(self) -> dict[str, str]:
        return {"deployment": self.deployment, "digest": self.digest}

    @classmethod
    def from_status(cls, raw: object) -> TemplateRef | None:
        if not isinstance(raw, dict):
            return None
        deployment, digest = raw.get("deployment"), raw.get("digest")
        if not isinstance(deployment, str) or not isinstance(digest, str):
            return None
        return cls(deployment, digest)


@dataclass(frozen=True)
class TemplateRollout:
    """``status.templateRollout``: where a rollout of a pod template is."""

    source: TemplateRef
    target: TemplateRef
    stage: str
    started_at: float
    wanted: int  # pods the target Deployment should have at this step
    canary_ready_at: float | None = None
    batch: int = 0
    next_batch_at: float = 0.0
    message: str = ""  # why it failed
    # the last time the target had every pod it asks ready, or more ready than ever since
    # (a pod that flaps is no progress), or a step started, or spec.paused held it
    progress_at: float = 0.0
    ready_seen: int = 0  # the most target pods ready since it last had all it asks
    paused_at: float | None = None  # when spec.paused began to hold it
    aborted: bool = False  # failed by the abort annotation, not by its deadline

    @property
    def id(self) -> str:
        """The promote annotation's value for its canary (``kubectl model promote``)."""
        return promotion_id(self.target.deployment, self.started_at)

    def to_status(self) -> dict[str, Any]:
        return {
            "kind": "template",
            "from": self.source.to_status(),
            "to": self.target.to_status(),
            "stage": self.stage,
            "startedAt": self.started_at,
            "wanted": self.wanted,
            "canaryReadyAt": self.canary_ready_at,
            "batch": self.batch,
            "nextBatchAt": self.next_batch_at,
            "message": self.message,
            "progressAt": self.progress_at,
            "readySeen": self.ready_seen,
            "pausedAt": self.paused_at,
            "aborted": self.aborted,
            "promoteWith": self.id,
        }

    @classmethod
    def from_status(cls, raw: object) -> TemplateRollout | None:
        """The stored state (``None`` for none, or one this operator cannot read: an edit
        of the status must not stop a pass)."""
        if not isinstance(raw, dict):
            return None
        source = TemplateRef.from_status(raw.get("from"))
        target = TemplateRef.from_status(raw.get("to"))
        if source is None or target is None or raw.get("stage") not in (CANARY, BATCHES, FAILED):
            return None
        try:
            ready = raw.get("canaryReadyAt")
            paused = raw.get("pausedAt")
            return cls(
                source,
                target,
                str(raw["stage"]),
                float(raw["startedAt"]),
                int(raw["wanted"]),
                float(ready) if ready is not None else None,
                int(raw.get("batch") or 0),
                float(raw.get("nextBatchAt") or 0.0),
                str(raw.get("message") or ""),
                float(raw["progressAt"] if "progressAt" in raw else raw["startedAt"]),
                int(raw.get("readySeen") or 0),
                float(paused) if paused is not None else None,
                raw.get("aborted") is True,
            )
        except (KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True)
class TemplatePlan:
    stable: TemplateRef
    previous: TemplateRef | None
    state: TemplateRollout | None
    replicas: dict[str, int]  # Deployment -> the pods it should have
    retired: tuple[str, ...] = ()  # empty Deployments no template needs: deleted
    draining: tuple[str, ...] = ()  # Deployments whose pods go as others are ready
    events: tuple[Event, ...] = ()
    phase: Phase | None = None  # None: no template rollout decides the phase
    reason: str = ""
    message: str = ""
    wake_in: float | None = None
    promotion_used: bool = False
    analysis: AnalysisState | None = None  # of the rollout's canary (status.analysis)
    cleared: tuple[str, ...] = ()  # the abort/retry annotations read: the operator clears them


def analysing(
    spec: ModelDeploymentSpec, state: TemplateRollout | None, analysis: AnalysisState | None
) -> AnalysisState | None:
    """The analysis of the template canary held now (its pods were ready), if it has one:
    the operator reads the figures when it is due."""
    if state is None or state.stage != CANARY or state.canary_ready_at is None:
        return None
    if spec.canary.analysis is None or analysis is None or analysis.rollout != state.id:
        return None
    return analysis


def names_template(value: str) -> bool:
    """Does an abort or retry annotation's value name a template rollout (its id) rather
    than a version?"""
    return "@" in value


def deployment_for(
    name: str, digest: str, stable: TemplateRef, previous: TemplateRef | None
) -> str:
    """The Deployment that runs the template ``digest``: the stable or previous one's if it
    is theirs (an edit back reuses it), else a new one named after the digest."""
    for known in (stable, previous):
        if known is not None and known.digest == digest:
            return known.deployment
    return deployment_name(name, template_label(digest))


def deployment_of(name: str, pod: PodView) -> str:
    """The Deployment a pod belongs to, by its template label (none: the first one's)."""
    return deployment_name(name, pod.template)


def plan_template(
    name: str,
    spec: ModelDeploymentSpec,
    digest: str,
    stable: TemplateRef | None,
    previous: TemplateRef | None,
    state: TemplateRollout | None,
    pods: list[PodView],
    now: float,
    rng: random.Random,
    promoted: str | None,
    version_rolling: bool,
    draining: tuple[str, ...] = (),
    refused: str | None = None,
    first_deployment: bool = False,
    analysis: AnalysisState | None = None,
    sample: Sample | None = None,
    aborted: str | None = None,
    retried: str | None = None,
) -> TemplatePlan:
    """What each Deployment of the ModelDeployment ``name`` should run, for the pod
    template ``digest`` the spec renders now. ``draining``: those the last pass left
    draining; ``refused``: why the API server refuses the target's pods, if it does;
    ``first_deployment``: no version was ever served by all pods (nothing to keep
    serving: a new template replaces the stable one's in place, as a first deployment's
    version moves every pod at once; a fix of pods that cannot start waits for nothing).
    ``analysis``: the canary's as the last plan left it; ``sample``: what the operator
    read of the two groups, when :func:`analysing` said a check was due.
    ``aborted``, ``retried``: the values of the abort and retry annotations that name a
    template rollout (:func:`names_template`)."""
    if stable is None:  # the first pass (or one of an operator that kept no template)
        stable = TemplateRef(name, digest)
    if first_deployment and state is None and digest != stable.digest:
        stable = replace(stable, digest=digest)
    events: list[Event] = []
    abandoned: list[str] = []
    if state is not None and state.target.digest != digest:
        events.append(
            Event(
                "TemplateRolloutAbandoned",
                f"pods of {state.target.deployment} go as {stable.deployment}'s are ready: "
                "the pod template changed again",
            )
        )
        abandoned.append(state.target.deployment)
        state = None
    cleared: list[str] = []
    if retried is not None:
        cleared.append(RETRY)
        if _retry(state, retried, events):
            state = None  # the failure forgotten: the rollout starts again below
    abort = False
    if aborted is not None:
        cleared.append(ABORT)
        abort = _abortable(state, aborted, events)
    plan: TemplatePlan
    if state is None and digest == stable.digest:
        plan = TemplatePlan(stable, previous, None, {stable.deployment: spec.replicas})
    elif state is None:
        target = TemplateRef(deployment_for(name, digest, stable, previous), digest)
        if version_rolling or spec.paused:
            why = "a version rollout to end" if version_rolling else "spec.paused"
            plan = TemplatePlan(
                stable, previous, None, {stable.deployment: spec.replicas},
                reason=WAITING_REASON,
                message=f"the new pod template ({target.deployment}) waits for {why}",
            )  # fmt: skip
        else:
            canary = spec.canary_pods()
            staged = canary > 0  # a stable pod stays beside it, even with replicas: 1
            state = TemplateRollout(
                stable,
                target,
                CANARY if staged else BATCHES,
                now,
                min(canary, spec.replicas)
                if staged
                else min(spec.replicas, spec.rollout.batch(spec.replicas)),
                batch=0 if staged else 1,
                progress_at=now,
            )
            events.append(
                Event(
                    STARTED_EVENT,
                    f"pods move from {stable.deployment} to {target.deployment} (pod template "
                    f"{digest})" + (f" with a {spec.canary.percent}% canary" if staged else ""),
                )
            )
    if state is not None:
        step = _Step(
            name, spec, state, stable, previous, pods, now, rng, promoted, refused, analysis
        )
        plan = step.abort() if abort else step.run(sample)
    plan = replace(plan, cleared=tuple(cleared))
    return _drain(name, spec, plan, pods, (*draining, *abandoned), events)


def _retry(state: TemplateRollout | None, value: str, events: list[Event]) -> bool:
    """Does the retry annotation restart the failed template rollout ``value`` names? One
    read again after it restarted it (its removal not yet seen) is dropped quietly; one of
    another rollout, or of one that has not failed, with an Event."""
    if state is not None and state.stage == FAILED and value == state.id:
        events.append(
            Event(RETRIED_EVENT, f"pods move to {state.target.deployment} again "
                  f"(was: {state.message})")
        )  # fmt: skip
        return True
    running = state is not None and state.stage != FAILED
    if running and state is not None and value.partition("@")[0] == state.target.deployment:
        return False  # the one this retry restarted, running
    why = "no failed pod template rollout has that id" + (
        f" (it is {state.id}, {state.stage})" if state is not None else ""
    )
    events.append(Event("RetryIgnored", f"retry of {value} ignored: {why}", warning=True))
    return False


def _abortable(state: TemplateRollout | None, value: str, events: list[Event]) -> bool:
    """Does the abort annotation stop the template rollout that runs now? One read again
    after it acted is dropped quietly; one of another rollout, or of one not running, is
    ignored with an Event."""
    if state is not None and value == state.id:
        if state.stage != FAILED:
            return True
        if state.aborted:
            return False
    why = "no pod template rollout with that id runs" + (
        f" (it is {state.id}, {state.stage})" if state is not None else ""
    )
    events.append(Event("AbortIgnored", f"abort of {value} ignored: {why}", warning=True))
    return False


def _drain(
    name: str,
    spec: ModelDeploymentSpec,
    plan: TemplatePlan,
    pods: list[PodView],
    draining: tuple[str, ...],
    events: list[Event],
) -> TemplatePlan:
    """``plan`` with every other Deployment that has pods (or drained last pass) kept at
    what the serving ones lack in ready pods, and those empty retired."""
    serving = {plan.stable.deployment}
    if plan.state is not None and plan.state.stage != FAILED:
        serving.add(plan.state.target.deployment)
    counts: dict[str, list[PodView]] = {}
    for pod in pods:
        counts.setdefault(deployment_of(name, pod), []).append(pod)
    others = sorted({*draining, *counts} - serving)
    if plan.state is not None and plan.state.stage == FAILED:
        others = sorted({*others, plan.state.target.deployment} - serving)
    ready = sum(p.ready for d in serving for p in counts.get(d, []))
    budget = max(0, spec.replicas - ready)
    replicas = dict(plan.replicas)
    still: list[str] = []
    retired = [d for d in plan.retired if not counts.get(d)]  # one with pods drains first
    kept = {plan.stable.deployment, plan.previous.deployment if plan.previous else None}
    if plan.state is not None:
        kept.add(plan.state.target.deployment)
    for deployment in others:  # ready pods only: one that is not ready serves nobody
        present = counts.get(deployment, [])
        keep = min(sum(p.ready for p in present), budget)
        budget -= keep
        replicas[deployment] = keep
        if present:
            still.append(deployment)
        elif deployment not in kept:
            retired.append(deployment)
    cap = spec.rollout.max_concurrent_loads
    if cap and still:  # unwinding: the stable's new pods are loads too
        starting = sum(not p.ready for d in serving for p in counts.get(d, []))
        own = counts.get(plan.stable.deployment, [])
        grown = len(own) + max(0, cap - starting)
        replicas[plan.stable.deployment] = min(replicas[plan.stable.deployment], grown)
    return replace(
        plan,
        replicas=replicas,
        retired=tuple(retired),
        draining=tuple(still),
        events=(*events, *plan.events),
    )


class _Step:
    """One pass of a template rollout in progress."""

    def __init__(
        self,
        name: str,
        spec: ModelDeploymentSpec,
        state: TemplateRollout,
        stable: TemplateRef,
        previous: TemplateRef | None,
        pods: list[PodView],
        now: float,
        rng: random.Random,
        promoted: str | None,
        refused: str | None,
        analysis: AnalysisState | None,
    ) -> None:
        """``analysis``: the last plan's, kept if it is this rollout's (an aborted or
        failed one's too: its verdict stays beside it)."""
        self.spec, self.state, self.stable, self.previous = spec, state, stable, previous
        self.now, self.rng, self.promoted, self.refused = now, rng, promoted, refused
        self.new = [p for p in pods if deployment_of(name, p) == state.target.deployment]
        self.old = [p for p in pods if deployment_of(name, p) == stable.deployment]
        self.events: list[Event] = []
        self.promotion_used = False
        # another rollout's never carries over
        self.analysis = analysis if analysis is not None and analysis.rollout == state.id else None
        self.sample: Sample | None = None

    def run(self, sample: Sample | None) -> TemplatePlan:
        self.sample = sample
        if self.state.stage == FAILED:
            reason = ABORTED_REASON if self.state.aborted else FAILED_REASON
            return self._plan(Phase.DEGRADED, reason, self.state.message, 0)
        ready = sum(p.ready for p in self.new)
        self._progress(ready)
        replicas = self.spec.replicas
        full = self.promoted == f"{self.state.id}{FULL_PROMOTION_SUFFIX}"
        if full and self.state.wanted < replicas:
            self.promotion_used = True
            self.state = replace(self.state, stage=BATCHES, wanted=replicas, progress_at=self.now)
            self.events.append(Event("FullPromotion", f"{self.state.target.deployment}: all pods"))
        if self.state.stage == BATCHES and ready >= replicas and not self.old:
            return self._complete()
        if overdue := self._overdue(ready):
            return self._fail(overdue)
        if self.state.stage == CANARY:
            return self._canary(ready)
        return self._batches(ready)

    def _progress(self, ready: int) -> None:
        """The deadline's clock: it runs only while pods are awaited, and a pod ready
        again after it flapped does not reset it. ``spec.paused`` stops every clock (the
        deadline, the canary's pause, the jitter); on resume each goes on from there."""
        state = self.state
        if self.spec.paused:
            paused_at = state.paused_at if state.paused_at is not None else self.now
            self.state = replace(state, progress_at=self.now, paused_at=paused_at)
            return
        if state.paused_at is not None:
            held = self.now - state.paused_at
            state = replace(
                state,
                paused_at=None,
                progress_at=self.now,
                canary_ready_at=None
                if state.canary_ready_at is None
                else state.canary_ready_at + held,
                next_batch_at=state.next_batch_at + held if state.next_batch_at else 0.0,
            )
        if ready >= min(state.wanted, self.spec.replicas) or ready > state.ready_seen:
            state = replace(state, progress_at=self.now, ready_seen=ready)
        self.state = state

    def _canary(self, ready: int) -> TemplatePlan:
        wanted = min(self.state.wanted, self.spec.replicas)
        if ready < wanted:
            return self._plan(
                Phase.CANARY, "CanaryLoading", f"{ready}/{wanted} canary pods of "
                f"{self.state.target.deployment} ready" + self._refusal(), ready,
            )  # fmt: skip
        if self.state.canary_ready_at is None:
            self.state = replace(self.state, canary_ready_at=self.now)
            self.events.append(
                Event("CanaryHealthy", f"{wanted} pods of {self.state.target.deployment} ready")
            )
        held_for = self.now - (self.state.canary_ready_at or self.now)
        canary = self.spec.canary
        spec, target = canary.analysis, self.state.target.deployment
        verdict = ""
        if spec is not None:  # checked even while spec.paused holds it, as a version's is
            if failed := self._analyse(spec):
                return failed
            verdict = f"; analysis {verdict_of(self.analysis)}"
            if (why := self._undecided(spec)) is not None:  # onInconclusive: hold
                return self._plan(
                    Phase.DEGRADED, INCONCLUSIVE_REASON,
                    f"the canary of {target} held (onInconclusive: hold): {why}; a "
                    "conclusive check ends it, or edit the pod template back", ready,
                )  # fmt: skip
        if self.spec.paused:
            return self._plan(
                Phase.CANARY, "Paused", f"spec.paused holds the canary{verdict}", ready
            )
        if canary.manual_promote:
            if self.promoted != self.state.id:
                return self._plan(
                    Phase.CANARY, "AwaitingPromotion",
                    f"the canary of {target} waits for a promotion (kubectl model promote)"
                    + (" and a passed check" if spec is not None else "") + verdict, ready,
                )  # fmt: skip
            if spec is not None and not last_check_passed(self.analysis):
                return self._plan(  # the annotation stays: it approves, the analysis decides
                    Phase.CANARY, "AwaitingAnalysis",
                    f"the canary of {target} is approved; waiting for analysis to pass "
                    f"(last: {verdict_of(self.analysis)})", ready,
                )  # fmt: skip
            self.promotion_used = True
        elif held_for < canary.pause_seconds:
            left = canary.pause_seconds - held_for
            return self._plan(
                Phase.CANARY, "CanaryPause",
                f"the canary of {target} holds {left:.0f}s more{verdict}", ready, wake_in=left,
            )  # fmt: skip
        elif spec is not None and not last_check_passed(self.analysis):
            return self._plan(
                Phase.CANARY, "AnalysisHolding",
                f"the canary of {target} moves on after a passed check{verdict}", ready,
            )  # fmt: skip
        self.events.append(Event("CanaryPromoted", f"{self.state.target.deployment} moves on"))
        self.state = replace(self.state, stage=BATCHES, progress_at=self.now)
        return self._next_batch(ready)

    def _analyse(self, spec: AnalysisSpec) -> TemplatePlan | None:
        """Record the sample; fail the rollout when that makes ``failureLimit`` failed
        checks, or (``onInconclusive: rollback``) when the analysis cannot conclude."""
        if self.analysis is None:  # the canary turned ready, or analysis asked for since
            self.analysis = AnalysisState.start(self.state.id, self.now, spec)
        sample, analysis = self.sample, self.analysis
        if sample is None or not analysis.due(sample.at):
            return None
        before, held_before = analysis.last_result, self._undecided(spec)
        self.analysis, check = analysis.advance(sample, spec, STABLE_GROUP, CANDIDATE_GROUP)
        if check is None:
            return None
        target = self.state.target.deployment
        if (why := self._undecided(spec)) is not None:
            if spec.on_inconclusive == "rollback":
                return self._fail(
                    f"canary analysis of {target} inconclusive: {why}: {verdict_of(self.analysis)}"
                )
            if held_before is None:
                self.events.append(
                    Event(INCONCLUSIVE_REASON, f"{target}: {why}; canary held", warning=True)
                )
            return None
        if check.result is Result.FAILED:
            a = self.analysis
            self.events.append(
                Event(
                    "AnalysisCheckFailed",
                    f"{target}: check {a.checks} failed ({a.failures} of failureLimit "
                    f"{spec.failure_limit}): {check.message}",
                    warning=True,
                )
            )
            if a.failures >= spec.failure_limit:
                return self._fail(
                    f"canary analysis of {target} failed {a.failures} of {a.checks} checks "
                    f"(failureLimit {spec.failure_limit}): {check.message}"
                )
        elif check.result != before:
            self.events.append(Event(f"Analysis{check.result}", f"{target}: {check.message}"))
        return None

    def _undecided(self, spec: AnalysisSpec) -> str | None:
        if self.analysis is None:
            return None
        return self.analysis.undecided(spec, spec.inconclusive_deadline(self.spec.rollout))

    def _batches(self, ready: int) -> TemplatePlan:
        if ready < min(self.state.wanted, self.spec.replicas):
            return self._plan(
                Phase.PROGRESSING, "BatchLoading",
                f"batch {self.state.batch}: {ready}/{self.state.wanted} pods of "
                f"{self.state.target.deployment} ready" + self._refusal(), ready,
            )  # fmt: skip
        return self._next_batch(ready)

    def _next_batch(self, ready: int) -> TemplatePlan:
        replicas = self.spec.replicas
        if self.state.wanted >= replicas:  # every pod asked for: the old ones go as they do
            return self._plan(
                Phase.PROGRESSING, "BatchLoading",
                f"{ready}/{replicas} pods of {self.state.target.deployment} ready", ready,
            )  # fmt: skip
        if self.state.next_batch_at == 0.0 and self.state.batch > 0:
            jitter = self.rng.uniform(0, self.spec.rollout.jitter_seconds)
            self.state = replace(self.state, next_batch_at=self.now + jitter)
            self.events.append(
                Event("BatchComplete", f"batch {self.state.batch} ready; next in {jitter:.1f}s")
            )
        if self.spec.paused:
            return self._plan(Phase.PROGRESSING, "Paused", "spec.paused holds the batches", ready)
        if self.now < self.state.next_batch_at:
            left = self.state.next_batch_at - self.now
            return self._plan(
                Phase.PROGRESSING, "BatchJitter",
                f"{ready}/{replicas} pods of {self.state.target.deployment} ready; next batch "
                f"in {left:.1f}s", ready, wake_in=left,
            )  # fmt: skip
        wanted = min(replicas, self.state.wanted + self.spec.rollout.batch(replicas))
        self.state = replace(
            self.state, wanted=wanted, batch=self.state.batch + 1, next_batch_at=0.0,
            progress_at=self.now,
        )  # fmt: skip
        self.events.append(
            Event("BatchStarted", f"batch {self.state.batch}: {self.state.target.deployment} "
                  f"to {wanted} pods")
        )  # fmt: skip
        return self._plan(
            Phase.PROGRESSING, "BatchLoading",
            f"batch {self.state.batch}: {ready}/{wanted} pods of "
            f"{self.state.target.deployment} ready", ready,
        )  # fmt: skip

    def _refusal(self) -> str:
        return f" (the API server refuses its pods: {self.refused})" if self.refused else ""

    def _overdue(self, ready: int) -> str | None:
        """No new pod ready for ``progressDeadlineSeconds`` while some are wanted."""
        deadline = self.spec.rollout.progress_deadline_seconds
        if ready >= min(self.state.wanted, self.spec.replicas):
            return None
        if self.now - self.state.progress_at <= deadline:
            return None
        starting = [p for p in self.new if not p.ready]
        why = sorted({p.unscheduled[1] for p in starting if p.unscheduled})
        if self.refused:
            why.append(f"the API server refuses its pods: {self.refused}")
        return (
            f"no more pods of {self.state.target.deployment} ready for {deadline:.0f}s "
            f"({ready}/{self.state.wanted}; starting: {[p.name for p in starting]})"
            + (f": {'; '.join(why)}" if why else "")
        )

    def _fail(self, message: str) -> TemplatePlan:
        self.state = replace(self.state, stage=FAILED, wanted=0, message=message)
        self.events.append(
            Event(FAILED_REASON, f"{message}; back on {self.stable.deployment}", True)
        )
        return self._plan(Phase.DEGRADED, FAILED_REASON, message, 0)

    def abort(self) -> TemplatePlan:
        """The abort annotation: failed now, as by its deadline (the stable Deployment
        back to every pod, the target drains), until the template changes or a retry."""
        message = f"aborted (kubectl model abort) at {self.state.wanted} pods of " + (
            f"{self.state.target.deployment}"
        )
        self.state = replace(self.state, stage=FAILED, wanted=0, message=message, aborted=True)
        self.events.append(
            Event(ABORTED_REASON, f"{message}; back on {self.stable.deployment}", True)
        )
        return self._plan(Phase.DEGRADED, ABORTED_REASON, message, 0)

    def _complete(self) -> TemplatePlan:
        target, source = self.state.target, self.state.source
        self.events.append(
            Event(COMPLETE_EVENT, f"all {len(self.new)} pods run {target.deployment}")
        )
        wanted = {target.deployment: self.spec.replicas, source.deployment: 0}
        retired = tuple(
            known.deployment
            for known in (self.previous,)
            if known is not None and known.deployment not in wanted
        )
        return TemplatePlan(
            target, source, None, wanted, retired, (), tuple(self.events),
            promotion_used=self.promotion_used,
        )  # fmt: skip

    def _plan(
        self,
        phase: Phase,
        reason: str,
        message: str,
        ready: int,
        wake_in: float | None = None,
    ) -> TemplatePlan:
        """The Deployments' sizes for this step: the target as many pods as wanted (new
        ones only as ``maxConcurrentLoads`` allows), the stable one fewer by those ready,
        and during the canary never none (an unpromoted canary serves not alone)."""
        replicas = self.spec.replicas
        cap = self.spec.rollout.max_concurrent_loads
        target = min(self.state.wanted, replicas)
        if cap:  # never more than ``cap`` starting, and none that started taken away
            target = min(target, max(len(self.new), ready + cap))
        stable = max(0, replicas - ready)
        if self.state.stage == CANARY:
            stable = max(stable, min(1, replicas))
        sizes = {self.stable.deployment: stable}
        if self.state.stage != FAILED:
            sizes[self.state.target.deployment] = target
        deadline = self.spec.rollout.progress_deadline_seconds
        if self.state.stage != FAILED and ready < target:
            left = max(0.0, self.state.progress_at + deadline - self.now) + 0.5
            wake_in = min(wake_in if wake_in is not None else left, left)
        analysis = self.analysis
        checking = analysing(self.spec, self.state, analysis) is not None and ready >= target
        if checking and analysis is not None:  # none while a canary pod is not ready
            check_in = max(0.0, analysis.next_check_at - self.now)  # the next check is due
            wake_in = check_in if wake_in is None else min(wake_in, check_in)
        elif analysis is not None and analysis.baseline is not None:
            analysis = replace(analysis, baseline=None)  # that canary is over
        return TemplatePlan(
            self.stable,
            self.previous,
            self.state,
            sizes,
            events=tuple(self.events),
            phase=phase,
            reason=reason,
            message=f"pod template rollout: {message}",
            wake_in=wake_in,
            promotion_used=self.promotion_used,
            analysis=analysis,
        )
