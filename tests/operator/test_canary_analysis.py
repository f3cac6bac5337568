"""Canary analysis as pure functions: the figures read from real Prometheus text (written
by prometheus_client, parsed as the operator parses a pod's /metrics), and the planner's
decisions on them (a pass promotes, failureLimit failures roll back, an inconclusive
check holds, a restarted operator continues from .status), on a simulated cluster."""

from __future__ import annotations

import json
import math

import pytest
from prometheus_client import generate_latest

from model_operator.analysis import AnalysisState, Result, Sample, judge
from model_operator.analysis_sources import pods_to_read
from model_operator.canary_metrics import (
    Figures,
    figures,
    increase,
    parse_metrics,
    quantile,
)
from model_operator.planner import BATCHES, CANARY, COMPLETE, FAILED
from model_operator.pods import PodView
from model_operator.spec import ModelDeploymentSpec, parse_spec
from model_operator.status import build_status, rollout_from_status
from model_rollout_contract import canary
from model_rollout_contract.canary import TrafficPolicy
from model_rollout_contract.states import Phase
from model_rollout_e2e.simulated_servers import Behaviour, SimulatedServer
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
GOOD = Behaviour(latency_s=0.010)


def spec(canary: dict, **analysis: object) -> ModelDeploymentSpec:
    settings = {"intervalSeconds": 2, "minRequests": 40, "failureLimit": 2, **analysis}
    return parse_spec({**BASE, "canary": {"percent": 25, "pauseSeconds": 6, **canary,
                                          "analysis": settings}})  # fmt: skip


class Traffic:
    """Each pod's server (no HTTP: its registry is read directly) answering
    ``per_step`` requests a step, the two versions as ``behaviours`` say."""

    def __init__(self, behaviours: dict[str, Behaviour], per_step: int = 20) -> None:
        self.behaviours = behaviours
        self.per_step = per_step
        self.servers: dict[str, SimulatedServer] = {}
        self.samples: list[Sample] = []

    def serve(self, cluster: SimCluster) -> None:
        for pod in cluster.pods:
            server = self.servers.setdefault(pod.name, SimulatedServer("mlp", "unused"))
            policy = TrafficPolicy.from_annotation(pod.policy) if pod.policy else None
            if pod.serving is not None:
                server.serve(pod.serving, policy, self.behaviours, self.per_step)

    def read(self, sp: ModelDeploymentSpec):  # type: ignore[no-untyped-def]
        def reader(pods: list[PodView], analysis: AnalysisState, now: float) -> Sample:
            chosen = pods_to_read(sp, "v1", "v2", pods)
            snapshot = {
                p.name: parse_metrics(
                    generate_latest(self.servers[p.name].metrics.registry).decode(),
                    "mlp",
                    ("v1", "v2"),
                )
                for p in chosen
            }
            self.samples.append(Sample(now, snapshot=snapshot))
            return self.samples[-1]

        return reader


def run(cluster: SimCluster, sp: ModelDeploymentSpec, traffic: Traffic, steps: int = 200):  # type: ignore[no-untyped-def]
    """Step until the rollout ends; every plan is kept in ``cluster.plans``."""
    for _ in range(steps):
        plan = cluster.step(sp, read=traffic.read(sp))
        traffic.serve(cluster)
        if plan.state.stage in (COMPLETE, FAILED) and not plan.actions:
            return plan
    raise AssertionError(f"no end in {steps} steps: {cluster.plans[-1]}")


# --- the figures ------------------------------------------------------------------------
def scrape(server: SimulatedServer) -> dict:
    text = generate_latest(server.metrics.registry).decode()
    return parse_metrics(text, "mlp", ("v1", "v2"))


