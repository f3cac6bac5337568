"""A model file is hashed while it is read (issue 33): each chunk of the private copy is
hashed on another thread as soon as it is in, so the stage costs about the longer of
the read and the hash, not their sum. What is hashed is still the private copy's bytes
(never the file), a file that changes size is refused, and at most ``size`` + 1 bytes
are read. Shown by the order of events of an instrumented reader and hasher, never by
timings."""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import mmap
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from model_rollout_contract.manifest import sha256_stream_chunked
from model_server.files import chunk_verifier, private_copy
from model_server.files.chunk_verifier import ExpectedBytes, Mismatch
from model_server.files.private_copy import read_into_private_copy

CHUNK = 4096


class RecordingHash:
    """sha256 that records each chunk it is given (the order, and what it views)."""

    def __init__(self, events: list[tuple[str, int]], hashed: threading.Semaphore) -> None:
        self._real = hashlib.sha256()
        self._events = events
        self._hashed = hashed
        self.viewed: list[object] = []

    def update(self, data: memoryview, /) -> None:
        self.viewed.append(data.obj)
        self._real.update(data)
        self._events.append(("hash", len(data)))
        self._hashed.release()

    def hexdigest(self) -> str:
        return self._real.hexdigest()


def read(path: Path, size: int | None = None, **kwargs: object) -> private_copy.HashedCopy:
    fd = os.open(path, os.O_RDONLY)
    try:
        told = path.stat().st_size if size is None else size
        return read_into_private_copy(fd, told, "model.onnx", str(path), **kwargs)  # type: ignore[arg-type]
    finally:
        os.close(fd)


def test_each_chunk_is_hashed_while_the_next_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader of chunk k waits until chunk k-1 was hashed (a bound only against a
    hang): read then hash, one after the other, could never interleave so."""
    path = tmp_path / "model.onnx"
    data = os.urandom(3 * CHUNK + 5)
    path.write_bytes(data)
    events: list[tuple[str, int]] = []
    hashed = threading.Semaphore(0)
    hashers: list[RecordingHash] = []
    real = os.sendfile

    def slow_sendfile(out_fd: int, in_fd: int, offset: int, count: int) -> int:
        if offset:
            hashed.acquire(timeout=5)  # the previous chunk's hash, if it runs alongside
        n = real(out_fd, in_fd, offset, count)
        events.append(("read", offset))
        return n

    def new_hash() -> RecordingHash:
        hashers.append(RecordingHash(events, hashed))
        return hashers[-1]

    monkeypatch.setattr(os, "sendfile", slow_sendfile)
    hashed_copy = read(path, chunk_bytes=CHUNK, new_hash=new_hash)
    assert events == [
        ("read", 0), ("hash", CHUNK),
        ("read", CHUNK), ("hash", CHUNK),
        ("read", 2 * CHUNK), ("hash", CHUNK),
        ("read", 3 * CHUNK), ("hash", 5),
    ]  # fmt: skip
    assert hashed_copy.sha256 == hashlib.sha256(data).hexdigest()
    assert bytes(hashed_copy.copy.view) == data
    # the hash read the private copy (its mapping), never the file
    assert hashers[0].viewed and all(isinstance(o, mmap.mmap) for o in hashers[0].viewed)
    assert hashed_copy.copy.mapping in hashers[0].viewed
    hashed_copy.copy.close()


def test_the_digest_is_of_the_bytes_copied_not_of_the_file_changed_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file is rewritten right after each chunk is copied: the digest is still that
    of the private copy, which is what is loaded."""
    path = tmp_path / "model.onnx"
    data = os.urandom(3 * CHUNK)
    path.write_bytes(data)
    real = os.sendfile
    writer = os.open(path, os.O_WRONLY)

    def sendfile_then_rewrite(out_fd: int, in_fd: int, offset: int, count: int) -> int:
        n = real(out_fd, in_fd, offset, count)
        os.pwrite(writer, b"\0" * n, offset)
        return n

    monkeypatch.setattr(os, "sendfile", sendfile_then_rewrite)
    try:
        hashed_copy = read(path, chunk_bytes=CHUNK)
    finally:
        os.close(writer)
    assert path.read_bytes() == b"\0" * len(data)
    assert bytes(hashed_copy.copy.view) == data
    assert hashed_copy.sha256 == hashlib.sha256(data).hexdigest()
    hashed_copy.copy.close()


@pytest.mark.parametrize("change", ["shrinks", "grows"])
def test_a_file_that_changes_size_midway_is_refused_reading_at_most_size_plus_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    path = tmp_path / "model.onnx"
    size = 3 * CHUNK
    path.write_bytes(os.urandom(size))
    asked: list[int] = []  # bytes asked of the file, by sendfile and pread
    real_sendfile, real_pread = os.sendfile, os.pread

    def sendfile(out_fd: int, in_fd: int, offset: int, count: int) -> int:
        asked.append(count)
        n = real_sendfile(out_fd, in_fd, offset, count)
        if offset == 0:  # after the first chunk, the file changes size
            with open(path, "r+b") as f:
                f.truncate(CHUNK + 10) if change == "shrinks" else f.truncate(10 * size)
        return n

    def pread(fd: int, count: int, offset: int) -> bytes:
        asked.append(count)
        return real_pread(fd, count, offset)

    monkeypatch.setattr(os, "sendfile", sendfile)
    monkeypatch.setattr(os, "pread", pread)
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(OSError, match="changed size while it was read"):
        read(path, size, chunk_bytes=CHUNK)
    assert sum(asked) <= size + 1
    # the hashing thread stopped and holds no view of the copy
    assert not [t for t in threading.enumerate() if t.ident not in before and t.name == "hash"]


