"""The canary's figures from the servers' own ``/metrics`` (the names in
``model_rollout_contract.canary``): what one scrape of a pod says, and what happened
between two scrapes of the same pods.

Counters are cumulative since a version was loaded, so figures are differences between
two snapshots, per pod and version as Prometheus' ``increase()`` takes them per series:
a series that went down was reset (the server restarted, or loaded the version again)
and counts from zero; a series that appeared since counts whole; a pod that was not in the
first snapshot is left out of that interval (its counters began before it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from model_rollout_contract import canary

# what one pod's server says about one version: series key -> cumulative value
Series = dict[str, float]
# one scrape of several pods: pod -> version -> series
Snapshot = dict[str, dict[str, Series]]

_BUCKET, _INF = "_bucket", "+Inf"
# the series the analysis reads; histograms by their buckets only
_COUNTERS = (
    canary.REQUESTS,
    canary.OUTPUT_NONFINITE,
    canary.SHADOW_REQUESTS,
    canary.SHADOW_ARGMAX_COMPARED,
    canary.SHADOW_ARGMAX_AGREED,
)
_HISTOGRAMS = (canary.LATENCY, canary.ENGINE_LATENCY, canary.SHADOW_DRIFT, canary.SHADOW_LATENCY)
_READ = frozenset((*_COUNTERS, *(h + _BUCKET for h in _HISTOGRAMS)))
# the labels that say whose series it is; any other label is part of the series' key
_OWNER_LABELS = ("model", "version")


class MetricsFormatError(ValueError):
    """A ``/metrics`` answer that is not the Prometheus text format."""


def _key(name: str, labels: Mapping[str, str]) -> str:
    rest = sorted((k, v) for k, v in labels.items() if k not in _OWNER_LABELS)
    return name + "".join(f"|{k}={v}" for k, v in rest)


def parse_metrics(text: str, model: str, versions: Iterable[str]) -> dict[str, Series]:
    """The series of ``model``'s ``versions`` in one ``/metrics`` answer."""
    wanted = set(versions)
    out: dict[str, Series] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = sample.labels
                if sample.name not in _READ or labels.get("model") != model:
                    continue
                version = labels.get("version")
                if version in wanted and math.isfinite(sample.value):
                    series = out.setdefault(version, {})
                    series[_key(sample.name, labels)] = float(sample.value)
    except (ValueError, TypeError, IndexError) as exc:  # what the parser raises on garbage
        raise MetricsFormatError(f"not the Prometheus text format: {exc}") from exc
    return out


def _increase(before: Series | None, after: Series) -> Series:
    """Per key, what ``after`` added to ``before``; all of ``after`` if any key went down."""
    if before is None:
        return dict(after)
    if any(after.get(k, 0.0) < v for k, v in before.items()):
        return dict(after)  # reset: a fresh series counts from zero
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def increase(before: Snapshot, after: Snapshot) -> dict[str, Series]:
    """Per version, what happened between the two snapshots, summed over the pods that
    are in both (a version that appeared on such a pod counts whole)."""
    total: dict[str, Series] = {}
    for pod, versions in after.items():
        if pod not in before:
            continue
        for version, series in versions.items():
            summed = total.setdefault(version, {})
            for key, value in _increase(before[pod].get(version), series).items():
                summed[key] = summed.get(key, 0.0) + value
    return total


def _sum(series: Series, name: str, where: str | None = None) -> float:
    """The sum of ``name``'s series, those with a label ``where`` (``"code=5"``:
    codes starting with 5) if given."""
    total = 0.0
    for key, value in series.items():
        head, *labels = key.split("|")
        if head == name and (where is None or any(lab.startswith(where) for lab in labels)):
            total += value
    return total


def buckets(series: Series, histogram: str) -> list[tuple[float, float]]:
    """A histogram's cumulative buckets as ``(upper bound, count)``, in order."""
    prefix = f"{histogram}{_BUCKET}|le="
    out = []
    for key, value in series.items():
        if key.startswith(prefix):
            bound = key[len(prefix) :]
            out.append((math.inf if bound == _INF else float(bound), value))
    return sorted(out)


