"""Leader election on a ``coordination.k8s.io/v1`` Lease, as client-go's leaderelection:
of several operator replicas one leads and runs the rollouts; the others wait. A Lease is
free when it has no holder, or when its record has not changed for its duration (judged
on this process's clock since it saw the record, never on the holder's timestamps, so
clock skew between nodes does not matter). Every write carries the resourceVersion it
read, so two candidates can never both win.

Fencing: a leader acts only while its last renewal *began* less than the duration minus
a margin ago (:attr:`LeaseSettings.valid_s`). A standby takes over no earlier than the
duration after it saw that renewal, so the leader's time runs out first, whatever it was
doing when it froze. The fence's clock is ``CLOCK_BOOTTIME``, which goes on counting
while the process is stopped (SIGSTOP) *and* while the machine is suspended (the
monotonic clock stops then, and would keep a stale fence valid on wake-up).
:class:`LeaseFence` is checked before every pass and every write, and bounds every
write's time-out by what is left of it; :class:`FenceWatchdog`, a thread, ends the
process if a write is still in flight when the fence runs out (a blocked event loop
cannot time the write out). What the fence cannot do is recall a write already sent: one
held in a proxy or a slow API server can still be applied after the fence ran out, so
only the margin (3 s) covers such delays; beyond it a late write can land after the new
leader's (the planner's next pass, which reads the live pods, then sets it right). Once
the time is out, or the Lease is seen taken, the process
exits at once (status :data:`LEASE_LOST_EXIT`, to come back as a candidate): a graceful
stop would run what was in flight, from a memory that may be long stale.

Renewal: every ``renew_s`` (2 s for a 15 s Lease), counted from the start of the
previous renewal; a failed try (an error, its own time-out ``try_timeout_s``) is tried
again after a jittered ``retry_min_s`` to ``retry_max_s`` (never sooner than a 429's
``Retry-After``) for as long as the fence holds, so that a flaky API server costs
the lead only when every try of a whole fence's time fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import random
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, NoReturn

from .constants import MIN_LEASE_S
from .errors import ApiError
from .kube_client import KubeClient

log = logging.getLogger(__name__)
_CONFLICT = (409, 422)  # resourceVersion precondition failed
LEASE_LOST_EXIT = 3  # the exit status of a replica that stopped leading


def boottime() -> float:
    """Seconds on ``CLOCK_BOOTTIME`` (monotonic, and counting through a suspend);
    the monotonic clock where there is none."""
    if hasattr(time, "CLOCK_BOOTTIME"):
        return time.clock_gettime(time.CLOCK_BOOTTIME)
    return time.monotonic()  # pragma: no cover - not Linux


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class LeaseSettings:
    namespace: str
    name: str = "model-rollout-operator"
    identity: str = ""  # this replica (its pod name)
    duration_s: float = 15.0  # a silent leader is replaced this long after its last renewal
    renew_s: float = 2.0  # the leader renews this often (from the start of the last one)
    margin_s: float = 3.0  # the fence ends this long before the Lease could expire
    retry_min_s: float = 1.5  # a failed try, or a candidate's look, again this late …
    retry_max_s: float = 2.5  # … to this late (uniform: replicas do not ask in step)
    try_timeout_s: float = 2.0  # one try (a read and a write) at most this long

    def __post_init__(self) -> None:
        if self.duration_s < MIN_LEASE_S:
            raise ValueError(f"a Lease of {self.duration_s:g}s: at least {MIN_LEASE_S:g}s")
        if not 0 < self.margin_s < self.duration_s:
            raise ValueError(f"the fence's margin {self.margin_s:g}s is not within the Lease")
        if not 0 < self.renew_s < self.valid_s:
            raise ValueError(f"renewing every {self.renew_s:g}s outlives the fence")
        if not 0 < self.retry_min_s <= self.retry_max_s:
            raise ValueError("retry_min_s must be positive and at most retry_max_s")

    @classmethod
    def scaled(cls, namespace: str, identity: str, duration_s: float) -> LeaseSettings:
        """The settings of a 15 s Lease (renewal 2 s, margin 3 s, retries 1.5-2.5 s, a
        try 2 s), scaled to ``duration_s``; a try of a short Lease is still given 1 s
        (half the fence at most): an API server's answer takes what it takes."""
        k = duration_s / 15.0
        valid_s = duration_s - 3.0 * k
        return cls(
            namespace, identity=identity, duration_s=duration_s, renew_s=2.0 * k,
            margin_s=3.0 * k, retry_min_s=1.5 * k, retry_max_s=2.5 * k,
            try_timeout_s=min(max(2.0 * k, 1.0), valid_s / 2),
        )  # fmt: skip

    @property
    def lease_seconds(self) -> int:
        """``spec.leaseDurationSeconds`` (whole seconds): rounded up, so that a standby
        never waits less than the fence assumes."""
        return math.ceil(self.duration_s)

    @property
    def valid_s(self) -> float:
        """How long after a renewal began its leader may act: the duration less the
        margin, for a write checked just before it is sent and for clocks that run at
        slightly different rates."""
        return self.duration_s - self.margin_s


