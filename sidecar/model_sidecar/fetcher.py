"""Fetch a version from the store into the shared volume, verified and atomically.

Everything is downloaded into ``<volume>/.incoming/<random>/`` (same filesystem), checked
(signature, size, SHA-256, allow-list), and only then renamed to
``<volume>/<model>/<version>/``, so the server never sees a partial or unverified file.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from model_rollout_contract.layout import INCOMING_DIR, object_key
from model_rollout_contract.manifest import MANIFEST_NAME, SIGNATURE_NAME, Manifest
from model_rollout_contract.versions import version_order

from .errors import ObjectMissing, StoreError, VerificationError
from .retry import Backoff, retry_async
from .store import ModelStore
from .verify import Verifier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalVersion:
    model: str
    version: str
    directory: Path
    manifest: Manifest

    @property
    def file(self) -> Path:
        return self.directory / self.manifest.file


@dataclass(frozen=True)
class FetchResult:
    local: LocalVersion
    downloaded_bytes: int  # 0 when the verified copy on disk was reused
    seconds: float


def _is_transient(exc: BaseException) -> bool:
    return isinstance(exc, StoreError) and exc.transient


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Fetcher:
    def __init__(
        self,
        store: ModelStore,
        verifier: Verifier,
        volume: Path,
        backoff: Backoff | None = None,
        max_concurrent_downloads: int = 1,
    ) -> None:
        self.store = store
        self.verifier = verifier
        self.volume = volume
        self.backoff = backoff or Backoff()
        self._downloads = asyncio.Semaphore(max_concurrent_downloads)

    def version_dir(self, model: str, version: str) -> Path:
        return self.volume / model / version

    def verified_local(self, model: str, version: str) -> LocalVersion | None:
        """The copy on disk if it is complete and still verifies, else ``None``."""
        directory = self.version_dir(model, version)
        try:
            data = (directory / MANIFEST_NAME).read_bytes()
            signature = (directory / SIGNATURE_NAME).read_bytes()
        except OSError:
            return None
        try:
            manifest = self.verifier.manifest(model, version, data, signature)
            self.verifier.file(directory / manifest.file, manifest)
        except (VerificationError, OSError) as exc:
            log.warning("local copy of %s:%s is not usable: %s", model, version, exc)
            return None
        return LocalVersion(model, version, directory, manifest)

    async def _read(self, key: str) -> bytes:
        return await retry_async(
            lambda: asyncio.to_thread(self.store.read, key),
            _is_transient,
            self.backoff,
            f"read {key}",
        )

    async def _download(self, key: str, target: Path, expected_size: int) -> int:
        size = await asyncio.to_thread(self.store.download, key, target)
        if size != expected_size:  # the connection dropped mid-transfer: worth a retry
            raise StoreError(
                f"truncated download of {key}: {size} of {expected_size} bytes", transient=True
            )
        return size

    async def fetch(self, model: str, version: str) -> FetchResult:
        """Return a verified local copy, downloading it if needed.

        Raises ``VerificationError`` (refused: do not serve) or ``StoreError``."""
        started = time.monotonic()
        local = await asyncio.to_thread(self.verified_local, model, version)
        if local is not None:
            return FetchResult(local, 0, time.monotonic() - started)
        async with self._downloads:
            data = await self._read(object_key(model, version, MANIFEST_NAME))
            try:
                signature: bytes | None = await self._read(
                    object_key(model, version, SIGNATURE_NAME)
                )
            except ObjectMissing:
                signature = None
            manifest = self.verifier.manifest(model, version, data, signature)
            incoming = self.volume / INCOMING_DIR / f"{model}-{version}-{uuid.uuid4().hex[:8]}"
            incoming.mkdir(parents=True)
            try:
                target = incoming / manifest.file
                key = object_key(model, version, manifest.file)
                size = await retry_async(
                    lambda: self._download(key, target, manifest.size),
                    _is_transient,
                    self.backoff,
                    f"download {model}:{version}",
                )
                await asyncio.to_thread(self.verifier.file, target, manifest)
                (incoming / MANIFEST_NAME).write_bytes(data)
                (incoming / SIGNATURE_NAME).write_bytes(signature or b"")
                _fsync_dir(incoming)
                final = self.version_dir(model, version)
                final.parent.mkdir(parents=True, exist_ok=True)
                if final.exists():  # an earlier copy that no longer verifies
                    shutil.rmtree(final)
                os.rename(incoming, final)
                _fsync_dir(final.parent)
            finally:
                shutil.rmtree(incoming, ignore_errors=True)
        log.info("fetched %s:%s (%d bytes) from %s", model, version, size, self.store.description)
        return FetchResult(
            LocalVersion(model, version, final, manifest), size, time.monotonic() - started
        )

    def prune(self, model: str, keep: int, protect: set[str]) -> list[str]:
        """Keep at most ``keep`` versions on disk, the newest in the contract's version
        order; never those in ``protect`` (the serving one)."""
        directory = self.volume / model
        if not directory.is_dir():
            return []
        versions = sorted(
            (p for p in directory.iterdir() if p.is_dir()),
            key=lambda p: version_order(p.name),
            reverse=True,
        )
        removed = []
        kept = [p for p in versions if p.name in protect]
        for path in versions:
            if path.name in protect:
                continue
            if len(kept) < keep:
                kept.append(path)
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
        if removed:
            log.info("pruned %s versions %s", model, removed)
        return removed
