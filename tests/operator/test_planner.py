"""The rollout planner, tested as a pure function: examples and a hypothesis simulation."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from model_operator.analysis import Sample
from model_operator.canary_metrics import Figures
from model_operator.planner import (
    BATCHES,
    CANARY,
    FAILED,
    RolloutState,
    plan_rollout,
)
from model_operator.spec import SpecError, parse_spec
from model_operator.status import rollout_from_status, rollout_to_status
from model_rollout_contract.states import SidecarState
from model_rollout_e2e.simulation import SimCluster, SimPod

BASE = {
    "model": "mlp",
    "version": "v1",
    "image": "img:1",
    "store": {"url": "s3://bucket/p"},
    "signingPublicKeySecret": "signing-key",
    "replicas": 4,
}


def spec(**overrides):  # type: ignore[no-untyped-def]
    raw = {**BASE, **overrides}
    return parse_spec(raw)


class Cluster(SimCluster):
    """A simulated cluster on a tick clock: each load takes ``delay`` ticks."""

    def __init__(self, n: int, version: str = "v1", refuse: frozenset[str] = frozenset()) -> None:
        super().__init__(n, version, refuse=refuse)

    def step(self, sp, promoted=None, delay=1, dt=1.0, read=None):  # type: ignore[no-untyped-def,override]
        return super().step(sp, promoted, delay, dt, read)


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
    token = plan.state.promotion
    assert token == f"v2@{int(plan.state.started_at)}" and token in plan.message
    for other in ("v1", "v2", f"v2@{int(plan.state.started_at) - 60}"):  # not this rollout
        plan = cluster.step(sp, promoted=other)
        assert plan.reason == "AwaitingPromotion" and not plan.promotion_used
    plan = cluster.step(sp, promoted=token)
    assert plan.promotion_used and plan.state.stage == BATCHES
    assert cluster.run(sp).phase == "Available"


# what a check reads of the canary (each the whole interval's figures, as Prometheus
# gives them): too few requests, a good candidate, one answering 5xx
FEW = Figures(3, 0, 0, 30, 0.01, 0.01, None, None, 0)
GOOD = Figures(50, 0, 0, 200, 0.01, 0.01, None, None, 0)
ERRORS = Figures(50, 25, 0, 200, 0.01, 0.01, None, None, 0)


class Reader:
    """The canary's figures at each check: ``figures`` until a test changes it."""

    def __init__(self, figures: Figures) -> None:
        self.figures = figures

    def __call__(self, pods: object, analysis: object, now: float) -> Sample:
        return Sample(now, figures=self.figures)


def analysed_manual_spec():  # type: ignore[no-untyped-def]
    analysis = {"intervalSeconds": 2, "minRequests": 10, "failureLimit": 2}
    return spec(
        version="v2",
        canary={"percent": 25, "trafficPercent": 20, "manualPromote": True, "analysis": analysis,
                "shadow": {"enabled": False}},
    )  # fmt: skip


def test_with_analysis_the_promote_annotation_approves_and_a_passed_check_promotes() -> None:
    """Flagger's manual gating: the annotation approves, the analysis must pass too, in
    either order; the annotation is kept (not used up) while it waits."""
    cluster, sp, read = Cluster(4), analysed_manual_spec(), Reader(FEW)
    for _ in range(10):
        plan = cluster.step(sp, read=read)
    assert plan.reason == "AwaitingPromotion" and "after a passed check" in plan.message
    token = plan.state.promotion
    for _ in range(6):  # approved, but every check is inconclusive: the canary holds
        plan = cluster.step(sp, promoted=token, read=read)
        assert (plan.reason, plan.state.stage, plan.promotion_used) == (
            "AwaitingAnalysis",
            CANARY,
            False,
        )
        assert "approved; waiting for analysis to pass (last: Inconclusive" in plan.message
    read.figures = GOOD
    for _ in range(4):  # passed, but the approval was withdrawn: it waits for one again
        plan = cluster.step(sp, read=read)
    assert plan.reason == "AwaitingPromotion" and plan.analysis is not None
    assert plan.analysis.last_result == "Passed" and cluster.serving() == {"v1": 3, "v2": 1}
    plan = cluster.step(sp, promoted=token, read=read)
    assert plan.promotion_used and plan.state.stage == BATCHES
    assert "CanaryPromoted" in [e.reason for e in plan.events]
    assert cluster.run(sp).phase == "Available"