def test_figures_are_the_difference_of_two_scrapes_of_real_prometheus_text() -> None:
    server = SimulatedServer("mlp", "unused")
    policy = TrafficPolicy("v1", "v2", traffic_percent=10, shadow_percent=50)
    slow_nan = Behaviour(latency_s=0.3, error_every=4, non_finite=2, drift=0.2)
    behaviours = {"v1": GOOD, "v2": slow_nan}
    server.serve("v2", policy, behaviours, 100)
    before = {"pod-a": scrape(server)}
    server.serve("v2", policy, behaviours, 1000)
    window = increase(before, {"pod-a": scrape(server), "pod-new": scrape(server)})
    f = figures(window, "v1", "v2")
    # 10% of 1000 answered by v2, a quarter of them 500s; half of v1's 900 shadowed
    # (a shadow run is one of v2's requests, and fails as often as its live answers)
    assert (f.live_requests, f.errors, f.shadow_requests, f.stable_requests) == (100, 138, 450, 900)
    assert f.requests == 550 and f.error_rate == pytest.approx(138 / 550)
    # every run that was not a 500, live (75) or shadow (450 - 113): the server counts a
    # shadow run's outputs as a live answer's
    assert f.non_finite == 2 * (75 + 337)
    # NaN on one side is not comparable (+Inf): the quantile is the highest finite bound
    assert f.drift_p99 == canary.DRIFT_BUCKETS[-1]
    assert f.candidate_p99 is not None and 0.25 < f.candidate_p99 <= 0.5
    assert f.stable_p99 is not None and 0.005 < f.stable_p99 <= 0.01
    assert f.latency_ratio is not None and f.latency_ratio > 20
    assert f.argmax_agreement == 1.0


def window_of(policy: TrafficPolicy, behaviours: dict[str, Behaviour]) -> dict:
    server = SimulatedServer("mlp", "unused")
    server.serve("v2", policy, behaviours, 10)
    before = {"pod-a": scrape(server)}
    server.serve("v2", policy, behaviours, 400)
    return increase(before, {"pod-a": scrape(server)})


# the stable version's requests wait 300 ms beside 10 ms in its engine (a queue, JSON)
QUEUED = Behaviour(latency_s=0.010, overhead_s=0.3)


def test_a_shadowed_candidate_is_compared_with_the_stable_engine_not_its_requests() -> None:
    """A shadow run has no queueing or JSON: compared with the stable version's request
    time, an engine 20 times slower would look faster than the stable version."""
    slow_engine = Behaviour(latency_s=0.2)
    window = window_of(
        TrafficPolicy("v1", "v2", shadow_percent=50), {"v1": QUEUED, "v2": slow_engine}
    )
    f = figures(window, "v1", "v2")
    assert (f.live_requests, f.engine_time) == (0, True) and f.shadow_requests > 100
    assert f.candidate_p99 is not None and 0.1 < f.candidate_p99 <= 0.25
    assert f.stable_p99 is not None and 0.005 < f.stable_p99 <= 0.01  # engine, not 310 ms
    sp = spec({"shadowPercent": 50}).canary.analysis
    assert sp is not None
    check = judge(f, sp, 30)
    assert check.result is Result.FAILED, check
    assert "p99 latency x" in check.message and "engine time of its shadow runs" in check.message


def test_live_answers_are_compared_on_request_time() -> None:
    window = window_of(
        TrafficPolicy("v1", "v2", traffic_percent=20, shadow_percent=50),
        {"v1": QUEUED, "v2": QUEUED},
    )
    f = figures(window, "v1", "v2")
    assert f.live_requests == 80 and not f.engine_time
    assert f.candidate_p99 is not None and f.stable_p99 is not None
    assert 0.25 < f.stable_p99 <= 0.5 and f.latency_ratio == pytest.approx(1.0)
    sp = spec({"trafficPercent": 20}).canary.analysis
    assert sp is not None
    check = judge(f, sp, 30)
    assert check.result is Result.PASSED and "(x1.00, request time)" in check.message


