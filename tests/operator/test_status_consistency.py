"""A status that never contradicts itself (issue 31): StoreReachable beside pods that
cannot fetch the target, verifiedVersions of versions never found, an analysis verdict of
another rollout in the ANALYSIS column, and RolloutComplete with no pod serving."""

from __future__ import annotations

import logging
import random

import kopf

from model_operator import handlers
from model_operator.analysis import Sample
from model_operator.canary_metrics import Figures
from model_operator.planner import FAILED, plan_rollout
from model_operator.pods import PodView
from model_operator.spec import parse_spec
from model_operator.status import build_status
from model_rollout_contract.states import Phase, SidecarState
from model_rollout_e2e.simulation import SimCluster

BASE = {
    "model": "mlp",
    "version": "v7",
    "image": "img:1",
    "store": {"url": "s3://bucket/p"},
    "signingPublicKeySecret": "signing-key",
    "replicas": 2,
}
NOT_FOUND = "not_found: mlp/v7/manifest.json is not in the model store"


def store_reachable(status: dict) -> dict:
    return next(c for c in status["conditions"] if c["type"] == "StoreReachable")


def status_of(pods: list[PodView], **kwargs: object) -> dict:
    sp = parse_spec(BASE)
    plan = plan_rollout(sp, "v1", None, None, pods, 100.0, random.Random(1))
    return build_status(plan, pods, 2, 1, 100.0, [], signing_key="k", **kwargs)  # type: ignore[arg-type]


def test_store_reachable_is_false_while_a_pod_reports_the_target_not_found() -> None:
    pods = [
        PodView("mlp-a", "v7", "v1", "v7", SidecarState.REFUSED, NOT_FOUND, True,
                code="not_found"),
        PodView("mlp-b", "v1", "v1", "v1", SidecarState.OK, ready=True),
    ]  # fmt: skip
    condition = store_reachable(status_of(pods))
    assert (condition["status"], condition["reason"]) == ("False", "NotInStore")
    assert condition["message"] == f"pod mlp-a cannot fetch v7: {NOT_FOUND}"
    # a report about another version says nothing about the target
    old = [PodView("mlp-a", "v7", "v1", "v6", SidecarState.REFUSED, NOT_FOUND, True,
                   code="not_found")]  # fmt: skip
    assert store_reachable(status_of(old))["status"] == "True"


def test_store_reachable_never_claims_a_version_the_operator_did_not_look_for() -> None:
    condition = store_reachable(status_of([], store_checked=False))
    assert condition["reason"] == "NotChecked"
    assert "is in the model store" not in condition["message"]
    checked = store_reachable(status_of([]))
    assert checked["message"] == "the target version is in the model store"


async def test_a_volume_store_verifies_no_version() -> None:
    """The operator cannot read a volume store: a version it never found there is not
    listed in verifiedVersions (nor shown as in the store)."""
    volume = parse_spec({**BASE, "store": {"pvc": "models"}, "version": "v9"})
    memo = kopf.Memo(api=None)
    status = {"verifiedVersions": ["v1"], "currentVersion": "v1"}
    gate = await handlers._store_gate(  # the gate alone, no cluster
        memo, True, "ml", volume, status, logging.getLogger("test")
    )
    assert gate.verified == ["v1"] and not gate.checked and gate.problem is None
    s3 = parse_spec({**BASE, "version": "v1"})
    served = await handlers._store_gate(memo, True, "ml", s3, status, logging.getLogger("t"))
    assert served.checked


def test_the_analysis_of_an_aborted_rollout_is_not_shown_beside_the_next_one() -> None:
    """v8's canary passed a check, then was aborted; v9 fails (its pods refuse it):
    status.analysis (the ANALYSIS column) must not say Passed."""
    analysis = {"intervalSeconds": 2, "minRequests": 10, "failureLimit": 2}
    canary = {"percent": 25, "trafficPercent": 20, "manualPromote": True, "analysis": analysis}
    base = {**BASE, "replicas": 4, "rollout": {"jitterSeconds": 0}, "canary": canary}
    v8, v9 = parse_spec({**base, "version": "v8"}), parse_spec({**base, "version": "v9"})
    good = Figures(50, 0, 0, 200, 0.01, 0.01, None, None, 0)
    cluster = SimCluster(4, "v1", refuse=frozenset({"v9"}))
    for _ in range(20):
        plan = cluster.step(v8, read=lambda pods, a, now: Sample(now, figures=good))
    assert plan.analysis is not None and plan.analysis.last_result == "Passed"
    plan = cluster.step(v8, aborted="v8")
    assert (plan.reason, plan.state.stage) == ("Aborted", FAILED)
    for _ in range(20):
        plan = cluster.step(v9)
        if plan.state.stage == FAILED:
            break
    assert (plan.phase, plan.reason) == (Phase.DEGRADED, "RolloutFailed")
    status = build_status(plan, [p.view() for p in cluster.pods], 4, 1, cluster.now, [],
                          signing_key="k")  # fmt: skip
    assert "analysis" not in status, status.get("analysis")


def test_a_first_deployment_with_no_pods_yet_is_not_complete() -> None:
    sp = parse_spec({**BASE, "version": "v1", "replicas": 3})
    plan = plan_rollout(sp, None, None, None, [], 100.0, random.Random(1))
    assert plan.phase is Phase.PROGRESSING and plan.reason == "PodsStarting"
    assert "RolloutComplete" not in [e.reason for e in plan.events]
    assert plan.stable_version is None and "0/3 pods" in plan.message
    cluster = SimCluster(3, None)  # the pods come: the rollout goes on as ever
    cluster.state = plan.state
    for _ in range(10):
        plan = cluster.step(sp)
    assert plan.phase is Phase.AVAILABLE and cluster.stable == "v1"
    complete = [e for p in cluster.plans for e in p.events if e.reason == "RolloutComplete"]
    assert [e.message for e in complete] == ["all 3 pods serve mlp:v1"]
