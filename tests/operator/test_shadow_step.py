"""The canary's shadow step (issue 31): the candidate answers only mirrored requests until
its analysis passes, and only then gets a live share; a failed shadow check rolls the
canary back before any user got an answer of the candidate. The planner as a pure
function on a simulated cluster, and the spec's defaults and refusals."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from model_operator.analysis import AnalysisState, Sample
from model_operator.canary_metrics import Figures
from model_operator.errors import SpecError
from model_operator.planner import BATCHES, CANARY, FAILED, Plan
from model_operator.spec import ModelDeploymentSpec, parse_spec
from model_operator.status import build_status, rollout_from_status, rollout_to_status
from model_rollout_contract.canary import TrafficPolicy
from model_rollout_contract.states import CanaryStep, Phase, SidecarState
from model_rollout_e2e.simulation import SimCluster

BASE = {
    "model": "mlp",
    "version": "v2",
    "image": "img:1",
    "store": {"url": "s3://bucket/p"},
    "signingPublicKeySecret": "signing-key",
    "replicas": 4,
    "rollout": {"batchSize": 2, "jitterSeconds": 0},
}
ANALYSIS = {"intervalSeconds": 2, "minRequests": 10, "failureLimit": 2}
# a whole interval's figures, as a check reads them: shadow runs only (the shadow step),
# good or failing; the live step's, good or failing
SHADOW_GOOD = Figures(0, 0, 60, 60, 0.01, 0.01, 0.0, None, 0, engine_time=True)
SHADOW_NAN = Figures(0, 0, 60, 60, 0.01, 0.01, None, None, 240, engine_time=True)
LIVE_GOOD = Figures(50, 0, 0, 200, 0.01, 0.01, None, None, 0)
LIVE_ERRORS = Figures(50, 25, 0, 200, 0.01, 0.01, None, None, 0)


def spec(**canary: object) -> ModelDeploymentSpec:
    settings = {"percent": 25, "pauseSeconds": 4, "trafficPercent": 20, "analysis": ANALYSIS}
    return parse_spec({**BASE, "canary": {**settings, **canary}})


class Reader:
    """The canary's figures at each check, by the step the rollout is in."""

    def __init__(self, cluster: SimCluster, shadow: Figures, live: Figures) -> None:
        self.cluster, self.shadow, self.live = cluster, shadow, live

    def __call__(self, pods: object, analysis: object, now: float) -> Sample:
        state = self.cluster.state
        step = state.canary_step if state is not None else CanaryStep.LIVE
        return Sample(now, figures=self.shadow if step is CanaryStep.SHADOW else self.live)


def run(cluster: SimCluster, sp: ModelDeploymentSpec, read: Reader, **kw: object) -> Plan:
    for _ in range(300):
        plan = cluster.step(sp, read=read, **kw)  # type: ignore[arg-type]
        if plan.state.stage == FAILED or plan.phase is Phase.AVAILABLE:
            return plan
    raise AssertionError(f"no end: {cluster.plans[-1]}")


def policies(cluster: SimCluster) -> list[TrafficPolicy]:
    """Every traffic policy the planner put on a pod, in order."""
    return [
        TrafficPolicy.from_annotation(a.policy)
        for plan in cluster.plans
        for a in plan.actions
        if a.policy is not None
    ]


def reasons(cluster: SimCluster) -> list[str]:
    return [e.reason for plan in cluster.plans for e in plan.events]


# --- the spec ---------------------------------------------------------------------------
def test_the_shadow_step_is_on_by_default_wherever_it_can_run() -> None:
    assert spec().canary.shadow.enabled and spec().canary.shadow.percent == 100
    assert not spec(shadow={"enabled": False}).canary.shadow.enabled
    assert spec(shadow={"percent": 30}).canary.shadow.percent == 30
    no_analysis = parse_spec({**BASE, "canary": {"percent": 25}})
    assert not no_analysis.canary.shadow.enabled  # nothing would end it
    no_pods = parse_spec({**BASE, "canary": {"analysis": ANALYSIS}})
    assert not no_pods.canary.shadow.enabled
    one_version = parse_spec(
        {**BASE, "retainVersions": 1, "canary": {"percent": 25, "analysis": ANALYSIS}}
    )
    assert not one_version.canary.shadow.enabled  # the pods cannot hold both versions


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (
            {"retainVersions": 1, "canary": {"percent": 25, "analysis": ANALYSIS,
                                             "shadow": {"enabled": True}}},
            "spec.canary.shadow.enabled needs spec.retainVersions of at least 2",
        ),
        (
            {"canary": {"analysis": ANALYSIS, "shadow": {"enabled": True}}},
            "spec.canary.shadow.enabled needs spec.canary.percent above 0",
        ),
        (
            {"canary": {"percent": 25, "shadow": {"enabled": True}}},
            "spec.canary.shadow.enabled needs spec.canary.analysis",
        ),
        (
            {"canary": {"percent": 25, "analysis": ANALYSIS, "shadow": {"percent": 0}}},
            "spec.canary.shadow.percent must be between 1 and 100",
        ),
    ],
    ids=["one version retained", "no canary pods", "no analysis", "nothing mirrored"],
)  # fmt: skip
def test_a_shadow_step_asked_for_where_it_cannot_run_is_refused(raw: dict, words: str) -> None:
    with pytest.raises(SpecError) as refused:
        parse_spec({**BASE, **raw})
    assert any(words in problem for problem in refused.value.problems), refused.value.problems