def test_a_reset_counts_from_zero_and_a_new_series_counts_whole() -> None:
    old, fresh = SimulatedServer("mlp", "unused"), SimulatedServer("mlp", "unused")
    old.serve("v1", None, {}, 500)
    before = {"pod-a": scrape(old)}
    fresh.serve("v1", None, {}, 30)  # the server restarted: its counters began again
    fresh.serve("v2", None, {}, 7)  # and a version appeared
    window = increase(before, {"pod-a": scrape(fresh)})
    f = figures(window, "v1", "v2")
    assert (f.stable_requests, f.live_requests) == (30, 7)


def test_quantiles_are_prometheus_histogram_quantile() -> None:
    buckets = [(0.1, 50.0), (0.2, 90.0), (0.4, 100.0), (math.inf, 100.0)]
    assert quantile(0.5, buckets) == pytest.approx(0.1)
    assert quantile(0.7, buckets) == pytest.approx(0.15)
    assert quantile(0.99, buckets) == pytest.approx(0.38)
    assert quantile(0.99, [(0.1, 0.0), (math.inf, 0.0)]) is None
    assert quantile(0.99, [(0.1, 1.0), (math.inf, 100.0)]) == 0.1  # in +Inf: the last bound


def test_fewer_requests_than_asked_is_inconclusive_not_a_failure() -> None:
    sp = spec({}, minRequests=50).canary.analysis
    assert sp is not None
    bad = Figures(10, 10, 0, 10, 1.0, 0.01, None, None, 5)
    check = judge(bad, sp, 30)
    assert check.result is Result.INCONCLUSIVE and "fewer than minRequests 50" in check.message


def test_shadow_engine_time_without_a_stable_reference_is_inconclusive() -> None:
    """Under dynamic batching the stable version may run every request in a batch: it
    then has no engine time of one request, and a shadowed candidate of any speed would
    pass unjudged."""
    sp = spec({}, minRequests=10).canary.analysis
    assert sp is not None
    unjudged = Figures(0, 0, 40, 40, 0.5, None, None, None, 0, engine_time=True)
    check = judge(unjudged, sp, 30)
    assert check.result is Result.INCONCLUSIVE and "stable version alone" in check.message
    judged = Figures(0, 0, 40, 40, 0.5, 0.1, None, None, 0, engine_time=True)
    assert judge(judged, sp, 30).result is Result.FAILED


# --- the planner ------------------------------------------------------------------------
def test_an_in_pod_canary_carries_the_policy_passes_and_is_promoted() -> None:
    """The shadow step's policy (no live share, every stable answer mirrored) until its
    check passes, then the live step's."""
    cluster = SimCluster(4, "v1")
    sp = spec({"trafficPercent": 10, "shadowPercent": 50})
    traffic = Traffic({"v1": GOOD, "v2": GOOD})
    seen_policies: list[str | None] = []
    for _ in range(200):
        plan = cluster.step(sp, read=traffic.read(sp))
        traffic.serve(cluster)
        if plan.state.stage == CANARY:
            for policy in {p.policy for p in cluster.pods if p.target == "v2"} - {None}:
                if policy not in seen_policies:
                    seen_policies.append(policy)
            assert all(p.policy is None for p in cluster.pods if p.target == "v1")
        if plan.phase is Phase.AVAILABLE:
            break
    shadow = TrafficPolicy("v1", "v2", 0, 100).to_annotation()
    expected = TrafficPolicy("v1", "v2", 10, 50).to_annotation()
    assert seen_policies == [shadow, expected]
    assert all(p.policy is None for p in cluster.pods)  # removed at the promotion
    assert cluster.serving() == {"v2": 4}
    assert plan.analysis is not None and plan.analysis.last_result is Result.PASSED
    assert plan.analysis.baseline is None  # that canary is over: no counters kept
    reasons = [e.reason for p in cluster.plans for e in p.events]
    assert reasons.index("AnalysisPassed") < reasons.index("CanaryPromoted")
    pause_left = [p for p in cluster.plans if p.reason == "CanaryPause"]
    assert pause_left and "analysis Passed" in pause_left[-1].message


