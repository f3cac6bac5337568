"""The operator's side of day-2 operations, as pure functions: the abort and retry
annotations in the planner, and the rollout history kept in ``.status.history``."""

from __future__ import annotations

from dataclasses import replace

from model_operator.history import SPEC_EDIT, record
from model_operator.planner import BATCHES, CANARY, COMPLETE, FAILED, Event, Plan, RolloutState
from model_operator.status import iso
from model_rollout_contract.annotations import ABORT, RETRY
from model_rollout_contract.defaults import HISTORY_LIMIT
from model_rollout_contract.states import Phase, RolloutResult
from model_rollout_e2e.simulation import SimCluster
from test_planner import spec


def canary_held(cluster: SimCluster, version: str = "v2"):  # type: ignore[no-untyped-def]
    sp = spec(version=version, canary={"percent": 25, "manualPromote": True})
    for _ in range(10):
        plan = cluster.step(sp)
    assert plan.reason == "AwaitingPromotion" and cluster.serving() == {"v1": 3, version: 1}
    return sp, plan


def test_abort_sends_every_pod_of_the_running_rollout_back_to_stable() -> None:
    cluster = SimCluster(4)
    sp, _ = canary_held(cluster)
    plan = cluster.step(sp, aborted="v2")
    assert plan.phase is Phase.DEGRADED and plan.reason == "Aborted"
    assert plan.state.stage == FAILED and plan.state.aborted and plan.state.rolled_back
    assert [e.reason for e in plan.events] == ["RolloutAborted"] and plan.events[0].warning
    assert [(a.version) for a in plan.actions] == ["v1"] and ABORT in plan.cleared
    for _ in range(5):  # stays back, the reason stays Aborted
        plan = cluster.step(sp)
    assert cluster.serving() == {"v1": 4} and plan.reason == "Aborted"
    assert cluster.stable == "v1"


def test_an_abort_of_another_version_is_ignored_with_an_event() -> None:
    cluster = SimCluster(4)
    sp, _ = canary_held(cluster)
    plan = cluster.step(sp, aborted="v3")
    assert plan.reason == "AwaitingPromotion" and plan.state.stage == CANARY
    assert [e.reason for e in plan.events] == ["AbortIgnored"]
    assert "current rollout is of v2" in plan.events[0].message and ABORT in plan.cleared
    # the same abort read again after it acted (its removal not seen yet): no event
    plan = cluster.step(sp, aborted="v2")
    plan = cluster.step(sp, aborted="v2")
    assert plan.reason == "Aborted" and plan.events == ()


def test_retry_forgets_a_failure_and_runs_the_rollout_again() -> None:
    cluster = SimCluster(4)
    sp, _ = canary_held(cluster)
    cluster.step(sp, aborted="v2")
    failed = cluster.run(sp)
    assert failed.state.stage == FAILED
    plan = cluster.step(sp, retried="v2")
    assert [e.reason for e in plan.events[:2]] == ["RolloutRetried", "RolloutStarted"]
    assert plan.state.stage == CANARY and not plan.state.aborted and RETRY in plan.cleared
    assert plan.state.started_at > failed.state.started_at
    plan = cluster.step(sp, retried="v2")  # read again while it runs: ignored quietly
    assert plan.state.stage == CANARY
    assert not {"RolloutRetried", "RetryIgnored", "RolloutStarted"} & {
        e.reason for e in plan.events
    }
    for _ in range(5):
        plan = cluster.step(sp)
    assert cluster.serving() == {"v1": 3, "v2": 1} and plan.reason == "AwaitingPromotion"
    plan = cluster.step(sp, promoted=plan.state.promotion)
    assert cluster.run(sp).phase is Phase.AVAILABLE and cluster.serving() == {"v2": 4}


