"""A model file's bytes in memory of this process alone, read and let go without
stalling serving.

Why not ``bytes``: freeing a large ``bytes`` object gives its pages back to the kernel
with the GIL held, and every request in flight waits for it. These bytes are a mapping of
a memfd instead: the kernel copies them into it (``sendfile``; ``readinto`` where it
will not) and they are let go with the GIL released
(:meth:`PrivateCopy.close`). A runtime that loads only from a file or from ``bytes`` (ONNX
Runtime, which would also hold the GIL copying a ``bytes`` argument) opens
the memfd by :attr:`PrivateCopy.path`: the very bytes that were hashed, with no second
copy, which no other process of this user can write (mode 0400, sealed against resizing;
root's override of file modes aside, which pods do not run as)."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import logging
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from model_server.files import chunk_verifier
from model_server.files.chunk_hasher import ChunkHasher, Hash
from model_server.files.chunk_verifier import ChunkVerifier, ExpectedBytes
from model_server.files.spare_copies import Pins, SpareCopies, SpareCopy, rewind

log = logging.getLogger(__name__)


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` through ctypes, which lets the GIL go for the call (Python's
    ``mmap.madvise`` holds it); None without it."""
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function  # type: ignore[no-any-return]


_MADVISE = _libc_madvise()
_MADV_POPULATE_READ = 22  # Linux's value; the mmap module names it on 3.13+ only
# a model file is read and hashed a chunk at a time: a chunk is hashed while the next
# is read, and the hash is left at most one chunk behind after the last byte. At most
# CHUNK_BYTES (few chunks: each asks for the GIL back twice, behind serving threads),
# a sixteenth of the file for smaller ones, at least MIN_CHUNK_BYTES (25 MiB on a
# 2-core VM, idle: 34 ms read then hashed, 28 in 8 MiB chunks, 22 in 2 MiB ones)
CHUNK_BYTES = 8 * 2**20
MIN_CHUNK_BYTES = 2**20


def punch_hole(mapping: mmap.mmap) -> None:
    """Free every page of ``mapping`` (a shared, writable mapping of a memfd) in one call
    made with the GIL released: ``MADV_REMOVE`` punches a hole in the file behind it,
    under the file's own locks once the range is found (the process's memory-map lock
    is held only for reading, and let go before the pages are freed). By address, never
    by file descriptor: a number closed and reused elsewhere could name a file that is
    not ours. Nothing to do for a closed or empty mapping; ``OSError`` if refused."""
    if _MADVISE is None or not hasattr(mmap, "MADV_REMOVE"):
        raise OSError(errno.ENOSYS, "no madvise(MADV_REMOVE) here")
    if mapping.closed or len(mapping) == 0:
        return
    try:
        anchor = ctypes.c_char.from_buffer(mapping)  # an export, for the address only
    except TypeError as exc:  # a read-only mapping: it cannot be ours
        raise OSError(errno.EINVAL, f"not a writable mapping: {exc}") from exc
    address = ctypes.addressof(anchor)
    del anchor  # the export ends here: the mapping can close later
    if _MADVISE(address, len(mapping), mmap.MADV_REMOVE) != 0:  # the kernel rounds it up
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


