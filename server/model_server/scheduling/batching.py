"""Dynamic batching per loaded version, as Triton's dynamic batcher: requests queued for
the same version, with the same input signature, run together as one engine run.

The batcher sits below the pin: each request pins its version in the data plane first,
then waits here with that pin held, in the queue of *that* :class:`LoadedVersion`. So a
batch runs on exactly one version (a swap starts new queues on the new version, it never
mixes the two), and a version dropped from the slot is closed only after the last batch
holding its requests has ended (retain-1 freeing waits for it).

How a batch forms (per version, per input signature: every input's dtype and every dim
but the first):

* it runs when ``max_batch_size`` rows (the first axis, Triton's ``max_batch_size``) are
  queued, or when the oldest request has waited ``max_queue_delay``, *and* one of the
  version's ``max_concurrent_runs`` run slots is free (the inference threads); while
  every slot is busy requests keep queueing, so with a delay of 0 a lightly loaded model
  runs each request at once and a busy one runs what queued meanwhile together;
* it takes queued requests oldest first while their rows fit (``max_batch_size``, or the
  engine's own profile maximum, or the model's rows per request, whichever is lowest: a
  batch is one run, bounded as one request is, :mod:`.request_limits`);
* its inputs are concatenated along axis 0, run once, and every output is split back by
  each request's rows.

Which models batch: those opted in (``BatchPolicy.models``, the server's
``--batch-model``; none by default) whose inputs and outputs all have a dynamic first
axis, read as the batch axis (as Triton's ``max_batch_size > 0``). As with Triton, rows
must be independent (no output row may depend on another row), which nothing here can
see: a model whose rows depend on each other would answer with other clients' rows, so
only its operator can say it may batch. A model whose outputs turn out not to follow
the batch's rows (an output's first dim other than the rows run) is run request by
request from then on. Other models, a request larger than a batch, one whose inputs
differ in their first dim, and one with no rows run alone, as without batching.

A batch whose run raises is run again request by request, so that only the request that
fails gets the error: a model that fails on part of its inputs must not fail its
neighbours (canary analysis counts errors per version). At close, requests still queued
are failed with 503 ``unavailable``, never left waiting.

A request cancelled while its batch runs (a client gone, the server's shutdown) waits for
the run to end before its cancellation goes on, so that its pin outlives the engine's use
of its inputs; one cancelled while queued leaves the queue and never runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from model_server.backends.base import Engine
from model_server.errors import Unavailable
from model_server.lifecycle.model_slot import LoadedVersion
from model_server.lifecycle.request_limits import RowLimits

log = logging.getLogger(__name__)
T = TypeVar("T")
Feeds = Mapping[str, np.ndarray]
Outputs = dict[str, np.ndarray]
Signature = tuple[tuple[str, str, tuple[int, ...]], ...]


@dataclass(frozen=True)
class BatchPolicy:
    """``max_batch_size`` rows per engine run (0: batching off) of the ``models`` opted in
    (keys); a request waits at most ``max_queue_delay_s`` for others; at most
    ``max_concurrent_runs`` runs of one version at once (the inference threads)."""

    max_batch_size: int = 0
    max_queue_delay_s: float = 0.0
    max_concurrent_runs: int = 1
    models: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.max_batch_size < 0 or self.max_queue_delay_s < 0:
            raise ValueError("max_batch_size and max_queue_delay_s must not be negative")
        if self.max_concurrent_runs < 1:
            raise ValueError("max_concurrent_runs must be at least 1")

    @property
    def enabled(self) -> bool:
        return self.max_batch_size > 0

    @classmethod
    def from_flags(
        cls, max_batch_size: int, max_queue_delay_us: int, runs: int, models: Iterable[str] = ()
    ) -> BatchPolicy:
        return cls(max_batch_size, max_queue_delay_us / 1e6, runs, frozenset(models))


def unbatchable_reason(engine: Engine) -> str | None:
    """Why the engine's requests cannot be batched (None: they can): every input and
    output must have a dynamic first axis, the batch axis."""
    for kind, specs in (("input", engine.inputs), ("output", engine.outputs)):
        for spec in specs:
            if not spec.shape or spec.shape[0] >= 0:
                return f"{kind} {spec.name!r} has no dynamic first axis (shape {spec.shape})"
    return None


def engine_max_rows(engine: Engine) -> int | None:
    """The most rows the engine accepts in one run when it says so (a TensorRT
    optimization profile's maximum first dim), else None."""
    bounds = [
        max_shape[0]
        for spec in engine.inputs
        if (max_shape := getattr(spec, "max_shape", None)) and max_shape[0] > 0
    ]
    return min(bounds) if bounds else None


def request_rows(feeds: Feeds) -> int | None:
    """A request's rows: the first dim every input shares (None: they differ, or an
    input is a scalar)."""
    rows = {np.shape(a)[0] if np.ndim(a) else None for a in feeds.values()}
    if len(rows) != 1:
        return None
    return rows.pop()


def signature(feeds: Feeds) -> Signature:
    """What requests batched together must share: names, dtypes, every dim but the first."""
    return tuple(
        sorted((name, np.asarray(a).dtype.str, tuple(np.shape(a)[1:])) for name, a in feeds.items())
    )


# --- on an inference thread -------------------------------------------------------------


@dataclass
class _Outcome:
    outputs: Outputs | None = None
    error: BaseException | None = None


@dataclass
class _RunReport:
    outcomes: list[_Outcome]
    runs: list[int]  # the rows of each engine run made
    rows_mismatch: bool = False  # the outputs did not follow the batch's rows


def _alone(version: LoadedVersion, feeds: Feeds) -> _Outcome:
    try:
        return _Outcome(outputs=version.infer(feeds))
    except Exception as exc:  # the runtime can raise anything: it is this request's error
        return _Outcome(error=exc)


def run_batch(version: LoadedVersion, requests: Sequence[Feeds], rows: Sequence[int]) -> _RunReport:
    """Run ``requests`` as one engine run and split the outputs by ``rows``; when that
    run raises, or its outputs do not follow the rows, run them one by one instead."""
    if len(requests) == 1:
        return _RunReport([_alone(version, requests[0])], [rows[0]])
    total = sum(rows)
    feeds = {name: np.concatenate([r[name] for r in requests], axis=0) for name in requests[0]}
    try:
        # not timed (ENGINE_LATENCY is of one request's runs, as a shadow run is), and its
        # outputs counted in the version's series only once they are known to split
        # (LoadedVersion.infer would count them now, and again when the requests are run
        # one by one)
        outputs = version.run_engine(feeds, timed=False)
    except Exception as exc:
        log.info(
            "a batch of %d requests on %s:%s failed (%s); running them one by one",
            len(requests), version.model, version.version, exc,
        )  # fmt: skip
        return _RunReport([_alone(version, r) for r in requests], [total, *rows])
    if not all(np.ndim(o) >= 1 and np.shape(o)[0] == total for o in outputs.values()):
        shapes = {name: np.shape(o) for name, o in outputs.items()}
        log.warning(
            "%s:%s: outputs %s do not follow the %d rows of a batch; its requests run one "
            "by one from now on", version.model, version.version, shapes, total,
        )  # fmt: skip
        outcomes = [_alone(version, r) for r in requests]
        return _RunReport(outcomes, [total, *rows], rows_mismatch=True)
    version.metrics.outputs(outputs)
    offsets = itertools.pairwise(itertools.accumulate(rows, initial=0))
    return _RunReport(
        [
            _Outcome(outputs={name: o[start:stop] for name, o in outputs.items()})
            for start, stop in offsets
        ],
        [total],
    )


# --- on the event loop ------------------------------------------------------------------


@dataclass(eq=False)
class _Batch:
    requests: list[_Pending]
    ended: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(eq=False)
class _Pending:
    feeds: Feeds
    rows: int
    key: Signature | None  # None: runs alone
    future: asyncio.Future[Outputs]
    queued_at: float
    batch: _Batch | None = None  # set once it is taken into a batch


async def _uninterruptibly(event: asyncio.Event) -> None:
    """Wait for ``event`` whatever cancellations arrive meanwhile (the caller re-raises
    the one it is handling)."""
    while not event.is_set():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(event.wait())


class _Abandoned(Exception):
    """The caller was cancelled before its call started: it is not made."""


def _retrieve(future: asyncio.Future[T]) -> None:
    """Mark an outcome as seen: a caller cancelled after it was set never reads it."""
    if not future.cancelled():
        future.exception()


async def run_to_completion(executor: Executor | None, fn: Callable[[], T]) -> T:
    """``fn()`` on ``executor``; a caller cancelled while it runs waits for it to end
    before the cancellation goes on (its pin must outlive the engine run), and one
    cancelled before it started makes it never start."""
    loop = asyncio.get_running_loop()
    lock = threading.Lock()
    state = {"started": False, "ended": False, "abandoned": False}
    ended = asyncio.Event()  # set only for a caller that was cancelled

    def call() -> T:
        with lock:
            if state["abandoned"]:
                raise _Abandoned  # never started: nothing to wait for
            state["started"] = True
        try:
            return fn()
        finally:
            with lock:
                state["ended"] = True
                waited_for = state["abandoned"]
            if waited_for:
                loop.call_soon_threadsafe(ended.set)

    try:
        return await loop.run_in_executor(executor, call)
    except asyncio.CancelledError:
        with lock:
            state["abandoned"] = True
            running = state["started"] and not state["ended"]
        if running:
            await _uninterruptibly(ended)
        raise


class VersionBatcher:
    """The queues of one loaded version (event-loop only: no lock needed)."""

    def __init__(
        self,
        version: LoadedVersion,
        policy: BatchPolicy,
        executor: Executor | None,
        observe_rows: Callable[[int], None],
        on_idle: Callable[[VersionBatcher], None],
        on_rows_mismatch: Callable[[LoadedVersion], None],
        limits: RowLimits | None = None,
    ) -> None:
        self.version = version
        self.policy = policy
        self.executor = executor
        self.limits = limits
        limit = engine_max_rows(version.engine)
        self.max_rows = min(policy.max_batch_size, limit) if limit else policy.max_batch_size
        # the most rows of a run of each queue: max_rows, or less for the model's bound
        self._caps: dict[Signature | None, int] = {}
        self._observe_rows = observe_rows
        self._on_idle = on_idle
        self._on_rows_mismatch = on_rows_mismatch
        self._queues: dict[Signature | None, deque[_Pending]] = {}
        self._queued_rows: dict[Signature | None, int] = {}
        self._running = 0
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False

    @property
    def idle(self) -> bool:
        return not self._queues and self._running == 0

    def queued(self) -> int:
        """Requests waiting for a batch now."""
        return sum(len(queue) for queue in self._queues.values())

    async def submit(self, feeds: Feeds) -> Outputs:
        if self._closed:
            raise Unavailable("the server is shutting down: the request was not run")
        rows = request_rows(feeds)
        cap = self._cap(feeds)
        alone = rows is None or rows == 0 or rows > cap
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Outputs] = loop.create_future()
        future.add_done_callback(_retrieve)  # a cancelled caller never reads its outcome
        key = None if alone else signature(feeds)
        self._caps[key] = cap
        pending = _Pending(feeds, rows or 0, key, future, time.monotonic())
        self._queues.setdefault(pending.key, deque()).append(pending)
        self._queued_rows[pending.key] = self._queued_rows.get(pending.key, 0) + pending.rows
        self._pump()
        try:
            return await future
        except asyncio.CancelledError:
            if pending.batch is None:  # still queued: it leaves the queue, nothing ran
                self._dequeue(pending)
            else:  # its batch is on the engine: its pin holds until the run ends
                await _uninterruptibly(pending.batch.ended)
            raise

    def _cap(self, feeds: Feeds) -> int:
        """The most rows of a batch of requests like ``feeds``."""
        bound = None
        if self.limits is not None:
            bound = self.limits.batch_rows(self.version.model, self.version.engine, feeds)
        return min(self.max_rows, bound) if bound is not None else self.max_rows

    def _forget(self, key: Signature | None) -> None:
        del self._queues[key], self._queued_rows[key]
        self._caps.pop(key, None)

    def _dequeue(self, pending: _Pending) -> None:
        queue = self._queues.get(pending.key)
        if queue is not None and pending in queue:
            queue.remove(pending)
            self._queued_rows[pending.key] -= pending.rows
            if not queue:
                self._forget(pending.key)
        pending.future.cancel()
        self._pump()

    def _ready(self, key: Signature | None, now: float) -> bool:
        return (
            key is None
            or self._queued_rows[key] >= self._caps[key]
            or now - self._queues[key][0].queued_at >= self.policy.max_queue_delay_s
        )

    def _take(self, key: Signature | None) -> list[_Pending]:
        """The oldest requests of queue ``key`` whose rows fit in one batch (one at least)."""
        queue = self._queues[key]
        taken = [queue.popleft()]
        rows = taken[0].rows
        while key is not None and queue and rows + queue[0].rows <= self._caps[key]:
            rows += queue[0].rows
            taken.append(queue.popleft())
        self._queued_rows[key] -= rows
        if not queue:
            self._forget(key)
        return taken

    def _pump(self) -> None:
        """Start every batch that is ready while a run slot is free; then wake up when
        the oldest request still queued has waited the delay."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        now = time.monotonic()
        while self._running < self.policy.max_concurrent_runs and self._queues:
            ready = [key for key in self._queues if self._ready(key, now)]
            if not ready:
                break
            oldest = min(ready, key=lambda key: self._queues[key][0].queued_at)
            self._start(_Batch(self._take(oldest)))
        if self._queues and self._running < self.policy.max_concurrent_runs:
            first = min(queue[0].queued_at for queue in self._queues.values())
            delay = max(0.0, first + self.policy.max_queue_delay_s - now)
            self._timer = asyncio.get_running_loop().call_later(delay, self._pump)
        if self.idle:
            self._on_idle(self)

    def _start(self, batch: _Batch) -> None:
        """Run ``batch`` on an inference thread; :meth:`_ended` settles its requests."""
        self._running += 1
        for pending in batch.requests:
            pending.batch = batch
        feeds, rows = [p.feeds for p in batch.requests], [p.rows for p in batch.requests]
        loop = asyncio.get_running_loop()
        try:
            future = loop.run_in_executor(self.executor, run_batch, self.version, feeds, rows)
        except RuntimeError:  # "cannot schedule new futures after shutdown"
            future = loop.create_future()
            future.cancel()
        future.add_done_callback(lambda done: self._ended(batch, done))

    def _ended(self, batch: _Batch, done: asyncio.Future[_RunReport]) -> None:
        requests = batch.requests
        if done.cancelled():  # the inference threads were stopped: the server's shutdown
            for pending in requests:
                _settle(pending, _Outcome(error=Unavailable(
                    "the server is shutting down: the request's batch was not run"
                )))  # fmt: skip
        elif (error := done.exception()) is not None:  # a defect here (run_batch catches
            log.error(  # the engine's errors)
                "batch on %s:%s failed", self.version.model, self.version.version,
                exc_info=error,
            )  # fmt: skip
            for pending in requests:
                _settle(pending, _Outcome(error=error))
        else:
            report = done.result()
            for run_rows in report.runs:
                self._observe_rows(run_rows)
            if report.rows_mismatch:
                self._on_rows_mismatch(self.version)
            for pending, outcome in zip(requests, report.outcomes, strict=True):
                _settle(pending, outcome)
        self._running -= 1
        batch.ended.set()
        if not self._closed:
            self._pump()
        elif self.idle:
            self._on_idle(self)

    def close(self) -> None:
        """Fail every queued request with 503 (runs under way finish)."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        queues, self._queues, self._queued_rows, self._caps = self._queues, {}, {}, {}
        for queue in queues.values():
            for pending in queue:
                _settle(pending, _Outcome(error=Unavailable(
                    "the server is shutting down: the request was queued for a batch and "
                    "not run"
                )))  # fmt: skip
        if self.idle:
            self._on_idle(self)


