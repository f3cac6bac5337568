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
  or until ``kubectl model promote`` (``manualPromote``);
* ``batches``: ``batchSize``/``batchPercent`` more pods at a time, a jitter between;
* complete: every pod on the new template: it becomes the stable one, the old Deployment
  stays at zero pods for a rollback (an edit of the template back), older ones go;
* ``failed``: a new pod not ready within ``progressDeadlineSeconds``: the candidate is
  scaled to zero (the stable pods never left) until the template changes again.

It waits while a version rollout runs, and a version rollout waits while it runs (one
kind of rollout at a time: each counts its loads alone). Pure, as :mod:`.planner`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any

from model_rollout_contract.annotations import FULL_PROMOTION_SUFFIX, promotion_id
from model_rollout_contract.states import Phase

from .planner import Event
from .pods import PodView
from .spec import ModelDeploymentSpec

CANARY = "canary"
BATCHES = "batches"
FAILED = "failed"
STARTED_EVENT = "TemplateRolloutStarted"
COMPLETE_EVENT = "TemplateRolloutComplete"
FAILED_REASON = "TemplateRolloutFailed"
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
            "promoteWith": self.id,
        }

    @classmethod
    def from_status(cls, raw: object) -> TemplateRollout | None:
        """The stored state (``None`` for none, or one this operator cannot read: an edit
        of the status must not stop a pass; the next pass starts it again)."""
        if not isinstance(raw, dict):
            return None
        source = TemplateRef.from_status(raw.get("from"))
        target = TemplateRef.from_status(raw.get("to"))
        try:
            if (
                source is None
                or target is None
                or raw.get("stage") not in (CANARY, BATCHES, FAILED)
            ):
                return None
            ready = raw.get("canaryReadyAt")
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
            )
        except (KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True)
class TemplatePlan:
    stable: TemplateRef
    previous: TemplateRef | None
    state: TemplateRollout | None
    replicas: dict[str, int]  # Deployment -> the pods it should have
    retired: tuple[str, ...] = ()  # Deployments no longer kept (neither stable nor previous)
    events: tuple[Event, ...] = ()
    phase: Phase | None = None  # None: no template rollout decides the phase
    reason: str = ""
    message: str = ""
    wake_in: float | None = None
    promotion_used: bool = False


def deployment_for(
    name: str, digest: str, stable: TemplateRef, previous: TemplateRef | None
) -> str:
    """The Deployment that runs the template ``digest``: the stable or previous one's if it
    is theirs (an edit back reuses it), else a new one named after the digest."""
    for known in (stable, previous):
        if known is not None and known.digest == digest:
            return known.deployment
    return f"{name}-{digest[:10]}"


def pods_of(name: str, deployment: str, pods: list[PodView]) -> list[PodView]:
    """The pods of ``deployment`` (its template's label; none for the Deployment named
    after the ModelDeployment)."""
    label = None if deployment == name else deployment.removeprefix(f"{name}-")
    return [p for p in pods if p.template == label]


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
) -> TemplatePlan:
    """What each Deployment of the ModelDeployment ``name`` should run, for the pod
    template ``digest`` the spec renders now."""
    replicas = spec.replicas
    if stable is None:  # the first pass (or one of an operator that kept no template)
        stable = TemplateRef(name, digest)
    if state is not None and state.target.digest != digest:
        events = (
            Event(
                "TemplateRolloutAbandoned",
                f"pods of {state.target.deployment} go: the template changed again",
            ),
        )
        kept = {stable.deployment, previous.deployment if previous else None}
        abandoned = () if state.target.deployment in kept else (state.target.deployment,)
        if digest == stable.digest:  # edited back: the stable pods never left
            plan = _steady(stable, previous, replicas)
            return replace(plan, events=events, retired=abandoned)
        plan = plan_template(
            name, spec, digest, stable, previous, None, pods, now, rng, promoted, version_rolling
        )
        return replace(plan, events=(*events, *plan.events), retired=abandoned)
    if state is None:
        if digest == stable.digest:
            return _steady(stable, previous, replicas)
        target = TemplateRef(deployment_for(name, digest, stable, previous), digest)
        if version_rolling or spec.paused:
            why = "the version rollout running" if version_rolling else "spec.paused"
            return replace(
                _steady(stable, previous, replicas, {target.deployment: 0}),
                phase=Phase.PROGRESSING,
                reason=WAITING_REASON,
                message=f"the new pod template ({target.deployment}) waits for {why}",
            )
        canary = spec.canary_pods()
        state = TemplateRollout(
            stable,
            target,
            CANARY if 0 < canary < replicas else BATCHES,
            now,
            canary if 0 < canary < replicas else min(replicas, spec.rollout.batch(replicas)),
            batch=0 if 0 < canary < replicas else 1,
        )
        started = Event(
            STARTED_EVENT,
            f"pods move from {stable.deployment} to {target.deployment} (pod template "
            f"{digest})"
            + (f" with a {spec.canary.percent}% canary" if state.stage == CANARY else ""),
        )
        plan = _Step(name, spec, state, stable, previous, pods, now, rng, promoted).run()
        return replace(plan, events=(started, *plan.events))
    return _Step(name, spec, state, stable, previous, pods, now, rng, promoted).run()