class PrivateCopy:
    """Read-only bytes and, unless empty, the path this process can open them by (until
    :meth:`close`)."""

    def __init__(
        self,
        view: memoryview,
        path: str | None = None,
        mapping: mmap.mmap | None = None,
        memfd_closer: weakref.finalize | None = None,
        spare: tuple[int, SpareCopies] | None = None,
        pins: Pins | None = None,
    ) -> None:
        """``spare``: the memfd and where its memory goes at :meth:`close` when no view
        holds it any more (kept for the next read of that size, not given back);
        ``pins``: see :meth:`pin`."""
        self.view = view
        self._path = path
        self.mapping = mapping
        self._memfd_closer = memfd_closer
        self._spare = spare
        self.pins: Pins = {} if pins is None else pins
        self._closing = threading.Lock()  # two closes at once: one punches, one returns
        self.closed = False
        # the pages were kept or given back: a later close (once a view went) is a no-op,
        # never a second keep of pages another copy may already be filling
        self._let_go = False

    @property
    def reusable(self) -> bool:
        """Kept for the next read of its size once let go (not given back): work done
        on its pages (:meth:`pin`) pays off over several versions."""
        return self._spare is not None

    @property
    def address(self) -> int | None:
        """Where the bytes start in this process's memory; None when empty or closed."""
        if self.closed or self.mapping is None or self.mapping.closed or not len(self.mapping):
            return None
        anchor = ctypes.c_char.from_buffer(self.mapping)  # an export, for the address only
        address = ctypes.addressof(anchor)
        del anchor
        return address

    def pin(self, owner: str, undo: Callable[[], None]) -> None:
        """Record that ``owner`` did something to these pages (registered them with a
        device driver) that ``undo`` reverses: it is called before the pages are given
        back, never while they are kept for a later read (the next version read into
        them finds ``owner`` in :attr:`pins` and need not do it again)."""
        self.pins[owner] = undo

    @property
    def path(self) -> str | None:
        """``/proc/self/fd/N`` of the memfd; None when empty, closed, or without /proc
        (a runtime is then given the bytes)."""
        if self.closed or self._path is None or not os.path.exists(self._path):
            return None
        return self._path

    def close(self) -> None:
        """Give the memory back now, on this thread. A loader's thread calls this once
        the engine is made, rather than leave it to whichever thread drops the last
        reference (the event loop's, at first: every request waited).

        Why a hole is punched first: one ``munmap`` of hundreds of MiB holds the
        process's memory-map lock for tens of ms, and every thread that maps or faults
        in memory meanwhile (Python's allocator, the CUDA driver) waits. Why in one call
        through ctypes: ``mmap.madvise`` holds the GIL, and freeing in chunks would ask
        for it back after each, behind the serving threads (each way measured:
        bench/results/h200/NOTES.md, 2026-12-03). The empty mapping then unmaps at once.
        A view still exported (a numpy array of the bytes) keeps everything until it
        goes. Never raises: a kernel that refuses the hole leaves the pages to the
        unmapping."""
        with self._closing:
            self.closed = True
            if self._let_go:
                return
            try:
                self.view.release()
            except BufferError:
                undo_pins(self.pins)
                return
            mapping = self.mapping
            if mapping is None or mapping.closed:
                return
            if _still_viewed(mapping):  # never kept: unmapped by whoever drops it last
                undo_pins(self.pins)
                return
            self._let_go = True
            if self._spare is not None and self._memfd_closer is not None:
                memfd, spares = self._spare
                kept = SpareCopy(memfd, mapping, self._memfd_closer, len(mapping), self.pins)
                for dropped in spares.keep(kept):
                    free(dropped.mapping, dropped.closer, dropped.pins)
                return
            free(mapping, self._memfd_closer, self.pins)


def free(mapping: mmap.mmap, memfd_closer: weakref.finalize | None, pins: Pins) -> None:
    """Give a private copy's pages back: undo its ``pins`` first, then punch a hole
    (see :meth:`PrivateCopy.close`), unmap it and close its memfd. Never raises: a kernel
    that refuses the hole leaves the pages to the unmapping."""
    undo_pins(pins)
    try:
        punch_hole(mapping)
    except OSError as exc:
        log.warning("could not punch a hole in a model's private copy: %s", exc)
    mapping.close()
    if memfd_closer is not None:
        memfd_closer()  # the memfd too, now (once: the finalizer is spent)


def undo_pins(pins: Pins) -> None:
    """Undo what runtimes did to a copy's pages (see :meth:`PrivateCopy.pin`) while they
    are still mapped: before they are given back, or before a copy still viewed is left
    to whoever drops the last view (the garbage collector unmaps it then, and knows
    nothing of a driver's registration). Never raises."""
    for owner, undo in list(pins.items()):
        try:
            undo()
        except Exception as exc:  # the pages still go: a driver's error is its own
            log.warning("could not undo %s's pin of a private copy: %s", owner, exc)
    pins.clear()


