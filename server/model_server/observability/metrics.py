"""Prometheus metrics of one server, in their own registry (several servers per process
in tests must not collide).

What is loaded (``model_server_version_serving``, ``model_server_versions_loaded``,
``model_server_memory_bytes``) is read from the slots at each scrape, so the series always
describe the versions in memory now: an unloaded version has no series left, and a
version evicted or refused is never counted. The per-version request, output and shadow
series of canary analysis are gathered the same way (:mod:`.version_metrics`), and so
are the per-tenant sums of the request series (:class:`TenantRequests`)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from model_rollout_contract.names import ModelKey


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
            "model_server_version_serving",
            "1 for the version serving each model, 0 for the retained ones",
            labels=["model", "version"],
        )
        loaded = GaugeMetricFamily(
            "model_server_versions_loaded",
            "Versions held in memory (serving + retained)",
            labels=["model"],
        )
        memory = GaugeMetricFamily(
            "model_server_memory_bytes",
            "Estimated memory held by loaded versions",
            labels=["model"],
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


class TenantRequests(Collector):
    """``model_server_tenant_inference_requests_total{tenant,code}`` and
    ``model_server_tenant_inference_request_duration_seconds{tenant}``: the per-model
    request counter and latency histogram summed by tenant at each scrape (a tenant's
    models are keyed ``tenant/name``; ``""`` is the default namespace). Summed rather than
    a ``tenant`` label added to the per-model series, whose label sets dashboards and the
    canary analysis match exactly; the label's values are the configured tenants only (any
    other prefix, as an unauthenticated caller's name may carry, counts under ``""``), so
    its cardinality is the configuration's."""

    def __init__(self, requests: Counter, latency: Histogram, tenants: Collection[str]) -> None:
        self.requests = requests
        self.latency = latency
        self.tenants = frozenset(tenants)

    def _tenant_label(self, model_key: str) -> str:
        tenant = ModelKey.tenant_in(model_key)
        return tenant if tenant in self.tenants else ""

    def collect(self) -> Iterator[Metric]:
        counts: dict[tuple[str, str], float] = defaultdict(float)
        for family in self.requests.collect():
            for s in family.samples:
                if s.name.endswith("_total"):
                    counts[(self._tenant_label(s.labels["model"]), s.labels["code"])] += s.value
        requests = CounterMetricFamily(
            "model_server_tenant_inference_requests",
            "Inference requests by tenant and result",
            labels=["tenant", "code"],
        )
        for (tenant, code), value in sorted(counts.items()):
            requests.add_metric([tenant, code], value)
        buckets: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        sums: dict[str, float] = defaultdict(float)
        for family in self.latency.collect():
            for s in family.samples:
                tenant = self._tenant_label(s.labels["model"])
                if s.name.endswith("_bucket"):
                    buckets[tenant][s.labels["le"]] += s.value  # same bounds for every model
                elif s.name.endswith("_sum"):
                    sums[tenant] += s.value
        latency = HistogramMetricFamily(
            "model_server_tenant_inference_request_duration_seconds",
            "Inference request latency by tenant",
            labels=["tenant"],
        )
        for tenant in sorted(buckets):
            latency.add_metric([tenant], list(buckets[tenant].items()), sums[tenant])
        yield from (requests, latency)


# of every metric the server serves (Prometheus naming: tests/contract/test_metric_names.py)
PREFIX = "model_server_"
LOAD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
BATCH_SIZE_BUCKETS = tuple(float(2**i) for i in range(13))  # 1 to 4096 rows


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.reload_success = Counter(
            "model_server_reload_success", "Versions swapped in successfully", ["model"], registry=r
        )
        self.reload_failure = Counter(
            "model_server_reload_failure",
            "Loads refused; the old version kept serving",
            ["model", "reason"],
            registry=r,
        )
        self.load_duration = Histogram(
            "model_server_load_duration_seconds",
            "Load + verify + warm-up time of a new version",
            ["model"],
            buckets=LOAD_BUCKETS,
            registry=r,
        )
        self.load_stage_duration = Histogram(
            "model_server_load_stage_duration_seconds",
            "Time of each stage of a load (read, hash, engine, warm-up, swap, ...)",
            ["model", "stage"],
            buckets=LOAD_BUCKETS,
            registry=r,
        )
        self.request_latency = Histogram(
            "model_server_inference_request_duration_seconds",
            "Inference request latency",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "model_server_inference_requests",
            "Inference requests by result",
            ["model", "code"],
            registry=r,
        )
        self.in_flight = Gauge(
            "model_server_inference_requests_in_flight",
            "Inference requests being served",
            ["model"],
            registry=r,
        )
        self.batch_size = Histogram(
            "model_server_inference_batch_rows",
            "Rows per engine run under dynamic batching (a batch, or a request run alone)",
            ["model"],
            buckets=BATCH_SIZE_BUCKETS,
            registry=r,
        )

        self.rate_limited = Counter(
            "model_server_tenant_rate_limited",
            "Inference requests refused (429) for their tenant's rate limit",
            ["tenant"],
            registry=r,
        )

    def watch_tenants(self, tenants: Collection[str], limited: Collection[str]) -> None:
        """Report the per-tenant request sums of ``tenants``, and ``rate_limited`` from
        zero for each tenant with a rate limit (so that ``increase()`` sees the first)."""
        self.registry.register(TenantRequests(self.requests, self.request_latency, tenants))
        for tenant in limited:
            self.rate_limited.labels(tenant)

    def watch_versions(self, rows: Callable[[], Iterable[VersionRow]]) -> None:
        """Report the loaded versions that ``rows`` yields at every scrape."""
        self.registry.register(LoadedVersions(rows))

    def watch_version_series(self, collector: Collector) -> None:
        """Report the per-version series (``version_metrics.VersionSeries``)."""
        self.registry.register(collector)
