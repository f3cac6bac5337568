"""The planner's parity with ``kubectl argo rollouts``: ``spec.paused`` (pause, resume) and
the full promotion (``promote --full``), as pure functions on the simulated cluster of
``test_planner.py``."""

from __future__ import annotations

import random
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from model_operator.planner import (
    BATCHES,
    CANARY,
    COMPLETE,
    FAILED,
    PAUSED_REASON,
    RolloutState,
    next_deadline,
)
from model_operator.status import build_status, rollout_from_status, rollout_to_status
from model_rollout_contract.annotations import (
    full_promotion_id,
    parse_promotion,
    promotion_id,
)
from model_rollout_e2e.simulation import SimCluster as Cluster
from tests.operator.test_planner import spec


def reasons(cluster: Cluster, since: int = 0) -> list[str]:
    return [e.reason for p in cluster.plans[since:] for e in p.events]


def test_the_promote_value_says_whether_it_is_full_in_one_place() -> None:
    assert full_promotion_id("v2", 1700000000.9) == "v2@1700000000+full"
    assert parse_promotion("v2@1700000000+full") == ("v2@1700000000", True)
    assert parse_promotion(promotion_id("v2", 1700000000)) == ("v2@1700000000", False)
    assert parse_promotion(None) == (None, False)


# -- spec.paused ------------------------------------------------------------------------
def test_a_paused_rollout_picks_no_canary_until_resumed() -> None:
    cluster = Cluster(4)
    paused = spec(version="v2", canary={"percent": 25, "pauseSeconds": 0}, paused=True)
    plan = cluster.step(paused)
    assert reasons(cluster) == ["RolloutStarted", "RolloutPaused"]
    assert (plan.phase, plan.reason, plan.actions) == ("Canary", PAUSED_REASON, ())
    assert "paused (spec.paused) at the canary stage" in plan.message
    for _ in range(20):
        plan = cluster.step(paused)
        assert not plan.actions and not plan.events
    assert next_deadline(paused, plan.state) is None  # nothing to wake up for
    assert cluster.serving() == {"v1": 4}
    running = spec(version="v2", canary={"percent": 25, "pauseSeconds": 0})
    plan = cluster.step(running)
    assert reasons(cluster, -1) == ["RolloutResumed", "CanaryStarted"]
    assert plan.state.paused_at is None
    assert cluster.run(running).phase == "Available" and cluster.serving() == {"v2": 4}


def test_pause_lets_loads_in_flight_finish_and_starts_no_batch() -> None:
    cluster = Cluster(6)
    sp = spec(version="v2", replicas=6, rollout={"batchSize": 2, "jitterSeconds": 0})
    plan = cluster.step(sp, delay=3)
    assert plan.reason == "BatchLoading" and len(plan.actions) == 2
    paused = spec(version="v2", replicas=6, rollout={"batchSize": 2, "jitterSeconds": 0},
                  paused=True)  # fmt: skip
    plan = cluster.step(paused, delay=3)
    assert plan.reason == PAUSED_REASON and "2 loading (loads in flight finish)" in plan.message
    for _ in range(10):
        plan = cluster.step(paused, delay=3)
        assert not plan.actions
    assert cluster.serving() == {"v1": 4, "v2": 2}  # the batch in flight finished
    assert plan.phase == "Progressing" and "BatchStarted" not in reasons(cluster, 1)
    assert cluster.run(sp).phase == "Available" and cluster.serving() == {"v2": 6}


def test_the_time_paused_counts_toward_no_canary_pause_or_jitter() -> None:
    cluster = Cluster(4)
    canary = {"percent": 25, "pauseSeconds": 10}
    rollout = {"batchSize": 1, "jitterSeconds": 10}
    running = spec(version="v2", canary=canary, rollout=rollout)
    paused = spec(version="v2", canary=canary, rollout=rollout, paused=True)
    while "CanaryHealthy" not in reasons(cluster):
        cluster.step(running)
    for _ in range(4):  # 4 s of the 10 s hold
        cluster.step(running)
    for _ in range(100):  # paused far longer than the hold
        assert cluster.step(paused).state.stage == CANARY
    resumed_at = len(cluster.plans)
    while cluster.state is not None and cluster.state.stage == CANARY:
        cluster.step(running)
    held = len(cluster.plans) - resumed_at
    assert 5 <= held <= 7, held  # what was left of the hold, not 0 and not all of it
    # the same with a jitter pause between batches: what was left of it, after the resume
    cluster.rng = Longest()
    while "BatchComplete" not in reasons(cluster, resumed_at):
        cluster.step(running)
    assert cluster.state is not None and cluster.state.next_batch_at - cluster.now == 9
    for _ in range(50):
        plan = cluster.step(paused)
        assert not plan.actions and plan.reason == PAUSED_REASON
    resumed_at = len(cluster.plans)
    while "BatchStarted" not in reasons(cluster, resumed_at):
        cluster.step(running)
    assert len(cluster.plans) - resumed_at == 10  # as many as without the pause


