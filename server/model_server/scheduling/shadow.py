"""Shadow runs: a request answered by the stable version under a traffic policy, run
again on the candidate once the client has its answer, and the two outputs compared.

The client never waits for it: the HTTP transport submits the job after the response is
written, and the candidate runs on threads of its own (``max_in_flight`` of them), not on
the inference threads. At most ``max_in_flight`` runs are in flight; one more is skipped
and counted (``model_server_shadow_skipped_total``), so a slow candidate cannot pile up work or
memory. A run pins the candidate like a request, so its engine stays open until the run
ends. What a run finds goes to the candidate's series (:mod:`.version_metrics`): the
largest absolute difference (``SHADOW_DRIFT``), the argmax agreement of 2-D class-score
outputs, its latency, its outputs, and a request counted 200, 500 when the candidate
failed, or the 4xx it would have answered a live request (over its own bound on rows,
inputs its kernels refuse: the client's, never the candidate's failure, and not run),
with its ``SHADOW_REQUESTS``, both once the run has ended (analysis takes live
answers as the difference, so a run in flight at a scrape must count in neither); the
client's answer is never affected."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from model_server.errors import ServingError, VersionNotFound
from model_server.lifecycle.model_slot import LoadedVersion, ModelSlot
from model_server.lifecycle.request_limits import RowLimits

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShadowJob:
    slot: ModelSlot
    candidate: str
    feeds: Mapping[str, np.ndarray]
    stable_outputs: Mapping[str, np.ndarray]  # every output of the stable version's run
    # the server's bounds on a request, checked against the candidate before it runs
    limits: RowLimits | None = None


@dataclass(frozen=True)
class Comparison:
    drift: float  # max |stable - candidate| over every output; inf: not comparable
    argmax_compared: int  # rows of 2-D class-score outputs
    argmax_agreed: int


def _max_abs_difference(stable: np.ndarray, candidate: np.ndarray) -> float:
    """Equal values (NaN and NaN, or infinities of one sign, included) differ by 0; a
    non-finite value against anything else by infinity."""
    if stable.size == 0:
        return 0.0
    if stable.dtype.kind not in "biuf" or candidate.dtype.kind not in "biuf":
        return 0.0 if np.array_equal(stable, candidate) else math.inf
    a, b = stable.astype(np.float64), candidate.astype(np.float64)
    with np.errstate(invalid="ignore"):
        difference = np.abs(a - b)
    if not np.isfinite(difference).all():
        difference[np.isnan(difference)] = math.inf
        difference[(a == b) | (np.isnan(a) & np.isnan(b))] = 0.0
    return float(difference.max())


def compare(stable: Mapping[str, np.ndarray], candidate: Mapping[str, np.ndarray]) -> Comparison:
    drift, compared, agreed = 0.0, 0, 0
    for name, s in stable.items():
        s = np.asarray(s)
        c = candidate.get(name)
        if c is None or np.shape(c) != s.shape:
            drift = math.inf  # an output missing, or of another shape
            continue
        c = np.asarray(c)
        drift = max(drift, _max_abs_difference(s, c))
        if s.ndim == 2 and s.shape[1] >= 2 and s.dtype.kind == "f" and c.dtype.kind == "f":
            compared += s.shape[0]
            agreed += int(np.count_nonzero(s.argmax(axis=1) == c.argmax(axis=1)))
    return Comparison(drift, compared, agreed)


def _run(candidate: LoadedVersion, job: ShadowJob) -> None:
    """On a shadow thread: run the candidate, compare, record in its series."""
    metrics = candidate.metrics
    started = time.perf_counter()
    try:
        if job.limits is not None:  # the candidate's own bounds, as a live request's
            job.limits.check(job.slot.key, candidate.engine, job.feeds)
        outputs = candidate.infer(job.feeds)
    except ServingError as exc:  # a 4xx is the request's, as it would be live
        metrics.shadow_request(str(exc.status))
        log.debug("shadow run of %s:%s refused: %s", candidate.model, candidate.version, exc)
        return
    except Exception as exc:  # the runtime can raise anything; the client is unaffected
        metrics.shadow_request("500")
        log.debug("shadow run of %s:%s failed: %s", candidate.model, candidate.version, exc)
        return
    metrics.shadow_latency.observe(time.perf_counter() - started)
    metrics.shadow_request("200")  # outputs were counted by candidate.infer
    found = compare(job.stable_outputs, outputs)
    metrics.shadow_drift.observe(found.drift)
    if found.argmax_compared:
        metrics.shadow_argmax_compared.inc(found.argmax_compared)
        metrics.shadow_argmax_agreed.inc(found.argmax_agreed)


class ShadowRunner:
    def __init__(self, max_in_flight: int) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self.max_in_flight = max_in_flight
        self._threads = ThreadPoolExecutor(max_in_flight, thread_name_prefix="shadow")
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def submit(self, job: ShadowJob) -> None:
        """Start ``job`` unless ``max_in_flight`` runs are in flight: then it is skipped
        (and counted). Nothing happens if the candidate is no longer loaded."""
        if self._closed:
            return
        try:
            candidate = job.slot.resolve(job.candidate)
        except VersionNotFound:
            return  # unloaded since the request: its policy went with it
        if len(self._tasks) >= self.max_in_flight:
            candidate.metrics.shadow_skipped.inc()
            return
        task = asyncio.get_running_loop().create_task(self._shadow(job))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _shadow(self, job: ShadowJob) -> None:
        try:
            with job.slot.pin(job.candidate) as candidate:
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(self._threads, _run, candidate, job)
        except VersionNotFound:
            pass  # unloaded before the run could start
        except Exception:  # a shadow run must never disturb serving
            log.exception("shadow run of %s:%s failed", job.slot.key, job.candidate)

    async def idle(self) -> None:
        """Wait for the runs in flight (tests, and a clean stop)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def close(self) -> None:
        """Start no more runs and drop those waiting for a thread. Runs under way keep
        their pin until they end, so the candidate's engine is not closed under them."""
        self._closed = True
        self._threads.shutdown(wait=False, cancel_futures=True)
