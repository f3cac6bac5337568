"""The pod template's rollout planner (operator/model_operator/template_rollout.py): an
image change moves pods between two Deployments under the canary, the batches and
``maxConcurrentLoads``, never with fewer ready pods than before, and an edit back ends it."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

from model_operator.pods import PodView
from model_operator.spec import ModelDeploymentSpec, parse_spec
from model_operator.template_pass import template_actions, without_retries
from model_operator.template_rollout import (
    BATCHES,
    CANARY,
    FAILED,
    TemplatePlan,
    TemplateRef,
    TemplateRollout,
    plan_template,
)
from model_rollout_contract.annotations import ABORT, RETRY
from model_rollout_contract.states import Phase
from tests.support.template_rollout import NEW, OLD, STABLE, TARGET


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
    **actions: str,
) -> TemplatePlan:
    return plan_template(
        "mlp", given, digest, STABLE, previous, state, seen, now, random.Random(1), promoted,
        version_rolling, **actions,
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


def test_an_edit_back_mid_rollout_keeps_the_candidates_ready_pods_until_replaced() -> None:
    """Edited back at 3 new pods ready of 4: the stable Deployment goes back to 4, and the
    candidate keeps as many pods as it lacks ready ones, then is deleted once empty."""
    state = TemplateRollout(STABLE, TemplateRef(TARGET, NEW), BATCHES, 0.0, wanted=4, batch=2)
    plan = step(spec(), state, pods(1, 3), digest=OLD)
    assert plan.state is None and plan.replicas == {"mlp": 4, TARGET: 3}
    assert plan.draining == (TARGET,) and plan.retired == ()
    later = step(spec(), None, pods(4, 1, new_ready=1)[:4] + pods(0, 1), digest=OLD)
    assert later.replicas == {"mlp": 4, TARGET: 0}
    done = plan_template(
        "mlp", spec(), OLD, STABLE, None, None, pods(4, 0), 0.0, random.Random(1), None, False,
        draining=(TARGET,),
    )  # fmt: skip
    assert done.retired == (TARGET,) and done.draining == () and done.replicas[TARGET] == 0


def test_an_edit_back_after_completion_reuses_the_old_deployment() -> None:
    stable, previous = TemplateRef(TARGET, NEW), STABLE
    plan = plan_template(
        "mlp", spec(), OLD, stable, previous, None, pods(0, 4), 0.0, random.Random(1), None,
        False,
    )  # fmt: skip
    assert plan.state is not None and plan.state.target == STABLE
    assert plan.replicas == {"mlp": 1, TARGET: 4}


def test_no_progress_by_the_deadline_fails_it_and_the_ready_pods_go_only_as_replaced() -> None:
    given = spec(rollout={"batchSize": 1, "progressDeadlineSeconds": 30})
    state = TemplateRollout(
        STABLE, TemplateRef(TARGET, NEW), BATCHES, 0.0, wanted=4, batch=3, progress_at=10.0,
        ready_seen=3,
    )  # fmt: skip
    plan = step(given, state, pods(1, 4, new_ready=3), now=50.0)
    assert plan.state is not None and plan.state.stage == FAILED
    assert plan.phase is Phase.DEGRADED and "new-3" in plan.message
    assert plan.replicas == {"mlp": 4, TARGET: 3}  # 1 stable pod ready: 3 still serve
    again = step(given, plan.state, pods(4, 3), now=60.0)  # the stable pods back, ready
    assert again.replicas == {"mlp": 4, TARGET: 0} and again.phase is Phase.DEGRADED


def test_a_pod_unready_long_after_its_creation_fails_nothing_while_others_progress() -> None:
    given = spec(rollout={"batchSize": 1, "progressDeadlineSeconds": 30})
    state = TemplateRollout(
        STABLE, TemplateRef(TARGET, NEW), BATCHES, 0.0, wanted=3, batch=2, progress_at=90.0,
        ready_seen=2,
    )  # fmt: skip
    plan = step(given, state, pods(2, 3, new_ready=2, created_at=0.0), now=100.0)
    assert plan.state is not None and plan.state.stage == BATCHES


def test_pods_the_api_server_refuses_are_said_and_fail_it_at_the_deadline() -> None:
    given = spec(rollout={"batchSize": 1, "progressDeadlineSeconds": 30})
    state = TemplateRollout(STABLE, TemplateRef(TARGET, NEW), CANARY, 0.0, wanted=1)
    quota = "exceeded quota: gpu"
    waiting = plan_template(
        "mlp", given, NEW, STABLE, None, state, pods(4, 0), 10.0, random.Random(1), None,
        False, refused=quota,
    )  # fmt: skip
    assert quota in waiting.message and waiting.phase is Phase.CANARY
    failed = plan_template(
        "mlp", given, NEW, STABLE, None, state, pods(4, 0), 40.0, random.Random(1), None,
        False, refused=quota,
    )  # fmt: skip
    assert failed.state is not None and failed.state.stage == FAILED and quota in failed.message


def test_a_pause_holds_the_deadline() -> None:
    given = spec(paused=True, rollout={"batchSize": 1, "progressDeadlineSeconds": 30})
    state = TemplateRollout(STABLE, TemplateRef(TARGET, NEW), CANARY, 0.0, wanted=1)
    plan = step(given, state, pods(4, 1, new_ready=0), now=500.0)
    assert plan.state is not None and plan.state.stage == CANARY


def test_scaled_down_to_its_canary_it_keeps_a_stable_pod_and_waits_for_the_promotion() -> None:
    given = spec(replicas=1, canary={"percent": 25, "manualPromote": True})
    state = TemplateRollout(STABLE, TemplateRef(TARGET, NEW), CANARY, 0.0, wanted=1)
    plan = step(given, state, pods(1, 1))
    assert plan.state is not None and plan.state.stage == CANARY
    assert plan.replicas == {"mlp": 1, TARGET: 1} and plan.reason == "AwaitingPromotion"


def test_a_third_template_after_an_edit_back_to_the_previous_drains_the_previous() -> None:
    """Stable A, previous P: edited to P (a rollout to P's Deployment), then to C: P's
    pods drain as C's are ready, and nothing is left behind to block the completion."""
    previous = TemplateRef("mlp-pppppppppp", "p" * 16)
    state = TemplateRollout(STABLE, previous, BATCHES, 0.0, wanted=4, batch=2)
    third = "c" * 16
    seen = [PodView(f"a-{i}", ready=True) for i in range(2)] + [
        PodView(f"p-{i}", ready=True, template="pppppppppp") for i in range(2)
    ]
    plan = plan_template(
        "mlp", spec(), third, STABLE, previous, state, seen, 0.0, random.Random(1), None, False
    )
    assert plan.state is not None and plan.state.target.digest == third
    assert plan.replicas["mlp-pppppppppp"] == 2 and plan.draining == ("mlp-pppppppppp",)
    done = [PodView(f"c-{i}", ready=True, template=third[:10]) for i in range(4)]
    finished = replace(plan.state, stage=BATCHES, wanted=4)
    plan = plan_template(
        "mlp", spec(), third, STABLE, previous, finished, done, 1.0, random.Random(1), None,
        False, draining=plan.draining,
    )  # fmt: skip
    assert plan.state is None and plan.stable.digest == third


def test_a_version_rollout_running_holds_the_new_template() -> None:
    plan = step(spec(), None, pods(4, 0), version_rolling=True)
    assert plan.state is None and plan.replicas == {"mlp": 4} and plan.phase is None
    assert plan.reason == "TemplateRolloutWaiting"


def test_the_state_survives_the_status() -> None:
    state = TemplateRollout(STABLE, TemplateRef(TARGET, NEW), BATCHES, 5.0, 3, 7.0, 2, 9.0, "")
    assert TemplateRollout.from_status(state.to_status()) == state
    assert TemplateRollout.from_status({"stage": "nonsense"}) is None
    assert TemplateRollout.from_status(replace(state, stage="x").to_status()) is None


def test_before_a_first_deployment_completes_a_new_template_replaces_the_stable_in_place() -> None:
    """Pods that cannot start (a missing toleration) keep the first deployment from
    completing; the fixed template must not wait for it: it is applied to the stable
    Deployment at once."""
    plan = plan_template(
        "mlp", spec(), NEW, STABLE, None, None, pods(1, 0), 0.0, random.Random(1), None,
        True, first_deployment=True,
    )  # fmt: skip
    assert plan.state is None and plan.stable == TemplateRef("mlp", NEW)
    assert plan.replicas == {"mlp": 4} and plan.phase is None


def test_a_held_canary_whose_pod_restarts_long_after_is_given_the_whole_deadline() -> None:
    """Held for a promotion for hours: the deadline runs only while pods are awaited, so
    a canary pod that restarts then does not fail the rollout at once."""
    given = spec(canary={"percent": 25, "manualPromote": True},
                 rollout={"batchSize": 1, "progressDeadlineSeconds": 600})  # fmt: skip
    state = TemplateRollout(
        STABLE, TemplateRef(TARGET, NEW), CANARY, 0.0, wanted=1, canary_ready_at=10.0,
        progress_at=10.0, ready_seen=1,
    )  # fmt: skip
    held = step(given, state, pods(3, 1), now=7200.0)
    assert held.reason == "AwaitingPromotion" and held.state is not None
    restarted = step(given, held.state, pods(3, 1, new_ready=0), now=7230.0)
    assert restarted.state is not None and restarted.state.stage == CANARY


def test_a_pod_that_flaps_ready_makes_no_progress() -> None:
    given = spec(rollout={"batchSize": 1, "progressDeadlineSeconds": 30})
    state = TemplateRollout(
        STABLE, TemplateRef(TARGET, NEW), BATCHES, 0.0, wanted=2, batch=2, progress_at=0.0,
        ready_seen=1,
    )  # fmt: skip
    down = step(given, state, pods(3, 2, new_ready=0), now=10.0)
    assert down.state is not None
    up_again = step(given, down.state, pods(3, 2, new_ready=1), now=20.0)
    assert up_again.state is not None and up_again.state.progress_at == 0.0
    late = step(given, up_again.state, pods(3, 2, new_ready=1), now=40.0)
    assert late.state is not None and late.state.stage == FAILED


def test_one_replica_still_gets_its_canary_beside_the_stable_pod() -> None:
    given = spec(replicas=1, canary={"percent": 25, "manualPromote": True})
    plan = step(given, None, pods(1, 0))
    assert plan.state is not None and plan.state.stage == CANARY
    assert plan.replicas == {"mlp": 1, TARGET: 1}


def test_draining_keeps_ready_pods_only() -> None:
    """Abandoned with 1 ready pod and 2 crash-looping: the stable lacks 3 ready pods, yet
    only the ready one stays (the broken ones would take the room its pods need)."""
    state = TemplateRollout(STABLE, TemplateRef(TARGET, NEW), BATCHES, 0.0, wanted=3, batch=2)
    plan = step(spec(), state, pods(1, 3, new_ready=1), digest=OLD)
    assert plan.replicas == {"mlp": 4, TARGET: 1}


def test_the_stable_deployment_grows_back_under_max_concurrent_loads() -> None:
    given = spec(rollout={"batchSize": 1, "maxConcurrentLoads": 1})
    state = TemplateRollout(STABLE, TemplateRef(TARGET, NEW), BATCHES, 0.0, wanted=3, batch=3)
    plan = step(given, state, pods(1, 3), digest=OLD)
    assert plan.replicas == {"mlp": 2, TARGET: 3}  # one new stable pod at a time


def test_a_pause_stops_the_canarys_pause_too() -> None:
    given = spec(rollout={"batchSize": 1, "progressDeadlineSeconds": 30})
    state = TemplateRollout(
        STABLE, TemplateRef(TARGET, NEW), CANARY, 0.0, wanted=1, canary_ready_at=0.0
    )
    paused = step(replace(given, paused=True), state, pods(3, 1), now=10.0)
    assert paused.state is not None and paused.state.paused_at == 10.0
    resumed = step(given, paused.state, pods(3, 1), now=100.0)  # 90 s later: 10 s held
    assert resumed.reason == "CanaryPause" and resumed.state is not None
    assert resumed.state.canary_ready_at == 90.0


def test_every_tracks_retry_waits_for_a_template_rollout() -> None:
    kept = {"serving.model-rollout.io/promote": "mlp-x@1", "other": "1"}
    retries = {"serving.model-rollout.io/retry": "v2", "serving.model-rollout.io/retry.acme": "v3"}
    assert without_retries({**kept, **retries}) == kept


def test_a_retry_restarts_a_failed_template_rollout_from_its_canary_with_a_fresh_deadline() -> None:
    given = spec(rollout={"batchSize": 1, "progressDeadlineSeconds": 30})
    failed = TemplateRollout(
        STABLE, TemplateRef(TARGET, NEW), FAILED, 0.0, wanted=0, batch=2, message="stuck"
    )
    held = step(given, failed, pods(4, 0), now=500.0)
    assert held.state == failed and held.reason == "TemplateRolloutFailed"
    retried = step(given, failed, pods(4, 0), now=500.0, retried=failed.id)
    assert retried.state is not None and retried.state.stage == CANARY
    assert retried.state.started_at == 500.0 and retried.state.progress_at == 500.0
    assert retried.replicas == {"mlp": 4, TARGET: 1} and retried.cleared == (RETRY,)
    assert [e.reason for e in retried.events] == [
        "TemplateRolloutRetried",
        "TemplateRolloutStarted",
    ]
    again = step(given, retried.state, pods(4, 1, new_ready=0), now=501.0, retried=failed.id)
    assert again.state is not None and again.state.stage == CANARY and again.events == ()


def test_an_abort_sends_the_pods_back_to_the_stable_template_until_a_retry() -> None:
    state = TemplateRollout(STABLE, TemplateRef(TARGET, NEW), BATCHES, 0.0, wanted=3, batch=2)
    aborted = step(spec(), state, pods(1, 3), aborted=state.id)
    assert aborted.state is not None and aborted.state.stage == FAILED and aborted.state.aborted
    assert aborted.phase is Phase.DEGRADED and aborted.reason == "TemplateRolloutAborted"
    assert aborted.replicas == {"mlp": 4, TARGET: 3} and aborted.draining == (TARGET,)
    assert aborted.cleared == (ABORT,) and aborted.events[0].reason == "TemplateRolloutAborted"
    assert TemplateRollout.from_status(aborted.state.to_status()) == aborted.state
    later = step(spec(), aborted.state, pods(4, 3), now=5000.0, aborted=state.id)
    assert later.state == aborted.state and later.events == ()  # read again: quietly
    assert later.reason == "TemplateRolloutAborted" and later.replicas[TARGET] == 0
    retried = step(spec(), aborted.state, pods(4, 0), now=5001.0, retried=state.id)
    assert retried.state is not None and retried.state.stage == CANARY


def test_an_abort_or_retry_of_no_such_template_rollout_is_ignored_with_an_event() -> None:
    state = TemplateRollout(STABLE, TemplateRef(TARGET, NEW), CANARY, 0.0, wanted=1)
    plan = step(spec(), state, pods(4, 0), retried=f"{TARGET}@1", aborted="mlp-cccccccccc@3")
    assert plan.state is not None and plan.state.stage == CANARY
    assert [e.reason for e in plan.events] == ["AbortIgnored"]
    assert sorted(plan.cleared) == sorted((ABORT, RETRY))
    failed = replace(state, stage=FAILED, started_at=5.0)
    stale = step(spec(), failed, pods(4, 0), retried=state.id)  # of an earlier one
    assert stale.state == failed and [e.reason for e in stale.events] == ["RetryIgnored"]
    idle = step(spec(), None, pods(4, 0), digest=OLD, retried="mlp@1")
    assert [e.reason for e in idle.events] == ["RetryIgnored"] and idle.cleared == (RETRY,)


def test_only_an_abort_or_retry_naming_a_template_rollout_is_the_templates() -> None:
    annotations = {ABORT: "mlp-bbbbbbbbbb@100", RETRY: "v2", f"{RETRY}.acme": "x@1"}
    rest, aborted, retried = template_actions(annotations)
    assert (aborted, retried) == ("mlp-bbbbbbbbbb@100", None)
    assert rest == {RETRY: "v2", f"{RETRY}.acme": "x@1"}