def test_an_approval_never_overrides_a_failed_analysis() -> None:
    cluster, sp, read = Cluster(4), analysed_manual_spec(), Reader(ERRORS)
    token = cluster.step(sp).state.promotion
    waiting = []
    for _ in range(20):  # approved from the start
        plan = cluster.step(sp, promoted=token, read=read)
        assert not plan.promotion_used
        if plan.reason == "AwaitingAnalysis":
            waiting.append(plan.message)
        if plan.state.stage == FAILED:
            break
    assert (plan.reason, plan.state.rolled_back) == ("AnalysisFailed", True)
    assert "(last: no check yet)" in waiting[0] and "(last: Failed" in waiting[-1], waiting
    for _ in range(3):
        plan = cluster.step(sp, promoted=token)
    assert cluster.serving() == {"v1": 4} and plan.state.stage == FAILED
    assert BATCHES not in {p.state.stage for p in cluster.plans}


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
        if max_loads:  # a cap over every load, the canary's included
            assert cluster.max_loads <= max_loads, (tick, plan.state.stage)
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
    assert not max_loads or cluster.max_loads <= max_loads


def test_status_merge_patch_deletes_what_disappeared() -> None:
    from model_operator.status import merge_patch

    old = {"versions": {"v1": 3, "v2": 1}, "phase": "Canary", "rollout": {"failure": "x"}}
    new = {"versions": {"v2": 4}, "rollout": {"stage": "complete"}}
    assert merge_patch(old, new) == {
        "versions": {"v1": None, "v2": 4},
        "phase": None,
        "rollout": {"failure": None, "stage": "complete"},
    }


def test_a_status_compares_equal_to_its_stored_copy() -> None:
    """The API server drops a null field that is not nullable (and a merge patch's null
    deletes the key): the status compared with the stored one carries no null."""
    from model_operator.status import without_nulls

    built = {"phase": "Available", "rollout": {"toVersion": "v1", "blockedSince": None},
             "previousVersion": None, "history": [{"fromVersion": None}]}  # fmt: skip
    stored = {
        "phase": "Available",
        "rollout": {"toVersion": "v1"},
        "history": [{"fromVersion": None}],
    }
    assert without_nulls(built) == stored


def test_a_deleted_canary_pod_is_replaced() -> None:
    cluster = Cluster(4)
    sp = spec(version="v2", canary={"percent": 25, "pauseSeconds": 2}, rollout={"batchSize": 1})
    plan = cluster.step(sp, delay=5)
    [canary] = [a.pod for a in plan.actions]
    cluster.step(sp, delay=5)
    fresh = cluster.replace_pod(canary)  # deleted while loading
    plan = cluster.step(sp, delay=5)
    assert [e.reason for e in plan.events] == ["CanaryReplaced"]
    [replacement] = [a.pod for a in plan.actions if a.version == "v2"]
    assert replacement not in (canary, fresh.name)
    # the new pod is pointed at once: stable, the version the canary stage wants for it
    assert [(a.pod, a.version) for a in plan.actions if a.version != "v2"] == [(fresh.name, "v1")]
    assert cluster.run(sp, delay=5).phase == "Available"
    assert cluster.serving() == {"v2": 4} and fresh.serving == "v2"


def test_a_version_rolled_back_from_gets_a_canary_again() -> None:
    cluster = Cluster(4)
    forward = spec(version="v2", canary={"percent": 25, "pauseSeconds": 0})
    cluster.run(forward)
    plan = cluster.step(spec(version="v1", canary={"percent": 25}))
    assert plan.events[0].reason == "RollbackStarted" and plan.state.fast
    cluster.run(spec(version="v1"))
    plan = cluster.step(forward)  # v2 again: it is the previous version, yet it was rolled back
    assert plan.state.stage == CANARY and not plan.state.fast
    assert [e.reason for e in plan.events] == ["RolloutStarted", "CanaryStarted"]


def test_a_rollback_to_a_version_the_pods_no_longer_hold_is_batched() -> None:
    cluster = Cluster(8)
    sp = spec(version="v2", replicas=8, canary={"percent": 0}, rollout={"batchSize": 8})
    cluster.run(sp)
    for pod in cluster.pods:  # their servers dropped v1 (retain 1, or restarted)
        pod.retained = ()
    cluster.max_loading = 0
    back = spec(version="v1", replicas=8, rollout={"batchSize": 8, "maxConcurrentLoads": 2})
    plan = cluster.step(back, delay=3)
    assert plan.events[0].reason == "RollbackStarted" and not plan.state.fast
    assert "no longer hold" in plan.events[0].message and len(plan.actions) == 2
    assert cluster.run(back, delay=3).phase == "Available"
    assert cluster.max_loading <= 2