BAD = {
    "errors": (Behaviour(error_every=5), {}, "% > 1.00% ("),
    "NaN": (Behaviour(non_finite=1), {}, "non-finite outputs"),
    "slow": (Behaviour(latency_s=0.2), {}, "p99 latency x"),
    "wrong outputs": (Behaviour(drift=0.5), {"maxOutputDrift": 0.01}, "drift p99"),
    "other classes": (Behaviour(argmax_agrees=False), {"minArgmaxAgreement": 0.9}, "argmax"),
}
MODES = {
    "traffic": {"trafficPercent": 20, "shadowPercent": 50},
    "shadow": {"shadowPercent": 50},
    "pods": {},
}
# drift and argmax are measured on shadowed requests only; a shadow run's outputs are
# counted as a live answer's (the server's candidate.infer), and compared too, so NaN
# shows both as non-finite outputs and as a drift of +Inf there
CASES = [
    pytest.param(BAD[bad], MODES[mode], id=f"{mode}-{bad}")
    for bad in BAD
    for mode in MODES
    if not (mode == "pods" and bad in ("wrong outputs", "other classes"))
] + [
    pytest.param(
        (Behaviour(non_finite=1), {"maxOutputDrift": 1.0}, "drift p99 10 > 1"),
        MODES["shadow"],
        id="shadow-NaN-drift",
    )
]


@pytest.mark.parametrize("shadow_step", [True, False], ids=["shadow-step", "live-only"])
@pytest.mark.parametrize(("bad", "canary"), CASES)
def test_a_bad_candidate_is_rolled_back_after_failure_limit_checks(
    bad: tuple[Behaviour, dict, str], canary: dict, shadow_step: bool
) -> None:
    """Caught whether the canary starts with its shadow step (the default with analysis:
    then before the candidate ever answered a user) or is live from the start."""
    behaviour, thresholds, words = bad
    sp = spec({**canary, "shadow": {"enabled": shadow_step}}, **thresholds)
    cluster = SimCluster(4, "v1")
    traffic = Traffic({"v1": GOOD, "v2": behaviour})
    plan = run(cluster, sp, traffic)
    assert plan.state.stage == FAILED and plan.state.rolled_back
    assert (plan.phase, plan.reason) == (Phase.DEGRADED, "AnalysisFailed")
    assert words in plan.message and "failureLimit 2" in plan.message, plan.message
    live = sum(server.live_answers("v2") for server in traffic.servers.values())
    if shadow_step:
        assert "failed in the shadow step" in plan.message and plan.state.canary_step == "shadow"
        assert live == 0  # no user ever got an answer of the bad version
    else:
        assert "step" not in plan.message
        mirrored_only = canary.get("shadowPercent") and not canary.get("trafficPercent")
        assert live > 0 or mirrored_only
    for _ in range(5):  # the canary pods went back, and stay there
        cluster.step(sp)
    assert cluster.serving() == {"v1": 4}
    assert all(p.target == "v1" and p.policy is None for p in cluster.pods)
    events = [e for p in cluster.plans for e in p.events]
    failed_checks = [e for e in events if e.reason == "AnalysisCheckFailed"]
    assert len(failed_checks) == 2 and all(e.warning for e in failed_checks)
    [final] = [e for e in events if e.reason == "AnalysisFailed"]
    assert final.warning and "back to v1" in final.message
    assert cluster.plans[-1].reason == "AnalysisFailed"  # Degraded until spec.version moves


def test_a_slow_shadowed_engine_is_rolled_back_beside_a_queued_stable_version() -> None:
    sp = spec({"shadowPercent": 50})
    cluster = SimCluster(4, "v1")
    plan = run(cluster, sp, Traffic({"v1": QUEUED, "v2": Behaviour(latency_s=0.2)}))
    assert (plan.reason, cluster.serving()) == ("AnalysisFailed", {"v1": 4})
    assert "p99 latency x" in plan.message and "engine time" in plan.message, plan.message