def _still_viewed(mapping: mmap.mmap) -> bool:
    """Whether a view of ``mapping`` is alive anywhere (a numpy array made from a view
    shares that view's export, so releasing ours does not end it). ``mmap`` says so only
    by refusing to resize while exported: a resize to its own size changes nothing."""
    try:
        mapping.resize(len(mapping))
    except BufferError:
        return True
    except OSError:  # cannot tell: keep the pages (they go with the mapping)
        return True
    return False


class _Check(Protocol):
    """What checks the private copy as it fills: :class:`ChunkHasher` (one sha256
    stream) or :class:`ChunkVerifier` (the manifest's chunk digests, in parallel)."""

    def filled(self, start: int, end: int) -> None: ...

    def finish(self) -> str: ...

    def abandon(self) -> None: ...


@dataclass(frozen=True)
class HashedCopy:
    """A private copy, the sha256 of its bytes (computed, or the manifest's once every
    chunk matched its signed digest), and where the time went: ``read_s`` until its last
    byte was in (hashing alongside), ``hash_wait_s`` after that, waiting for the hash to
    catch up."""

    copy: PrivateCopy
    sha256: str
    read_s: float
    hash_wait_s: float


def read_into_private_copy(
    fd: int,
    size: int,
    name: str,
    shown: str,
    *,
    chunk_bytes: int | None = None,
    new_hash: Callable[[], Hash] = hashlib.sha256,
    expected: ExpectedBytes | None = None,
    spares: SpareCopies | None = None,
) -> HashedCopy:
    """The ``size`` bytes of the open regular file ``fd`` (its ``fstat`` size), read
    once into a new memfd, ``chunk_bytes`` (:func:`chunk_bytes_for` the size) at a
    time, each chunk hashed on another thread as soon as it is in the memfd
    (:class:`ChunkHasher`): the digest is of the private copy's bytes, never of the
    file. ``OSError`` if the file does not hold exactly ``size`` bytes when read (it
    changed meanwhile: at most ``size`` + 1 bytes are read). The memfd is read-only
    for its owner (mode 0400, from before its first byte: no other process of this
    user can open it for writing through ``/proc``, only this descriptor writes) and
    sealed against growing or shrinking once sized.

    With ``expected`` (the manifest's chunk digests: :meth:`ExpectedBytes.of`) a size
    that differs raises :class:`~.chunk_verifier.Mismatch` before anything is read, and
    where there are threads to spare (``chunk_verifier.WORKERS`` > 1) the chunks are
    checked instead of the whole file's sha256, on several threads
    (:class:`ChunkVerifier`; a chunk that differs raises ``Mismatch``). With one, a
    stream of whole chunks would only start later than this one: the file is hashed
    whole and its digest is the caller's to compare, as without chunk digests.

    With ``spares``, a kept copy of exactly ``size`` bytes is filled rather than new
    pages (every byte rewritten: its pages are already there), and the copy goes back to
    ``spares`` when closed (:mod:`.spare_copies`)."""
    started = time.perf_counter()
    if expected is not None:
        expected.check_size(size, shown)
    if size == 0:
        extra = os.read(fd, 1)
        if extra:
            raise OSError(f"{shown} grew while it was read")
        digest = new_hash().hexdigest()
        return HashedCopy(PrivateCopy(memoryview(b"")), digest, time.perf_counter() - started, 0.0)
    spare = spares.take(size) if spares is not None else None
    pins: Pins = spare.pins if spare is not None else {}
    if spare is not None:
        memfd, mapping, closer = spare.memfd, spare.mapping, spare.closer
    else:
        memfd, mapping, closer = _new_memfd(name, size)
    try:
        if spare is not None:
            rewind(spare)
        with memoryview(mapping) as view:
            hasher: _Check = (
                ChunkVerifier(view, expected, shown, new_hash=new_hash)
                if expected is not None and chunk_verifier.WORKERS > 1
                else ChunkHasher(view, new_hash)
            )
            try:
                chunk = chunk_bytes or chunk_bytes_for(size)
                got = _fill(fd, memfd, mapping, size, chunk, hasher)
                grown = bool(os.pread(fd, 1, size))
                if got != size or grown:
                    raise OSError(
                        f"{shown} changed size while it was read ({size} bytes at its fstat)"
                    )
                read = time.perf_counter()
                digest = hasher.finish()
            except BaseException:
                hasher.abandon()  # no view of the mapping left on its thread
                raise
            hash_wait = time.perf_counter() - read
            readonly = view.toreadonly()
    except BaseException:  # refused: the copy goes here, not wherever the error is dropped
        PrivateCopy(memoryview(b""), None, mapping, closer, pins=pins).close()
        raise
    kept = (memfd, spares) if spares is not None else None
    copy = PrivateCopy(readonly, f"/proc/self/fd/{memfd}", mapping, closer, kept, pins)
    return HashedCopy(copy, digest, read - started, hash_wait)


