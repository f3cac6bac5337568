"""Rollouts simulated on a virtual clock with the real planner (what-if tooling, the
scale benchmark and the planner's property tests share it).

Each pod starts loading its new target when it first sees it and serves it after
``load_seconds(pod, version)``; versions in ``refuse`` are refused, as a sidecar refuses
a badly signed engine. With ``spec.canary.analysis``, ``step``'s ``read`` measures the
canary when a check is due (as the operator's handlers do), and the analysis' state is
kept between steps as ``.status.analysis`` keeps it.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from model_operator.analysis import AnalysisState, Sample
from model_operator.planner import COMPLETE, FAILED, Plan, RolloutState, analysing, plan_rollout
from model_operator.pods import PodView
from model_operator.spec import ModelDeploymentSpec
from model_rollout_contract.states import SidecarState


@dataclass
class SimPod:
    name: str
    target: str | None = None
    serving: str | None = None
    reported: str | None = None
    state: SidecarState = SidecarState.OK
    ready: bool = True
    done_at: float | None = None
    retained: tuple[str, ...] = ()  # what its server holds besides the serving version
    seen_at: float | None = None  # when its sidecar saw the reported target
    policy: str | None = None  # its traffic policy annotation

    def view(self) -> PodView:
        refused = self.state is SidecarState.REFUSED
        reason = "bad_signature: simulated refusal" if refused else None
        return PodView(
            self.name,
            self.target,
            self.serving,
            self.reported,
            self.state,
            reason,
            self.ready,
            self.retained,
            self.seen_at,
            policy=self.policy,
        )

    @property
    def loading(self) -> bool:
        refused = self.state is SidecarState.REFUSED
        return self.target is not None and self.target != self.serving and not refused

    @property
    def fetching(self) -> bool:
        """Loading a version its server does not hold (not a pointer swap): a load, what
        ``maxConcurrentLoads`` caps."""
        return self.loading and self.target not in self.retained


class SimCluster:
    def __init__(
        self,
        replicas: int,
        version: str | None = "v1",
        load_seconds: Callable[[str, str], float] = lambda pod, version: 1.0,
        refuse: frozenset[str] = frozenset(),
        seed: int = 1,
        retain: int = 2,
    ) -> None:
        self.retain = retain  # versions each server holds, the serving one included
        self.pods = [SimPod(f"pod-{i:03d}", version, version, version) for i in range(replicas)]
        self.load_seconds = load_seconds
        self.refuse = refuse
        self.stable: str | None = version
        self.previous: str | None = None
        self.state: RolloutState | None = RolloutState(version, None, COMPLETE) if version else None
        self.now = 1000.0
        self.rng = random.Random(seed)
        self.plans: list[Plan] = []
        self.max_loading = 0  # pods waiting for their target, pointer swaps included
        self.max_loads = 0  # pods loading a version their server does not hold
        self.analysis: AnalysisState | None = None

    def step(
        self,
        spec: ModelDeploymentSpec,
        promoted: str | None = None,
        delay: float | None = None,
        dt: float = 1.0,
        read: Callable[[list[PodView], AnalysisState, float], Sample] | None = None,
        aborted: str | None = None,
        retried: str | None = None,
    ) -> Plan:
        """``read(pods, analysis, now)``: what the operator reads of the canary;
        ``aborted``, ``retried``: the abort and retry annotations' values."""
        views = [p.view() for p in self.pods]
        held = analysing(spec, self.state, self.analysis)
        due = held is not None and held.due(self.now) and read is not None
        sample = read(views, held, self.now) if due and read and held else None
        plan = plan_rollout(
            spec,
            self.stable,
            self.previous,
            self.state,
            views,
            self.now,
            self.rng,
            promoted,
            self.analysis,
            sample,
            aborted_version=aborted,
            retried_version=retried,
        )
        self.analysis = plan.analysis
        by_name = {p.name: p for p in self.pods}
        for action in plan.actions:
            by_name[action.pod].target = action.version
            by_name[action.pod].policy = action.policy
        self.state, self.stable, self.previous = (
            plan.state,
            plan.stable_version,
            plan.previous_version,
        )
        self.plans.append(plan)
        self.max_loading = max(self.max_loading, sum(p.loading for p in self.pods))
        self.max_loads = max(self.max_loads, sum(p.fetching for p in self.pods))
        self.now += dt
        for pod in self.pods:
            self._advance(pod, delay)
        return plan

    def _advance(self, pod: SimPod, delay: float | None) -> None:
        if pod.target is None:
            return
        if pod.target == pod.serving:  # the sidecar reports it already serves the target
            pod.reported, pod.state, pod.done_at = pod.target, SidecarState.OK, None
            return
        if pod.reported != pod.target:
            duration = delay if delay is not None else self.load_seconds(pod.name, pod.target)
            if pod.target in pod.retained:
                duration = 0.0  # a pointer swap: the server still holds it
            pod.reported, pod.state, pod.seen_at = pod.target, SidecarState.LOADING, self.now
            pod.done_at = self.now + duration
        if pod.target in self.refuse:
            pod.state = SidecarState.REFUSED
        elif pod.done_at is not None and self.now >= pod.done_at:
            held = (*pod.retained, pod.serving) if pod.serving else pod.retained
            kept = tuple(v for v in held if v != pod.target)
            pod.retained = kept[-(self.retain - 1) :] if self.retain > 1 else ()  # [-0:] keeps all
            pod.serving, pod.state, pod.done_at = pod.target, SidecarState.OK, None

    def run(
        self, spec: ModelDeploymentSpec, limit: int = 100_000, **kw: float | str | None
    ) -> Plan:
        for _ in range(limit):
            plan = self.step(spec, **kw)  # type: ignore[arg-type]
            if (
                plan.state.stage in (COMPLETE, FAILED)
                and not plan.actions
                and plan.phase in ("Available", "Degraded")
            ):
                return plan
        raise RuntimeError(f"rollout did not end within {limit} steps: {self.plans[-1]}")

    def replace_pod(self, name: str) -> SimPod:
        """The pod is deleted; the Deployment creates a fresh one (no target, nothing
        loaded until the operator points it somewhere)."""
        self.pods = [p for p in self.pods if p.name != name]
        fresh = SimPod(f"pod-r{len(self.plans):05d}-{name}", None, None, None)
        self.pods.append(fresh)
        return fresh

    def serving(self) -> dict[str, int]:
        return dict(Counter(p.serving or "-" for p in self.pods))