def test_an_inconclusive_check_holds_the_canary_and_the_next_one_sees_longer() -> None:
    sp = spec({"trafficPercent": 10}, minRequests=60)
    cluster = SimCluster(4, "v1")
    traffic = Traffic({"v1": GOOD, "v2": GOOD}, per_step=20)  # 2 requests a step for v2
    plan = run(cluster, sp, traffic)
    assert plan.phase is not Phase.DEGRADED and cluster.serving() == {"v2": 4}
    results = [p.analysis.last_result for p in cluster.plans if p.analysis is not None]
    assert Result.INCONCLUSIVE in results and results[-1] is Result.PASSED
    held = [p for p in cluster.plans if p.reason == "AnalysisHolding"]
    assert held, "the pause ended without a passed check: the canary must hold"
    assert "fewer than minRequests 60" in held[0].message
    # the interval that passed began where the inconclusive ones did
    checks = [p.analysis for p in cluster.plans if p.analysis and p.analysis.at]
    passed = next(a for a in checks if a.last_result is Result.PASSED)
    first = next(a for a in checks if a.last_result is Result.INCONCLUSIVE)
    assert passed.at is not None and first.at is not None and passed.at - first.at >= 2


def test_a_restarted_operator_continues_from_the_status() -> None:
    """The analysis' state goes through .status as JSON (as the API server keeps it) and
    back between every two steps: the rollback comes at the same check, from the same
    scrapes, as without the round trip."""
    sp = spec({"trafficPercent": 20}, failureLimit=3)
    outcomes = []
    for restart in (False, True):
        cluster = SimCluster(4, "v1", seed=3)
        traffic = Traffic({"v1": GOOD, "v2": Behaviour(error_every=3)})
        for _ in range(200):
            plan = cluster.step(sp, read=traffic.read(sp))
            traffic.serve(cluster)
            if restart:
                status = json.loads(json.dumps(
                    build_status(plan, [p.view() for p in cluster.pods], 4, 1, cluster.now,
                                 [], signing_key="k")))  # fmt: skip
                cluster.analysis = AnalysisState.from_status(status.get("analysis"))
                cluster.state = rollout_from_status(status["rollout"])
                assert (cluster.analysis is None) == (plan.analysis is None)
            if plan.state.stage == FAILED:
                break
        assert plan.analysis is not None
        outcomes.append((plan.analysis.checks, plan.analysis.failures, cluster.now, plan.message))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][1] == 3


def test_status_analysis_keeps_the_last_scrape_while_the_canary_is_held() -> None:
    sp = spec({"trafficPercent": 20, "shadow": {"enabled": False}}, minRequests=5)
    cluster = SimCluster(4, "v1")
    traffic = Traffic({"v1": GOOD, "v2": GOOD})
    for _ in range(30):
        plan = cluster.step(sp, read=traffic.read(sp))
        traffic.serve(cluster)
        if plan.analysis is not None and plan.analysis.checks:
            break
    status = build_status(plan, [p.view() for p in cluster.pods], 4, 1, cluster.now, [],
                          signing_key="k")  # fmt: skip
    analysis = status["analysis"]
    assert analysis["lastResult"] == "Passed" and analysis["checks"] == 1
    assert set(analysis["baseline"]) == {p.name for p in cluster.pods if p.target == "v2"}
    assert analysis["at"].endswith("Z")


def test_a_new_target_drops_the_policy_of_an_abandoned_canary() -> None:
    sp = spec({"trafficPercent": 20})
    cluster = SimCluster(4, "v1")
    traffic = Traffic({"v1": GOOD, "v2": GOOD})
    for _ in range(6):
        cluster.step(sp, read=traffic.read(sp))
        traffic.serve(cluster)
    assert any(p.policy for p in cluster.pods)
    v3 = parse_spec({**BASE, "version": "v3", "canary": {"percent": 25, "pauseSeconds": 1}})
    for _ in range(60):
        plan = cluster.step(v3)
        if plan.phase is Phase.AVAILABLE:
            break
    assert cluster.serving() == {"v3": 4}
    assert all(p.policy is None for p in cluster.pods)


