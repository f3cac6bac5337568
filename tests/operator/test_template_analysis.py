"""The canary analysis of a pod template rollout: the target template's pods judged
against the stable template's on the version both serve, by the version canary's checks
(operator/model_operator/analysis.py, unchanged): which pods are read and how their
series become the groups ``stable`` and ``candidate``, each group's Prometheus pod
pattern (one Deployment's pods exactly), and the template planner's decisions on the
verdicts (a pass moves on to the batches, ``failureLimit`` failures fail the rollout,
an inconclusive run holds or fails as ``onInconclusive`` says)."""

from __future__ import annotations

import random
import re
from typing import Any

from prometheus_client import generate_latest

from model_operator.analysis import (
    CANDIDATE_GROUP,
    STABLE_GROUP,
    AnalysisState,
    Result,
    Sample,
)
from model_operator.analysis_sources import (
    as_groups,
    deployment_pods_regex,
    pods_regex,
    read_template_canary,
    template_pods_to_read,
)
from model_operator.canary_metrics import Figures, figures, increase, parse_metrics
from model_operator.manifests import deployment_name, template_digest, template_label
from model_operator.pods import PodView
from model_operator.spec import ModelDeploymentSpec, parse_spec
from model_operator.template_pass import TemplatePass, plan_templates, template_analysis
from model_operator.template_rollout import (
    BATCHES,
    CANARY,
    FAILED,
    TemplatePlan,
    TemplateRef,
    TemplateRollout,
    plan_template,
)
from model_rollout_contract import canary
from model_rollout_contract.states import Phase, SidecarState
from model_rollout_e2e.simulated_servers import Behaviour, SimulatedServer
from tests.support.fake_prometheus import fake_prometheus
from tests.support.template_rollout import NEW, STABLE, TARGET

GOOD, BAD = (
    Figures(200, 0, 0, 600, 0.010, 0.010, None, None, 0),
    Figures(200, 40, 0, 600, 0.010, 0.010, None, None, 0),
)
OK = SidecarState.OK
FEW = Figures(3, 0, 0, 9, 0.010, 0.010, None, None, 0)


def spec(analysis: dict[str, Any] | None = None, **canary_: Any) -> ModelDeploymentSpec:
    settings = {"intervalSeconds": 10, "minRequests": 50, "failureLimit": 2, **(analysis or {})}
    raw: dict[str, Any] = {
        "model": "mlp", "version": "v1", "image": "server:2", "replicas": 4,
        "store": {"pvc": "models"}, "allowUnsigned": True,
        "canary": {"percent": 25, "pauseSeconds": 30, "analysis": settings, **canary_},
        "rollout": {"batchSize": 1, "jitterSeconds": 0},
    }  # fmt: skip
    return parse_spec(raw)


def pods(old: int = 3, new: int = 1) -> list[PodView]:
    return [
        PodView(f"mlp-5f7c9d8b4-o{i:04d}", serving="v1", ready=True, state=OK) for i in range(old)
    ] + [
        PodView(
            f"{TARGET}-6c8d7b9f5-n{i:04d}", serving="v1", ready=True, state=OK, template=NEW[:10]
        )
        for i in range(new)
    ]


def step(
    sp: ModelDeploymentSpec,
    state: TemplateRollout | None,
    analysis: AnalysisState | None,
    now: float,
    sample: Sample | None = None,
    promoted: str | None = None,
    seen: list[PodView] | None = None,
) -> TemplatePlan:
    seen = pods() if seen is None else seen
    return plan_template(
        "mlp", sp, NEW, STABLE, None, state, seen, now, random.Random(1), promoted, False,
        analysis=analysis, sample=sample,
    )  # fmt: skip


def held_canary(sp: ModelDeploymentSpec) -> TemplatePlan:
    """The rollout started at 0 and its canary pod ready at 1: its analysis begins."""
    started = step(sp, None, None, 0.0, seen=pods(4, 0))
    assert started.state is not None and started.analysis is None  # no pod ready yet
    ready = step(sp, started.state, None, 1.0)
    assert ready.state is not None and ready.state.canary_ready_at == 1.0
    assert ready.analysis is not None and ready.analysis.rollout == ready.state.id
    return ready