def test_a_new_target_first_sends_pods_on_the_abandoned_version_back() -> None:
    cluster = Cluster(8)
    v2 = spec(version="v2", replicas=8, canary={"percent": 0}, rollout={"batchSize": 2})
    for _ in range(12):
        cluster.step(v2, delay=1)
    on_v2 = {p.name for p in cluster.pods if p.target == "v2"}
    assert 2 <= len(on_v2) < 8
    v3 = spec(version="v3", replicas=8, canary={"percent": 25, "pauseSeconds": 1})
    plan = cluster.step(v3, delay=1)
    back = {a.pod for a in plan.actions if a.version == "v1"}
    assert back == on_v2  # every pod on v2 goes back to the stable v1 at once
    assert {a.pod for a in plan.actions if a.version == "v3"}.isdisjoint(back)
    for _ in range(3):
        cluster.step(v3, delay=1)
        assert not any(p.target == "v2" for p in cluster.pods)
    assert cluster.run(v3, delay=1).phase == "Available" and cluster.serving() == {"v3": 8}


def test_waiting_for_unavailable_pods_has_a_deadline() -> None:
    cluster = Cluster(4)
    cluster.pods[3].ready = False  # never becomes ready
    sp = spec(
        version="v2",
        canary={"percent": 0},
        rollout={"batchSize": 1, "progressDeadlineSeconds": 10, "maxUnavailable": 0},
    )
    plan = cluster.run(sp, delay=1)
    assert plan.phase == "Degraded" and "not ready for 10s" in plan.message


def test_a_batch_deadline_counts_from_when_the_sidecar_saw_the_target() -> None:
    from model_operator.pods import PodView
    from model_rollout_contract.states import SidecarState

    sp = spec(version="v2", replicas=1, canary={"percent": 0},
              rollout={"progressDeadlineSeconds": 60})  # fmt: skip
    state = RolloutState("v2", "v1", BATCHES, started_at=0, batch=1, batch_in_flight=True,
                         batch_started_at=0.0)  # fmt: skip

    def pod(seen_at: float | None, reported: str | None) -> PodView:
        return PodView(
            "p", "v2", "v1", reported, SidecarState.LOADING, None, True, ("v0",), seen_at
        )

    rng = random.Random(0)
    # the kubelet took 50 s to show the target; the sidecar has been loading for 20 s
    assert plan_rollout(sp, "v1", None, state, [pod(50, "v2")], 70, rng).phase == "Progressing"
    assert plan_rollout(sp, "v1", None, state, [pod(50, "v2")], 111, rng).phase == "Degraded"
    # a sidecar that never reported seeing it gets the longest signal delay, then fails
    assert plan_rollout(sp, "v1", None, state, [pod(None, "v1")], 100, rng).phase == "Progressing"
    assert plan_rollout(sp, "v1", None, state, [pod(None, "v1")], 151, rng).phase == "Degraded"


@settings(max_examples=120, deadline=None)
@given(
    replicas=st.integers(2, 16),
    canary=st.sampled_from([0, 25, 50]),
    max_loads=st.one_of(st.none(), st.integers(1, 4)),
    deletions=st.lists(st.integers(0, 60), max_size=6),
    seed=st.integers(0, 1000),
)
def test_rollouts_finish_whatever_pods_are_deleted(
    replicas, canary, max_loads, deletions, seed
) -> None:
    rollout = {"batchPercent": 25, "jitterSeconds": 1}
    if max_loads:
        rollout["maxConcurrentLoads"] = max_loads
    sp = spec(version="v2", replicas=replicas, canary={"percent": canary, "pauseSeconds": 1},
              rollout=rollout)  # fmt: skip
    cluster = Cluster(replicas)
    rng = random.Random(seed)
    for tick in range(3000):
        if tick in deletions:
            cluster.replace_pod(rng.choice(cluster.pods).name)
        plan = cluster.step(sp, delay=2)
        assert cluster.max_loading <= max(sp.rollout.batch(replicas), sp.canary_pods()) + len(
            deletions
        )
        if max_loads:  # a replacement pod's first load is one of them
            assert cluster.max_loads <= max_loads, (tick, plan.state.stage)
        if plan.phase == "Available" and tick > max(deletions, default=0):
            break
    else:
        raise AssertionError(f"rollout did not finish: {cluster.plans[-1]}")
    assert cluster.serving() == {"v2": replicas}


