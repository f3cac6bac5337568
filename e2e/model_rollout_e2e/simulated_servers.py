"""Servers for simulated pods (operator tests without model processes): each listens on
its pod's own address and port 8000 and answers ``/metrics`` with the contract's
per-version series (``model_rollout_contract.canary``), written with prometheus_client
exactly as a server exports them. What they count is traffic the test makes up: each
version answers as its :class:`Behaviour` says, split between the two versions as the
pod's traffic policy says, the way a real server splits it.

They count as the model server does: a shadow run is one of the candidate's requests
(code 200, or 500 when it failed) with a shadow latency of its own, its outputs are
counted in the candidate's output series (NaN included, as a live answer's) and compared
with the stable ones (drift +Inf when either side is not finite). Which requests go
where is decided by counting, not by chance (every n-th request), so that what the
operator measures is known exactly."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from model_rollout_contract import canary
from model_rollout_contract.canary import TrafficPolicy
from model_rollout_contract.defaults import SERVER_PORT

OWNER = ("model", "version")


@dataclass(frozen=True)
class Behaviour:
    """How a version answers: its engine's time per run, the rest of a live request's
    time (queueing, JSON; a shadow run has none), every how many answers one is a 500
    (0: never), NaN values per answer, and how far its outputs are from the stable
    version's and whether their argmax agrees (seen on shadowed requests)."""

    latency_s: float = 0.010
    overhead_s: float = 0.0
    error_every: int = 0
    non_finite: int = 0
    drift: float = 0.0
    argmax_agrees: bool = True


class _Metrics:
    """The contract's series, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(canary.REQUESTS, "answers", [*OWNER, "code"], registry=r)
        self.latency = Histogram(canary.LATENCY, "answer time", OWNER, registry=r)
        self.values = Counter(canary.OUTPUT_VALUES, "output values", OWNER, registry=r)
        self.nonfinite = Counter(canary.OUTPUT_NONFINITE, "NaN or Inf", OWNER, registry=r)
        self.shadow = Counter(canary.SHADOW_REQUESTS, "mirrored", OWNER, registry=r)
        self.drift = Histogram(
            canary.SHADOW_DRIFT, "max abs diff", OWNER, buckets=canary.DRIFT_BUCKETS, registry=r
        )
        self.compared = Counter(canary.SHADOW_ARGMAX_COMPARED, "compared", OWNER, registry=r)
        self.agreed = Counter(canary.SHADOW_ARGMAX_AGREED, "agreed", OWNER, registry=r)
        self.shadow_latency = Histogram(canary.SHADOW_LATENCY, "shadow time", OWNER, registry=r)
        self.engine_latency = Histogram(canary.ENGINE_LATENCY, "engine time", OWNER, registry=r)


def _every(count: int, percent: int) -> bool:
    """Whether the ``count``-th event is one of ``percent`` % (spread evenly)."""
    return (count + 1) * percent // 100 > count * percent // 100


@dataclass
class SimulatedServer:
    """One pod's server as the operator sees it: ``/metrics`` at ``address:port``."""

    model: str
    address: str
    port: int = SERVER_PORT
    metrics: _Metrics = field(default_factory=_Metrics)
    answered: int = 0  # requests so far (the split counts them)
    stable_answers: int = 0
    per_version: dict[str, int] = field(default_factory=dict)  # answers (errors count them)
    live: dict[str, int] = field(default_factory=dict)  # answers a client got, per version
    _runner: web.AppRunner | None = None

    async def start(self) -> None:
        async def metrics(_: web.Request) -> web.Response:
            body = generate_latest(self.metrics.registry)
            return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.address, self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _fails(self, version: str, how: Behaviour) -> bool:
        """Whether this run of ``version`` fails (counted per version)."""
        n = self.per_version.get(version, 0)
        self.per_version[version] = n + 1
        return how.error_every > 0 and n % how.error_every == how.error_every - 1

    def live_answers(self, version: str) -> int:
        """How many clients got an answer of ``version`` (shadow runs are not answers)."""
        return self.live.get(version, 0)

    def _answer(self, version: str, how: Behaviour) -> None:
        m = self.metrics
        self.live[version] = self.live.get(version, 0) + 1
        failed = self._fails(version, how)
        m.requests.labels(self.model, version, "500" if failed else "200").inc()
        m.latency.labels(self.model, version).observe(how.latency_s + how.overhead_s)
        if not failed:  # the server times an engine's successful runs only
            m.engine_latency.labels(self.model, version).observe(how.latency_s)
            m.values.labels(self.model, version).inc(10)
            m.nonfinite.labels(self.model, version).inc(how.non_finite)

    def _shadow(self, candidate: str, stable: Behaviour, how: Behaviour) -> None:
        m = self.metrics
        m.shadow.labels(self.model, candidate).inc()
        if self._fails(candidate, how):
            m.requests.labels(self.model, candidate, "500").inc()
            return
        m.shadow_latency.labels(self.model, candidate).observe(how.latency_s)
        m.engine_latency.labels(self.model, candidate).observe(how.latency_s)
        m.requests.labels(self.model, candidate, "200").inc()
        m.values.labels(self.model, candidate).inc(10)  # as the server's candidate.infer
        m.nonfinite.labels(self.model, candidate).inc(how.non_finite)
        finite = not (how.non_finite or stable.non_finite)
        drift = abs(how.drift - stable.drift) if finite else float("inf")
        m.drift.labels(self.model, candidate).observe(drift)
        m.compared.labels(self.model, candidate).inc()
        if how.argmax_agrees:
            m.agreed.labels(self.model, candidate).inc()

    def serve(
        self,
        serving: str,
        policy: TrafficPolicy | None,
        behaviours: dict[str, Behaviour],
        requests: int,
    ) -> None:
        """Answer ``requests`` requests, as the pod's server would under ``policy`` (a
        policy for another candidate than the one served is not applied, as the
        server refuses it)."""
        if policy is not None and policy.candidate != serving:
            policy = None
        for _ in range(requests):
            n = self.answered
            self.answered += 1
            if policy is None:
                self._answer(serving, behaviours.get(serving, Behaviour()))
                continue
            if _every(n, policy.traffic_percent):
                self._answer(policy.candidate, behaviours.get(policy.candidate, Behaviour()))
                continue
            stable = behaviours.get(policy.stable, Behaviour())
            self._answer(policy.stable, stable)
            if _every(self.stable_answers, policy.shadow_percent):
                how = behaviours.get(policy.candidate, Behaviour())
                self._shadow(policy.candidate, stable, how)
            self.stable_answers += 1
