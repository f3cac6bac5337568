"""The rollout planner, tested as a pure function: examples and a hypothesis simulation."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from model_operator.planner import (
    BATCHES,
    CANARY,
    FAILED,
    RolloutState,
)
from model_operator.spec import SpecError, parse_spec
from model_operator.status import rollout_from_status, rollout_to_status
from model_rollout_e2e.simulation import SimCluster, SimPod

BASE = {
    "model": "mlp",
    "version": "v1",
    "image": "img:1",
    "store": {"url": "s3://b/p"},
    "replicas": 4,
}


def spec(**overrides):  # type: ignore[no-untyped-def]
    raw = {**BASE, **overrides}
    return parse_spec(raw)


class Cluster(SimCluster):
    """A simulated cluster on a tick clock: each load takes ``delay`` ticks."""

    def __init__(self, n: int, version: str = "v1", refuse: frozenset[str] = frozenset()) -> None:
        super().__init__(n, version, refuse=refuse)

    def step(self, sp, promoted=None, delay=1, dt=1.0):  # type: ignore[no-untyped-def,override]
        return super().step(sp, promoted, delay, dt)


def test_spec_validation_lists_every_problem() -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(
            {
                **BASE,
                "replicas": -1,
                "canary": {"percent": 150},
                "version": "../x",
                "store": {},
                "rollout": {"batchSize": 1, "batchPercent": 10},
            }
        )
    text = str(info.value)
    for fragment in (
        "spec.replicas",
        "spec.canary.percent",
        "spec.version",
        "spec.store",
        "batchSize or batchPercent",
    ):
        assert fragment in text
    with pytest.raises(SpecError, match="must be a number"):
        parse_spec({**BASE, "replicas": True})
    assert spec().rollout.batch(4) == 1  # default 25%
    assert spec(rollout={"batchPercent": 50, "maxConcurrentLoads": 1}).rollout.batch(8) == 1
    assert spec(canary={"percent": 10}).canary_pods() == 1
    assert spec(replicas=0, canary={"percent": 10}).canary_pods() == 0


def test_canary_then_batches_with_jitter() -> None:
    cluster = Cluster(8)
    sp = spec(
        version="v2",
        replicas=8,
        canary={"percent": 25, "pauseSeconds": 5},
        rollout={"batchSize": 2, "jitterSeconds": 3},
    )
    first = cluster.step(sp)
    assert first.phase == "Canary"
    assert [a.pod for a in first.actions] == ["pod-000", "pod-001"]
    assert all(a.previous == "v1" for a in first.actions)
    assert [e.reason for e in first.events] == ["RolloutStarted", "CanaryStarted"]
    # during canary + pause, exactly the canary pods are retargeted
    while cluster.state.stage == CANARY:  # type: ignore[union-attr]
        plan = cluster.step(sp)
        if plan.state.stage == CANARY:
            assert sum(p.target == "v2" for p in cluster.pods) == 2
    reasons = [e.reason for p in cluster.plans for e in p.events]
    assert reasons.index("CanaryHealthy") < reasons.index("CanaryPromoted")
    healthy = next(p for p in cluster.plans if any(e.reason == "CanaryHealthy" for e in p.events))
    promoted = next(p for p in cluster.plans if any(e.reason == "CanaryPromoted" for e in p.events))
    assert cluster.plans.index(promoted) - cluster.plans.index(healthy) >= 5  # held pauseSeconds
    plan = cluster.run(sp)
    assert plan.phase == "Available" and cluster.stable == "v2" and cluster.previous == "v1"
    assert cluster.serving() == {"v2": 8}
    batches = [e for p in cluster.plans for e in p.events if e.reason == "BatchStarted"]
    assert len(batches) == 3  # 6 remaining pods, 2 at a time
    assert cluster.max_loading <= 2


def test_manual_promotion_waits_for_the_annotation() -> None:
    cluster = Cluster(4)
    sp = spec(version="v2", canary={"percent": 25, "manualPromote": True})
    for _ in range(10):
        plan = cluster.step(sp)
    assert plan.reason == "AwaitingPromotion" and cluster.serving() == {"v1": 3, "v2": 1}
    plan = cluster.step(sp, promoted="v1")  # promoting another version does nothing
    assert plan.reason == "AwaitingPromotion"
    assert cluster.run(sp, promoted="v2").phase == "Available"


def test_refusal_stops_the_rollout_and_rollback_is_fast() -> None:
    cluster = Cluster(6, refuse=frozenset({"v2"}))
    sp = spec(version="v2", replicas=6, canary={"percent": 0}, rollout={"batchSize": 2})
    plan = cluster.run(sp)
    assert plan.phase == "Degraded" and plan.state.stage == FAILED
    assert "refused mlp:v2" in plan.message
    assert sum(p.target == "v2" for p in cluster.pods) == 2  # only the first batch
    assert cluster.stable == "v1"
    for _ in range(5):  # stays stopped
        assert not cluster.step(sp).actions
    back = spec(version="v1", replicas=6, rollout={"batchSize": 2})
    plan = cluster.step(back)
    assert plan.events[0].reason == "RollbackStarted" and plan.state.fast
    assert plan.phase == "RollingBack" and {a.pod for a in plan.actions} == {"pod-000", "pod-001"}
    assert cluster.run(back).phase == "Available"
    assert cluster.serving() == {"v1": 6} and cluster.stable == "v1"


def test_rollback_after_completion_skips_canary() -> None:
    cluster = Cluster(4)
    cluster.run(spec(version="v2", canary={"percent": 50, "pauseSeconds": 0}))
    assert (cluster.stable, cluster.previous) == ("v2", "v1")
    plan = cluster.step(spec(version="v1", canary={"percent": 50}))
    assert plan.state.fast and plan.state.stage == BATCHES and len(plan.actions) == 4
    cluster.run(spec(version="v1"))
    assert (cluster.stable, cluster.previous) == ("v1", "v2")


def test_initial_deployment_and_new_pods() -> None:
    cluster = Cluster(3)
    for pod in cluster.pods:
        pod.target = pod.serving = pod.reported = None
    cluster.stable, cluster.state = None, None
    assert cluster.run(spec(version="v1", replicas=3)).phase == "Available"
    assert cluster.stable == "v1" and cluster.previous is None
    cluster.pods.append(SimPod("pod-099"))  # scaled up: unannotated
    plan = cluster.step(spec(version="v1", replicas=4))
    assert [a.pod for a in plan.actions] == ["pod-099"]


def test_progress_deadline() -> None:
    cluster = Cluster(2)
    sp = spec(version="v2", replicas=2, rollout={"progressDeadlineSeconds": 10})
    for _ in range(3):
        cluster.step(sp, delay=1000)
    plan = cluster.run(sp, delay=1000)
    assert plan.state.stage == FAILED and "after 10s" in plan.message


def test_state_round_trips_through_status() -> None:
    state = RolloutState("v2", "v1", CANARY, batch=3, batch_in_flight=True, canary_healthy_at=12.5)
    raw = rollout_to_status(state)
    assert rollout_from_status(raw) == state
    assert "toVersion" in raw and "canaryHealthyAt" in raw and raw["stage"] == "canary"
    assert type(raw["stage"]) is str  # plain JSON in .status, not an enum object
    assert rollout_from_status({"junk": 1}) is None
    assert rollout_from_status({"toVersion": "v1", "unknownField": 3}) == RolloutState("v1")
    assert rollout_from_status({"toVersion": "v1", "stage": "exploded"}) is None


@settings(max_examples=150, deadline=None)
@given(
    replicas=st.integers(1, 24),
    canary=st.sampled_from([0, 10, 25, 50, 100]),
    batch=st.one_of(
        st.builds(lambda n: {"batchSize": n}, st.integers(1, 8)),
        st.builds(lambda n: {"batchPercent": n}, st.integers(1, 100)),
    ),
    max_loads=st.one_of(st.none(), st.integers(1, 4)),
    delay=st.integers(0, 3),
    restart_at=st.integers(0, 40),
    seed=st.integers(0, 1000),
)
def test_simulated_rollouts_respect_limits_and_finish(
    replicas, canary, batch, max_loads, delay, restart_at, seed
) -> None:
    rollout = {**batch, "jitterSeconds": 2}
    if max_loads:
        rollout["maxConcurrentLoads"] = max_loads
    sp = spec(
        version="v2",
        replicas=replicas,
        canary={"percent": canary, "pauseSeconds": 2},
        rollout=rollout,
    )
    cluster = Cluster(replicas)
    cluster.rng = random.Random(seed)
    limit = sp.rollout.batch(replicas)
    canary_pods = sp.canary_pods()
    for tick in range(2000):
        if tick == restart_at:  # an operator restart: state only survives through status
            cluster.state = (
                rollout_from_status(rollout_to_status(cluster.state)) if cluster.state else None
            )
        plan = cluster.step(sp, delay=delay)
        targeted = sum(p.target == "v2" for p in cluster.pods)
        if plan.state.stage == CANARY:
            assert targeted <= canary_pods
        assert cluster.max_loading <= max(limit, canary_pods)
        if plan.phase == "Available":
            break
    else:
        raise AssertionError("rollout did not finish")
    assert cluster.serving() == {"v2": replicas}
    assert (cluster.stable, cluster.previous) == ("v2", "v1")
    # and back: a fast rollback ends on v1 everywhere
    back = replace(sp, version="v1")
    assert cluster.run(back, delay=delay).phase == "Available"
    assert cluster.serving() == {"v1": replicas}


def test_status_merge_patch_deletes_what_disappeared() -> None:
    from model_operator.status import merge_patch

    old = {"versions": {"v1": 3, "v2": 1}, "phase": "Canary", "rollout": {"failure": "x"}}
    new = {"versions": {"v2": 4}, "rollout": {"stage": "complete"}}
    assert merge_patch(old, new) == {
        "versions": {"v1": None, "v2": 4},
        "phase": None,
        "rollout": {"failure": None, "stage": "complete"},
    }