@pytest.mark.parametrize("mib", [0, 1, 25, 100, 400, 4000])
def test_chunks_are_whole_pages_a_sixteenth_of_the_file_within_bounds(mib: int) -> None:
    """Small files in chunks small enough that the hash is never far behind; large ones
    in few chunks (each asks for the GIL back behind the serving threads)."""
    chunk = private_copy.chunk_bytes_for(mib * 2**20 + 123)
    assert chunk % mmap.PAGESIZE == 0
    assert private_copy.MIN_CHUNK_BYTES <= chunk <= private_copy.CHUNK_BYTES
    if private_copy.MIN_CHUNK_BYTES < mib * 2**20 // 16 < private_copy.CHUNK_BYTES:
        assert chunk <= mib * 2**20 // 16


# --- checked by the manifest's chunk digests (one sha256 stream cannot be split) ---

MIB = 2**20


def expected_of(data: bytes, chunk: int = MIB) -> ExpectedBytes:
    whole, chunks = sha256_stream_chunked(io.BytesIO(data), chunk)
    return ExpectedBytes(len(data), whole, chunks)


class BarrierHash:
    """sha256 whose first updates (as many as the barrier's parties) wait for one
    another: they pass only if that many chunks are hashed at once (the timeout is a
    bound against a hang only)."""

    def __init__(self, barrier: threading.Barrier, order: Iterator[int], threads: set[str]):
        self._real = hashlib.sha256()
        self._barrier = barrier
        self._order = order
        self._threads = threads

    def update(self, data: memoryview, /) -> None:
        self._threads.add(threading.current_thread().name)
        if next(self._order) < self._barrier.parties:
            with contextlib.suppress(threading.BrokenBarrierError):
                self._barrier.wait(timeout=5)
        self._real.update(data)

    def hexdigest(self) -> str:
        return self._real.hexdigest()


def test_chunks_are_checked_on_several_threads_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "model.onnx"
    data = os.urandom(3 * MIB + 5)
    path.write_bytes(data)
    monkeypatch.setattr(chunk_verifier, "WORKERS", 2)
    barrier, order, threads = threading.Barrier(2), itertools.count(), set[str]()
    hashed_copy = read(
        path, chunk_bytes=MIB, expected=expected_of(data),
        new_hash=lambda: BarrierHash(barrier, order, threads),
    )  # fmt: skip
    assert not barrier.broken  # two chunks were hashed at the same time
    assert len(threads) == 2 and all(t.startswith("verify") for t in threads)
    assert hashed_copy.sha256 == hashlib.sha256(data).hexdigest()  # the manifest's
    assert bytes(hashed_copy.copy.view) == data
    hashed_copy.copy.close()


def test_with_chunk_digests_the_file_is_never_hashed_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(chunk_verifier, "WORKERS", 2)
    path = tmp_path / "model.onnx"
    data = os.urandom(2 * MIB)
    path.write_bytes(data)
    lengths: list[int] = []

    class Recording:
        def __init__(self) -> None:
            self._real = hashlib.sha256()

        def update(self, data: memoryview, /) -> None:
            lengths.append(len(data))
            self._real.update(data)

        def hexdigest(self) -> str:
            return self._real.hexdigest()

    def no_stream(*args: object) -> None:
        raise AssertionError("hashed as one stream")

    monkeypatch.setattr(private_copy, "ChunkHasher", no_stream)
    hashed_copy = read(path, chunk_bytes=MIB // 4, expected=expected_of(data), new_hash=Recording)
    assert sorted(lengths) == [MIB, MIB]  # each chunk once, as a whole
    hashed_copy.copy.close()


@pytest.mark.parametrize(("offset", "chunk"), [(MIB + 123, 1), (3 * MIB + 2, 3)])
def test_a_flipped_byte_is_refused_by_its_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offset: int, chunk: int
) -> None:
    """In a middle chunk, and in the last, partial one."""
    monkeypatch.setattr(chunk_verifier, "WORKERS", 2)
    path = tmp_path / "model.onnx"
    data = bytearray(os.urandom(3 * MIB + 5))
    expected = expected_of(bytes(data))
    data[offset] ^= 0x40
    path.write_bytes(data)
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(Mismatch, match=rf"bytes \d+-\d+ \(chunk {chunk} of 4\)"):
        read(path, chunk_bytes=MIB, expected=expected)
    # the hashing threads stopped and hold no view of the copy
    assert not [t for t in threading.enumerate() if t.ident not in before]


@pytest.mark.parametrize("change", [-1, 1])
def test_a_file_of_another_size_than_its_manifest_s_is_refused_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: int
) -> None:
    path = tmp_path / "model.onnx"
    data = os.urandom(2 * MIB + 5)
    path.write_bytes(data[:change] if change < 0 else data + b"x")
    copied: list[int] = []
    monkeypatch.setattr(os, "sendfile", lambda *args: copied.append(1))
    with pytest.raises(Mismatch, match=f"has {len(data) + change} bytes, its manifest says"):
        read(path, expected=expected_of(data))
    assert copied == []
