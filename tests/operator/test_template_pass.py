"""What a template rollout writes into the status (operator/model_operator/template_pass.py):
the phase and conditions while it moves pods or failed, and never over a version
rollout's phase once it no longer holds versions."""

from __future__ import annotations

from typing import Any

from model_operator.template_pass import TemplatePass
from model_operator.template_rollout import (
    FAILED,
    TemplatePlan,
    TemplateRef,
    TemplateRollout,
)
from model_rollout_contract.states import Phase

STABLE = TemplateRef("mlp", "a" * 16)
TARGET = TemplateRef("mlp-bbbbbbbbbb", "b" * 16)


def written(plan: TemplatePlan, **status: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"phase": "Available", "message": "all serve v1", **status}
    out.setdefault("conditions", [{"type": "Ready", "status": "True", "reason": "Available"}])
    TemplatePass("mlp", TARGET.digest, plan).write(out, [], 100.0)
    return out


def reasons(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_a_running_template_rollout_is_the_phase_and_not_ready() -> None:
    state = TemplateRollout(STABLE, TARGET, "canary", 0.0, wanted=1)
    plan = TemplatePlan(
        STABLE, None, state, {"mlp": 4, TARGET.deployment: 1},
        phase=Phase.CANARY, reason="AwaitingPromotion", message="pod template rollout: held",
    )  # fmt: skip
    status = written(plan)
    assert status["phase"] == "Canary" and status["templateRollout"]["kind"] == "template"
    assert reasons(status)["Ready"] == ("False", "AwaitingPromotion")
    assert reasons(status)["Progressing"] == ("True", "AwaitingPromotion")


def test_a_failed_template_leaves_a_running_version_rollouts_phase_alone() -> None:
    state = TemplateRollout(STABLE, TARGET, FAILED, 0.0, wanted=0, message="pods not ready")
    plan = TemplatePlan(
        STABLE, None, state, {"mlp": 4},
        phase=Phase.DEGRADED, reason="TemplateRolloutFailed", message="pod template: failed",
    )  # fmt: skip
    rolling = {"toVersion": "v2", "fromVersion": "v1", "stage": "canary", "startedAt": 5.0}
    status = written(plan, phase="Canary", message="canary of v2", rollout=rolling)
    assert status["phase"] == "Canary"
    assert status["message"] == "canary of v2; pod template: failed"
    alone = written(plan)
    assert alone["phase"] == "Degraded" and reasons(alone)["Degraded"][0] == "True"


def test_a_waiting_template_adds_to_the_message_only() -> None:
    plan = TemplatePlan(
        STABLE, None, None, {"mlp": 4}, reason="TemplateRolloutWaiting",
        message="the new pod template (mlp-bbbbbbbbbb) waits for a version rollout to end",
    )  # fmt: skip
    status = written(plan, phase="Progressing", message="batch 2 of v2")
    assert status["phase"] == "Progressing" and status["message"].startswith("batch 2 of v2; ")
    assert "templateRollout" not in status