def test_a_failing_analysis_rolls_back_even_while_awaiting_promotion() -> None:
    sp = spec({"trafficPercent": 20, "manualPromote": True, "shadow": {"enabled": False}})
    cluster = SimCluster(4, "v1")
    plan = run(cluster, sp, Traffic({"v1": GOOD, "v2": Behaviour(non_finite=3)}))
    assert plan.reason == "AnalysisFailed" and cluster.serving() == {"v1": 4}
    assert any(p.reason == "AwaitingPromotion" for p in cluster.plans)


def test_after_a_rollback_the_stable_version_and_a_new_rollout_work_as_before() -> None:
    sp = spec({"trafficPercent": 20})
    cluster = SimCluster(4, "v1")
    run(cluster, sp, Traffic({"v1": GOOD, "v2": Behaviour(error_every=2)}))
    back = parse_spec({**BASE, "version": "v1"})
    for _ in range(10):
        plan = cluster.step(back)
    assert plan.phase is Phase.AVAILABLE and plan.state.stage == COMPLETE
    v3 = parse_spec({**BASE, "version": "v3", "canary": {"percent": 25, "pauseSeconds": 1}})
    for _ in range(40):
        plan = cluster.step(v3)
    assert cluster.serving() == {"v3": 4} and plan.state.stage == COMPLETE
    assert BATCHES in {p.state.stage for p in cluster.plans}


def test_a_verdict_on_replaced_canary_pods_is_not_carried_over() -> None:
    """Canary pods replaced mid-pause are measured afresh: the last Passed judged other
    pods and must not promote these before a check of their own."""
    from dataclasses import replace

    analysis = spec({"trafficPercent": 20}).canary.analysis
    assert analysis is not None
    passed = replace(
        AnalysisState.start("v2@1", 0.0, analysis), last_result=Result.PASSED, checks=1
    )
    again = passed.restart_window(10.0, analysis)
    assert again.last_result is None and again.checks == 1


def test_a_drift_threshold_no_drift_could_exceed_is_refused() -> None:
    from model_operator.errors import SpecError

    with pytest.raises(SpecError, match="maxOutputDrift"):
        spec({"shadowPercent": 20}, maxOutputDrift=canary.MAX_DRIFT_THRESHOLD * 2)


async def test_prometheus_one_live_answer_too_many_in_a_shadow_only_window_is_engine_time() -> None:
    """Prometheus' extrapolating increase() (or a scrape between the two counters) can
    read one more request of the candidate than its shadow runs in a window where it
    answered no client: with no live answer timed, latency is still engine time, and a
    candidate 20x slower fails."""
    from model_operator.analysis_sources import query_prometheus
    from model_operator.spec import AnalysisSpec, PrometheusSpec
    from tests.support.fake_prometheus import fake_prometheus

    def value(q: str) -> float | None:
        cand = 'version="v2"' in q
        if canary.REQUESTS in q and "code=~" in q:
            return 0.0
        if canary.REQUESTS in q:
            return 41.0 if cand else 40.0
        if canary.SHADOW_REQUESTS in q:
            return 40.0 if cand else 0.0
        if canary.SHADOW_LATENCY in q:
            return 0.200 if cand else None
        if canary.ENGINE_LATENCY in q:
            return 0.010
        if canary.LATENCY in q:
            return None if cand else 0.015  # no live answer of the candidate was timed
        return None

    async with fake_prometheus(value) as url:
        spec = PrometheusSpec(url)
        got = await query_prometheus(spec, "ns", "mlp", "mlp", ("v1", "v2"), 60.0, 0.0)
    assert got.figures is not None and got.figures.engine_time
    check = judge(got.figures, AnalysisSpec(min_requests=10, max_latency_ratio=1.5), 60.0)
    assert check.result is Result.FAILED, check.message


