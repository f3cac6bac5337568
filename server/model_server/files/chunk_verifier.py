"""A buffer checked against the signed per-chunk digests of its manifest while it fills:
each chunk is hashed on a small pool of threads as soon as its last byte is in, so
the check of a model file is split across cores (``hashlib`` lets the GIL go for large
buffers) instead of one sha256 stream, which cannot be. Only the buffer's own bytes are
hashed, never the file they came from. The chunk digests are signed with the
whole-file digest (and the sidecar checked that both describe the same bytes), so
bytes whose every chunk matches are the bytes of that whole-file digest."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from model_rollout_contract.manifest import Chunks, Manifest
from model_server.files.chunk_hasher import Hash, following

# threads that hash chunks at once: a core is left to the read into the private copy
# (sendfile copies on the reading thread), and at most 4, to leave cores to serving.
# With 1 (2 cores, where the read is the floor) the file is hashed as one stream instead
# (:func:`~.private_copy.read_into_private_copy`): whole chunks would start later.
WORKERS = max(1, min(4, (os.cpu_count() or 1) - 1))


class Mismatch(Exception):
    """The bytes read are not those the manifest describes (size or a chunk's digest)."""


@dataclass(frozen=True)
class ExpectedBytes:
    """What a model file must hold, by its manifest: its size, its whole-file sha256 and
    the sha256 of each chunk."""

    size: int
    sha256: str
    chunks: Chunks

    @classmethod
    def of(cls, manifest: Manifest | None, name: str) -> ExpectedBytes | None:
        """The manifest's chunk digests of the model file ``name``; None without a
        manifest, without chunks, or when it describes another file (then the file is
        hashed whole and compared, as before)."""
        if manifest is None or manifest.chunks is None or manifest.file != name:
            return None
        return cls(manifest.size, manifest.sha256, manifest.chunks)

    def check_size(self, size: int, shown: str) -> None:
        if size != self.size:
            raise Mismatch(f"{shown} has {size} bytes, its manifest says {self.size}")


class ChunkVerifier:
    """Checks ``buffer`` (``expected.size`` bytes) chunk by chunk as :meth:`filled`
    says its ranges are in, on up to ``workers`` threads; :meth:`finish` waits for the
    last and gives the whole-file digest the chunks are signed with, or raises
    :class:`Mismatch`. The ranges must follow one another from 0, as
    :class:`~model_server.files.chunk_hasher.ChunkHasher`'s."""

    def __init__(
        self,
        buffer: memoryview,
        expected: ExpectedBytes,
        shown: str,
        workers: int | None = None,  # WORKERS
        new_hash: Callable[[], Hash] = hashlib.sha256,
    ) -> None:
        self._buffer = buffer
        self._expected = expected
        self._shown = shown
        self._new_hash = new_hash
        threads = max(1, workers or WORKERS)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="verify")
        self._checks: list[Future[str | None]] = []  # chunk i's digest, in order
        self._next = 0  # where the next range must start: no gap, no overlap
        self._stopped = False

    def filled(self, start: int, end: int) -> None:
        """``buffer[start:end]`` holds its final bytes: hash each chunk now complete."""
        self._next = following(self._next, start, end)
        chunks, size = self._expected.chunks, self._expected.size
        while len(self._checks) < len(chunks.sha256):
            first, last = chunks.span(len(self._checks), size)
            if last > end:
                break
            self._checks.append(self._pool.submit(self._hash, first, last))

    def finish(self) -> str:
        """The manifest's whole-file digest once every chunk matched its own (raises
        :class:`Mismatch` for the first that did not, or what hashing raised)."""
        try:
            if len(self._checks) != len(self._expected.chunks.sha256):
                raise ValueError(f"{self._next} of {self._expected.size} bytes filled")
            for index, (check, wanted) in enumerate(
                zip(self._checks, self._expected.chunks.sha256, strict=True)
            ):
                got = check.result()
                if got != wanted:
                    first, last = self._expected.chunks.span(index, self._expected.size)
                    raise Mismatch(
                        f"sha256 of {self._shown} bytes {first}-{last} (chunk {index} of "
                        f"{len(self._checks)}) is {got}, its manifest says {wanted}"
                    )
            return self._expected.sha256
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Stop without a digest, and wait until no view of the buffer is held here (the
        caller may then unmap it)."""
        self._stopped = True
        for check in self._checks:
            check.cancel()
        self._pool.shutdown(wait=True)

    def _hash(self, start: int, end: int) -> str | None:
        if self._stopped:
            return None
        digest = self._new_hash()
        with self._buffer[start:end] as chunk:
            digest.update(chunk)
        return digest.hexdigest()
