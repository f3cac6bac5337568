"""The operator's own Prometheus metrics, served on ``--metrics-port``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from model_rollout_contract.states import ConditionType, Phase

from .analysis import Result

# of every metric the operator serves (Prometheus naming: tests/contract/test_metric_names.py)
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
        # the chart's dashboard and alerts read these (deploy/helm/model-rollout/files/)
        self.batch = Gauge(
            "model_operator_rollout_batch",
            "The batch the running rollout of a ModelDeployment is on (0: canary or none)",
            ["namespace", "name"],
            registry=r,
        )
        self.analysis_checks = Gauge(
            "model_operator_analysis_checks",
            "Checks the canary analysis of the current (or last) rollout has made",
            ["namespace", "name"],
            registry=r,
        )
        self.analysis_failures = Gauge(
            "model_operator_analysis_failures",
            "Of those checks, the ones that failed",
            ["namespace", "name"],
            registry=r,
        )
        self.analysis_result = Gauge(
            "model_operator_analysis_last_result",
            "1 for the canary analysis' last verdict (Passed, Failed, Inconclusive)",
            ["namespace", "name", "result"],
            registry=r,
        )
        self.degraded = Gauge(
            "model_operator_deployment_degraded",
            "1 while a ModelDeployment's Degraded condition is true, by its reason"
            " (AnalysisFailed, Aborted, RolloutFailed, InvalidSpec, ...)",
            ["namespace", "name", "reason"],
            registry=r,
        )
        self._versions: dict[tuple[str, str], set[str]] = {}
        self._reasons: dict[tuple[str, str], str] = {}

    def observe(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        """The gauges of one ModelDeployment, from the ``.status`` a pass wrote."""
        phase = str(status.get("phase"))
        versions: Mapping[str, int] = status.get("versions") or {}
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
        self.batch.labels(namespace, name).set((status.get("rollout") or {}).get("batch") or 0)
        analysis = status.get("analysis") or {}
        self.analysis_checks.labels(namespace, name).set(analysis.get("checks", 0))
        self.analysis_failures.labels(namespace, name).set(analysis.get("failures", 0))
        for result in Result:
            verdict = 1 if analysis.get("lastResult") == result.value else 0
            self.analysis_result.labels(namespace, name, result.value).set(verdict)
        self._observe_degraded(namespace, name, status.get("conditions") or [])

    def forget(self, namespace: str, name: str) -> None:
        """Remove every series of a ModelDeployment that is gone: left behind, its last
        phase (Degraded, say) would keep the chart's alerts firing for nothing."""
        key = (namespace, name)
        per_deployment = (self.pass_seconds, self.batch, self.analysis_checks)
        for metric in (*per_deployment, self.analysis_failures):
            metric.remove(namespace, name)
        for phase in Phase:
            self.phase.remove(namespace, name, phase.value)
        for result in Result:
            self.analysis_result.remove(namespace, name, result.value)
        for version in self._versions.pop(key, set()):
            self.pods.remove(namespace, name, version)
        reason = self._reasons.pop(key, None)
        if reason is not None:
            self.degraded.remove(namespace, name, reason)

    def _observe_degraded(self, namespace: str, name: str, conditions: list[Any]) -> None:
        reason = next(
            (
                str(c.get("reason") or "Unknown")
                for c in conditions
                if c.get("type") == ConditionType.DEGRADED and c.get("status") == "True"
            ),
            None,
        )
        before = self._reasons.pop((namespace, name), None)
        if before is not None and before != reason:
            self.degraded.remove(namespace, name, before)
        if reason is not None:
            self.degraded.labels(namespace, name, reason).set(1)
            self._reasons[(namespace, name)] = reason

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