def _steady(
    stable: TemplateRef,
    previous: TemplateRef | None,
    replicas: int,
    others: dict[str, int] | None = None,
) -> TemplatePlan:
    wanted = {**(others or {}), stable.deployment: replicas}
    if previous is not None and previous.deployment != stable.deployment:
        wanted.setdefault(previous.deployment, 0)
    return TemplatePlan(stable, previous, None, wanted)


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
    ) -> None:
        self.spec, self.state, self.stable, self.previous = spec, state, stable, previous
        self.now, self.rng, self.promoted = now, rng, promoted
        self.new = pods_of(name, state.target.deployment, pods)
        new = {p.name for p in self.new}
        self.old = [p for p in pods if p.name not in new]
        self.events: list[Event] = []
        self.promotion_used = False

    def run(self) -> TemplatePlan:
        if self.state.stage == FAILED:
            return self._plan(Phase.DEGRADED, FAILED_REASON, self.state.message, 0)
        ready = sum(p.ready for p in self.new)
        starting = [p for p in self.new if not p.ready]
        if overdue := self._overdue(starting):
            return self._fail(overdue)
        replicas = self.spec.replicas
        if ready >= replicas and len(self.old) == 0:
            return self._complete()
        full = self.promoted == f"{self.state.id}{FULL_PROMOTION_SUFFIX}"
        if full and self.state.wanted < replicas:
            self.promotion_used = True
            self.state = replace(self.state, stage=BATCHES, wanted=replicas)
            self.events.append(Event("FullPromotion", f"{self.state.target.deployment}: all pods"))
        if self.state.stage == CANARY:
            return self._canary(ready)
        return self._batches(ready)

    def _canary(self, ready: int) -> TemplatePlan:
        wanted = self.state.wanted
        if ready < wanted:
            return self._plan(
                Phase.CANARY, "CanaryLoading", f"{ready}/{wanted} canary pods of "
                f"{self.state.target.deployment} ready", ready,
            )  # fmt: skip
        if self.state.canary_ready_at is None:
            self.state = replace(self.state, canary_ready_at=self.now)
            self.events.append(
                Event("CanaryHealthy", f"{wanted} pods of {self.state.target.deployment} ready")
            )
        held_for = self.now - (self.state.canary_ready_at or self.now)
        canary = self.spec.canary
        if self.spec.paused:
            return self._plan(Phase.CANARY, "Paused", "spec.paused holds the canary", ready)
        if canary.manual_promote:
            if self.promoted != self.state.id:
                return self._plan(
                    Phase.CANARY, "AwaitingPromotion",
                    f"the canary of {self.state.target.deployment} waits for a promotion "
                    f"(kubectl model promote)", ready,
                )  # fmt: skip
            self.promotion_used = True
        elif held_for < canary.pause_seconds:
            left = canary.pause_seconds - held_for
            return self._plan(
                Phase.CANARY, "CanaryPause",
                f"the canary of {self.state.target.deployment} holds {left:.0f}s more", ready,
                wake_in=left,
            )  # fmt: skip
        self.events.append(Event("CanaryPromoted", f"{self.state.target.deployment} moves on"))
        self.state = replace(self.state, stage=BATCHES)
        return self._next_batch(ready)

    def _batches(self, ready: int) -> TemplatePlan:
        if ready < self.state.wanted:
            return self._plan(
                Phase.PROGRESSING, "BatchLoading",
                f"batch {self.state.batch}: {ready}/{self.state.wanted} pods of "
                f"{self.state.target.deployment} ready", ready,
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
            self.state, wanted=wanted, batch=self.state.batch + 1, next_batch_at=0.0
        )
        self.events.append(
            Event("BatchStarted", f"batch {self.state.batch}: {self.state.target.deployment} "
                  f"to {wanted} pods")
        )  # fmt: skip
        return self._plan(
            Phase.PROGRESSING, "BatchLoading",
            f"batch {self.state.batch}: {ready}/{wanted} pods of "
            f"{self.state.target.deployment} ready", ready,
        )  # fmt: skip

    def _overdue(self, starting: list[PodView]) -> str | None:
        deadline = self.spec.rollout.progress_deadline_seconds
        late = [
            p.name
            for p in starting
            if self.now - (p.created_at if p.created_at is not None else self.state.started_at)
            > deadline
        ]
        if not late:
            return None
        why = {p.unscheduled[1] for p in starting if p.name in late and p.unscheduled}
        return f"pods of {self.state.target.deployment} not ready after {deadline:.0f}s: {late}" + (
            f" ({'; '.join(sorted(why))})" if why else ""
        )

    def _fail(self, message: str) -> TemplatePlan:
        self.state = replace(self.state, stage=FAILED, wanted=0, message=message)
        self.events.append(
            Event(FAILED_REASON, f"{message}; back on {self.stable.deployment}", True)
        )
        return self._plan(Phase.DEGRADED, FAILED_REASON, message, 0)

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
            target, source, None, wanted, retired, tuple(self.events),
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
        ones only as ``maxConcurrentLoads`` allows), the stable one fewer by those ready."""
        cap = self.spec.rollout.max_concurrent_loads
        target = self.state.wanted
        if cap:  # never more than ``cap`` starting, and none that started taken away
            target = min(target, max(len(self.new), ready + cap))
        stable = max(0, self.spec.replicas - ready)
        replicas = {self.state.target.deployment: target, self.stable.deployment: stable}
        deadline = self.spec.rollout.progress_deadline_seconds
        if self.state.stage != FAILED and any(not p.ready for p in self.new):
            wake_in = min(wake_in or deadline, deadline)
        return TemplatePlan(
            self.stable,
            self.previous,
            self.state,
            replicas,
            (),
            tuple(self.events),
            phase,
            reason,
            f"pod template rollout: {message}",
            wake_in,
            self.promotion_used,
        )
