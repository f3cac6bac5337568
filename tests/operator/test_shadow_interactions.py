"""The canary's shadow step together with ``spec.paused``, ``promote --full``, a scaler's
pods and operator restarts (three features written apart, judged together): the planner
as a pure function on the simulated cluster of ``test_shadow_step.py``."""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path

import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st

from model_operator.analysis import AnalysisState, Sample
from model_operator.canary_metrics import Figures
from model_operator.errors import SpecError
from model_operator.planner import BATCHES, CANARY, FAILED, Plan
from model_operator.spec import ModelDeploymentSpec, parse_spec
from model_operator.status import build_status, rollout_from_status
from model_rollout_cli.view import canary_step_text
from model_rollout_contract.annotations import full_promotion_id
from model_rollout_contract.canary import TrafficPolicy
from model_rollout_contract.states import CanaryStep, Phase
from model_rollout_e2e.simulation import SimCluster, SimPod
from tests.operator.test_shadow_step import (
    ANALYSIS,
    BASE,
    LIVE_ERRORS,
    LIVE_GOOD,
    SHADOW_GOOD,
    SHADOW_NAN,
)
from tests.support.crd_validation import ResourceSchema

ROOT = Path(__file__).resolve().parents[2]
FEW = Figures(3, 0, 3, 30, 0.01, 0.01, None, None, 0)  # too few requests: inconclusive
FIGURES = {"good": (SHADOW_GOOD, LIVE_GOOD), "bad": (SHADOW_NAN, LIVE_ERRORS), "few": (FEW, FEW)}


def spec(replicas: int = 4, paused: bool = False, **canary: object) -> ModelDeploymentSpec:
    settings_ = {"percent": 25, "pauseSeconds": 2, "trafficPercent": 20, "analysis": ANALYSIS}
    rollout = {"batchSize": 1, "jitterSeconds": 2, "progressDeadlineSeconds": 30,
               "maxConcurrentLoads": 2}  # fmt: skip
    raw = {**BASE, "replicas": replicas, "paused": paused, "rollout": rollout}
    return parse_spec({**raw, "canary": {**settings_, **canary}})


def restart(cluster: SimCluster, plan: Plan) -> None:
    """The operator restarted: what it knows is what ``.status`` kept, as JSON."""
    status = json.loads(json.dumps(build_status(
        plan, [p.view() for p in cluster.pods], len(cluster.pods), 1, cluster.now, [],
        signing_key="k")))  # fmt: skip
    cluster.state = rollout_from_status(status["rollout"])
    cluster.analysis = AnalysisState.from_status(status.get("analysis"))


def live_share(pod: SimPod) -> bool:
    """Does this pod let the candidate answer users (``v2`` is the candidate)?"""
    if pod.target != "v2":
        return False
    return pod.policy is None or TrafficPolicy.from_annotation(pod.policy).traffic_percent > 0


def until_shadow(cluster: SimCluster, sp: ModelDeploymentSpec, figures: Figures) -> Plan:
    read = lambda pods, analysis, now: Sample(now, figures=figures)  # noqa: E731
    for _ in range(30):
        plan = cluster.step(sp, read=read)
        if plan.reason == "ShadowAnalysis":
            return plan
    raise AssertionError(cluster.plans[-1])


def test_an_abort_after_a_full_promotion_in_the_shadow_step_does_not_say_no_user_saw_it() -> None:
    """promote --full skips the shadow step: the candidate then answers users in the
    batches, so a later rollback must not say that no user got an answer of it."""
    cluster = SimCluster(4, "v1")
    sp = spec()
    plan = until_shadow(cluster, sp, FEW)
    full = full_promotion_id("v2", plan.state.started_at)
    plan = cluster.step(sp, promoted=full)
    assert plan.state.full and plan.state.stage == BATCHES
    assert "the shadow step" in plan.events[0].message, plan.events[0].message
    while not any(live_share(p) for p in cluster.pods if p.serving == "v2"):
        plan = cluster.step(sp, delay=3)
    plan = cluster.step(sp, aborted="v2")
    status = build_status(plan, [p.view() for p in cluster.pods], 4, 1, cluster.now, [],
                          signing_key="k")  # fmt: skip
    said = canary_step_text(status["rollout"]) or ""
    assert "no user got an answer" not in said, said
    assert status["rollout"]["shadowResult"].startswith("skipped: fully promoted")