@settings(max_examples=120, deadline=None)
@given(
    replicas=st.integers(1, 12),
    retain=st.sampled_from([1, 2]),
    canary=st.sampled_from([25, 50]),
    max_loads=st.one_of(st.none(), st.integers(1, 3)),
    edits=st.lists(st.sampled_from(["v1", "v2", "v3"]), min_size=1, max_size=5),
    seed=st.integers(0, 1000),
)
def test_version_edits_never_mix_more_than_two_versions_and_end_where_asked(
    replicas, retain, canary, max_loads, edits, seed
) -> None:
    """Any sequence of edits ends with every pod on the last version; no pod is ever
    pointed at a version no rollout wants (at most stable, target and one abandoned);
    with ``maxConcurrentLoads``, no more loads than that at any time, whatever they load
    (a canary, a batch, or a version to go back to that a server no longer holds)."""
    cluster = SimCluster(replicas, "v1", lambda pod, version: 2.0, seed=seed, retain=retain)
    rollout: dict[str, object] = {"batchPercent": 50, "jitterSeconds": 1}
    if max_loads:
        rollout["maxConcurrentLoads"] = max_loads
    for version in edits:
        sp = spec(version=version, replicas=replicas,
                  canary={"percent": canary, "pauseSeconds": 1}, rollout=rollout)  # fmt: skip
        for _ in range(random.Random(seed).randint(0, 15)):  # edit again mid-rollout
            cluster.step(sp)
            targets = {p.target for p in cluster.pods} - {None}
            assert len(targets) <= 3, targets
            assert not max_loads or cluster.max_loads <= max_loads
    plan = cluster.run(sp)
    assert plan.phase == "Available" and cluster.serving() == {edits[-1]: replicas}
    assert not max_loads or cluster.max_loads <= max_loads


def test_a_canary_larger_than_max_concurrent_loads_is_picked_in_waves() -> None:
    """Half of 8 pods as a canary, at most one load at a time: four waves of one pod,
    each told as such, and the canary is healthy (its pause begins) only once all four
    serve the version."""
    cluster = Cluster(8)
    sp = spec(version="v2", replicas=8, canary={"percent": 50, "pauseSeconds": 2},
              rollout={"batchSize": 2, "maxConcurrentLoads": 1})  # fmt: skip
    while cluster.state is None or cluster.state.canary_healthy_at is None:
        plan = cluster.step(sp, delay=2)
        assert sum(p.fetching for p in cluster.pods) <= 1
        if plan.state.canary_healthy_at is None:
            assert plan.reason == "CanaryLoading", plan.message
    reasons = [e.reason for p in cluster.plans for e in p.events]
    assert [r for r in reasons if r.startswith("Canary")] == [
        "CanaryStarted", "CanaryExtended", "CanaryExtended", "CanaryExtended", "CanaryHealthy",
    ]  # fmt: skip
    assert sum(p.serving == "v2" for p in cluster.pods) == 4
    assert "3 more wait: 1 loads in flight (maxConcurrentLoads 1)" in cluster.plans[0].message
    assert cluster.run(sp, delay=2).phase == "Available" and cluster.max_loads == 1


def test_pods_that_no_longer_hold_stable_go_back_to_it_under_the_cap() -> None:
    """Servers that keep one version (``retainVersions: 1``) dropped v1 when they loaded
    v2; v3 abandons v2, so going back to v1 is a load for each of them: at most
    ``maxConcurrentLoads`` at a time, the new rollout's loads counted too."""
    cluster = SimCluster(8, "v1", seed=3, retain=1)
    v2 = spec(version="v2", replicas=8, canary={"percent": 0},
              rollout={"batchSize": 2, "maxConcurrentLoads": 2, "jitterSeconds": 0})  # fmt: skip
    for _ in range(8):
        cluster.step(v2, delay=1)
    on_v2 = [p for p in cluster.pods if p.serving == "v2" and p.target == "v2"]
    assert len(on_v2) >= 4 and all(p.retained == () for p in on_v2)
    v3 = replace(v2, version="v3")
    plan = cluster.step(v3, delay=1)
    assert len([a for a in plan.actions if a.version == "v1"]) <= 2
    assert cluster.run(v3, delay=1).phase == "Available" and cluster.serving() == {"v3": 8}
    assert cluster.max_loads <= 2


