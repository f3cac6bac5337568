"""Build-once cache of compiled engines, shared between the server processes of a pod.

An engine compiled from ONNX is only valid for the exact model bytes, runtime version,
device, precision and shape profile it was built with, so all five make up the key.
A per-entry ``fcntl`` lock lets exactly one process build while the others block and
then reuse the result.

What is served from the cache must be what was built: the digest of every entry is
stored beside it (``<entry>.sha256``, renamed into place after the entry), and a hit
reads the entry once, through the cache directory's descriptor without following a
link, checks those bytes against the digest and hands the same bytes to the backend. An
entry that is a link, not a regular file, lacks its digest or does not match it is built
again, never loaded. Builds happen in a private directory (``mkdtemp``: mode 0700, a
random name) and are renamed into place, so nothing planted in the cache is written
through either.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from model_rollout_contract.manifest import is_sha256, sha256_bytes
from model_server.files.trusted_files import UntrustedPath, read_regular

log = logging.getLogger(__name__)

_UNSAFE = re.compile(r"[^A-Za-z0-9.+-]+")
DIGEST_SUFFIX = ".sha256"  # beside each entry: the sha256 of its bytes, as hex
LOCK_SUFFIX = ".lock"
_BUILD_INFIX = ".build-"  # private build directories: .<entry>.build-<random>
_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


def _slug(text: str) -> str:
    return _UNSAFE.sub("-", text).strip("-").lower() or "none"


@dataclass(frozen=True)
class CacheKey:
    model_name: str
    model_sha256: str
    runtime: str  # e.g. "trt10.3.0" or "ort1.32.0"
    device: str  # e.g. "NVIDIA H200" or the CPU model
    precision: str  # fp32 | fp16 | int8
    shape_profile: str  # e.g. "input:1x4-8x4-32x4" or "dynamic"

    def file_name(self, suffix: str) -> str:
        """``<model>_<gpu>_<trt>_<precision>_<shapes>_<sha12>.<suffix>``."""
        parts = (
            self.model_name,
            self.device,
            self.runtime,
            self.precision,
            self.shape_profile,
            self.model_sha256[:12],
        )
        return "_".join(_slug(p) for p in parts) + f".{suffix}"


@dataclass(frozen=True)
class CacheResult:
    """An entry's bytes, checked against its recorded digest (or just built). Backends
    load ``data``: the file itself could be changed after the check."""

    name: str  # the entry's file name, for messages
    data: bytes = field(repr=False)
    hit: bool
    build_seconds: float
    wait_seconds: float


class BadEntry(Exception):
    """A cache entry that must not be loaded: a link, a special file, no digest beside
    it, or bytes that do not match the digest."""


class EngineCache:
    def __init__(
        self,
        root: str | Path,
        max_bytes: int | None = None,
        max_age_seconds: float | None = None,
        suffix: str = "engine",
    ) -> None:
        self.root = Path(root)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.max_age_seconds = max_age_seconds
        self.suffix = suffix

    def path_for(self, key: CacheKey) -> Path:
        """Where the entry of ``key`` lives (for messages and housekeeping: entries are
        read through :meth:`open` only)."""
        return self.root / key.file_name(self.suffix)

    @contextlib.contextmanager
    def _directory(self) -> Iterator[int]:
        """A descriptor of the cache directory (trusted as configured, like a
        repository's root); everything inside is reached relative to it."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            yield fd
        finally:
            os.close(fd)

    @staticmethod
    def _open_lock(directory: int, name: str) -> int:
        """The entry's lock file, never opened through a link: a link in its place is
        removed and a lock file made instead."""
        try:
            return os.open(name + LOCK_SUFFIX, _LOCK_FLAGS, 0o600, dir_fd=directory)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
        log.warning("engine cache: replacing the link in place of %s%s", name, LOCK_SUFFIX)
        os.unlink(name + LOCK_SUFFIX, dir_fd=directory)
        return os.open(name + LOCK_SUFFIX, _LOCK_FLAGS, 0o600, dir_fd=directory)

    @contextlib.contextmanager
    def _locked(self, directory: int, name: str, mode: int) -> Iterator[None]:
        fd = self._open_lock(directory, name)
        try:
            fcntl.flock(fd, mode)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _read_checked(self, directory: int, name: str) -> bytes | None:
        """The entry's bytes if they match the digest beside them; ``None`` if there is no
        entry. Raises ``BadEntry`` for anything that must not be loaded."""
        shown = str(self.root / name)
        try:
            data = read_regular(directory, name, shown)
        except FileNotFoundError:
            return None
        except UntrustedPath as exc:
            raise BadEntry(str(exc)) from exc
        try:
            recorded = read_regular(directory, name + DIGEST_SUFFIX, shown + DIGEST_SUFFIX)
        except FileNotFoundError:
            raise BadEntry(f"{shown} has no {DIGEST_SUFFIX} beside it") from None
        except UntrustedPath as exc:
            raise BadEntry(str(exc)) from exc
        expected = recorded.decode("ascii", "replace").strip()
        if not is_sha256(expected):
            raise BadEntry(f"{shown}{DIGEST_SUFFIX} does not hold a sha256")
        actual = sha256_bytes(data)
        if actual != expected:
            raise BadEntry(f"{shown} has sha256 {actual}, its digest file says {expected}")
        return data

    def _lookup(self, directory: int, name: str) -> bytes | None:
        """``_read_checked``, with a bad entry logged and treated as absent."""
        try:
            return self._read_checked(directory, name)
        except BadEntry as exc:
            log.warning("engine cache: not loading %s, building it again: %s", name, exc)
            return None

    def get(self, key: CacheKey) -> bytes | None:
        """The checked bytes of the entry for ``key``, or None when there is none (or a
        bad one): nothing is built (a backend that can serve without the entry builds it
        later, through :meth:`open`)."""
        name = key.file_name(self.suffix)
        with self._directory() as directory:
            with self._locked(directory, name, fcntl.LOCK_SH):  # not while one is built
                data = self._lookup(directory, name)
            if data is not None:
                with contextlib.suppress(FileNotFoundError):  # recency, for clean-up
                    os.utime(name, dir_fd=directory, follow_symlinks=False)
        return data

    @contextlib.contextmanager
    def open(self, key: CacheKey, build: Callable[[Path], None]) -> Iterator[CacheResult]:
        """Yield the checked bytes of the entry for ``key``, building it first if it is
        absent or bad.

        ``build(path)`` writes the engine to ``path`` (in a private directory); it is
        renamed into place, its digest beside it, only when it returns, so a crash
        mid-build never leaves a half-written entry."""
        name = key.file_name(self.suffix)
        started = time.monotonic()
        build_seconds = 0.0
        with self._directory() as directory:
            with self._locked(directory, name, fcntl.LOCK_SH):  # not while one is built
                data = self._lookup(directory, name)
            hit = data is not None
            if data is None:
                with self._locked(directory, name, fcntl.LOCK_EX):
                    data = self._lookup(directory, name)  # built by another while we waited
                    hit = data is not None
                    if data is None:
                        data, build_seconds = self._build(directory, name, build)
            with contextlib.suppress(FileNotFoundError):  # recency, for clean-up
                os.utime(name, dir_fd=directory, follow_symlinks=False)
        wait_seconds = time.monotonic() - started - build_seconds
        yield CacheResult(name, data, hit, build_seconds, wait_seconds)
        self.clean_up()

    def _build(
        self, directory: int, name: str, build: Callable[[Path], None]
    ) -> tuple[bytes, float]:
        """Build into a private directory, then rename the entry and its digest into
        place (the caller holds the entry's exclusive lock)."""
        started = time.monotonic()
        self._remove_builds(name)  # what a crashed build of this entry left
        work = Path(tempfile.mkdtemp(prefix=f".{name}{_BUILD_INFIX}", dir=self.root))
        try:
            build(work / name)
            with contextlib.ExitStack() as stack:
                work_fd = os.open(work, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                stack.callback(os.close, work_fd)
                try:
                    data = read_regular(work_fd, name, str(work / name))
                except FileNotFoundError:
                    raise RuntimeError(f"the engine builder wrote no {name}") from None
                digest_fd = os.open(
                    name + DIGEST_SUFFIX,
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    0o600,
                    dir_fd=work_fd,
                )
                with os.fdopen(digest_fd, "w", encoding="ascii") as f:
                    f.write(sha256_bytes(data) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
                # rename never follows a link in the way: it replaces it
                os.replace(name, name, src_dir_fd=work_fd, dst_dir_fd=directory)
                os.replace(
                    name + DIGEST_SUFFIX,
                    name + DIGEST_SUFFIX,
                    src_dir_fd=work_fd,
                    dst_dir_fd=directory,
                )
        finally:
            shutil.rmtree(work, ignore_errors=True)
        seconds = time.monotonic() - started
        log.info("engine cache: built %s in %.3fs", name, seconds)
        return data, seconds

    def _remove_builds(self, name: str) -> None:
        for leftover in self.root.glob(f".{name}{_BUILD_INFIX}*"):
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)

    def entries(self) -> list[Path]:
        """The entries (regular files only), least recently used first."""
        found = []
        for path in self.root.glob(f"*.{self.suffix}"):
            try:
                info = path.lstat()
            except FileNotFoundError:
                continue
            if stat.S_ISREG(info.st_mode):
                found.append((info.st_mtime, path))
        return [path for _, path in sorted(found)]

    def clean_up(self) -> list[Path]:
        """Drop entries older than ``max_age_seconds``, then least recently used ones
        until the cache fits ``max_bytes``. Entries being built or read (locked) are
        skipped."""
        removed: list[Path] = []
        now = time.time()
        sizes = {}
        for entry in self.entries():
            with contextlib.suppress(FileNotFoundError):
                info = entry.lstat()
                sizes[entry] = (info.st_size, info.st_mtime)
        total = sum(size for size, _ in sizes.values())
        for entry, (size, mtime) in sizes.items():
            too_old = self.max_age_seconds is not None and now - mtime > self.max_age_seconds
            too_big = self.max_bytes is not None and total > self.max_bytes
            if not (too_old or too_big):
                continue
            if self._try_remove(entry.name):
                removed.append(entry)
                total -= size
        return removed

    def _try_remove(self, name: str) -> bool:
        with self._directory() as directory:
            fd = self._open_lock(directory, name)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return False
                # the digest first: an entry without one is never loaded
                for part in (name + DIGEST_SUFFIX, name):
                    try:
                        os.unlink(part, dir_fd=directory)
                    except OSError as exc:
                        if exc.errno != errno.ENOENT:
                            raise
                # the empty lock file stays: others may hold it open
                log.info("engine cache: evicted %s", name)
                return True
            finally:
                os.close(fd)
