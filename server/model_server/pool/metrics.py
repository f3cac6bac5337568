"""The Prometheus exposition of a pool of server processes: the expositions of every
worker merged into the one a single server of the pod would give, since the operator's
canary analysis and Prometheus scrape the pod's port and reach whichever worker the
kernel picks.

Counters, histograms (buckets, ``_sum``, ``_count``) and summaries are summed per
(sample name, labels): each request was counted by exactly one worker. A gauge is merged
as :data:`GAUGE_MERGE` says: summed where each worker holds its own part (requests in
flight, memory: every worker holds its own copy of the engines), the largest where the
value describes the server rather than adds up over processes (which version serves, how
many are loaded: the same in every worker of a pod in agreement). ``_created`` samples
are left out: a sum of processes has no single creation time."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from model_rollout_contract import canary

Merge = Callable[[float, float], float]


def _sum(a: float, b: float) -> float:
    return a + b


# every gauge a server registers (a test checks), and how the pool's value is made
GAUGE_MERGE: dict[str, Merge] = {
    "model_server_inference_requests_in_flight": _sum,
    "model_server_memory_bytes": _sum,  # each worker holds its own copy of every version
    "model_server_version_serving": max,  # 1 for the serving version: a flag, not a count
    "model_server_versions_loaded": max,
    canary.OUTPUT_SUM: _sum,  # a sum of outputs, split over the workers that answered
}
# the pool's own gauge: workers whose exposition a scrape could not get (left out)
UNANSWERED = "model_server_pool_workers_unanswered"


def is_created(name: str) -> bool:
    """A creation time (format 0.0.4 writes them as gauge families of their own)."""
    return name.endswith("_created")


SampleKey = tuple[str, tuple[tuple[str, str], ...]]


class _Families:
    """What ``generate_latest`` needs of a registry: the merged families."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def merge_expositions(expositions: Iterable[str], unanswered: int = 0) -> bytes:
    """One exposition (text format 0.0.4) of the sum of ``expositions``; ``unanswered``
    is reported as :data:`UNANSWERED`."""
    merged: dict[str, Metric] = {}
    values: dict[str, dict[SampleKey, float]] = {}
    for text in expositions:
        for family in text_string_to_metric_families(text):
            if is_created(family.name):
                continue
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
                values[family.name] = {}
            combine = GAUGE_MERGE.get(family.name, _sum) if family.type == "gauge" else _sum
            held = values[family.name]
            for s in family.samples:
                if is_created(s.name):
                    continue
                key = (s.name, tuple(sorted(s.labels.items())))
                held[key] = combine(held[key], s.value) if key in held else s.value
    for name, family in merged.items():
        for (sample_name, labels), value in values[name].items():
            family.add_sample(sample_name, dict(labels), value)
    pool = GaugeMetricFamily(
        UNANSWERED, "Workers of this pod whose metrics this scrape could not get (left out)"
    )
    pool.add_metric([], unanswered)
    return generate_latest(_Families([*merged.values(), pool]))  # type: ignore[arg-type]
