"""Prometheus metrics of one server, in their own registry (several servers per process
in tests must not collide).

What is loaded (``current_model_version``, ``model_versions_loaded``,
``model_memory_bytes``) is read from the slots at each scrape, so the series always
describe the versions in memory now: an unloaded version has no series left, and a
version evicted or refused is never counted. The per-version request, output and shadow
series of canary analysis are gathered the same way (:mod:`.version_metrics`)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class VersionRow(NamedTuple):
    model: str
    version: str
    serving: bool
    memory_bytes: int


class LoadedVersions(Collector):
    """The per-version gauges, computed from what ``rows`` says is loaded."""

    def __init__(self, rows: Callable[[], Iterable[VersionRow]]) -> None:
        self.rows = rows

    def collect(self) -> Iterator[Metric]:
        current = GaugeMetricFamily(
            "current_model_version",
            "1 for the version serving each model, 0 for the retained ones",
            labels=["model", "version"],
        )
        loaded = GaugeMetricFamily(
            "model_versions_loaded",
            "Versions held in memory (serving + retained)",
            labels=["model"],
        )
        memory = GaugeMetricFamily(
            "model_memory_bytes", "Estimated memory held by loaded versions", labels=["model"]
        )
        counts: dict[str, int] = defaultdict(int)
        held: dict[str, int] = defaultdict(int)
        for row in self.rows():
            current.add_metric([row.model, row.version], 1.0 if row.serving else 0.0)
            counts[row.model] += 1
            held[row.model] += row.memory_bytes
        for model in sorted(counts):
            loaded.add_metric([model], counts[model])
            memory.add_metric([model], held[model])
        yield from (current, loaded, memory)


LOAD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
BATCH_SIZE_BUCKETS = tuple(float(2**i) for i in range(13))  # 1 to 4096 rows


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
        self.batch_size = Histogram(
            "inference_batch_size",
            "Rows per engine run under dynamic batching (a batch, or a request run alone)",
            ["model"],
            buckets=BATCH_SIZE_BUCKETS,
            registry=r,
        )

    def watch_versions(self, rows: Callable[[], Iterable[VersionRow]]) -> None:
        """Report the loaded versions that ``rows`` yields at every scrape."""
        self.registry.register(LoadedVersions(rows))

    def watch_version_series(self, collector: Collector) -> None:
        """Report the per-version series (``version_metrics.VersionSeries``)."""
        self.registry.register(collector)