# --- an analysis that always concludes -------------------------------------------------
NO_TRAFFIC = Figures(0, 0, 0, 0, None, None, None, None, 0)


def unreadable(pods: object, analysis: object, now: float) -> Sample:
    return Sample(now, problem="Prometheus: http://prometheus:9090: connection refused")


def no_traffic(pods: object, analysis: object, now: float) -> Sample:
    return Sample(now, figures=NO_TRAFFIC)


def inconclusive_spec(canary: dict, rollout: dict | None = None, **analysis: object):  # type: ignore[no-untyped-def]
    settings = {"intervalSeconds": 2, "minRequests": 40, "failureLimit": 2, **analysis}
    return parse_spec({**BASE, "rollout": {**BASE["rollout"], **(rollout or {})},  # type: ignore[dict-item]
                       "canary": {"percent": 25, "pauseSeconds": 6, **canary,
                                  "analysis": settings}})  # fmt: skip


def step_until_failed(cluster: SimCluster, sp: ModelDeploymentSpec, read, steps: int = 400):  # type: ignore[no-untyped-def]
    for _ in range(steps):
        plan = cluster.step(sp, read=read)
        if plan.state.stage == FAILED:
            return plan
    raise AssertionError(f"still {cluster.plans[-1].phase} after {steps} steps")


@pytest.mark.parametrize("read", [no_traffic, unreadable], ids=["no traffic", "unreadable"])
def test_an_analysis_that_never_concludes_is_rolled_back_by_the_progress_deadline(read) -> None:  # type: ignore[no-untyped-def]
    """Observed: 360 inconclusive checks in 6 hours, the phase still Canary. By default
    the clock is spec.rollout.progressDeadlineSeconds: then Degraded, AnalysisInconclusive,
    and the canary pods back on the stable version."""
    sp = inconclusive_spec({"trafficPercent": 20}, {"progressDeadlineSeconds": 30})
    cluster = SimCluster(4, "v1")
    plan = step_until_failed(cluster, sp, read)
    assert (plan.phase, plan.reason) == (Phase.DEGRADED, "AnalysisInconclusive")
    assert plan.state.rolled_back and plan.analysis is not None
    assert 14 <= plan.analysis.checks <= 17, plan.analysis  # ~30s of checks every 2s
    assert plan.analysis.failures == 0 and plan.analysis.last_result is Result.INCONCLUSIVE
    assert "no check concluded in 3" in plan.message, plan.message
    assert any(e.reason == "AnalysisInconclusive" and e.warning for e in plan.events)
    for _ in range(5):
        plan = cluster.step(sp, read=read)
    assert cluster.serving() == {"v1": 4} and plan.reason == "AnalysisInconclusive"
    status = build_status(plan, [p.view() for p in cluster.pods], 4, 1, cluster.now, [],
                          signing_key="k")  # fmt: skip
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "AnalysisInconclusive")


def test_inconclusive_limit_counts_checks_in_a_row_and_a_conclusive_one_resets_it() -> None:
    sp = inconclusive_spec({"trafficPercent": 20}, inconclusiveLimit=3)
    reads: list[Sample] = []

    def flaky(pods: object, analysis: object, now: float) -> Sample:  # two bad, one good
        reads.append(Sample(now, figures=FEW_FIGURES if len(reads) % 3 != 2 else NO_ERRORS))
        return reads[-1]

    cluster, manual = SimCluster(4, "v1"), replace_pause(sp)
    for _ in range(40):  # passes now and then: never three inconclusive in a row
        plan = cluster.step(manual, read=flaky)
        assert plan.state.stage == CANARY and plan.phase is Phase.CANARY, plan
    assert len(reads) > 10
    plan = step_until_failed(cluster, manual, unreadable)
    assert plan.reason == "AnalysisInconclusive" and plan.analysis is not None
    assert "3 inconclusive checks in a row (inconclusiveLimit 3)" in plan.message
    assert "connection refused" in plan.message