# -- scaling mid-rollout (spec.replicas follows a scaler: kubectl scale, an HPA, KEDA) ---
def _scaled_up(cluster: Cluster, name: str) -> SimPod:
    """A pod the Deployment created for a scale-up: pointed nowhere, not ready yet."""
    pod = SimPod(name, None, None, None, ready=False)
    cluster.pods.append(pod)
    return pod


def _first_targets(cluster: Cluster, pod: str) -> list[str]:
    return [a.version for p in cluster.plans for a in p.actions if a.pod == pod]


def test_a_pod_added_mid_canary_starts_on_stable_and_the_canary_grows_with_replicas() -> None:
    cluster = Cluster(4)
    sp = spec(version="v2", canary={"percent": 25, "pauseSeconds": 3600},
              rollout={"batchSize": 1})  # fmt: skip
    while not any(e.reason == "CanaryHealthy" for e in cluster.step(sp).events):
        pass
    scaled = spec(version="v2", replicas=5, canary={"percent": 25, "pauseSeconds": 3600},
                  rollout={"batchSize": 1})  # fmt: skip
    new = _scaled_up(cluster, "pod-004")
    plan = cluster.step(scaled)
    # 25% of 5 is 2 canary pods: a serving pod joins the canary; the new pod, which
    # loads something anyway, is pointed at the stable version (its init container's)
    assert [(a.pod, a.version) for a in plan.actions] == [("pod-001", "v2"), ("pod-004", "v1")]
    assert [e.reason for e in plan.events] == ["CanaryExtended"]  # topped up, no new rollout
    assert plan.state.stage == CANARY and plan.state.started_at == cluster.plans[0].state.started_at
    new.ready = True
    assert cluster.step(scaled).phase == "Canary"
    assert new.serving == "v1" and _first_targets(cluster, "pod-004") == ["v1"]


def test_a_pod_added_mid_batches_starts_on_the_target_and_loads_once() -> None:
    cluster = Cluster(4)
    sp = spec(version="v2", canary={"percent": 25, "pauseSeconds": 1},
              rollout={"batchSize": 1, "jitterSeconds": 0, "maxConcurrentLoads": 2})  # fmt: skip
    while cluster.step(sp, delay=3).state.stage != BATCHES:
        pass
    assert sum(p.target == "v2" for p in cluster.pods) < 4  # mid-batches
    new = _scaled_up(cluster, "pod-004")
    scaled = replace(sp, replicas=5)
    plan = cluster.step(scaled, delay=3)
    assert ("pod-004", "v2", "v1") in [(a.pod, a.version, a.previous) for a in plan.actions]
    started = [e for p in cluster.plans for e in p.events if e.reason == "BatchStarted"]
    assert all("pod-004" not in e.message for e in started)  # no batch of its own
    while cluster.state is not None and cluster.state.stage == BATCHES:
        cluster.step(scaled, delay=3)
        new.ready = new.serving is not None
        assert cluster.max_loads <= 2
    assert cluster.run(scaled, delay=3).phase == "Available"
    assert cluster.serving() == {"v2": 5} and _first_targets(cluster, "pod-004") == ["v2"]


def test_a_pod_added_to_a_failed_rollout_starts_on_stable() -> None:
    cluster = Cluster(2, refuse=frozenset({"v2"}))
    sp = spec(version="v2", replicas=2, canary={"percent": 50})
    assert cluster.run(sp).phase == "Degraded"
    _scaled_up(cluster, "pod-002")
    plan = cluster.step(replace(sp, replicas=3))
    assert [(a.pod, a.version) for a in plan.actions] == [("pod-002", "v1")]


def test_a_scale_down_mid_rollout_neither_stalls_nor_breaks_max_unavailable() -> None:
    """Pods the Deployment deletes (a canary pod, one loading in a batch) are gone from
    the next pass: the canary is topped up, the batch finishes without them, and no
    pod counts as unavailable for being deleted."""
    cluster = Cluster(6)
    sp = spec(version="v2", replicas=6, canary={"percent": 34, "pauseSeconds": 1},
              rollout={"batchSize": 2, "jitterSeconds": 0, "maxUnavailable": 0})  # fmt: skip
    plan = cluster.step(sp, delay=4)
    canary = [a.pod for a in plan.actions]
    assert len(canary) == 3
    cluster.pods = [p for p in cluster.pods if p.name != canary[0]]  # scaled to 5
    plan = cluster.step(replace(sp, replicas=5), delay=4)
    assert plan.actions == ()  # 34% of 5 is 2 canary pods: two are loading already
    sp = replace(sp, replicas=5)
    while not (cluster.step(sp, delay=4).state.stage == BATCHES and cluster.state.batch_in_flight):  # type: ignore[union-attr]
        pass
    loading = [p.name for p in cluster.pods if p.loading]
    assert loading
    cluster.pods = [p for p in cluster.pods if p.name != loading[0]]  # scaled to 4
    sp = replace(sp, replicas=4)
    plan = cluster.run(sp, delay=4)
    assert plan.phase == "Available" and cluster.serving() == {"v2": 4}
    reasons = {p.reason for p in cluster.plans}
    assert "WaitingForAvailability" not in reasons and "RolloutFailed" not in reasons