def checked(sp: ModelDeploymentSpec, plan: TemplatePlan, *results: Figures) -> TemplatePlan:
    """``plan`` carried on with one check due each interval, each of these figures."""
    for f in results:
        assert plan.state is not None and plan.analysis is not None
        at = plan.analysis.next_check_at
        plan = step(sp, plan.state, plan.analysis, at, Sample(at, figures=f))
    return plan


# --- the pods read, and their groups -----------------------------------------------------
def test_the_ready_pods_serving_the_version_of_each_template_are_read() -> None:
    stable = [
        PodView("mlp-x-aaaaa", serving="v1", ready=True, state=OK),
        PodView("mlp-x-bbbbb", serving="v1", ready=False, state=OK),  # serves nobody
        PodView("mlp-x-ccccc", serving="v0", ready=True, state=OK),  # another version
    ]
    candidate = [
        PodView(f"{TARGET}-x-ddddd", serving="v1", ready=True, state=OK, template=NEW[:10])
    ]
    reference, chosen = template_pods_to_read("v1", stable, candidate)
    assert [p.name for p in reference] == ["mlp-x-aaaaa"]
    assert [p.name for p in chosen] == [f"{TARGET}-x-ddddd"]


def test_each_pods_series_become_its_groups_and_the_figures_judge_the_candidate() -> None:
    """Real Prometheus text of one version on two pods: the slow, failing pod (the new
    template's) is the candidate, the other the reference, as two versions would be."""
    servers = {"old": SimulatedServer("mlp", "unused"), "new": SimulatedServer("mlp", "unused")}
    behaviours = {
        "old": {"v1": Behaviour(latency_s=0.010)},
        "new": {"v1": Behaviour(latency_s=0.300, error_every=5)},
    }

    def snapshot() -> Sample:
        read = {
            name: parse_metrics(generate_latest(s.metrics.registry).decode(), "mlp", ("v1",))
            for name, s in servers.items()
        }
        return as_groups(Sample(0.0, snapshot=read), "v1", {"new"})

    for name, server in servers.items():
        server.serve("v1", None, behaviours[name], 10)
    before = snapshot()
    for name, server in servers.items():
        server.serve("v1", None, behaviours[name], 100)
    after = snapshot()
    assert before.snapshot is not None and after.snapshot is not None
    assert set(after.snapshot["new"]) == {CANDIDATE_GROUP}
    assert set(after.snapshot["old"]) == {STABLE_GROUP}
    f = figures(increase(before.snapshot, after.snapshot), STABLE_GROUP, CANDIDATE_GROUP)
    assert (f.live_requests, f.stable_requests, f.errors) == (100, 100, 20)
    assert f.latency_ratio is not None and f.latency_ratio > 10


# --- Prometheus: each group by its own Deployment's pods ---------------------------------
def test_a_deployments_pod_pattern_matches_its_pods_only() -> None:
    """PromQL anchors a regular expression at both ends, as fullmatch does."""
    first, later = "mlp-5f7c9d8b4-x2k9q", "mlp-0123456789-6c8d7b9f5-p7wz4"
    assert re.fullmatch(pods_regex("mlp"), first) and re.fullmatch(pods_regex("mlp"), later)
    assert re.fullmatch(deployment_pods_regex("mlp"), first)
    assert not re.fullmatch(deployment_pods_regex("mlp"), later)
    assert re.fullmatch(deployment_pods_regex("mlp-0123456789"), later)
    assert not re.fullmatch(deployment_pods_regex("mlp-0123456789"), first)