# --- the planner ------------------------------------------------------------------------
def test_a_failed_shadow_check_rolls_back_before_the_candidate_had_any_live_share() -> None:
    cluster = SimCluster(4, "v1")
    sp = spec()
    plan = run(cluster, sp, Reader(cluster, SHADOW_NAN, LIVE_GOOD))
    assert (plan.phase, plan.reason) == (Phase.DEGRADED, "AnalysisFailed")
    assert plan.state.rolled_back and plan.state.canary_step is CanaryStep.SHADOW
    assert "failed in the shadow step 2 of 2 checks" in plan.message, plan.message
    assert "non-finite outputs 240 > 0" in plan.message
    seen = policies(cluster)
    assert seen and all(p.traffic_percent == 0 and p.shadow_percent == 100 for p in seen), seen
    for _ in range(5):
        cluster.step(sp)
    assert cluster.serving() == {"v1": 4} and all(p.policy is None for p in cluster.pods)
    failed = [e for p in cluster.plans for e in p.events if e.reason == "AnalysisCheckFailed"]
    assert [e.message.split(" (")[0] for e in failed] == [
        "check 1 failed in the shadow step",
        "check 2 failed in the shadow step",
    ]
    assert "ShadowPassed" not in reasons(cluster) and "CanaryPromoted" not in reasons(cluster)


def test_a_passed_shadow_step_goes_live_and_is_judged_again_before_the_batches() -> None:
    cluster = SimCluster(4, "v1")
    sp = spec()
    plan = run(cluster, sp, Reader(cluster, SHADOW_GOOD, LIVE_GOOD))
    assert plan.phase is Phase.AVAILABLE and cluster.serving() == {"v2": 4}
    order = [p for p in dict.fromkeys(policies(cluster))]
    assert order == [TrafficPolicy("v1", "v2", 0, 100), TrafficPolicy("v1", "v2", 20, 0)]
    steps = [r for r in reasons(cluster) if r in ("AnalysisPassed", "ShadowPassed",
                                                    "CanaryPromoted")]  # fmt: skip
    assert steps == ["AnalysisPassed", "ShadowPassed", "AnalysisPassed", "CanaryPromoted"]
    shadow = [
        p for p in cluster.plans if p.state.stage == CANARY and p.state.canary_step == "shadow"
    ]
    assert shadow and all(p.message.startswith("canary step shadow: ") for p in shadow)
    assert plan.state.shadow_result is not None
    assert plan.state.shadow_result.startswith("passed at check 1 (0 failed)")
    # the live step holds its own pauseSeconds, counted from going live
    went_live = next(i for i, p in enumerate(cluster.plans) if p.reason == "CanaryLive")
    promoted = next(
        i for i, p in enumerate(cluster.plans) if "CanaryPromoted" in [e.reason for e in p.events]
    )
    assert promoted - went_live >= 4


def test_a_whole_pod_canary_mirrors_in_its_shadow_step_and_serves_whole_when_live() -> None:
    cluster = SimCluster(4, "v1")
    sp = spec(trafficPercent=0)
    live_policies = []
    for _ in range(300):
        plan = cluster.step(sp, read=Reader(cluster, SHADOW_GOOD, LIVE_GOOD))
        if plan.state.stage == CANARY and plan.state.canary_step is CanaryStep.LIVE:
            live_policies += [p.policy for p in cluster.pods if p.target == "v2"]
        if plan.phase is Phase.AVAILABLE:
            break
    assert set(policies(cluster)) == {TrafficPolicy("v1", "v2", 0, 100)}
    assert live_policies and set(live_policies) == {None}  # the candidate answers them all
    assert "every request of the canary pods" in next(
        p.message for p in cluster.plans if p.reason == "CanaryLive"
    )


