"""The pod template's rollout planner (operator/model_operator/template_rollout.py): an
image change moves pods between two Deployments under the canary, the batches and
``maxConcurrentLoads``, never with fewer ready pods than before, and an edit back ends it."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

from model_operator.pods import PodView
from model_operator.spec import ModelDeploymentSpec, parse_spec
from model_operator.template_rollout import (
    BATCHES,
    CANARY,
    FAILED,
    TemplatePlan,
    TemplateRef,
    TemplateRollout,
    plan_template,
)
from model_rollout_contract.states import Phase

OLD, NEW = "a" * 16, "b" * 16
STABLE = TemplateRef("mlp", OLD)
TARGET = f"mlp-{NEW[:10]}"


def spec(**given: Any) -> ModelDeploymentSpec:
    raw: dict[str, Any] = {
        "model": "mlp", "version": "v1", "image": "server:1", "replicas": 4,
        "store": {"pvc": "models"}, "allowUnsigned": True,
        "canary": {"percent": 25, "pauseSeconds": 60},
        "rollout": {"batchSize": 1, "jitterSeconds": 0},
    }  # fmt: skip
    raw.update(given)
    return parse_spec(raw)


def pods(
    old: int, new: int, new_ready: int | None = None, created_at: float = 0.0
) -> list[PodView]:
    ready = new if new_ready is None else new_ready
    return [PodView(f"old-{i}", ready=True) for i in range(old)] + [
        PodView(f"new-{i}", ready=i < ready, template=NEW[:10], created_at=created_at)
        for i in range(new)
    ]


def step(
    given: ModelDeploymentSpec,
    state: TemplateRollout | None,
    seen: list[PodView],
    now: float = 100.0,
    digest: str = NEW,
    promoted: str | None = None,
    version_rolling: bool = False,
    previous: TemplateRef | None = None,
) -> TemplatePlan:
    return plan_template(
        "mlp", given, digest, STABLE, previous, state, seen, now, random.Random(1), promoted,
        version_rolling,
    )  # fmt: skip


def test_the_same_template_keeps_its_deployment_and_starts_nothing() -> None:
    plan = step(spec(), None, pods(4, 0), digest=OLD)
    assert plan.replicas == {"mlp": 4} and plan.state is None and plan.phase is None


def test_a_new_template_starts_a_canary_beside_every_stable_pod() -> None:
    plan = step(spec(), None, pods(4, 0))
    assert plan.state is not None and plan.state.stage == CANARY
    assert plan.replicas == {TARGET: 1, "mlp": 4}  # none taken away before one is ready
    assert plan.phase is Phase.CANARY and plan.events[0].reason == "TemplateRolloutStarted"


def test_stable_pods_go_only_as_new_ones_are_ready_then_the_pause_promotes() -> None:
    started = step(spec(), None, pods(4, 0), now=0.0).state
    assert started is not None
    loading = step(spec(), started, pods(4, 1, new_ready=0), now=1.0)
    assert loading.replicas == {TARGET: 1, "mlp": 4}
    held = step(spec(), started, pods(4, 1), now=2.0)
    assert held.replicas == {TARGET: 1, "mlp": 3} and held.reason == "CanaryPause"
    assert held.state is not None
    promoted = step(spec(), held.state, pods(3, 1), now=70.0)
    assert promoted.state is not None and promoted.state.stage == BATCHES
    assert promoted.replicas == {TARGET: 2, "mlp": 3}


def test_manual_promotion_needs_this_rollouts_id() -> None:
    given = spec(canary={"percent": 25, "manualPromote": True})
    started = step(given, None, pods(4, 0), now=0.0).state
    assert started is not None
    held = step(given, started, pods(3, 1), now=5000.0, promoted="mlp-x@1")
    assert held.reason == "AwaitingPromotion" and not held.promotion_used
    moved = step(given, held.state, pods(3, 1), now=5001.0, promoted=started.id)
    assert moved.promotion_used and moved.state is not None and moved.state.stage == BATCHES


def test_max_concurrent_loads_caps_the_new_pods_starting() -> None:
    given = spec(rollout={"batchSize": 3, "jitterSeconds": 0, "maxConcurrentLoads": 1})
    state = TemplateRollout(STABLE, TemplateRef(TARGET, NEW), BATCHES, 0.0, wanted=4, batch=1)
    plan = step(given, state, pods(3, 1, new_ready=1))
    assert plan.replicas == {TARGET: 2, "mlp": 3}  # one ready, one starting: the cap
    plan = step(given, state, pods(3, 2, new_ready=1))
    assert plan.replicas[TARGET] == 2


def test_all_new_pods_ready_and_the_old_gone_complete_it() -> None:
    state = TemplateRollout(STABLE, TemplateRef(TARGET, NEW), BATCHES, 0.0, wanted=4, batch=3)
    plan = step(spec(), state, pods(0, 4))
    assert plan.state is None and plan.stable == TemplateRef(TARGET, NEW)
    assert plan.previous == STABLE and plan.replicas == {TARGET: 4, "mlp": 0}
    assert [e.reason for e in plan.events] == ["TemplateRolloutComplete"]


def test_a_template_edited_back_mid_rollout_ends_it_and_retires_the_candidate() -> None:
    state = TemplateRollout(STABLE, TemplateRef(TARGET, NEW), CANARY, 0.0, wanted=1)
    plan = step(spec(), state, pods(3, 1), digest=OLD)
    assert plan.state is None and plan.replicas == {"mlp": 4} and plan.retired == (TARGET,)


def test_an_edit_back_after_completion_reuses_the_old_deployment() -> None:
    stable, previous = TemplateRef(TARGET, NEW), STABLE
    plan = plan_template(
        "mlp", spec(), OLD, stable, previous, None, pods(0, 4), 0.0, random.Random(1), None,
        False,
    )  # fmt: skip
    assert plan.state is not None and plan.state.target == STABLE
    assert plan.replicas == {"mlp": 1, TARGET: 4}


def test_a_new_pod_not_ready_by_the_deadline_fails_it_and_keeps_the_stable_pods() -> None:
    given = spec(rollout={"batchSize": 1, "progressDeadlineSeconds": 30})
    state = TemplateRollout(STABLE, TemplateRef(TARGET, NEW), CANARY, 0.0, wanted=1)
    plan = step(given, state, pods(4, 1, new_ready=0, created_at=10.0), now=50.0)
    assert plan.state is not None and plan.state.stage == FAILED
    assert plan.replicas == {TARGET: 0, "mlp": 4} and plan.phase is Phase.DEGRADED
    again = step(given, plan.state, pods(4, 0), now=60.0)
    assert again.replicas == {TARGET: 0, "mlp": 4} and again.phase is Phase.DEGRADED


def test_a_version_rollout_running_holds_the_new_template() -> None:
    plan = step(spec(), None, pods(4, 0), version_rolling=True)
    assert plan.state is None and plan.replicas == {"mlp": 4, TARGET: 0}
    assert plan.reason == "TemplateRolloutWaiting"


def test_the_state_survives_the_status() -> None:
    state = TemplateRollout(STABLE, TemplateRef(TARGET, NEW), BATCHES, 5.0, 3, 7.0, 2, 9.0, "")
    assert TemplateRollout.from_status(state.to_status()) == state
    assert TemplateRollout.from_status({"stage": "nonsense"}) is None
    assert TemplateRollout.from_status(replace(state, stage="x").to_status()) is None