def test_a_pod_added_while_paused_in_the_batches_is_pointed_at_the_stable_version() -> None:
    """A pause holds the target's exposure where it is: a scaler's new pod pre-pulls the
    stable version meanwhile, and moves in a batch once resumed."""
    cluster = SimCluster(2, "v1")
    sp = spec(2, shadow={"enabled": False}, analysis=None)
    plan = cluster.step(sp)
    while plan.state.stage != BATCHES:
        plan = cluster.step(sp)
    cluster.pods.append(SimPod("pod-new"))
    plan = cluster.step(spec(3, paused=True, shadow={"enabled": False}, analysis=None))
    assert plan.reason == "Paused"
    assert [(a.pod, a.version) for a in plan.actions if a.pod == "pod-new"] == [("pod-new", "v1")]
    plan = cluster.run(spec(3, shadow={"enabled": False}, analysis=None))
    assert plan.phase is Phase.AVAILABLE and cluster.serving() == {"v2": 3}


EVENTS = st.sampled_from(
    ["pause", "resume", "full", "up", "down", "restart", "abort", "retry", "-"]
)


@settings(max_examples=150, deadline=None)
@given(
    events=st.lists(st.tuples(st.integers(0, 30), EVENTS), max_size=8),
    checks=st.lists(st.sampled_from(sorted(FIGURES)), min_size=1, max_size=10),
    manual=st.booleans(),
    whole_pods=st.booleans(),
    replicas=st.integers(2, 8),
    seed=st.integers(0, 1000),
)
# paused in the shadow step before its check passes; scaled up then, and restarted
@example(
    events=[(5, "pause")],
    checks=["few", "few", "good"],
    manual=False,
    whole_pods=False,
    replicas=4,
    seed=0,
)
@example(
    events=[(5, "pause"), (6, "up"), (7, "restart"), (9, "down")],
    checks=["few", "bad", "few", "good"],
    manual=True,
    whole_pods=True,
    replicas=4,
    seed=1,
)
def test_pause_full_promotion_scaling_and_restarts_around_the_shadow_step(
    events: list[tuple[int, str]],
    checks: list[str],
    manual: bool,
    whole_pods: bool,
    replicas: int,
    seed: int,
) -> None:
    """Whatever interleaving of pause/resume, full promotion, scale up/down, abort, retry,
    operator restarts and check results (passed, failed, inconclusive): no pod gives the
    candidate a live share before a passed shadow check unless a full promotion was
    asked; maxConcurrentLoads holds; nothing new starts while paused; and once resumed
    with checks that conclude, the rollout ends."""
    cluster = SimCluster(replicas, "v1", seed=seed)
    canary = {"manualPromote": manual, "trafficPercent": 0 if whole_pods else 20}
    seen: list[str] = []

    def read(pods: object, analysis: object, now: float) -> Sample:
        verdict = checks[len(seen)] if len(seen) < len(checks) else "good"
        seen.append(verdict)
        state = cluster.state
        shadow = state is not None and state.canary_step is CanaryStep.SHADOW
        return Sample(now, figures=FIGURES[verdict][0 if shadow else 1])

    paused = asked_full = passed = False
    at = dict(events)
    for tick in range(600):
        event = at.get(tick, "-")
        promoted = aborted = retried = None
        state = cluster.state
        if event in ("pause", "resume"):
            paused = event == "pause"
        elif event == "full" and state is not None:
            promoted = full_promotion_id("v2", state.started_at)
        elif event == "abort":
            aborted = "v2"
        elif event == "retry":
            retried = "v2"
        elif event == "up":
            cluster.pods.append(SimPod(f"pod-new{tick:03d}"))
        elif event == "down" and len(cluster.pods) > 1:
            cluster.pods.pop(seed % len(cluster.pods))
        if tick > 60:
            paused = False
        if manual and promoted is None and state is not None:
            promoted = state.promotion
        sp = spec(len(cluster.pods), paused, **canary)
        before = {p.name: p.target for p in cluster.pods}
        plan = cluster.step(
            sp, promoted=promoted, aborted=aborted, retried=retried, read=read, delay=2
        )
        if state is not None and plan.state.started_at != state.started_at:
            asked_full = passed = False  # a retry: a rollout of its own
        if event == "restart":
            restart(cluster, plan)
        reasons = [e.reason for e in plan.events]
        asked_full |= promoted is not None and promoted.endswith("+full") and not paused
        passed |= "ShadowPassed" in reasons
        live = [p.name for p in cluster.pods if live_share(p)]
        assert passed or asked_full or not live, (tick, live, plan.reason, plan.message)
        assert cluster.max_loads <= 2, tick
        if paused and plan.state.stage in (CANARY, BATCHES) and not plan.state.fast:
            moved = [a.pod for a in plan.actions if a.version == "v2" and before[a.pod] != "v2"]
            assert not moved, (tick, moved, plan.message)
            started = {"CanaryStarted", "ShadowPassed", "CanaryPromoted", "BatchStarted"}
            assert not started & set(reasons), (tick, reasons)
        if tick > 60 and (plan.state.stage == FAILED or plan.phase is Phase.AVAILABLE):
            break
    else:
        raise AssertionError(f"no end: {cluster.plans[-1]}")
    if plan.phase is Phase.AVAILABLE:
        assert cluster.serving() == {"v2": len(cluster.pods)}
    if plan.state.stage == FAILED and plan.state.rolled_back:
        for _ in range(10):
            cluster.step(replace(sp, paused=False))
        assert all(p.target == "v1" and p.policy is None for p in cluster.pods)


