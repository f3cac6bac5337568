"""One pass's template rollout, between the status and the cluster: the plan of
:mod:`.template_rollout` for the pod template the spec renders now (with its canary's
figures, when an analysis check is due), which Deployment is rendered whole this pass,
and what the plan adds to the status."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

from model_rollout_contract.annotations import ABORT, RETRY
from model_rollout_contract.states import ConditionType, Phase, RolloutStage

from . import cluster
from .analysis import AnalysisState, Sample
from .analysis_sources import read_template_canary
from .kube_client import KubeClient
from .manifests import TEMPLATE_DIGEST, deployment, template_digest, template_of
from .pods import PodView
from .spec import ModelDeploymentSpec
from .status import condition, iso, rollout_from_status
from .template_recovery import stable_from_cluster
from .template_rollout import (
    FAILED,
    TemplatePlan,
    TemplateRef,
    TemplateRollout,
    analysing,
    deployment_of,
    names_template,
    plan_template,
)

_rng = random.SystemRandom()
TEMPLATE_FIELD = "template"  # .status: the stable pod template (TemplateRef)
PREVIOUS_TEMPLATE_FIELD = "previousTemplate"  # the one before: kept for a rollback
TEMPLATE_ROLLOUT_FIELD = "templateRollout"  # the template rollout under way, if any
DRAINING_FIELD = "templateDraining"  # Deployments whose pods go as others are ready
# .status.analysis holds the template canary's analysis (kind: template) while its rollout
# is there, in place of a version rollout's: one ANALYSIS column, of the rollout under way
ANALYSIS_FIELD = "analysis"
ANALYSIS_KIND = "template"
_ROLLING_STAGES = (RolloutStage.CANARY, RolloutStage.BATCHES)


@dataclass(frozen=True)
class TemplatePass:
    name: str
    digest: str  # of the pod template the spec renders now
    plan: TemplatePlan

    def rendered(self) -> str | None:
        """The Deployment applied whole this pass (its template the spec's): the stable
        one in the steady state, the target during a rollout; ``None`` while the new
        template waits, or after it failed (the others are only scaled)."""
        state = self.plan.state
        if state is None:
            stable = self.plan.stable
            return stable.deployment if stable.digest == self.digest else None
        return None if state.stage == FAILED else state.target.deployment

    def holds_versions(self) -> bool:
        """A template rollout is moving pods: version rollouts wait for it to end."""
        state = self.plan.state
        return state is not None and state.stage != FAILED

    def scales(self, check_children: bool) -> bool:
        """Are the Deployments not rendered whole to be scaled this pass? Always while a
        template moves or waits, or one drains; else at the periodic check."""
        plan = self.plan
        return bool(
            plan.state is not None
            or plan.draining
            or plan.retired
            or plan.events
            or self.rendered() != plan.stable.deployment
            or check_children
        )

    def deployment(
        self, rendered: str, namespace: str, spec: ModelDeploymentSpec
    ) -> dict[str, Any]:
        """The Deployment ``rendered`` with the pods the plan gives it."""
        body = deployment(self.name, namespace, spec, template_of(self.name, rendered))
        body["spec"]["replicas"] = self.plan.replicas.get(rendered, spec.replicas)
        body["metadata"]["annotations"][TEMPLATE_DIGEST] = self.digest
        return body

    def write(self, status: dict[str, Any], existing: list[dict[str, Any]], now: float) -> None:
        """The plan's part of ``status``: the templates, the rollout (``kind: template``),
        and while one runs (or failed) the phase, message and conditions; a template that
        waits adds to the message only (the version rollout's phase stands)."""
        plan = self.plan
        status[TEMPLATE_FIELD] = plan.stable.to_status()
        for key in (PREVIOUS_TEMPLATE_FIELD, TEMPLATE_ROLLOUT_FIELD, DRAINING_FIELD):
            status.pop(key, None)
        if plan.previous is not None:
            status[PREVIOUS_TEMPLATE_FIELD] = plan.previous.to_status()
        if plan.state is not None:
            status[TEMPLATE_ROLLOUT_FIELD] = plan.state.to_status()
        if plan.draining:
            status[DRAINING_FIELD] = list(plan.draining)
        rollout = rollout_from_status(status.get("rollout"))
        versions_move = rollout is not None and rollout.stage in _ROLLING_STAGES
        if plan.state is not None and plan.analysis is not None and not versions_move:
            # a version rollout that runs (after a failed template) keeps its own
            analysis = {"kind": ANALYSIS_KIND, **plan.analysis.to_status()}
            if plan.analysis.at is not None:
                analysis["at"] = iso(plan.analysis.at)
            status[ANALYSIS_FIELD] = analysis
        if plan.phase is None or (plan.phase is Phase.DEGRADED and versions_move):
            # a failed template's state stays, and says so, beside a version rollout's
            if plan.message:
                before = str(status.get("message") or "")
                status["message"] = f"{before}; {plan.message}" if before else plan.message
            return
        status["phase"] = str(plan.phase)
        status["message"] = plan.message
        degraded = plan.phase is Phase.DEGRADED
        changed = {
            ConditionType.PROGRESSING: condition(
                ConditionType.PROGRESSING,
                plan.phase.rolling,
                plan.reason,
                plan.message,
                now,
                existing,
            ),
            ConditionType.DEGRADED: condition(
                ConditionType.DEGRADED,
                degraded,
                plan.reason if degraded else "Healthy",
                plan.message if degraded else "no rollout failed",
                now,
                existing,
            ),
            ConditionType.READY: condition(
                ConditionType.READY, False, plan.reason, plan.message, now, existing
            ),
        }
        kept = [c for c in status.get("conditions") or [] if c.get("type") not in changed]
        status["conditions"] = [*kept, *changed.values()]


def held_version(status: dict[str, Any]) -> str | None:
    """The version a track stays on while a template rollout runs: the one its rollout
    (if any, even a failed one) is about, else its stable version."""
    rollout = rollout_from_status(status.get("rollout"))
    return rollout.to_version if rollout is not None else status.get("currentVersion")


def without_retries(annotations: dict[str, str]) -> dict[str, str]:
    """``annotations`` without any track's retry (``retry``, ``retry.<track>``): while a
    template rollout runs, a retry waits for it (kept on the resource, not acted on)."""
    return {k: v for k, v in annotations.items() if k != RETRY and not k.startswith(f"{RETRY}.")}


def template_actions(
    annotations: dict[str, str],
) -> tuple[dict[str, str], str | None, str | None]:
    """``annotations`` without the abort and retry that name a template rollout (never
    seen by a version's planner), and those two values (``None``: absent or a version's)."""
    taken = {k: v for k, v in annotations.items() if k in (ABORT, RETRY) and names_template(v)}
    rest = {k: v for k, v in annotations.items() if k not in taken}
    return rest, taken.get(ABORT), taken.get(RETRY)


def _version_rolling(status: dict[str, Any]) -> bool:
    """Does a version rollout run, of the deployment's model or of a tenant's?"""
    tenants = status.get("tenants")
    tracks = [status, *(t for t in (tenants.values() if isinstance(tenants, dict) else ()))]
    for track in tracks:
        if not isinstance(track, dict):
            continue
        rollout = rollout_from_status(track.get("rollout"))
        if rollout is not None and rollout.stage in _ROLLING_STAGES:
            return True
    return False


def template_analysis(status: dict[str, Any]) -> AnalysisState | None:
    """The template canary's analysis the last pass left (``None``: none, or a version's)."""
    raw = status.get(ANALYSIS_FIELD)
    if not isinstance(raw, dict) or raw.get("kind") != ANALYSIS_KIND:
        return None
    return AnalysisState.from_status(raw)


async def _read_canary(
    name: str,
    namespace: str,
    spec: ModelDeploymentSpec,
    state: TemplateRollout | None,
    analysis: AnalysisState | None,
    version: str | None,
    pods: list[PodView],
    now: float,
) -> Sample | None:
    """The template canary's figures, when its analysis has a check due (else ``None``):
    the target Deployment's pods against the stable one's, on the version both serve."""
    held = analysing(spec, state, analysis)
    if held is None or state is None or version is None or not held.due(now):
        return None
    source, target = state.source.deployment, state.target.deployment
    groups: dict[str, list[PodView]] = {source: [], target: []}
    for pod in pods:
        groups.get(deployment_of(name, pod), []).append(pod)
    if sum(p.ready for p in groups[target]) < min(state.wanted, spec.replicas):
        return None  # a canary pod not ready (again): no check until it is
    return await read_template_canary(
        spec, namespace, version, (source, groups[source]), (target, groups[target]),
        held.window_start, now,
    )  # fmt: skip


def _draining(status: dict[str, Any]) -> tuple[str, ...]:
    raw = status.get(DRAINING_FIELD)
    return tuple(d for d in raw if isinstance(d, str)) if isinstance(raw, list) else ()


async def plan_templates(
    api: KubeClient,
    name: str,
    namespace: str,
    spec: ModelDeploymentSpec,
    status: dict[str, Any],
    pods: list[PodView],
    promoted: str | None,
    uid: str | None = None,
    aborted: str | None = None,
    retried: str | None = None,
) -> TemplatePass:
    """The template plan for this pass, from the status the last pass left (and, while
    the target has fewer pods than it asks, why the API server refuses them: ``uid``,
    the ModelDeployment's, owns the target); ``aborted``, ``retried``: see
    :func:`template_actions`."""
    state = TemplateRollout.from_status(status.get(TEMPLATE_ROLLOUT_FIELD))
    refused = None
    if state is not None and state.stage != FAILED:
        target = state.target.deployment
        present = sum(1 for p in pods if deployment_of(name, p) == target)
        if present < min(state.wanted, spec.replicas):
            refused = await cluster.pods_refused(api, namespace, state.target.deployment, uid)
    digest = template_digest(name, namespace, spec)
    stable = TemplateRef.from_status(status.get(TEMPLATE_FIELD))
    first_deployment = status.get("currentVersion") is None
    if stable is None:  # a first pass, or a status restored without it: the cluster says
        stable = await stable_from_cluster(api, namespace, name, digest, pods, uid)
        # ready pods serve: a status without currentVersion is no first deployment then
        first_deployment = first_deployment and not any(p.ready for p in pods)
    now = time.time()
    analysis = template_analysis(status)
    # the version every pod serves while a template rollout runs (no version rollout
    # runs then; one that failed left its pods on the stable version)
    serving = status.get("currentVersion")
    sample = await _read_canary(name, namespace, spec, state, analysis, serving, pods, now)
    plan = plan_template(
        name,
        spec,
        digest,
        stable,
        TemplateRef.from_status(status.get(PREVIOUS_TEMPLATE_FIELD)),
        state,
        pods,
        now,
        _rng,
        promoted,
        _version_rolling(status),
        _draining(status),
        refused,
        first_deployment=first_deployment,
        analysis=analysis,
        sample=sample,
        aborted=aborted,
        retried=retried,
    )
    return TemplatePass(name, digest, plan)
