"""Leader election on a ``coordination.k8s.io/v1`` Lease, as client-go's leaderelection:
of several operator replicas one leads and runs the rollouts; the others wait. A Lease is
free when it has no holder, or when its record has not changed for its duration (judged
on this process's clock since it saw the record, never on the holder's timestamps, so
clock skew between nodes does not matter). Every write carries the resourceVersion it
read, so two candidates can never both win.

Fencing: a leader acts only while its last renewal *began* less than the duration minus
a margin (one renewal period) ago on its monotonic clock, which a paused process
(SIGSTOP, a frozen VM) does not stop. A standby takes over no earlier than the duration
after it saw that renewal, so the leader's time runs out first, whatever it was doing
when it froze. :class:`LeaseFence` is checked before every pass and every write; once the
time is out, or the Lease is seen taken or could not be renewed, the process exits at
once (status :data:`LEASE_LOST_EXIT`, to come back as a candidate): a graceful stop would
run what was in flight, from a memory that may be long stale.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, NoReturn

from .errors import ApiError
from .kube_client import KubeClient

log = logging.getLogger(__name__)
_CONFLICT = (409, 422)  # resourceVersion precondition failed
LEASE_LOST_EXIT = 3  # the exit status of a replica that stopped leading


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class LeaseSettings:
    namespace: str
    name: str = "model-rollout-operator"
    identity: str = ""  # this replica (its pod name)
    duration_s: float = 15.0  # a silent leader is replaced this long after its last renewal
    renew_s: float = 5.0  # the leader renews this often
    retry_s: float = 2.0  # a candidate looks this often (and a leader retries a renewal)

    @property
    def valid_s(self) -> float:
        """How long after a renewal began its leader may act: the duration less one
        renewal period (client-go's renew deadline), for a write checked just before it
        is sent and for clocks that run at slightly different rates."""
        return self.duration_s - self.renew_s


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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.valid_s = valid_s
        self.on_lost = on_lost
        self.clock = clock
        self._renewed: float | None = None  # when the last successful renewal began

    def renewed(self, began: float) -> None:
        """A renewal that began at ``began`` (this clock) succeeded."""
        self._renewed = began if self._renewed is None else max(self._renewed, began)

    def expired(self) -> bool:
        return self._renewed is None or self.clock() - self._renewed >= self.valid_s

    def check(self) -> None:
        """Return only while this replica may act; else ``on_lost``."""
        if self.expired():
            self.lose(f"not renewed for {self.valid_s:g}s")

    def lose(self, why: str) -> NoReturn:
        self.on_lost(why)
        raise AssertionError("on_lost returned")  # it must not: never act on


class LeaderElection:
    def __init__(
        self, api: KubeClient, settings: LeaseSettings, fence: LeaseFence | None = None
    ) -> None:
        self.api = api
        self.settings = settings
        self.fence = fence or LeaseFence(settings.valid_s)
        self.path = (
            f"/apis/coordination.k8s.io/v1/namespaces/{settings.namespace}/leases/{settings.name}"
        )
        self._observed: tuple[Any, float] | None = None  # (record, when this process saw it)

    def _expired(self, spec: dict[str, Any]) -> bool:
        record = (spec.get("holderIdentity"), spec.get("renewTime"))
        now = time.monotonic()
        if self._observed is None or self._observed[0] != record:
            self._observed = (record, now)
        return now - self._observed[1] > float(spec.get("leaseDurationSeconds") or 0)

    async def try_acquire(self) -> bool:
        """One attempt: take the Lease if it is free or ours, renewing it if ours (the
        fence counts from when the attempt began)."""
        began = self.fence.clock()
        if await self._try_acquire():
            self.fence.renewed(began)
            return True
        return False

    async def _try_acquire(self) -> bool:
        s = self.settings
        lease = await self.api.request("GET", self.path)
        spec_new = {
            "holderIdentity": s.identity,
            "leaseDurationSeconds": int(s.duration_s),
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
                if exc.status in (*_CONFLICT, 409):
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
            if exc.status in _CONFLICT:
                return False  # someone else wrote it first
            raise
        return True

    async def acquire(self) -> None:
        """Wait until this replica leads."""
        while True:
            try:
                if await self.try_acquire():
                    log.info("leading (lease %s as %s)", self.settings.name, self.settings.identity)
                    return
            except ApiError as exc:
                log.warning("lease %s: %s", self.settings.name, exc)
            await asyncio.sleep(self.settings.retry_s)

    async def hold(self) -> NoReturn:
        """Renew every ``renew_s`` (a failed renewal again after ``retry_s``) for as long
        as this replica leads; once the Lease is taken or the fence's time ran out, the
        fence's ``on_lost``."""
        name = self.settings.name
        wait = self.settings.renew_s
        while True:
            await asyncio.sleep(wait)
            self.fence.check()  # paused past its time: nothing more, the renewal neither
            try:
                if await self.try_acquire():
                    wait = self.settings.renew_s
                    continue
                self.fence.lose(f"lease {name} taken by another replica")
            except ApiError as exc:
                log.warning("lease %s not renewed: %s", name, exc)
            if self.fence.expired():
                self.fence.lose(f"lease {name} could not be renewed in time")
            wait = self.settings.retry_s