def test_a_failure_in_the_live_step_names_it() -> None:
    cluster = SimCluster(4, "v1")
    plan = run(cluster, spec(), Reader(cluster, SHADOW_GOOD, LIVE_ERRORS))
    assert plan.reason == "AnalysisFailed" and plan.state.canary_step is CanaryStep.LIVE
    assert "failed in the live step" in plan.message and cluster.serving() == {"v1": 4}


def test_a_promotion_during_the_shadow_step_approves_but_skips_no_step() -> None:
    """With manualPromote, the annotation read during the shadow step is kept (not used):
    the canary goes live only on the shadow step's passed check, and to the batches only
    on a passed check of the live step; one promote is enough for both."""
    cluster = SimCluster(4, "v1")
    sp = spec(manualPromote=True)
    read = Reader(cluster, SHADOW_GOOD, LIVE_GOOD)
    token = cluster.step(sp, read=read).state.promotion
    read.shadow = Figures(3, 0, 3, 30, 0.01, 0.01, None, None, 0)  # too few: inconclusive
    for _ in range(8):
        plan = cluster.step(sp, promoted=token, read=read)
        assert plan.state.canary_step is CanaryStep.SHADOW and not plan.promotion_used
    assert plan.reason == "ShadowAnalysis" and "approved" in plan.message, plan.message
    read.shadow = SHADOW_GOOD
    used_in = []
    for _ in range(40):
        plan = cluster.step(sp, promoted=token, read=read)
        if plan.promotion_used:
            used_in.append(plan.state.canary_step)
        if plan.state.stage == BATCHES:
            break
    assert used_in == [CanaryStep.LIVE]
    assert reasons(cluster).index("ShadowPassed") < reasons(cluster).index("CanaryPromoted")


def test_an_operator_restarted_mid_shadow_resumes_the_shadow_step() -> None:
    """The rollout and its analysis go through .status as JSON (as the API server keeps
    them) between every two steps: the same plans, the same rollback, as without."""
    outcomes = []
    for restart in (False, True):
        cluster = SimCluster(4, "v1", seed=3)
        read = Reader(cluster, SHADOW_NAN, LIVE_GOOD)
        sp = spec(analysis={**ANALYSIS, "failureLimit": 3})
        steps = []
        for _ in range(100):
            plan = cluster.step(sp, read=read)
            steps.append((plan.reason, plan.state.canary_step))
            if restart:
                status = json.loads(json.dumps(build_status(
                    plan, [p.view() for p in cluster.pods], 4, 1, cluster.now, [],
                    signing_key="k")))  # fmt: skip
                cluster.state = rollout_from_status(status["rollout"])
                cluster.analysis = AnalysisState.from_status(status.get("analysis"))
            if plan.state.stage == FAILED:
                break
        outcomes.append((steps, plan.message, cluster.now))
    assert outcomes[0] == outcomes[1]
    assert ("ShadowAnalysis", CanaryStep.SHADOW) in outcomes[0][0]
    assert "failed in the shadow step 3 of 3" in outcomes[0][1]


def test_the_step_round_trips_and_a_state_stored_before_steps_loads_as_live() -> None:
    cluster = SimCluster(4, "v1")
    plan = cluster.step(spec(), read=Reader(cluster, SHADOW_GOOD, LIVE_GOOD))
    raw = rollout_to_status(plan.state)
    assert raw["canaryStep"] == "shadow" and type(raw["canaryStep"]) is str
    assert rollout_from_status(json.loads(json.dumps(raw))) == plan.state
    old = {k: v for k, v in raw.items() if k not in ("canaryStep", "shadowResult")}
    loaded = rollout_from_status(old)
    assert loaded is not None and loaded.canary_step is CanaryStep.LIVE  # it was live then
    assert rollout_from_status({**raw, "canaryStep": "sideways"}) is None


def test_the_status_names_the_step_and_its_checks() -> None:
    cluster = SimCluster(4, "v1")
    read = Reader(cluster, SHADOW_GOOD, LIVE_GOOD)
    sp = spec()
    plan = cluster.step(sp, read=read)
    while plan.reason != "CanaryLive":
        plan = cluster.step(sp, read=read)
    status = build_status(plan, [p.view() for p in cluster.pods], 4, 1, cluster.now, [],
                          signing_key="k")  # fmt: skip
    assert status["rollout"]["canaryStep"] == "live"
    assert status["rollout"]["shadowResult"].startswith("passed at check 1 (0 failed): ")
    [progressing] = [c for c in status["conditions"] if c["type"] == "Progressing"]
    assert progressing["reason"] == "CanaryLive"
    assert progressing["message"].startswith("canary step live: shadow step passed at check 1")