class Longest(random.Random):
    """Every jitter pause as long as it may be."""

    def uniform(self, a: float, b: float) -> float:
        return b


def test_no_deadline_fails_a_paused_rollout_and_it_restarts_on_resume() -> None:
    cluster = Cluster(2)
    rollout = {"progressDeadlineSeconds": 10, "batchSize": 1}
    running = spec(version="v2", replicas=2, rollout=rollout)
    paused = spec(version="v2", replicas=2, rollout=rollout, paused=True)
    for _ in range(5):
        cluster.step(running, delay=1000)  # a load that never ends
    for _ in range(50):  # past the deadline many times over: paused, not failed
        plan = cluster.step(paused, delay=1000)
        assert plan.state.stage == BATCHES and plan.phase == "Progressing"
    for _ in range(9):  # the deadline restarted at the resume
        assert cluster.step(running, delay=1000).state.stage == BATCHES
    plan = cluster.run(running, delay=1000)
    assert plan.state.stage == FAILED and "after 10s" in plan.message


def test_a_refusal_still_fails_a_paused_rollout() -> None:
    cluster = Cluster(4, refuse=frozenset({"v2"}))
    cluster.step(spec(version="v2", canary={"percent": 25}))
    plan = cluster.run(spec(version="v2", canary={"percent": 25}, paused=True))
    assert plan.state.stage == FAILED and "refused mlp:v2" in plan.message


def test_abort_and_a_fast_rollback_act_while_paused_a_batched_one_waits() -> None:
    cluster = Cluster(4)
    paused = spec(version="v2", canary={"percent": 50, "pauseSeconds": 1000}, paused=True)
    running = spec(version="v2", canary={"percent": 50, "pauseSeconds": 1000})
    while "CanaryHealthy" not in reasons(cluster):
        cluster.step(running)
    cluster.step(paused)
    plan = cluster.step(paused, aborted="v2")
    assert plan.reason == "Aborted" and len(plan.actions) == 2  # back to v1 while paused
    assert cluster.run(paused).phase == "Degraded" and cluster.serving() == {"v1": 4}
    # a fast rollback (pointer swaps back to the stable version) runs while paused
    cluster = Cluster(4)
    while "CanaryHealthy" not in reasons(cluster):
        cluster.step(running)
    cluster.step(paused)
    back = spec(version="v1", paused=True)
    plan = cluster.step(back)
    assert plan.state.fast and plan.phase == "RollingBack" and len(plan.actions) == 2
    assert cluster.run(back).phase == "Available" and cluster.serving() == {"v1": 4}
    # a rollback that needs loads is an ordinary rollout: it waits for the resume
    cluster = Cluster(4, version="v2")
    cluster.previous = "v1"  # the pods no longer hold it
    plan = cluster.step(spec(version="v1", paused=True))
    assert not plan.state.fast and plan.reason == PAUSED_REASON and not plan.actions


def test_a_promotion_waits_while_paused_and_acts_on_resume() -> None:
    cluster = Cluster(4)
    manual = {"percent": 25, "manualPromote": True}
    running = spec(version="v2", canary=manual)
    paused = spec(version="v2", canary=manual, paused=True)
    while cluster.state is None or cluster.state.canary_healthy_at is None:
        cluster.step(running)
    token = cluster.state.promotion
    for value in (token, full_promotion_id("v2", cluster.state.started_at)):
        for _ in range(5):
            plan = cluster.step(paused, promoted=value)
            assert plan.reason == PAUSED_REASON and not plan.promotion_used
    plan = cluster.step(running, promoted=token)
    assert plan.promotion_used and plan.state.stage == BATCHES


# -- promote --full ---------------------------------------------------------------------
def test_a_full_promotion_skips_the_canary_hold_and_the_batches_under_the_cap() -> None:
    cluster = Cluster(8)
    sp = spec(
        version="v2", replicas=8, canary={"percent": 25, "manualPromote": True},
        rollout={"batchSize": 1, "jitterSeconds": 600, "maxConcurrentLoads": 3},
    )  # fmt: skip
    while cluster.state is None or cluster.state.canary_healthy_at is None:
        cluster.step(sp)
    full = full_promotion_id("v2", cluster.state.started_at)
    before = len(cluster.plans)
    plan = cluster.step(sp, promoted=full, delay=2)
    assert plan.promotion_used and plan.state.full and plan.state.stage == BATCHES
    assert reasons(cluster, before) == ["FullyPromoted", "BatchStarted"]
    assert len(plan.actions) == 3  # maxConcurrentLoads, not batchSize
    assert plan.reason == "FullPromotion" and "3 wait" in plan.message
    plan = cluster.run(sp, delay=2)
    assert plan.phase == "Available" and cluster.serving() == {"v2": 8}
    assert cluster.max_loads <= 3 and plan.state.full and plan.state.stage == COMPLETE
    # no jitter: 6 pods, 3 at a time, 2 s a load; batches of 1 with 600 s jitter otherwise
    assert len(cluster.plans) - before <= 8
    assert "BatchComplete" not in reasons(cluster, before)


