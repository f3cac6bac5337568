"""The per-version series that canary analysis reads (names from
:mod:`model_rollout_contract.canary`), labelled ``{model, version}``.

Each loaded version owns its own :class:`VersionMetrics`, built of prometheus_client's
(thread-safe) counters, gauges and histograms in no registry; :class:`VersionSeries`
gathers, at each scrape, those of the versions the slots hold now. So the series of a
version live exactly as long as it is loaded: an unloaded version's series are gone, a
version loaded again starts from zero (as counters restart with a process), and a request
still finishing on an unloaded version cannot bring its series back.

``OUTPUT_SUM`` is a gauge (a sum of outputs can fall), so its name has no ``_total``;
the ``_total`` names are counters. Every name in ``canary.py`` is a sample name of the
exposition."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

import numpy as np
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from model_rollout_contract import canary
from model_server.observability.metrics import LATENCY_BUCKETS

# shadow runs not started because as many were in flight already (the server's own name)
SHADOW_SKIPPED = "model_server_shadow_skipped_total"
_LABELS = ("model", "version")


def output_statistics(outputs: Mapping[str, np.ndarray]) -> tuple[int, int, float, float]:
    """Over every floating-point output: (values, non-finite values, sum and sum of
    squares of the finite ones). One pass of numpy per output: cheap for every request."""
    values = nonfinite = 0
    total = squares = 0.0
    for array in outputs.values():
        a = np.asarray(array)
        if a.dtype.kind != "f" or a.size == 0:
            continue
        flat = a.ravel().astype(np.float64, copy=False)
        finite = np.isfinite(flat)
        bad = flat.size - int(np.count_nonzero(finite))
        if bad:
            flat = flat[finite]
        values += a.size
        nonfinite += bad
        total += float(flat.sum())
        squares += float(flat @ flat)
    return values, nonfinite, total, squares


class VersionMetrics:
    """The request, latency, engine time, output and shadow series of one loaded version
    (for the shadow ones, the version is the candidate that was run)."""

    def __init__(self, model: str, version: str) -> None:
        lv = self._lv = (model, version)
        self._requests = Counter(
            canary.REQUESTS, "Inference requests answered by this version, by HTTP code "
            "(shadow runs included: 200, or 500 when the candidate failed)",
            [*_LABELS, "code"], registry=None,
        )  # fmt: skip
        self._parents: list[Counter | Gauge | Histogram] = [self._requests]
        # the series analysis reads exist from the start at zero: Prometheus' increase()
        # cannot count a series' first sample, so the first errors would go unseen
        for code in ("200", "500"):
            self._requests.labels(*lv, code)
        self.latency = self._histogram(
            canary.LATENCY, "Latency of the requests this version answered", LATENCY_BUCKETS
        )
        self.engine_latency = self._histogram(
            canary.ENGINE_LATENCY,
            "The engine's own time per successful run of this version, live or shadow "
            "(no queueing, no decoding)",
            LATENCY_BUCKETS,
        )
        self.output_values = self._counter(canary.OUTPUT_VALUES, "Floating-point output values")
        self.output_nonfinite = self._counter(
            canary.OUTPUT_NONFINITE, "Output values that were NaN or infinite"
        )
        self.output_squares = self._counter(
            canary.OUTPUT_SQUARES, "Sum of the squares of the finite output values"
        )
        sums = Gauge(canary.OUTPUT_SUM, "Sum of the finite output values", _LABELS, registry=None)
        self._parents.append(sums)
        self.output_sum = sums.labels(*lv)
        self.shadow_requests = self._counter(
            canary.SHADOW_REQUESTS, "Requests answered by the stable version, mirrored to this one"
        )
        self.shadow_skipped = self._counter(
            SHADOW_SKIPPED, "Shadow runs skipped: the bound of shadow runs in flight was reached"
        )
        self.shadow_drift = self._histogram(
            canary.SHADOW_DRIFT,
            "Per shadowed request, the largest |stable - candidate| over the outputs "
            "(+Inf: not comparable, or non-finite on one side only)",
            canary.DRIFT_BUCKETS,
        )
        self.shadow_argmax_compared = self._counter(
            canary.SHADOW_ARGMAX_COMPARED, "Rows of 2-D class-score outputs compared"
        )
        self.shadow_argmax_agreed = self._counter(
            canary.SHADOW_ARGMAX_AGREED, "Of those, rows whose argmax agreed"
        )
        self.shadow_latency = self._histogram(
            canary.SHADOW_LATENCY, "Latency of this version's shadow runs", LATENCY_BUCKETS
        )

    def _counter(self, name: str, doc: str) -> Counter:
        parent = Counter(name, doc, _LABELS, registry=None)
        self._parents.append(parent)
        return parent.labels(*self._lv)

    def _histogram(self, name: str, doc: str, buckets: Iterable[float]) -> Histogram:
        parent = Histogram(name, doc, _LABELS, buckets=tuple(buckets), registry=None)
        self._parents.append(parent)
        return parent.labels(*self._lv)

    def request(self, code: str, seconds: float | None) -> None:
        """One request answered (``seconds`` None: a shadow run, timed on its own)."""
        self._requests.labels(*self._lv, code).inc()
        if seconds is not None:
            self.latency.observe(seconds)

    def shadow_request(self, code: str) -> None:
        """One shadow run ended: counted as one of ``SHADOW_REQUESTS`` and of ``REQUESTS``
        together (the shadow one first, so a scrape in between never sees a live answer
        that was not), since analysis takes live answers as the difference."""
        self.shadow_requests.inc()
        self.request(code, None)

    def outputs(self, outputs: Mapping[str, np.ndarray]) -> None:
        values, nonfinite, total, squares = output_statistics(outputs)
        if values:
            self.output_values.inc(values)
            self.output_nonfinite.inc(nonfinite)
            self.output_sum.inc(total)
            self.output_squares.inc(squares)

    def collect(self) -> Iterator[Metric]:
        for parent in self._parents:
            yield from parent.collect()


class VersionSeries(Collector):
    """The series of the versions that ``held`` yields at each scrape, one family per
    name (the exposition format allows a name once)."""

    def __init__(self, held: Callable[[], Iterable[VersionMetrics]]) -> None:
        self.held = held

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for metrics in self.held():
            for family in metrics.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                merged.samples.extend(family.samples)
        yield from families.values()
