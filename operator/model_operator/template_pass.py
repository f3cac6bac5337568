"""One pass's template rollout, between the status and the cluster: the plan of
:mod:`.template_rollout` for the pod template the spec renders now, which Deployment is
rendered whole this pass, and what the plan adds to the status."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

from model_rollout_contract.states import ConditionType, Phase, RolloutStage

from .manifests import deployment, template_digest
from .pods import PodView
from .spec import ModelDeploymentSpec
from .status import condition, rollout_from_status
from .template_rollout import (
    FAILED,
    TemplatePlan,
    TemplateRef,
    TemplateRollout,
    plan_template,
)

_rng = random.SystemRandom()
TEMPLATE_FIELD = "template"  # .status: the stable pod template (TemplateRef)
PREVIOUS_TEMPLATE_FIELD = "previousTemplate"  # the one before: kept for a rollback
TEMPLATE_ROLLOUT_FIELD = "templateRollout"  # the template rollout under way, if any
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

    def deployment(
        self, rendered: str, namespace: str, spec: ModelDeploymentSpec
    ) -> dict[str, Any]:
        """The Deployment ``rendered`` with the pods the plan gives it."""
        label = None if rendered == self.name else rendered.removeprefix(f"{self.name}-")
        body = deployment(self.name, namespace, spec, label)
        body["spec"]["replicas"] = self.plan.replicas.get(rendered, spec.replicas)
        return body

    def write(self, status: dict[str, Any], existing: list[dict[str, Any]], now: float) -> None:
        """The plan's part of ``status``: the templates, the rollout (``kind: template``),
        and while it decides them, the phase, message and conditions."""
        plan = self.plan
        status[TEMPLATE_FIELD] = plan.stable.to_status()
        status.pop(PREVIOUS_TEMPLATE_FIELD, None)
        status.pop(TEMPLATE_ROLLOUT_FIELD, None)
        if plan.previous is not None:
            status[PREVIOUS_TEMPLATE_FIELD] = plan.previous.to_status()
        if plan.state is not None:
            status[TEMPLATE_ROLLOUT_FIELD] = plan.state.to_status()
        if plan.phase is None:
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
        }
        kept = [c for c in status.get("conditions") or [] if c.get("type") not in changed]
        status["conditions"] = [*kept, *changed.values()]


def plan_templates(
    name: str,
    namespace: str,
    spec: ModelDeploymentSpec,
    status: dict[str, Any],
    pods: list[PodView],
    promoted: str | None,
    now: float | None = None,
) -> TemplatePass:
    """The template plan for this pass, from the status the last pass left."""
    rollout = rollout_from_status(status.get("rollout"))
    version_rolling = rollout is not None and rollout.stage in _ROLLING_STAGES
    digest = template_digest(name, namespace, spec)
    plan = plan_template(
        name,
        spec,
        digest,
        TemplateRef.from_status(status.get(TEMPLATE_FIELD)),
        TemplateRef.from_status(status.get(PREVIOUS_TEMPLATE_FIELD)),
        TemplateRollout.from_status(status.get(TEMPLATE_ROLLOUT_FIELD)),
        pods,
        time.time() if now is None else now,
        _rng,
        promoted,
        version_rolling,
    )
    return TemplatePass(name, digest, plan)
