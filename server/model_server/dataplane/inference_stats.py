"""Per-version inference statistics, in the shape of Triton's statistics extension
(``GET /v2/models[/{m}[/versions/{v}]]/stats``, gRPC ``ModelStatistics``).

Each loaded version has its own numbers, kept beside it (weakly: they go when the
version is freed), so a version loaded again starts from zero, as its Prometheus series
do (:mod:`.version_metrics`). A request refused before its version was pinned (a
malformed body) is no version's.

What the durations measure here (the server has no scheduler queue of its own):

* ``compute_input``: decoding the body into tensors (in a JSON worker when large);
* ``compute_infer``: running the pinned version, waiting for an inference thread (and a
  batch, with dynamic batching) included;
* ``compute_output``: selecting the outputs and encoding the answer;
* ``queue``: the rest of the request's time in the data plane (routing, pinning, a
  decode repeated because a swap changed the inputs);
* ``success``/``fail``: the whole request, by outcome.

``inference_count`` counts a batched request (a model with ``max_batch_size`` > 0) as
its rows, ``execution_count`` the requests run; with dynamic batching several requests
share one engine run, which this count does not see."""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

from model_server.lifecycle.model_slot import LoadedVersion


@dataclass
class Duration:
    """A count and a total duration, as Triton's ``StatisticDuration``."""

    count: int = 0
    ns: int = 0

    def add(self, ns: int) -> None:
        self.count += 1
        self.ns += max(0, ns)

    def to_json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass(frozen=True)
class RequestTiming:
    """Where one answered request spent its time, in nanoseconds."""

    total_ns: int
    input_ns: int
    infer_ns: int
    output_ns: int

    @property
    def queue_ns(self) -> int:
        return max(0, self.total_ns - self.input_ns - self.infer_ns - self.output_ns)


@dataclass
class _BatchStats:
    compute_input: Duration
    compute_infer: Duration
    compute_output: Duration


class VersionStatistics:
    """One loaded version's numbers; recorded from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.last_inference_ms = 0
        self.inference_count = 0
        self.execution_count = 0
        self.success = Duration()
        self.fail = Duration()
        self.queue = Duration()
        self.compute_input = Duration()
        self.compute_infer = Duration()
        self.compute_output = Duration()
        self.batches: dict[int, _BatchStats] = {}

    def succeeded(self, timing: RequestTiming, batch_size: int) -> None:
        with self._lock:
            self.last_inference_ms = int(time.time() * 1000)
            self.inference_count += batch_size
            self.execution_count += 1
            self.success.add(timing.total_ns)
            self.queue.add(timing.queue_ns)
            self.compute_input.add(timing.input_ns)
            self.compute_infer.add(timing.infer_ns)
            self.compute_output.add(timing.output_ns)
            batch = self.batches.get(batch_size)
            if batch is None:
                batch = self.batches[batch_size] = _BatchStats(Duration(), Duration(), Duration())
            batch.compute_input.add(timing.input_ns)
            batch.compute_infer.add(timing.infer_ns)
            batch.compute_output.add(timing.output_ns)

    def failed(self, total_ns: int) -> None:
        with self._lock:
            self.last_inference_ms = int(time.time() * 1000)
            self.fail.add(total_ns)

    def to_json(self, name: str, version: str) -> dict[str, Any]:
        """Triton's ``$model_stat`` object."""
        with self._lock:
            return {
                "name": name,
                "version": version,
                "last_inference": self.last_inference_ms,
                "inference_count": self.inference_count,
                "execution_count": self.execution_count,
                "inference_stats": {
                    "success": self.success.to_json(),
                    "fail": self.fail.to_json(),
                    "queue": self.queue.to_json(),
                    "compute_input": self.compute_input.to_json(),
                    "compute_infer": self.compute_infer.to_json(),
                    "compute_output": self.compute_output.to_json(),
                    "cache_hit": Duration().to_json(),  # no response cache
                },
                "batch_stats": [
                    {
                        "batch_size": size,
                        "compute_input": batch.compute_input.to_json(),
                        "compute_infer": batch.compute_infer.to_json(),
                        "compute_output": batch.compute_output.to_json(),
                    }
                    for size, batch in sorted(self.batches.items())
                ],
            }


class StatisticsBook:
    """The statistics of every loaded version, made on first use and dropped with the
    version (keyed weakly by the :class:`LoadedVersion` object, not by its name)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_version: weakref.WeakKeyDictionary[LoadedVersion, VersionStatistics] = (
            weakref.WeakKeyDictionary()
        )

    def of(self, version: LoadedVersion) -> VersionStatistics:
        with self._lock:
            stats = self._by_version.get(version)
            if stats is None:
                stats = self._by_version[version] = VersionStatistics()
            return stats
