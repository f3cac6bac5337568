"""Leader election on a ``coordination.k8s.io/v1`` Lease, as client-go's leaderelection:
of several operator replicas one leads and runs the rollouts; the others wait. A Lease is
free when it has no holder, or when its record has not changed for its duration (judged
on this process's clock since it saw the record, never on the holder's timestamps, so
clock skew between nodes does not matter). Every write carries the resourceVersion it
read, so two candidates can never both win. A leader that cannot renew within the
duration stops leading (and the process exits, to come back as a candidate).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from .errors import ApiError
from .kube_client import KubeClient

log = logging.getLogger(__name__)
_CONFLICT = (409, 422)  # resourceVersion precondition failed


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class LeaseSettings:
    namespace: str
    name: str = "model-rollout-operator"
    identity: str = ""  # this replica (its pod name)
    duration_s: float = 15.0  # a silent leader is replaced this long after its last renewal
    renew_s: float = 5.0  # the leader renews this often
    retry_s: float = 2.0  # a candidate looks this often


class LeaderElection:
    def __init__(self, api: KubeClient, settings: LeaseSettings) -> None:
        self.api = api
        self.settings = settings
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
        """One attempt: take the Lease if it is free or ours, renewing it if ours."""
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

    async def hold(self) -> None:
        """Renew until that fails for longer than the lease lasts; then return (lost)."""
        renewed = time.monotonic()
        while True:
            await asyncio.sleep(self.settings.renew_s)
            try:
                if await self.try_acquire():
                    renewed = time.monotonic()
                    continue
                log.warning("lease %s taken by another replica", self.settings.name)
                return
            except ApiError as exc:
                log.warning("lease %s not renewed: %s", self.settings.name, exc)
            if time.monotonic() - renewed > self.settings.duration_s - self.settings.renew_s:
                log.error("lease %s could not be renewed in time", self.settings.name)
                return