def test_a_long_names_pod_pattern_matches_its_truncated_pod_names() -> None:
    """Kubernetes names a pod ``(<replicaset>-)[:58]`` and 5 random characters: a
    ModelDeployment of 40 characters has a template's pods named without the whole hash
    (``<name>-<10 hex>-<6 of the hash>xxxxx``); each Deployment's pattern still matches
    its own pods only (none matched: the candidate had no requests, and the analysis
    failed every template canary of such a name as inconclusive)."""
    name = "recommendation-ranker-distilled-prod-eu1"  # 40 characters
    template = f"{name}-0123456789"

    def pod(deployment: str, pod_template_hash: str) -> str:
        return f"{deployment}-{pod_template_hash}-"[:58] + "p7wz4"

    for digits in ("6c8d7b9f5", "6c8d7b9f5x"):
        stable_pod, template_pod = pod(name, digits), pod(template, digits)
        assert re.fullmatch(deployment_pods_regex(name), stable_pod)
        assert re.fullmatch(deployment_pods_regex(template), template_pod)
        assert not re.fullmatch(deployment_pods_regex(name), template_pod)
        assert not re.fullmatch(deployment_pods_regex(template), stable_pod)


async def test_prometheus_is_asked_of_each_templates_pods_on_the_one_version() -> None:
    asked: list[str] = []
    candidate_pods = f'pod=~"{deployment_pods_regex(TARGET)}"'
    stable_pods = f'pod=~"{deployment_pods_regex("mlp")}"'

    def value(q: str) -> float | None:
        asked.append(q)
        assert 'version="v1"' in q and (candidate_pods in q) != (stable_pods in q), q
        cand = candidate_pods in q
        if canary.REQUESTS in q and "code=~" in q:
            return 30.0 if cand else 0.0
        if canary.REQUESTS in q:
            return 100.0 if cand else 300.0
        if canary.LATENCY in q:
            return 0.020 if cand else 0.010
        return None

    async with fake_prometheus(value) as url:
        sp = spec({"prometheus": {"url": url}})
        sample = await read_template_canary(
            sp, "ns", "v1", ("mlp", []), (TARGET, []), window_start=0.0, at=60.0
        )
    assert sample.figures is not None, sample.problem
    f = sample.figures
    assert (f.live_requests, f.errors, f.stable_requests) == (100, 30, 300)
    assert (f.candidate_p99, f.stable_p99) == (0.020, 0.010)
    assert any(candidate_pods in q for q in asked) and any(stable_pods in q for q in asked)


async def test_a_pass_reads_the_canarys_two_templates_when_a_check_is_due() -> None:
    """The operator's pass (template_pass.plan_templates) asks Prometheus of the target
    Deployment's pods and the stable one's on the version every pod serves, records the
    check in status.analysis (kind template), and a passed check ends the canary."""
    asked: list[str] = []

    def value(q: str) -> float | None:
        asked.append(q)
        v = 0.0 if "code=~" in q else 100.0 if canary.REQUESTS in q else None
        return 0.010 if canary.LATENCY in q and canary.SHADOW_LATENCY not in q else v

    async with fake_prometheus(value) as url:
        sp = spec({"prometheus": {"url": url}})
        digest = template_digest("mlp", "ns", sp)
        target = TemplateRef(deployment_name("mlp", template_label(digest)), digest)
        state = TemplateRollout(STABLE, target, CANARY, 0.0, wanted=1, canary_ready_at=1.0,
                                progress_at=1.0, ready_seen=1)  # fmt: skip
        assert sp.canary.analysis is not None
        analysis = AnalysisState.start(state.id, 1.0, sp.canary.analysis)
        status = {
            "currentVersion": "v1", "template": STABLE.to_status(),
            "templateRollout": state.to_status(),
            "analysis": {"kind": "template", **analysis.to_status()},
        }  # fmt: skip
        new = PodView(f"{target.deployment}-6c8d7b9f5-n0000", serving="v1", ready=True,
                      state=OK, template=template_label(digest))  # fmt: skip
        seen = [*pods(3, 0), new]
        passed = await plan_templates(None, "mlp", "ns", sp, status, seen, None)  # type: ignore[arg-type]
    plan = passed.plan
    assert plan.state is not None and plan.state.stage == BATCHES, plan.message
    assert plan.analysis is not None and plan.analysis.last_result is Result.PASSED
    own = f'pod=~"{deployment_pods_regex(target.deployment)}"'
    assert asked and all('version="v1"' in q for q in asked)
    assert any(own in q for q in asked)
    assert any(f'pod=~"{deployment_pods_regex("mlp")}"' in q for q in asked)