@functools.cache
def crd_schema() -> ResourceSchema:
    return ResourceSchema.load(ROOT / "deploy" / "crds" / "modeldeployment.yaml")


@settings(max_examples=200, deadline=None)
@given(
    percent=st.sampled_from([None, 0, 25]),
    analysis=st.booleans(),
    retain=st.sampled_from([None, 1, 2]),
    shadow=st.sampled_from([None, {}, {"enabled": True}, {"enabled": False},
                            {"percent": 50}, {"enabled": True, "percent": 100}]),
    traffic=st.sampled_from([None, 0, 20]),
    mirrored=st.sampled_from([None, 0, 10]),
    manual=st.sampled_from([None, True]),
    paused=st.sampled_from([None, True, False]),
)  # fmt: skip
def test_the_crd_and_the_operator_refuse_the_same_shadow_and_pause_specs(
    percent: int | None,
    analysis: bool,
    retain: int | None,
    shadow: dict[str, object] | None,
    traffic: int | None,
    mirrored: int | None,
    manual: bool | None,
    paused: bool | None,
) -> None:
    """The API server's schema and CEL rules, and the operator's own parse, accept and
    refuse the same combinations of the canary's steps, its shares and ``spec.paused``."""
    [doc] = yaml.safe_load_all((ROOT / "examples" / "modeldeployment.yaml").read_text())
    fields = {
        "percent": percent,
        "trafficPercent": traffic,
        "shadowPercent": mirrored,
        "manualPromote": manual,
        "shadow": shadow,
        "analysis": {"intervalSeconds": 2, "minRequests": 10} if analysis else None,
    }
    canary = {k: v for k, v in fields.items() if v is not None}
    doc["spec"] = {k: v for k, v in doc["spec"].items() if k not in ("canary", "retainVersions")}
    doc["spec"].update({"canary": canary, **({} if retain is None else {"retainVersions": retain}),
                        **({} if paused is None else {"paused": paused})})  # fmt: skip
    schema = crd_schema()
    refused_by_crd = schema.problems(doc)
    try:
        parse_spec(schema.stored(doc)["spec"])
        refused_by_operator: list[str] = []
    except SpecError as error:
        refused_by_operator = error.problems
    assert bool(refused_by_crd) == bool(refused_by_operator), (refused_by_crd, refused_by_operator)


def test_a_pause_in_the_shadow_step_does_not_say_the_canary_pods_serve_the_candidate() -> None:
    """In the shadow step every user gets the stable version's answer: the paused message
    says the canary pods hold the candidate, and that it answers only mirrored requests."""
    cluster = SimCluster(4, "v1")
    until_shadow(cluster, spec(), FEW)
    plan = cluster.step(spec(paused=True))
    assert plan.reason == "Paused" and "1/4 pods serve v2" not in plan.message, plan.message
    assert "1/4 pods hold v2 (it answers only mirrored requests)" in plan.message, plan.message