def test_a_retry_of_another_version_or_of_a_success_is_ignored_with_an_event() -> None:
    cluster = SimCluster(4)
    sp = spec(version="v2")
    cluster.run(sp)
    plan = cluster.step(sp, retried="v2")
    assert [e.reason for e in plan.events] == ["RetryIgnored"] and "succeeded" in plan.events[
        0
    ].message
    plan = cluster.step(sp, retried="v9")
    assert "not spec.version v2" in plan.events[0].message
    assert plan.state.stage == COMPLETE and RETRY in plan.cleared


def _plan(state: RolloutState, *events: str, reason: str = "BatchLoading") -> Plan:
    """A plan of ``state``; Available once the rollout is complete."""
    phase = Phase.AVAILABLE if state.stage == COMPLETE else Phase.PROGRESSING
    return Plan(state, "v1", None, (), tuple(Event(e, e) for e in events), phase, reason, "msg")


def test_history_records_one_entry_per_rollout_most_recent_first() -> None:
    v2 = RolloutState("v2", "v1", BATCHES, started_at=100.0)
    history = record([], _plan(v2, "RolloutStarted"), 101.0, "release by ci")
    assert history == [
        {
            "version": "v2",
            "fromVersion": "v1",
            "startedAt": iso(100.0),
            "result": "Progressing",
            "reason": "BatchLoading",
            "triggeredBy": "release by ci",
        }
    ]
    # the same pass again (a restart, a crash before the status write): the same entry
    assert record(history, _plan(v2, "RolloutStarted"), 101.0, "release by ci") == history
    assert record(history, _plan(v2), 102.0, None) == history
    complete = replace(v2, stage=COMPLETE)  # a pod still starting: not Succeeded yet
    starting = replace(_plan(complete), phase=Phase.PROGRESSING, reason="PodsStarting")
    assert record(history, starting, 120.0, None)[0]["result"] == "Progressing"
    done = record(history, _plan(complete), 130.0, None)
    assert done[0]["result"] == "Succeeded" and done[0]["finishedAt"] == iso(130.0)
    assert done[0]["triggeredBy"] == "release by ci"
    v3 = RolloutState("v3", "v2", CANARY, started_at=200.0)
    running = record(done, _plan(v3, "RolloutStarted"), 200.0, None)
    assert [e["version"] for e in running] == ["v3", "v2"]
    assert running[0]["triggeredBy"] == SPEC_EDIT
    v4 = RolloutState("v4", "v2", CANARY, started_at=300.0)
    superseded = record(running, _plan(v4, "RolloutStarted"), 300.0, None)
    assert [e["result"] for e in superseded] == ["Progressing", "Superseded", "Succeeded"]
    assert superseded[1]["finishedAt"] == iso(300.0)


def test_history_results_and_bound() -> None:
    cases = {
        RolloutResult.ABORTED: {"aborted": True, "rolled_back": True},
        RolloutResult.ROLLED_BACK: {"rolled_back": True},
        RolloutResult.FAILED: {},
    }
    for result, flags in cases.items():
        state = RolloutState("v2", "v1", FAILED, started_at=5.0, failure="why", **flags)
        [entry] = record([], _plan(state, "RolloutStarted"), 9.0, None)
        assert (entry["result"], entry["reason"]) == (result, "why")
    history: list = []
    for i in range(HISTORY_LIMIT + 5):
        state = RolloutState(f"v{i}", None, COMPLETE, started_at=float(i * 10))
        history = record(history, _plan(state, "RolloutStarted"), i * 10.0 + 1, None)
    assert len(history) == HISTORY_LIMIT
    assert history[0]["version"] == f"v{HISTORY_LIMIT + 4}"
    # a steady state (no rollout started) adds nothing; garbage in the status is dropped
    steady = RolloutState("v1", None, COMPLETE, started_at=1.0)
    assert record(["junk", {"version": "v0"}], _plan(steady), 2.0, None) == [{"version": "v0"}]
    assert record("junk", _plan(steady), 2.0, None) == []