def quantile(q: float, cumulative: list[tuple[float, float]]) -> float | None:
    """Prometheus' ``histogram_quantile``: linear within the bucket the rank falls in
    (from 0 for the first); the highest finite bound when it falls in ``+Inf``."""
    if not cumulative or cumulative[-1][1] <= 0:
        return None
    rank = q * cumulative[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in cumulative:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    return lower_bound


@dataclass(frozen=True)
class Figures:
    """One interval of the canary, as the analysis judges it."""

    live_requests: int  # answered by the candidate
    errors: int  # 5xx of the candidate's, live or shadowed (a 4xx is the client's)
    shadow_requests: int  # stable answers also run on the candidate
    stable_requests: int  # answered by the stable version (the latency reference)
    candidate_p99: float | None  # seconds: its live answers, else its shadowed runs
    stable_p99: float | None  # seconds: of what the candidate's is compared with
    drift_p99: float | None  # of the per-request max |stable - candidate|
    argmax_agreement: float | None  # None: no class-score outputs were compared
    non_finite: int  # NaN or infinite output values of the candidate
    # the p99s are engine time (no live answer of the candidate, so its shadow runs
    # against the stable version's engine runs), not request time (live answers of both):
    # a shadow run has no queueing or JSON, so a request time would flatter it
    engine_time: bool = False

    @property
    def requests(self) -> int:
        """What the candidate answered, live or in the shadow: minRequests counts these."""
        return self.live_requests + self.shadow_requests

    @property
    def error_rate(self) -> float | None:
        return self.errors / self.requests if self.requests else None

    @property
    def latency_basis(self) -> str:
        """What :attr:`latency_ratio` compares, in the words of the condition message."""
        if self.engine_time:
            return "engine time of its shadow runs vs the stable version's runs"
        return "request time"

    @property
    def latency_ratio(self) -> float | None:
        if self.candidate_p99 is None or not self.stable_p99:
            return None
        return self.candidate_p99 / self.stable_p99


def compares_engine_time(shadowed: int, live: int, live_p99: float | None) -> bool:
    """Whether latency is judged as engine time: shadow runs, and no live answer of the
    candidate, or none that was timed (``live_p99`` None). The second guards the count:
    live answers are REQUESTS less SHADOW_REQUESTS, which Prometheus' extrapolating
    ``increase()`` (or a scrape between the two counters) can leave at one where the
    candidate answered no client, and request time would then skip the check."""
    return shadowed > 0 and (live == 0 or live_p99 is None)


def figures(window: Mapping[str, Series], stable: str, candidate: str) -> Figures:
    """The figures of one interval, from :func:`increase` of two snapshots. Latency
    compares like with like: the candidate's live answers with the stable version's
    (request time), or, with none live, its shadow runs with the stable version's engine
    runs (engine time)."""
    cand, base = window.get(candidate, {}), window.get(stable, {})
    shadowed = round(_sum(cand, canary.SHADOW_REQUESTS))
    live = max(0, round(_sum(cand, canary.REQUESTS)) - shadowed)  # REQUESTS counts shadows
    engine_time = compares_engine_time(
        shadowed, live, quantile(0.99, buckets(cand, canary.LATENCY))
    )
    if engine_time:
        latency = buckets(cand, canary.SHADOW_LATENCY)
        reference = buckets(base, canary.ENGINE_LATENCY)
    else:
        latency, reference = buckets(cand, canary.LATENCY), buckets(base, canary.LATENCY)
    compared = _sum(cand, canary.SHADOW_ARGMAX_COMPARED)
    return Figures(
        live_requests=live,
        errors=round(_sum(cand, canary.REQUESTS, "code=5")),
        shadow_requests=shadowed,
        stable_requests=round(_sum(base, canary.REQUESTS)),
        candidate_p99=quantile(0.99, latency),
        stable_p99=quantile(0.99, reference),
        drift_p99=quantile(0.99, buckets(cand, canary.SHADOW_DRIFT)),
        argmax_agreement=_sum(cand, canary.SHADOW_ARGMAX_AGREED) / compared if compared else None,
        non_finite=round(_sum(cand, canary.OUTPUT_NONFINITE)),
        engine_time=engine_time,
    )
