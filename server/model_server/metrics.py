"""Prometheus metrics of one server, in their own registry (several servers per process
in tests must not collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LOAD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.reload_success = Counter(
            "model_reload_success", "Versions swapped in successfully", ["model"], registry=r
        )
        self.reload_failure = Counter(
            "model_reload_failure",
            "Loads refused; the old version kept serving",
            ["model", "reason"],
            registry=r,
        )
        self.load_duration = Histogram(
            "model_load_duration_seconds",
            "Load + verify + warm-up time of a new version",
            ["model"],
            buckets=LOAD_BUCKETS,
            registry=r,
        )
        self.current_version = Gauge(
            "current_model_version",
            "1 for the version serving each model",
            ["model", "version"],
            registry=r,
        )
        self.versions_loaded = Gauge(
            "model_versions_loaded",
            "Versions held in memory (serving + retained)",
            ["model"],
            registry=r,
        )
        self.memory_bytes = Gauge(
            "model_memory_bytes", "Estimated memory held by loaded versions", ["model"], registry=r
        )
        self.request_latency = Histogram(
            "inference_request_duration_seconds",
            "Inference request latency",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "inference_requests", "Inference requests by result", ["model", "code"], registry=r
        )
        self.in_flight = Gauge(
            "inference_requests_in_flight",
            "Inference requests being served",
            ["model"],
            registry=r,
        )

    def serving(self, model: str, version: str, previous: str | None) -> None:
        if previous is not None and previous != version:
            self.current_version.labels(model, previous).set(0)
        self.current_version.labels(model, version).set(1)