def exit_lost(why: str) -> NoReturn:
    """Stop acting at once: the process exits, whatever is in flight."""
    log.critical("lost the lease: %s; exiting", why)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(LEASE_LOST_EXIT)


class LeaseFence:
    """Whether this replica may still act as the leader (see the module's docstring).
    ``on_lost(why)`` is called, and must not return, when it may not: by default the
    process exits."""

    def __init__(
        self,
        valid_s: float,
        on_lost: Callable[[str], NoReturn] = exit_lost,
        clock: Callable[[], float] = boottime,
    ) -> None:
        self.valid_s = valid_s
        self.on_lost = on_lost
        self.clock = clock
        self._renewed: float | None = None  # when the last successful renewal began
        self._writes = 0  # writes in flight (:meth:`writing`)
        self._lock = threading.Lock()  # the watchdog reads from its thread

    def renewed(self, began: float) -> None:
        """A renewal that began at ``began`` (this clock) succeeded."""
        self._renewed = began if self._renewed is None else max(self._renewed, began)

    def remaining(self) -> float:
        """Seconds this replica may still act (0 or less: none)."""
        if self._renewed is None:
            return 0.0
        return self.valid_s - (self.clock() - self._renewed)

    def expired(self) -> bool:
        return self.remaining() <= 0

    def check(self) -> float:
        """Return (the seconds left) only while this replica may act; else ``on_lost``."""
        left = self.remaining()
        if left <= 0:
            self.lose(f"not renewed for {self.valid_s:g}s")
        return left

    @contextlib.contextmanager
    def writing(self) -> Iterator[float]:
        """Around one write: checks the fence, gives the seconds left (the write's
        time-out) and counts the write as in flight for the watchdog."""
        left = self.check()
        with self._lock:
            self._writes += 1
        try:
            yield left
        finally:
            with self._lock:
                self._writes -= 1

    @property
    def writes_in_flight(self) -> int:
        with self._lock:
            return self._writes

    def lose(self, why: str) -> NoReturn:
        self.on_lost(why)
        raise AssertionError("on_lost returned")  # it must not: never act on


class FenceWatchdog:
    """A thread that ends the process (the fence's ``on_lost``) when a write is still in
    flight once the fence ran out: a write's time-out needs a running event loop, and
    one blocked (by a slow call, a paused machine that woke up) would let it finish
    late. Checks every ``interval_s``; :meth:`check` is one look."""

    def __init__(self, fence: LeaseFence, interval_s: float = 0.1) -> None:
        self.fence = fence
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fence watchdog", daemon=True)

    def check(self) -> None:
        if self.fence.writes_in_flight and self.fence.expired():
            self.fence.lose("a write outlived the lease's fence")

    def start(self) -> FenceWatchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.check()


