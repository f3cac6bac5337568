"""The sidecar's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# of every metric the sidecar serves (Prometheus naming: tests/contract/test_metric_names.py)
PREFIX = "model_sidecar_"


class SidecarMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.fetches = Counter(
            "model_sidecar_fetches", "Version fetches by result", ["model", "result"], registry=r
        )
        self.refusals = Counter(
            "model_sidecar_refusals", "Versions refused, by reason", ["model", "reason"], registry=r
        )
        self.fetch_seconds = Histogram(
            "model_sidecar_fetch_duration_seconds", "Download + verify time", ["model"], registry=r
        )
        self.bytes = Counter(
            "model_sidecar_downloaded_bytes", "Bytes downloaded", ["model"], registry=r
        )
        self.swaps = Counter(
            "model_sidecar_swaps",
            "Swaps requested from the server, by result",
            ["model", "result"],
            registry=r,
        )
        self.policies = Counter(
            "model_sidecar_traffic_policy_messages",
            "Traffic-policy messages to the server, by result (set, cleared, error)",
            ["model", "result"],
            registry=r,
        )
        self.downloads = Gauge(
            "model_sidecar_downloads_in_progress",
            "Store transfers streaming now (bounded by --max-concurrent-downloads)",
            ["model"],
            registry=r,
        )
        self.untrusted = Gauge(
            "model_sidecar_untrusted_versions",
            "1 for a version the server holds whose manifest no longer verifies (a signing key "
            "removed from the Secret, say): it is not swapped back to",
            ["model", "version"],
            registry=r,
        )
        self.serving = Gauge(
            "model_sidecar_serving_version",
            "1 for the version the server serves",
            ["model", "version"],
            registry=r,
        )
        self.kube_errors = Counter(
            "model_sidecar_kube_api_errors",
            "Kubernetes API calls (read, watch, annotate) that failed, by HTTP status"
            " (0: no answer, or one that was not the API's)",
            ["call", "status"],
            registry=r,
        )
        self.pod_view_stale = Gauge(
            "model_sidecar_pod_view_stale_seconds",
            "How long the pod watch has been following its last view of the pod because"
            " the API does not answer (0 while it does)",
            ["model"],
            registry=r,
        )
