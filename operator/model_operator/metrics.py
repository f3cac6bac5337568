"""The operator's own Prometheus metrics, served on ``--metrics-port``."""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from model_rollout_contract.states import Phase

# of every metric the operator serves (Prometheus naming: tests/test_metric_names.py)
PREFIX = "model_operator_"
PASS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.pass_seconds = Histogram(
            "model_operator_reconcile_duration_seconds",
            "One observe-plan-act pass of a ModelDeployment",
            ["namespace", "name"],
            buckets=PASS_BUCKETS,
            registry=r,
        )
        self.api_errors = Counter(
            "model_operator_api_errors",
            "Kubernetes API calls that failed (status 0: not reached)",
            ["status"],
            registry=r,
        )
        self.phase = Gauge(
            "model_operator_deployment_phase",
            "1 for the phase each ModelDeployment is in",
            ["namespace", "name", "phase"],
            registry=r,
        )
        self.pods = Gauge(
            "model_operator_deployment_pods",
            "Pods of a ModelDeployment by the version they serve",
            ["namespace", "name", "version"],
            registry=r,
        )
        self._versions: dict[tuple[str, str], set[str]] = {}

    def observe(self, namespace: str, name: str, phase: str, versions: Mapping[str, int]) -> None:
        for candidate in Phase:
            self.phase.labels(namespace, name, candidate.value).set(
                1 if candidate.value == phase else 0
            )
        before = self._versions.get((namespace, name), set())
        for gone in before - set(versions):  # no stale series for versions no pod serves
            self.pods.remove(namespace, name, gone)
        for version, count in versions.items():
            self.pods.labels(namespace, name, version).set(count)
        self._versions[(namespace, name)] = set(versions)

    async def serve(self, port: int) -> web.AppRunner:
        async def handle(request: web.Request) -> web.Response:
            body = generate_latest(self.registry)
            return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

        app = web.Application()
        app.router.add_get("/metrics", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "0.0.0.0", port).start()
        return runner
