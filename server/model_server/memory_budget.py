"""One memory budget for the whole server: what every model's engines hold (loaded
versions, and dropped ones that requests in flight still keep open) plus what the loads
in progress have reserved. A load reserves its estimate before it starts and gives it
back when it ends, so two loads at once can never overshoot together. A retained version
that requests still pin frees nothing when evicted, so it is not counted as room."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .errors import MemoryBudgetExceeded
from .model_slot import LoadedVersion

MIB = 2**20


@dataclass
class Reservation:
    """Bytes set aside for one load; ``evicted`` are the retained versions unloaded to
    make room (to be restored if the load fails)."""

    budget: MemoryBudget | None
    nbytes: int
    evicted: list[LoadedVersion] = field(default_factory=list)

    def release(self) -> None:
        if self.budget is not None:
            self.budget._release(self.nbytes)
            self.budget = None


class MemoryBudget:
    def __init__(self, limit_bytes: int | None, held_bytes: Callable[[], int]) -> None:
        self.limit_bytes = limit_bytes
        self.held_bytes = held_bytes  # by the open engines of every model
        self._reserved = 0
        self._lock = threading.Lock()

    @property
    def reserved_bytes(self) -> int:
        return self._reserved

    def reserve(
        self,
        what: str,
        needed: int,
        evictable: Sequence[LoadedVersion],
        evict: Callable[[LoadedVersion], None],
    ) -> Reservation:
        """Set ``needed`` bytes aside for loading ``what``. If they fit only without some
        of ``evictable`` (retained versions, the least recently served first), those are
        evicted — only those no request pins, since evicting a pinned one frees nothing
        until its requests end; if they would not fit even then, nothing is evicted and
        ``MemoryBudgetExceeded`` says what is held. (Every caller runs on the event loop,
        as do the pins: nothing changes between the count and the evictions.)"""
        if self.limit_bytes is None:
            return Reservation(None, 0)
        with self._lock:
            held = self.held_bytes()
            spare = self.limit_bytes - held - self._reserved
            unpinned = [v for v in evictable if v.in_flight == 0]
            freeable = sum(v.memory_bytes for v in unpinned)
            if needed > spare + freeable:
                raise MemoryBudgetExceeded(
                    f"loading {what} needs about {needed / MIB:.1f} MiB; "
                    f"{held / MIB:.1f} MiB are held by open engines (loaded versions, and "
                    f"dropped ones still running requests) and "
                    f"{self._reserved / MIB:.1f} MiB reserved by loads in progress, "
                    f"of a memory budget of {self.limit_bytes / MIB:.1f} MiB"
                )
            evicted = []
            for version in unpinned:
                if needed <= spare:
                    break
                evict(version)
                evicted.append(version)
                spare += version.memory_bytes
            self._reserved += needed
        return Reservation(self, needed, evicted)

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self._reserved -= nbytes
