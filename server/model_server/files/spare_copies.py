"""Memory for the next version's private copy, ready before its load starts.

Why: reading a model file into *fresh* pages costs the kernel a page allocation and a
zeroing per page: 235 ms for 400 MiB on an H100 host, against 65 ms into pages already
there (bench/results/h100/NOTES.md). A model's versions are usually one size (the same
architecture, new weights), so the last version's private copy, once its engine is made,
is the next one's memory: it is kept here (at most ``budget_bytes`` in all) rather than
given back, and the next read of a file of exactly that size fills it (every byte
rewritten, the hash taken of what was written). The pages are this process's alone
all the while: the memfd is mode 0400 and sealed at its size, and only a copy no view
still holds is kept (:meth:`PrivateCopy.close`).

Peak memory does not grow: a load's private copy held this much anyway; what changes is
that it stays held between loads (``--spare-copy-mb 0``: never)."""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

# what a runtime did to a copy's memory that must be undone before its pages go (a
# device driver's registration of them as pinned memory), by who did it
Pins = dict[str, Callable[[], None]]


@dataclass(frozen=True)
class SpareCopy:
    """A memfd (owned by ``closer``) and its shared writable mapping, ``size`` bytes,
    sealed against resizing, its pages already in memory; ``pins``: kept with them (a
    registration made for an earlier version serves the next one read into them)."""

    memfd: int
    mapping: mmap.mmap
    closer: weakref.finalize
    size: int
    pins: Pins = field(default_factory=dict)


class SpareCopies:
    """At most ``budget_bytes`` of spare copies, the newest kept first; taken by exact
    size. Thread-safe: loads of several models read at once."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = max(0, budget_bytes)
        self._spares: list[SpareCopy] = []
        self._lock = threading.Lock()
        self._closed = False  # after close(): nothing is kept (no one would free it)
        self.taken = 0  # reads that found their memory ready (for the load's stages)

    def take(self, size: int) -> SpareCopy | None:
        """A spare of ``size`` bytes, now the caller's; ``None`` if none is kept."""
        with self._lock:
            for index, spare in enumerate(self._spares):
                if spare.size == size and not spare.mapping.closed:
                    del self._spares[index]
                    self.taken += 1
                    return spare
        return None

    def keep(self, spare: SpareCopy) -> list[SpareCopy]:
        """Keep ``spare`` for a later read; returns those that do not fit the budget
        (``spare`` itself, or older ones it displaced), which the caller frees."""
        if spare.size > self.budget_bytes or spare.size == 0:
            return [spare]
        with self._lock:
            if self._closed:
                return [spare]
            self._spares.insert(0, spare)
            kept, dropped, total = [], [], 0
            for one in self._spares:
                if total + one.size <= self.budget_bytes:
                    kept.append(one)
                    total += one.size
                else:
                    dropped.append(one)
            self._spares = kept
        return dropped

    def held_bytes(self) -> int:
        with self._lock:
            return sum(s.size for s in self._spares)

    def clear(self) -> list[SpareCopy]:
        """Every spare, now the caller's to free."""
        with self._lock:
            spares, self._spares = self._spares, []
        return spares

    def close(self) -> list[SpareCopy]:
        """Every spare, now the caller's to free; a copy let go later (a load that was
        still running) is given back rather than kept."""
        with self._lock:
            self._closed = True
            spares, self._spares = self._spares, []
        return spares


def rewind(spare: SpareCopy) -> None:
    """Put the memfd's offset back at 0: the file is copied into it in order from there
    (``sendfile`` writes at the descriptor's offset, left at the end by the last read)."""
    os.lseek(spare.memfd, 0, os.SEEK_SET)