FEW_FIGURES = Figures(3, 0, 0, 30, 0.01, 0.01, None, None, 0)
NO_ERRORS = Figures(50, 0, 0, 200, 0.01, 0.01, None, None, 0)


def replace_pause(sp: ModelDeploymentSpec) -> ModelDeploymentSpec:
    """``sp`` with manual promotion: a passed check never ends the canary by itself."""
    from dataclasses import replace

    return replace(sp, canary=replace(sp.canary, manual_promote=True))


def test_on_inconclusive_hold_keeps_the_canary_degraded_until_a_check_concludes() -> None:
    sp = inconclusive_spec(
        {"trafficPercent": 20}, inconclusiveDeadlineSeconds=10, onInconclusive="hold"
    )
    cluster = SimCluster(4, "v1")
    for _ in range(30):
        plan = cluster.step(sp, read=no_traffic)
    assert (plan.phase, plan.reason, plan.state.stage) == (
        Phase.DEGRADED,
        "AnalysisInconclusive",
        CANARY,
    )
    assert "held (onInconclusive: hold)" in plan.message and "deadline 10s" in plan.message
    status = build_status(plan, [p.view() for p in cluster.pods], 4, 1, cluster.now, [],
                          signing_key="k")  # fmt: skip
    progressing = next(c for c in status["conditions"] if c["type"] == "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("False", "AnalysisInconclusive")
    assert "no rollout in progress" not in progressing["message"]
    assert cluster.serving() == {"v1": 3, "v2": 1}
    assert any(p.policy for p in cluster.pods)  # the canary keeps its traffic policy
    warned = [
        e
        for p in cluster.plans
        for e in p.events
        if e.reason == "AnalysisInconclusive" and e.warning
    ]
    assert len(warned) == 1 and "canary held" in warned[0].message  # once, when it began
    good = Reader(NO_ERRORS)
    for _ in range(40):
        plan = cluster.step(sp, read=good)
        if plan.state.stage != CANARY:
            break
    assert "CanaryPromoted" in [e.reason for p in cluster.plans for e in p.events]


class Reader:
    def __init__(self, figures: Figures) -> None:
        self.figures = figures

    def __call__(self, pods: object, analysis: object, now: float) -> Sample:
        return Sample(now, figures=self.figures)


def test_the_inconclusive_count_survives_a_restart_and_a_new_canary_pod() -> None:
    analysis = inconclusive_spec({"trafficPercent": 20}).canary.analysis
    assert analysis is not None
    state = AnalysisState.start("v2@1", 0.0, analysis)
    for at in (2.0, 4.0, 6.0):
        state, _ = state.advance(Sample(at, figures=NO_TRAFFIC), analysis, "v1", "v2")
    back = AnalysisState.from_status(json.loads(json.dumps(state.to_status())))
    assert back is not None and (back.inconclusive, back.undecided_since) == (3, 0.0)
    moved = back.restart_window(7.0, analysis)
    assert (moved.inconclusive, moved.undecided_since) == (3, 0.0)
    assert moved.undecided(analysis, 6.0) is not None and moved.undecided(analysis, 60.0) is None


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        ({"onInconclusive": "wait"}, "onInconclusive must be one of"),
        ({"inconclusiveLimit": 0}, "inconclusiveLimit must be between"),
        ({"inconclusiveDeadlineSeconds": 0}, "inconclusiveDeadlineSeconds must be between"),
    ],
)
def test_inconclusive_settings_are_validated(settings: dict, problem: str) -> None:
    from model_operator.errors import SpecError

    with pytest.raises(SpecError, match=problem):
        inconclusive_spec({"trafficPercent": 20}, **settings)
