"""Build-once cache of compiled engines, shared between processes on one node.

An engine compiled from ONNX is only valid for the exact model bytes, runtime version,
device, precision and shape profile it was built with, so all five make up the key.
A per-entry ``fcntl`` lock lets exactly one process build while the others block and
then reuse the result; readers hold a shared lock so clean-up never deletes a file that
is being loaded.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_UNSAFE = re.compile(r"[^A-Za-z0-9.+-]+")


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
    path: Path
    hit: bool
    build_seconds: float
    wait_seconds: float


class EngineCache:
    def __init__(
        self,
        root: str | Path,
        max_bytes: int | None = None,
        max_age_seconds: float | None = None,
        suffix: str = "engine",
    ) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.max_age_seconds = max_age_seconds
        self.suffix = suffix

    def path_for(self, key: CacheKey) -> Path:
        return self.root / key.file_name(self.suffix)

    @staticmethod
    def _lock_path(entry: Path) -> Path:
        return entry.with_name(entry.name + ".lock")

    @contextlib.contextmanager
    def _locked(self, entry: Path, mode: int) -> Iterator[None]:
        fd = os.open(self._lock_path(entry), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, mode)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    @contextlib.contextmanager
    def open(self, key: CacheKey, build: Callable[[Path], None]) -> Iterator[CacheResult]:
        """Yield the cached entry for ``key``, building it first if absent.

        ``build(tmp_path)`` writes the engine to ``tmp_path``; it is renamed into place
        only when it returns, so a crash mid-build never leaves a half-written entry.
        The entry stays share-locked (safe from clean-up) while the ``with`` body runs.
        """
        entry = self.path_for(key)
        started = time.monotonic()
        hit = True
        build_seconds = 0.0
        for _attempt in range(3):  # an entry evicted between build and use is rebuilt
            if not entry.exists():
                with self._locked(entry, fcntl.LOCK_EX):
                    if not entry.exists():  # nobody built it while we waited
                        hit = False
                        build_seconds += self._build(entry, build)
            with self._locked(entry, fcntl.LOCK_SH):
                if not entry.exists():
                    continue
                os.utime(entry)  # recency for LRU clean-up
                wait_seconds = time.monotonic() - started - build_seconds
                yield CacheResult(entry, hit, build_seconds, wait_seconds)
                break
        else:
            raise RuntimeError(f"engine cache entry {entry} kept vanishing during use")
        self.clean_up()

    @staticmethod
    def _build(entry: Path, build: Callable[[Path], None]) -> float:
        tmp = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
        started = time.monotonic()
        try:
            build(tmp)
            os.replace(tmp, entry)
        finally:
            tmp.unlink(missing_ok=True)
        seconds = time.monotonic() - started
        log.info("engine cache: built %s in %.3fs", entry.name, seconds)
        return seconds

    def entries(self) -> list[Path]:
        return sorted(self.root.glob(f"*.{self.suffix}"), key=lambda p: p.stat().st_mtime)

    def clean_up(self) -> list[Path]:
        """Drop entries older than ``max_age_seconds``, then least recently used ones
        until the cache fits ``max_bytes``. Entries in use (share-locked) are skipped."""
        removed: list[Path] = []
        now = time.time()
        entries = self.entries()
        total = sum(p.stat().st_size for p in entries)
        for entry in entries:
            too_old = (
                self.max_age_seconds is not None
                and now - entry.stat().st_mtime > self.max_age_seconds
            )
            too_big = self.max_bytes is not None and total > self.max_bytes
            if not (too_old or too_big):
                continue
            size = entry.stat().st_size
            if self._try_remove(entry):
                removed.append(entry)
                total -= size
        return removed

    def _try_remove(self, entry: Path) -> bool:
        fd = os.open(self._lock_path(entry), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            entry.unlink(missing_ok=True)  # the empty lock file stays: others may hold it open
            log.info("engine cache: evicted %s", entry.name)
            return True
        finally:
            os.close(fd)