def test_no_shadow_step_leaves_the_canary_as_it_was() -> None:
    cluster = SimCluster(4, "v1")
    sp = spec(shadow={"enabled": False})
    plan = run(cluster, sp, Reader(cluster, SHADOW_NAN, LIVE_GOOD))
    assert plan.phase is Phase.AVAILABLE  # the live figures are all it saw
    assert set(policies(cluster)) == {TrafficPolicy("v1", "v2", 20, 0)}
    assert not any("step" in p.message for p in cluster.plans), cluster.plans[-1].message


def test_a_whole_pod_canary_in_its_shadow_step_is_read_from_its_own_pods_only() -> None:
    """In the shadow step a canary pod holds its own reference (the stable version answers
    beside the candidate): the stable pods are read only once a whole-pod canary is live."""
    from model_operator.analysis_sources import pods_to_read
    from model_operator.pods import PodView

    sp = spec(trafficPercent=0)
    ok = SidecarState.OK
    canary = PodView("pod-0", "v2", "v2", "v2", ok, ready=True)
    stable = [PodView(f"pod-{i}", "v1", "v1", "v1", ok, ready=True) for i in (1, 2, 3)]
    pods = [canary, *stable]
    assert pods_to_read(sp, "v1", "v2", pods, CanaryStep.SHADOW) == [canary]
    assert pods_to_read(sp, "v1", "v2", pods, CanaryStep.LIVE) == [canary, *stable]


FIGURES = {
    "good": (SHADOW_GOOD, LIVE_GOOD),
    "bad": (SHADOW_NAN, LIVE_ERRORS),
    "few": (Figures(3, 0, 3, 30, 0.01, 0.01, None, None, 0),) * 2,
}


@settings(max_examples=80, deadline=None)
@given(
    checks=st.lists(st.sampled_from(sorted(FIGURES)), min_size=1, max_size=12),
    manual=st.booleans(),
    whole_pods=st.booleans(),
    restart_at=st.integers(0, 40),
)
def test_no_live_share_before_a_passed_shadow_check_whatever_the_checks_say(
    checks: list[str], manual: bool, whole_pods: bool, restart_at: int
) -> None:
    """Any sequence of check results, operator restarts and approvals: the candidate gets
    a live share (a policy with trafficPercent above 0, or a canary pod without a policy)
    only after the shadow step passed, and every rollout ends."""
    sp = parse_spec({**BASE, "rollout": {"batchSize": 2, "jitterSeconds": 0,
                                         "progressDeadlineSeconds": 30},
                     "canary": {"percent": 25, "pauseSeconds": 2, "manualPromote": manual,
                                "trafficPercent": 0 if whole_pods else 20,
                                "analysis": ANALYSIS}})  # fmt: skip
    cluster = SimCluster(4, "v1")
    seen: list[str] = []

    def read(pods: object, analysis: AnalysisState, now: float) -> Sample:
        seen.append(checks[min(len(seen), len(checks) - 1)])
        state = cluster.state
        shadow = state is not None and state.canary_step is CanaryStep.SHADOW
        return Sample(now, figures=FIGURES[seen[-1]][0 if shadow else 1])

    went_live = False
    for tick in range(400):
        if tick == restart_at and cluster.state is not None:
            cluster.state = rollout_from_status(json.loads(json.dumps(
                rollout_to_status(cluster.state))))  # fmt: skip
        promoted = cluster.state.promotion if manual and cluster.state else None
        plan = cluster.step(sp, promoted=promoted, read=read)
        went_live |= "ShadowPassed" in [e.reason for e in plan.events]
        for action in plan.actions:
            if action.version != "v2" or plan.state.stage != CANARY:
                continue
            live = (
                action.policy is None
                or TrafficPolicy.from_annotation(action.policy).traffic_percent
            )
            assert went_live or not live, (tick, action)
        if plan.state.stage == FAILED or plan.phase is Phase.AVAILABLE:
            break
    else:
        raise AssertionError(f"no end: {cluster.plans[-1]}")
    if plan.state.stage == FAILED and not went_live:
        assert plan.state.canary_step is CanaryStep.SHADOW


def test_a_shadow_step_turned_off_mid_step_goes_live_and_says_it_was_skipped() -> None:
    cluster = SimCluster(4, "v1")
    few = Figures(3, 0, 3, 30, 0.01, 0.01, None, None, 0)
    read = Reader(cluster, few, LIVE_GOOD)
    for _ in range(6):
        plan = cluster.step(spec(), read=read)
    assert plan.reason == "ShadowAnalysis"
    plan = cluster.step(spec(shadow={"enabled": False}), read=read)
    assert plan.reason == "CanaryLive" and plan.state.canary_step is CanaryStep.LIVE
    assert [e.reason for e in plan.events] == ["ShadowSkipped"]
    assert plan.state.shadow_result == "skipped: spec.canary no longer asks for it"