def _new_memfd(name: str, size: int) -> tuple[int, mmap.mmap, weakref.finalize]:
    """A new memfd of ``size`` bytes, mode 0400 from before its first byte, sealed
    against resizing, and its shared writable mapping; the finalizer closes the memfd
    once the last view of the mapping is gone."""
    memfd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.fchmod(memfd, 0o400)  # the descriptor was opened for writing: it still may
        os.ftruncate(memfd, size)
        fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK)
        mapping = mmap.mmap(memfd, size, flags=mmap.MAP_SHARED)
    except BaseException:
        os.close(memfd)
        raise
    return memfd, mapping, weakref.finalize(mapping, os.close, memfd)


def chunk_bytes_for(size: int) -> int:
    """The chunk a file of ``size`` bytes is read and hashed by: a sixteenth of it,
    whole pages, within ``MIN_CHUNK_BYTES`` and ``CHUNK_BYTES``."""
    sixteenth = size // 16 - size // 16 % mmap.PAGESIZE
    return max(MIN_CHUNK_BYTES, min(CHUNK_BYTES, sixteenth))


def _fill(
    fd: int, memfd: int, mapping: mmap.mmap, size: int, chunk_bytes: int, hasher: _Check
) -> int:
    """Copy the file's first ``size`` bytes into the memfd a chunk at a time, each handed
    to ``hasher`` once in; returns the bytes copied (fewer if the file shrank).

    Each chunk is copied by ``sendfile``, in the kernel (the GIL let go): on a VM,
    filling fresh pages through a mapping took a fault per page (48 ms for 25 MiB
    against 28 ms; bench/results/NOTES.md); its pages are then mapped in one call
    (``MADV_POPULATE_READ``, not a fault per page when hashed and loaded). Where the
    kernel will not ``sendfile``, the rest is read through the mapping."""
    got = 0
    send = True
    populate = _Populate(mapping)
    with (
        os.fdopen(fd, "rb", buffering=0, closefd=False) as source,
        memoryview(mapping) as view,
    ):
        while got < size:
            end = min(size, got + chunk_bytes)
            start = got
            if send:
                try:
                    while got < end:  # the memfd's offset follows: it is written in order
                        n = os.sendfile(memfd, fd, got, end - got)
                        if not n:
                            break
                        got += n
                except OSError as exc:  # a file system that cannot splice: read the rest
                    log.debug("sendfile into the private copy refused: %s", exc)
                    send = False
                    os.lseek(fd, got, os.SEEK_SET)  # sendfile at an offset leaves it alone
                populate(start, got)
            if not send:
                while got < end:
                    n = source.readinto(view[got:end])
                    if not n:
                        break
                    got += n
            hasher.filled(start, got)
            if got < end:  # the file ended early
                break
    return got


class _Populate:
    """Maps a range of a fresh mapping's pages in one call made with the GIL released
    (``MADV_POPULATE_READ``, Linux 5.14); does nothing, from the first refusal on,
    where the kernel will not (each page then faults in when first read)."""

    def __init__(self, mapping: mmap.mmap) -> None:
        self._address: int | None = None
        self._madvise = _MADVISE
        if _MADVISE is not None and len(mapping):
            anchor = ctypes.c_char.from_buffer(mapping)  # an export, for the address only
            self._address = ctypes.addressof(anchor)
            del anchor

    def __call__(self, start: int, end: int) -> None:
        if self._madvise is None or self._address is None or end <= start:
            return
        first = start - start % mmap.PAGESIZE
        if self._madvise(self._address + first, end - first, _MADV_POPULATE_READ) != 0:
            self._address = None