async def test_no_ready_candidate_pod_is_an_unreadable_sample() -> None:
    sample = await read_template_canary(spec(), "ns", "v1", ("mlp", pods(4, 0)), (TARGET, []),
                                        0.0, 10.0)  # fmt: skip
    assert sample.problem is not None and TARGET in sample.problem


# --- the planner's decisions --------------------------------------------------------------
def test_a_passed_check_after_the_pause_moves_the_canary_on_to_the_batches() -> None:
    sp = spec()
    plan = held_canary(sp)
    assert plan.phase is Phase.CANARY and plan.wake_in == 0.0  # a check is due at once
    plan = checked(sp, plan, FEW)  # inconclusive: too few requests
    assert plan.state is not None and plan.state.stage == CANARY
    plan = checked(sp, plan, GOOD)  # passed at 21, but the pause holds until 31
    assert plan.state is not None and plan.state.stage == CANARY and plan.reason == "CanaryPause"
    assert plan.analysis is not None and plan.analysis.last_result is Result.PASSED
    assert "analysis Passed" in plan.message
    moved = step(sp, plan.state, plan.analysis, 40.0)
    assert moved.state is not None and moved.state.stage == BATCHES
    assert "CanaryPromoted" in [e.reason for e in moved.events]


def test_the_pause_over_without_a_passed_check_holds_the_canary() -> None:
    sp = spec()
    plan = checked(sp, held_canary(sp), FEW, FEW)
    plan = step(sp, plan.state, plan.analysis, 40.0)
    assert plan.state is not None and plan.state.stage == CANARY
    assert plan.reason == "AnalysisHolding"
    assert plan.wake_in is not None  # the next check wakes the operator


def test_a_promotion_waits_for_a_passed_check() -> None:
    sp = spec(manualPromote=True)
    plan = held_canary(sp)
    assert plan.state is not None
    approved = step(sp, plan.state, plan.analysis, 2.0, promoted=plan.state.id)
    assert approved.reason == "AwaitingAnalysis" and not approved.promotion_used
    plan = checked(sp, plan, GOOD)
    assert plan.state is not None
    moved = step(sp, plan.state, plan.analysis, 25.0, promoted=plan.state.id)
    assert moved.state is not None and moved.state.stage == BATCHES and moved.promotion_used


def test_failure_limit_failed_checks_fail_it_and_the_stable_deployment_grows_back() -> None:
    sp = spec()
    plan = checked(sp, held_canary(sp), BAD)
    assert plan.state is not None and plan.state.stage == CANARY
    assert "AnalysisCheckFailed" in [e.reason for e in plan.events]
    plan = checked(sp, plan, BAD)
    assert plan.state is not None and plan.state.stage == FAILED
    assert plan.phase is Phase.DEGRADED and plan.reason == "TemplateRolloutFailed"
    assert "canary analysis" in plan.message and "error rate 20.00%" in plan.message
    assert plan.replicas == {"mlp": 4, TARGET: 1}  # its ready pod goes as the stable's are
    assert TARGET in plan.draining
    assert plan.analysis is not None and plan.analysis.last_result is Result.FAILED
    later = step(sp, plan.state, plan.analysis, 100.0)  # and stays failed
    assert later.state is not None and later.state.stage == FAILED
    assert later.reason == "TemplateRolloutFailed" and "error rate" in later.message


def test_an_aborted_canary_keeps_its_analysis_as_a_failed_one_does() -> None:
    """``kubectl model abort`` of a template canary with a failed check: the analysis
    stays in the plan (status.analysis, kind template) while the aborted rollout is in
    status.templateRollout, as after a failure by its checks; it was dropped at the abort."""
    sp = spec()
    plan = checked(sp, held_canary(sp), BAD)
    assert plan.state is not None and plan.analysis is not None
    aborted = plan_template(
        "mlp", sp, NEW, STABLE, None, plan.state, pods(), 15.0, random.Random(1), None, False,
        analysis=plan.analysis, aborted=plan.state.id,
    )  # fmt: skip
    assert aborted.state is not None and aborted.state.stage == FAILED
    assert aborted.reason == "TemplateRolloutAborted"
    assert aborted.analysis is not None and aborted.analysis.failures == 1
    assert aborted.analysis.baseline is None  # that canary is over