class LeaderElection:
    def __init__(
        self,
        api: KubeClient,
        settings: LeaseSettings,
        fence: LeaseFence | None = None,
        rng: random.Random | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        """``rng`` draws the retries' jitter; ``sleep`` waits (on the fence's clock)."""
        self.api = api
        self.sleep = sleep
        self.settings = settings
        self.fence = fence or LeaseFence(settings.valid_s)
        self.rng = rng or random.Random()
        self.path = (
            f"/apis/coordination.k8s.io/v1/namespaces/{settings.namespace}/leases/{settings.name}"
        )
        self._observed: tuple[Any, float] | None = None  # (record, when this process saw it)

    def _expired(self, spec: dict[str, Any]) -> bool:
        record = (spec.get("holderIdentity"), spec.get("renewTime"))
        now = self.fence.clock()
        if self._observed is None or self._observed[0] != record:
            self._observed = (record, now)
        return now - self._observed[1] > float(spec.get("leaseDurationSeconds") or 0)

    def retry_delay(self, retry_after_s: float | None = None) -> float:
        """The pause before the next try: jittered, never shorter than ``Retry-After``."""
        s = self.settings
        drawn = self.rng.uniform(s.retry_min_s, s.retry_max_s)
        return drawn if retry_after_s is None else max(drawn, retry_after_s)

    async def try_acquire(self) -> bool:
        """One try, of at most ``try_timeout_s``: take the Lease if it is free or ours,
        renewing it if ours (the fence counts from when the try began). Raises
        :class:`ApiError`, or ``asyncio.TimeoutError``."""
        began = self.fence.clock()
        async with asyncio.timeout(self.settings.try_timeout_s):  # wait_for may eat a cancel
            if not await self._try_acquire():
                return False
        self.fence.renewed(began)
        return True

    async def _try_acquire(self) -> bool:
        s = self.settings
        lease = await self.api.request("GET", self.path)
        spec_new = {
            "holderIdentity": s.identity,
            "leaseDurationSeconds": s.lease_seconds,
            "renewTime": _now(),
        }
        if lease is None:
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": s.name, "namespace": s.namespace},
                "spec": {**spec_new, "acquireTime": spec_new["renewTime"], "leaseTransitions": 0},
            }
            try:
                await self.api.request("POST", self.path.rsplit("/", 1)[0], body)
            except ApiError as exc:
                if exc.status in _CONFLICT:
                    return False
                raise
            return True
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity")
        if holder not in (None, "", s.identity) and not self._expired(spec):
            return False
        if holder != s.identity:
            spec_new["acquireTime"] = spec_new["renewTime"]
            spec_new["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
        version = lease["metadata"].get("resourceVersion")
        patch = [
            {"op": "test", "path": "/metadata/resourceVersion", "value": version},
            *({"op": "add", "path": f"/spec/{k}", "value": v} for k, v in spec_new.items()),
        ]
        try:
            await self.api.request("PATCH", self.path, patch, "application/json-patch+json")
        except ApiError as exc:
            if exc.status in _CONFLICT and holder != s.identity:
                return False  # someone else wrote it first
            # its own Lease changed since the read (a late try of its own landed, or its
            # labels were edited): a failed try, and the next one reads it again
            raise
        return True

    async def acquire(self) -> None:
        """Wait until this replica leads."""
        while True:
            retry_after: float | None = None
            try:
                if await self.try_acquire():
                    log.info("leading (lease %s as %s)", self.settings.name, self.settings.identity)
                    return
            except ApiError as exc:
                log.warning("lease %s: %s", self.settings.name, exc)
                retry_after = exc.retry_after_s
            except asyncio.TimeoutError:
                log.warning("lease %s: no answer in %gs", self.settings.name,
                            self.settings.try_timeout_s)  # fmt: skip
            await self.sleep(self.retry_delay(retry_after))

    async def hold(self) -> NoReturn:
        """Renew every ``renew_s`` from the start of the last renewal; a failed try again
        after :meth:`retry_delay`, for as long as the fence holds; once the Lease is
        taken or the fence's time ran out, the fence's ``on_lost``."""
        name = self.settings.name
        clock = self.fence.clock
        next_at = clock() + self.settings.renew_s
        while True:
            await self.sleep(max(0.0, next_at - clock()))
            self.fence.check()  # paused past its time: nothing more, the renewal neither
            began = clock()
            retry_after: float | None = None
            try:
                if await self.try_acquire():
                    next_at = began + self.settings.renew_s
                    continue
                self.fence.lose(f"lease {name} taken by another replica")
            except ApiError as exc:
                log.warning("lease %s not renewed: %s", name, exc)
                retry_after = exc.retry_after_s
            except asyncio.TimeoutError:
                log.warning("lease %s not renewed: no answer in %gs", name,
                            self.settings.try_timeout_s)  # fmt: skip
            if self.fence.expired():
                self.fence.lose(f"lease {name} could not be renewed in time")
            next_at = clock() + self.retry_delay(retry_after)