def test_a_full_promotion_of_batches_moves_the_rest_as_loads_end() -> None:
    cluster = Cluster(6)
    sp = spec(version="v2", replicas=6, rollout={"batchSize": 1, "jitterSeconds": 600,
                                                  "maxConcurrentLoads": 2})  # fmt: skip
    for _ in range(3):
        plan = cluster.step(sp)
    assert plan.reason == "BatchJitter"
    full = full_promotion_id("v2", plan.state.started_at)
    plan = cluster.step(sp, promoted=full, delay=1)
    assert "FullyPromoted" in [e.reason for e in plan.events] and len(plan.actions) == 2
    assert "the canary hold" not in plan.events[0].message  # there was none
    plan = cluster.run(sp, delay=1)
    assert plan.phase == "Available" and cluster.max_loads <= 2


def test_a_full_promotion_of_another_rollout_or_a_finished_one_does_nothing() -> None:
    cluster = Cluster(4)
    sp = spec(version="v2", canary={"percent": 25, "manualPromote": True})
    while cluster.state is None or cluster.state.canary_healthy_at is None:
        cluster.step(sp)
    stale = full_promotion_id("v2", cluster.state.started_at - 60)
    for _ in range(3):
        plan = cluster.step(sp, promoted=stale)
        assert plan.reason == "AwaitingPromotion" and not plan.promotion_used
    assert not cluster.state.full


def test_full_and_paused_at_round_trip_through_status_and_old_statuses_load() -> None:
    state = RolloutState("v2", "v1", BATCHES, full=True, paused_at=12.5)
    raw = rollout_to_status(state)
    assert raw["full"] is True and raw["pausedAt"] == 12.5
    assert rollout_from_status(raw) == state
    old = {"toVersion": "v2", "fromVersion": "v1", "stage": "canary", "startedAt": 5.0}
    loaded = rollout_from_status(old)
    assert loaded is not None and not loaded.full and loaded.paused_at is None


def test_the_paused_condition_says_what_spec_paused_holds() -> None:
    cluster = Cluster(4)
    plan = cluster.step(spec(version="v2", canary={"percent": 25}, paused=True))

    def paused_condition(paused: bool, plan_=plan) -> dict[str, str]:  # type: ignore[no-untyped-def]
        status = build_status(plan_, [], 4, 1, 100.0, [], signing_key="k", paused=paused)
        return next(c for c in status["conditions"] if c["type"] == "Paused")

    held = paused_condition(True)
    assert (held["status"], held["reason"]) == ("True", "RolloutPaused")
    assert held["message"] == plan.message
    assert paused_condition(False)["status"] == "False"
    idle = Cluster(4).step(spec(version="v1", paused=True))  # nothing runs: nothing held
    nothing = paused_condition(True, idle)
    assert nothing["status"] == "True" and "no rollout is held now" in nothing["message"]


@settings(max_examples=100, deadline=None)
@given(
    replicas=st.integers(1, 16),
    canary=st.sampled_from([0, 25, 50]),
    max_loads=st.one_of(st.none(), st.integers(1, 3)),
    delay=st.integers(0, 3),
    pauses=st.lists(st.tuples(st.integers(0, 60), st.integers(1, 30)), max_size=4),
    full_at=st.one_of(st.none(), st.integers(0, 60)),
    seed=st.integers(0, 1000),
)
def test_pauses_and_a_full_promotion_anywhere_keep_the_cap_and_finish(
    replicas: int,
    canary: int,
    max_loads: int | None,
    delay: int,
    pauses: list[tuple[int, int]],
    full_at: int | None,
    seed: int,
) -> None:
    """While paused no pod is pointed at the new version; whenever it is paused and fully
    promoted, the rollout keeps maxConcurrentLoads and ends on the new version."""
    rollout: dict[str, object] = {"batchSize": 1, "jitterSeconds": 3}
    if max_loads:
        rollout["maxConcurrentLoads"] = max_loads
    canary_spec = {"percent": canary, "pauseSeconds": 5}
    running = spec(version="v2", replicas=replicas, canary=canary_spec, rollout=rollout)
    paused = replace(running, paused=True)
    paused_ticks = {t for start, length in pauses for t in range(start, start + length)}
    cluster = Cluster(replicas)
    cluster.rng = random.Random(seed)
    for tick in range(3000):
        sp = paused if tick in paused_ticks else running
        state = cluster.state
        promoted = None
        if tick == full_at and state is not None:
            promoted = full_promotion_id("v2", state.started_at)
        plan = cluster.step(sp, promoted=promoted, delay=delay)
        if sp.paused and plan.state.stage in (CANARY, BATCHES):
            assert not [a for a in plan.actions if a.version == "v2" and a.previous is not None]
        if max_loads:
            assert cluster.max_loads <= max_loads, tick
        if plan.phase == "Available" and tick > max(paused_ticks, default=0):
            break
    else:
        raise AssertionError("rollout did not finish")
    assert cluster.serving() == {"v2": replicas} and cluster.stable == "v2"
