"""The sidecar's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class SidecarMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.fetches = Counter(
            "sidecar_fetch", "Version fetches by result", ["model", "result"], registry=r
        )
        self.refusals = Counter(
            "sidecar_refusal", "Versions refused, by reason", ["model", "reason"], registry=r
        )
        self.fetch_seconds = Histogram(
            "sidecar_fetch_duration_seconds", "Download + verify time", ["model"], registry=r
        )
        self.bytes = Counter("sidecar_downloaded_bytes", "Bytes downloaded", ["model"], registry=r)
        self.swaps = Counter(
            "sidecar_swap",
            "Swaps requested from the server, by result",
            ["model", "result"],
            registry=r,
        )
        self.policies = Counter(
            "sidecar_traffic_policy",
            "Traffic-policy messages to the server, by result (set, cleared, error)",
            ["model", "result"],
            registry=r,
        )
        self.downloads = Gauge(
            "sidecar_downloads_in_progress",
            "Store transfers streaming now (bounded by --max-concurrent-downloads)",
            ["model"],
            registry=r,
        )
        self.serving = Gauge(
            "sidecar_serving_version",
            "1 for the version the server serves",
            ["model", "version"],
            registry=r,
        )