def _settle(pending: _Pending, outcome: _Outcome) -> None:
    if pending.future.done():  # cancelled meanwhile
        return
    if outcome.error is not None:
        pending.future.set_exception(outcome.error)
    else:
        assert outcome.outputs is not None
        pending.future.set_result(outcome.outputs)


class Batchers:
    """The batchers of the versions that have requests queued or running now; a batcher
    goes when it is idle (so none outlives its version) and comes back with the next
    request."""

    def __init__(
        self,
        policy: BatchPolicy,
        executor: Executor | None,
        observe_rows: Callable[[str, int], None],
        limits: RowLimits | None = None,
    ) -> None:
        self.policy = policy
        self.executor = executor
        self.limits = limits  # the models' bounds on rows per request: a batch's too
        self._observe_rows = observe_rows
        self._active: dict[LoadedVersion, VersionBatcher] = {}
        # versions whose outputs did not follow a batch's rows: they run unbatched
        self._refused: weakref.WeakSet[LoadedVersion] = weakref.WeakSet()
        self._closed = False

    def batches(self, version: LoadedVersion) -> bool:
        return (
            self.policy.enabled
            and version.model in self.policy.models
            and version not in self._refused
            and unbatchable_reason(version.engine) is None
        )

    def run(self, version: LoadedVersion, feeds: Feeds) -> Awaitable[Outputs]:
        """The outputs of ``feeds`` on ``version``, run in a batch (``batches(version)``
        must be true)."""
        if self._closed:
            raise Unavailable("the server is shutting down: the request was not run")
        batcher = self._active.get(version)
        if batcher is None:
            model = version.model
            batcher = self._active[version] = VersionBatcher(
                version,
                self.policy,
                self.executor,
                lambda rows: self._observe_rows(model, rows),
                self._idle,
                self._refused.add,
                self.limits,
            )
        return batcher.submit(feeds)

    def queued(self) -> int:
        """Requests waiting for a batch now, over every version (tests, observability)."""
        return sum(batcher.queued() for batcher in self._active.values())

    def _idle(self, batcher: VersionBatcher) -> None:
        if self._active.get(batcher.version) is batcher:
            del self._active[batcher.version]

    def close(self) -> None:
        self._closed = True
        for batcher in list(self._active.values()):
            batcher.close()