def test_inconclusive_with_on_inconclusive_hold_holds_the_canary() -> None:
    sp = spec({"inconclusiveLimit": 2, "onInconclusive": "hold"})
    plan = checked(sp, held_canary(sp), FEW, FEW)
    assert plan.state is not None and plan.state.stage == CANARY
    assert plan.phase is Phase.DEGRADED and plan.reason == "AnalysisInconclusive"
    plan = step(sp, plan.state, plan.analysis, 60.0)  # the pause is over: still held
    assert plan.state is not None and plan.state.stage == CANARY


def test_inconclusive_fails_it_by_default_on_inconclusive_rollback() -> None:
    sp = spec({"inconclusiveLimit": 2})
    plan = checked(sp, held_canary(sp), FEW, FEW)
    assert plan.state is not None and plan.state.stage == FAILED
    assert "inconclusive" in plan.message and plan.replicas["mlp"] == 4
    assert plan.reason == "TemplateRolloutFailed"


def test_another_rollouts_analysis_never_carries_over() -> None:
    sp = spec()
    plan = checked(sp, held_canary(sp), GOOD)
    assert plan.state is not None and plan.analysis is not None
    other = AnalysisState.start("mlp-cccccccccc@5", 0.0, sp.canary.analysis)  # type: ignore[arg-type]
    again = step(sp, plan.state, other, 12.0)
    assert again.analysis is not None and again.analysis.rollout == plan.state.id
    assert again.analysis.last_result is None


# --- the status ---------------------------------------------------------------------------
def test_the_analysis_is_the_status_analysis_of_kind_template_and_read_back() -> None:
    sp = spec()
    plan = checked(sp, held_canary(sp), GOOD)
    status: dict[str, Any] = {"phase": "Available", "message": "", "conditions": []}
    TemplatePass("mlp", NEW, plan).write(status, [], 100.0)
    written = status["analysis"]
    assert written["kind"] == "template" and written["lastResult"] == "Passed"
    assert written["at"].endswith("Z") or "+" in written["at"]
    assert template_analysis(status) == plan.analysis
    assert template_analysis({"analysis": {**written, "kind": None}}) is None  # a version's


def test_a_failed_templates_analysis_leaves_a_running_version_canarys_alone() -> None:
    """After a template canary failed its analysis a version rollout may run: its own
    analysis keeps the field (the version planner reads it back each pass)."""
    sp = spec()
    failed = checked(sp, held_canary(sp), BAD, BAD)
    assert failed.state is not None and failed.state.stage == FAILED
    version_analysis = {"rollout": "v2@5", "windowStart": 5.0, "nextCheckAt": 15.0}
    rolling = {"toVersion": "v2", "fromVersion": "v1", "stage": "canary", "startedAt": 5.0}
    status: dict[str, Any] = {
        "phase": "Canary", "message": "canary of v2", "conditions": [],
        "rollout": rolling, "analysis": dict(version_analysis),
    }  # fmt: skip
    TemplatePass("mlp", NEW, failed).write(status, [], 100.0)
    assert status["analysis"] == version_analysis
    alone: dict[str, Any] = {"phase": "Available", "message": "", "conditions": []}
    TemplatePass("mlp", NEW, failed).write(alone, [], 100.0)
    assert alone["analysis"]["kind"] == "template" and alone["analysis"]["lastResult"] == "Failed"


def test_a_canary_pod_not_ready_again_waits_for_it_not_for_a_check() -> None:
    """The canary's checks wait while its pod is not ready (no check is made then): the
    operator must not wake at once, again and again, for a check that is overdue."""
    sp = spec()
    plan = checked(sp, held_canary(sp), GOOD)
    assert plan.state is not None and plan.analysis is not None
    unready = [*pods(3, 0), PodView(f"{TARGET}-6c8d7b9f5-n0000", template=NEW[:10])]
    later = step(sp, plan.state, plan.analysis, plan.analysis.next_check_at + 5, seen=unready)
    assert later.reason == "CanaryLoading"
    assert later.wake_in is not None and later.wake_in > 1.0
