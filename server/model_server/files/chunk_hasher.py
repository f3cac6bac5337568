"""The sha256 of a buffer filled chunk by chunk, computed while it fills: each chunk is
hashed on a thread of its own as soon as it is in the buffer, so a model file's read and
its hash overlap (``hashlib`` lets the GIL go for large buffers) and cost about the
longer of the two, not their sum. Only the buffer's own bytes are hashed, in order,
never the file they came from."""

from __future__ import annotations

import hashlib
import queue
import threading
from collections.abc import Callable
from typing import Protocol


class Hash(Protocol):
    """What is needed of a ``hashlib`` object (a test's may record its calls)."""

    def update(self, data: memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


def following(done: int, start: int, end: int) -> int:
    """``end``, once ``[start, end)`` is checked to follow ``done`` bytes filled in order
    (no gap, no overlap); raises ``ValueError`` otherwise."""
    if start != done or end < start:
        raise ValueError(f"range {start}:{end} does not follow {done}")
    return end


class ChunkHasher:
    """Hashes ``buffer[start:end]`` for each :meth:`filled` range, in the order given,
    on its own thread; :meth:`finish` waits for the last and gives the hex digest.
    The ranges must follow one another from 0 (the caller fills the buffer in order)."""

    def __init__(self, buffer: memoryview, new_hash: Callable[[], Hash] = hashlib.sha256) -> None:
        self._buffer = buffer
        self._hash = new_hash()
        self._ranges: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        self._next = 0  # where the next range must start: no gap, no overlap
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="hash", daemon=True)
        self._thread.start()

    def filled(self, start: int, end: int) -> None:
        """``buffer[start:end]`` holds its final bytes: hash them next."""
        self._next = following(self._next, start, end)
        if end > start:
            self._ranges.put((start, end))

    def finish(self) -> str:
        """The hex digest of everything filled, once hashed (raises what hashing raised)."""
        self._ranges.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._hash.hexdigest()

    def abandon(self) -> None:
        """Stop without a digest, and wait until no view of the buffer is held here (the
        caller may then unmap it)."""
        self._stopped = True
        self._ranges.put(None)
        self._thread.join()

    def _run(self) -> None:
        try:
            while (span := self._ranges.get()) is not None:
                if self._stopped:
                    continue
                with self._buffer[span[0] : span[1]] as chunk:
                    self._hash.update(chunk)
        except BaseException as exc:  # raised by finish(), on the caller's thread
            self._error = exc
