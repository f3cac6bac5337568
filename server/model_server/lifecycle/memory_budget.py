"""One memory budget for the whole server: what every model's engines hold (loaded
versions, and dropped ones that requests in flight still keep open) plus what the loads
in progress have reserved. A load reserves its estimate before it starts and gives it
back when it ends, so two loads at once can never overshoot together. A retained version
that requests still pin frees nothing when evicted, so it is not counted as room.

Tenants share the budget under caps of their own (``memory_mb`` in the tenants file): a
tenant's models (``tenant/name``) together hold and reserve at most their tenant's cap,
so one tenant's versions and loads cannot take the room another tenant's next load
needs. A load makes room only from its own model's retained versions, so it never
evicts another tenant's rollback target."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from model_rollout_contract.names import ModelKey
from model_server.errors import MemoryBudgetExceeded
from model_server.lifecycle.model_slot import LoadedVersion

MIB = 2**20


@dataclass
class Reservation:
    """Bytes set aside for one load; ``evicted`` are the retained versions unloaded to
    make room (to be restored if the load fails)."""

    budget: MemoryBudget | None
    nbytes: int
    evicted: list[LoadedVersion] = field(default_factory=list)
    tenant: str | None = None

    def release(self) -> None:
        if self.budget is not None:
            self.budget._release(self.nbytes, self.tenant)
            self.budget = None


class MemoryBudget:
    def __init__(
        self,
        limit_bytes: int | None,
        held_bytes: Callable[[str | None], int],
        tenant_caps: Mapping[str, int] | None = None,
    ) -> None:
        self.limit_bytes = limit_bytes
        # by the open engines of every model (None), or of one tenant's models
        self.held_bytes = held_bytes
        self.tenant_caps = dict(tenant_caps or {})
        self._reserved = 0
        self._reserved_by: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def reserved_bytes(self) -> int:
        return self._reserved

    def _spare(self, tenant: str | None) -> tuple[int, str | None]:
        """Room left before the tightest limit on ``tenant``'s load, and what to say if
        the load does not fit (``None``: unlimited)."""
        spare, message = None, None
        if self.limit_bytes is not None:
            held = self.held_bytes(None)
            spare = self.limit_bytes - held - self._reserved
            message = (
                f"{held / MIB:.1f} MiB are held by open engines (loaded versions, and "
                f"dropped ones still running requests) and "
                f"{self._reserved / MIB:.1f} MiB reserved by loads in progress, "
                f"of a memory budget of {self.limit_bytes / MIB:.1f} MiB"
            )
        cap = self.tenant_caps.get(tenant) if tenant is not None else None
        if cap is not None and tenant is not None:
            held = self.held_bytes(tenant)
            reserved = self._reserved_by.get(tenant, 0)
            tenant_spare = cap - held - reserved
            if spare is None or tenant_spare < spare:
                spare = tenant_spare
                message = (
                    f"tenant {tenant}'s models hold {held / MIB:.1f} MiB (loaded versions, "
                    f"and dropped ones still running requests) and its loads in progress "
                    f"{reserved / MIB:.1f} MiB, of its memory cap of {cap / MIB:.1f} MiB"
                )
        return (spare if spare is not None else -1), message

    def reserve(
        self,
        key: str,
        version: str,
        needed: int,
        evictable: Sequence[LoadedVersion],
        evict: Callable[[LoadedVersion], None],
    ) -> Reservation:
        """Set ``needed`` bytes aside for loading ``key:version``. If they fit only without some
        of ``evictable`` (retained versions, the least recently served first), those are
        evicted — only those no request pins, since evicting a pinned one frees nothing
        until its requests end; if they would not fit even then, nothing is evicted and
        ``MemoryBudgetExceeded`` says what is held. (Every caller runs on the event loop,
        as do the pins: nothing changes between the count and the evictions.)"""
        tenant, what = ModelKey.tenant_in(key), f"{key}:{version}"
        with self._lock:
            spare, message = self._spare(tenant)
            if message is None:  # no budget and no cap on this load
                return Reservation(None, 0)
            unpinned = [v for v in evictable if v.in_flight == 0]
            freeable = sum(v.memory_bytes for v in unpinned)
            if needed > spare + freeable:
                raise MemoryBudgetExceeded(
                    f"loading {what} needs about {needed / MIB:.1f} MiB; {message}"
                )
            evicted = []
            for old in unpinned:
                if needed <= spare:
                    break
                evict(old)
                evicted.append(old)
                spare += old.memory_bytes
            self._reserved += needed
            if tenant is not None:
                self._reserved_by[tenant] = self._reserved_by.get(tenant, 0) + needed
        return Reservation(self, needed, evicted, tenant)

    def _release(self, nbytes: int, tenant: str | None = None) -> None:
        with self._lock:
            self._reserved -= nbytes
            if tenant is not None and tenant in self._reserved_by:
                self._reserved_by[tenant] -= nbytes