def test_a_pod_created_after_its_batch_started_counts_its_deadline_from_its_creation() -> None:
    from model_operator.pods import PodView

    sp = spec(version="v2", replicas=2, canary={"percent": 0},
              rollout={"progressDeadlineSeconds": 60})  # fmt: skip
    state = RolloutState("v2", "v1", BATCHES, started_at=0, batch=1, batch_in_flight=False,
                         batch_started_at=0.0)  # fmt: skip
    done = PodView("a", "v2", "v2", "v2", SidecarState.OK, None, True, ("v1",), 1.0)
    rng = random.Random(0)

    def new(created_at: float) -> PodView:  # pointed at v2 at once; its init still pulls
        return PodView("b", "v2", created_at=created_at)

    # scaled up at 500 s: 90 s for its sidecar to report, then the 60 s deadline
    assert plan_rollout(sp, "v1", None, state, [done, new(500)], 600, rng).phase == "Progressing"
    assert plan_rollout(sp, "v1", None, state, [done, new(500)], 651, rng).phase == "Degraded"
    # without its creation time, the batch's start counts
    assert plan_rollout(sp, "v1", None, state, [done, new(0)], 600, rng).phase == "Degraded"


def test_a_pods_creation_time_is_read_from_its_metadata() -> None:
    from model_operator.pods import pod_view

    meta = {"name": "b", "creationTimestamp": "2026-12-06T08:50:31Z"}
    assert pod_view({"metadata": meta}).created_at == 1796547031.0
    assert pod_view({"metadata": {**meta, "creationTimestamp": "yesterday"}}).created_at is None
    assert pod_view({"metadata": {"name": "b"}}).created_at is None


@settings(max_examples=80, deadline=None)
@given(
    replicas=st.integers(2, 10),
    canary=st.sampled_from([0, 25, 50]),
    max_loads=st.one_of(st.none(), st.integers(1, 3)),
    scales=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12)), max_size=5),
    seed=st.integers(0, 1000),
)
def test_rollouts_finish_whatever_a_scaler_does_and_new_pods_start_where_the_stage_says(
    replicas, canary, max_loads, scales, seed
) -> None:
    rollout = {"batchPercent": 25, "jitterSeconds": 1}
    if max_loads:
        rollout["maxConcurrentLoads"] = max_loads
    sp = spec(version="v2", replicas=replicas, canary={"percent": canary, "pauseSeconds": 1},
              rollout=rollout)  # fmt: skip
    cluster = Cluster(replicas)
    rng = random.Random(seed)
    added = 0
    stage_when_added: dict[str, object] = {}
    for tick in range(3000):
        for at, size in scales:
            if at != tick:
                continue
            sp = replace(sp, replicas=size)
            while len(cluster.pods) > size:  # the ReplicaSet deletes some pod
                cluster.pods.remove(rng.choice(cluster.pods))
            while len(cluster.pods) < size:
                added += 1
                cluster.pods.append(SimPod(f"pod-new-{added:03d}"))
                stage_when_added[f"pod-new-{added:03d}"] = cluster.state
        plan = cluster.step(sp, delay=2)
        if max_loads:
            assert cluster.max_loads <= max_loads, (tick, plan.state.stage)
        if plan.phase == "Available" and tick > max((at for at, _ in scales), default=0):
            break
    else:
        raise AssertionError(f"rollout did not finish: {cluster.plans[-1]}")
    assert cluster.serving() == {"v2": len(cluster.pods)} and len(cluster.pods) == sp.replicas
    for name, state in stage_when_added.items():
        first = _first_targets(cluster, name)[:1]
        if first and isinstance(state, RolloutState) and state.stage == CANARY:
            assert first[0] in ("v1", "v2")  # stable, or picked as a canary pod
        elif first and isinstance(state, RolloutState) and state.stage == BATCHES:
            assert first == ["v2"], (name, state)
