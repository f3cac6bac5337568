"""Fetch a version from the store into the shared volume, verified and atomically.

Everything is downloaded into ``<volume>/.incoming/<random>/`` (same filesystem), checked
(signature, binding, publish sequence — against the volume's ledger and the operator's
pin —, size, SHA-256, allow-list), and only then renamed
to ``<volume>/<model>/<version>/``, so the server never sees a partial or unverified
file. That is every file the manifest names: the model, and the golden set when it has
one (``golden.npz``; missing from the store while named: ``golden_missing``). Each
download stops at the manifest's size for it plus one byte: a larger object is refused,
never written out whole. Every step goes through :class:`~.volume.SafeDir`, so
a link planted in the volume is refused, never followed.

A signature, size or digest mismatch met while the version is being published again
(:mod:`.publish_window`) is reported ``publish_in_progress`` and tried again, not refused.

At most ``max_concurrent_downloads`` transfers run at once, and a transfer keeps its slot
until its worker thread has really stopped (a cancelled fetch included), so the limit
holds for what reaches the store, not only for what is awaited.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from model_rollout_contract.canary import GOLDEN_FILE
from model_rollout_contract.layout import INCOMING_DIR, object_key
from model_rollout_contract.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    MAX_SIGNATURE_BYTES,
    SIGNATURE_NAME,
    FileRef,
    Manifest,
)
from model_rollout_contract.names import ModelKey, is_valid_name
from model_rollout_contract.pins import InvalidPins
from model_rollout_contract.versions import sorted_versions

from . import sequences
from .errors import (
    BadPins,
    ObjectMissing,
    StoreError,
    UnsafeVolume,
    VerificationError,
    VolumeError,
)
from .publish_window import MIXED_STATE_REASONS, PUBLISH_WINDOW_S, mid_publish
from .retry import Backoff, retry_async
from .store import ModelStore, ObjectStream, ObjectTooLarge, read_object
from .verify import Verifier
from .volume import SafeDir, write_error

log = logging.getLogger(__name__)
T = TypeVar("T")
_CHUNK = 1 << 20

INCOMING_AREA_MARK = "+"  # in no model name: an area cannot be taken for a model's


def incoming_area(model: str) -> str:
    """The directory of ``.incoming`` that ``model``'s sidecar downloads into: ``+name``,
    or ``tenant+name``."""
    key = ModelKey.parse(model)
    return f"{key.tenant or ''}{INCOMING_AREA_MARK}{key.name}"


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


class _Cancelled(Exception):
    """The fetch that started this transfer was cancelled: stop between chunks."""


def _is_transient(exc: BaseException) -> bool:
    return isinstance(exc, StoreError) and exc.transient


class Fetcher:
    def __init__(
        self,
        store: ModelStore,
        verifier: Verifier,
        volume: Path,
        backoff: Backoff | None = None,
        max_concurrent_downloads: int = 1,
        publish_window_s: float = PUBLISH_WINDOW_S,
        pins: Callable[[], Mapping[str, int]] | None = None,
    ) -> None:
        """``pins``: the publish sequences the operator pinned, by version, read anew
        for each fetch (the pod's annotations, the ConfigMap); raises ``InvalidPins``."""
        if max_concurrent_downloads < 1:
            raise ValueError("max_concurrent_downloads must be at least 1")
        self.pins = pins
        self.store = store
        self.verifier = verifier
        self.volume = volume
        self.backoff = backoff or Backoff()
        self.publish_window_s = publish_window_s
        self._slots = asyncio.Semaphore(max_concurrent_downloads)
        self._lock = threading.Lock()
        self.downloading = 0  # transfers streaming now (worker threads)
        self.most_downloading = 0  # the most at once so far
        self.received_bytes = 0  # every byte read from the store, refused ones included

    def version_dir(self, model: str, version: str) -> Path:
        return self.volume / model / version

    def root(self) -> SafeDir:
        return SafeDir.open(self.volume, create=True)

    def sweep_incoming(self, model: str) -> list[str]:
        """Remove what a crashed or killed sidecar of ``model`` left in its part of
        ``.incoming`` (call at start, before any fetch: nothing in there is ever served),
        and what a sidecar of an earlier release left at the top. Never another model's:
        a pod with tenant models has a sidecar per model, and one that restarts must not
        pull the files from under a sibling's download."""
        swept: list[str] = []
        with self.root() as root, root.child(INCOMING_DIR, create=True) as incoming:
            for name, _ in incoming.entries():
                if INCOMING_AREA_MARK not in name:  # no sidecar of this release's
                    incoming.remove(name)
                    swept.append(name)
            with incoming.child(incoming_area(model), create=True) as area:
                for name, _ in area.entries():
                    area.remove(name)
                    swept.append(name)
        if swept:
            log.info("swept %d leftover download(s) from %s", len(swept), incoming.path)
        return swept

    def pinned(self, version: str) -> int | None:
        """The operator's pin for ``version``; ``BadPins`` when the pins cannot be read."""
        if self.pins is None:
            return None
        try:
            return self.pins().get(version)
        except InvalidPins as exc:
            raise BadPins(f"the operator's pinned publish sequences are unusable: {exc}") from exc

    def untrusted(self, model: str, version: str) -> str | None:
        """Why the copy of ``version`` on disk would not be accepted now (its manifest:
        signature under the keys trusted now, binding, pin; not its files, which the
        server hashed when it loaded them), or ``None``. For a version the server holds:
        swapping back to it needs no download, so this is its only check."""
        pinned = self.pinned(version)
        with self.root() as root:
            try:
                with root.model_dir(model) as model_dir, model_dir.child(version) as directory:
                    data = directory.read_bytes(MANIFEST_NAME, MAX_MANIFEST_BYTES)
                    signature = directory.read_bytes(SIGNATURE_NAME, MAX_SIGNATURE_BYTES)
                    manifest = self.verifier.manifest(model, version, data, signature)
                    sequences.check(model_dir, model, version, manifest.sequence, pinned)
            except FileNotFoundError:
                return "its manifest is not on the volume any more to be checked"
            except (VerificationError, VolumeError) as exc:
                return f"{exc.code}: {exc.message}"
        return None

    def verified_local(self, model: str, version: str) -> LocalVersion | None:
        """The copy on disk if it is complete and still verifies, else ``None``. A link
        where the model's or the version's directory should be is refused."""
        pinned = self.pinned(version)
        with self.root() as root:
            try:
                model_dir = root.model_dir(model)
            except FileNotFoundError:
                return None
            with model_dir:
                try:
                    version_dir = model_dir.child(version)
                except FileNotFoundError:
                    return None
                with version_dir:
                    try:
                        data = version_dir.read_bytes(MANIFEST_NAME, MAX_MANIFEST_BYTES)
                        signature = version_dir.read_bytes(SIGNATURE_NAME, MAX_SIGNATURE_BYTES)
                        manifest = self.verifier.manifest(model, version, data, signature)
                        sequences.check(model_dir, model, version, manifest.sequence, pinned)
                        for expected in manifest.files():
                            with version_dir.open_read(expected.file) as f:
                                self.verifier.file(f, expected, manifest.chunks_of(expected))
                    except (FileNotFoundError, VerificationError, VolumeError) as exc:
                        log.warning("local copy of %s:%s is not usable: %s", model, version, exc)
                        return None
        return LocalVersion(model, version, self.version_dir(model, version), manifest)

    async def _in_thread(self, work: Callable[[threading.Event], T]) -> T:
        """Run ``work`` in a thread; if the caller is cancelled, tell the thread and wait
        for it to stop before giving up (the caller's slot stays taken until then)."""
        cancelled = threading.Event()
        future = asyncio.ensure_future(asyncio.to_thread(work, cancelled))
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            cancelled.set()
            await asyncio.wait({future})
            if not future.cancelled():
                future.exception()  # retrieved: the thread's _Cancelled, or its failure
            raise

    async def _read(self, key: str, limit: int) -> bytes:
        return await retry_async(
            lambda: self._in_thread(lambda _: read_object(self.store, key, limit)),
            _is_transient,
            self.backoff,
            f"read {key}",
        )

    async def fetch(self, model: str, version: str) -> FetchResult:
        """Return a verified local copy, downloading it if needed.

        Raises ``VerificationError`` (refused: do not serve), ``StoreError``,
        ``VolumeError`` (no space, or a link where the sidecar writes)."""
        started = time.monotonic()
        local = await asyncio.to_thread(self.verified_local, model, version)
        if local is not None:
            return FetchResult(local, 0, time.monotonic() - started)
        async with self._slots:
            try:
                data = await self._read(
                    object_key(model, version, MANIFEST_NAME), MAX_MANIFEST_BYTES
                )
            except ObjectTooLarge as exc:
                raise VerificationError("bad_manifest", exc.message) from exc
            try:
                size, manifest = await self._download_verified(model, version, data)
            except VerificationError as exc:
                transient = await self._mid_publish(exc, model, version, data)
                if transient is None:
                    raise
                raise transient from exc
        log.info("fetched %s:%s (%d bytes) from %s", model, version, size, self.store.description)
        return FetchResult(
            LocalVersion(model, version, self.version_dir(model, version), manifest),
            size,
            time.monotonic() - started,
        )

    async def _mid_publish(
        self, exc: VerificationError, model: str, version: str, data: bytes
    ) -> StoreError | None:
        """After a mismatch: the manifest read again, to tell a publish under way (a
        transient error, returned) from a version that does not verify (``None``)."""
        if exc.reason not in MIXED_STATE_REASONS:
            return None
        try:
            current: bytes | None = await self._read(
                object_key(model, version, MANIFEST_NAME), MAX_MANIFEST_BYTES
            )
        except (ObjectMissing, ObjectTooLarge):
            current = None
        return mid_publish(exc, data, current, self.publish_window_s)

    async def _download_verified(
        self, model: str, version: str, data: bytes
    ) -> tuple[int, Manifest]:
        """The signature, then the model (downloaded, checked, renamed into place)."""
        try:
            signature: bytes | None = await self._read(
                object_key(model, version, SIGNATURE_NAME), MAX_SIGNATURE_BYTES
            )
        except ObjectMissing:
            signature = None
        except ObjectTooLarge as exc:
            raise VerificationError("bad_signature", exc.message) from exc
        manifest = self.verifier.manifest(model, version, data, signature)
        sequences.check(None, model, version, manifest.sequence, self.pinned(version))
        attempt = functools.partial(self._install, model, version, manifest, data, signature)
        size = await retry_async(
            lambda: self._in_thread(attempt),
            _is_transient,
            self.backoff,
            f"download {model}:{version}",
        )
        return size, manifest

    def _install(
        self,
        model: str,
        version: str,
        manifest: Manifest,
        data: bytes,
        signature: bytes | None,
        cancelled: threading.Event,
    ) -> int:
        """One attempt: download into ``.incoming``, verify, rename into place."""
        with self.root() as root:
            with root.model_dir(model, create=True) as model_dir:
                sequences.check(model_dir, model, version, manifest.sequence)
            with (
                root.child(INCOMING_DIR, create=True) as downloads,
                downloads.child(incoming_area(model), create=True) as incoming,
            ):
                name = f"{version}-{secrets.token_hex(4)}"
                try:
                    with incoming.child(name, create=True) as work:
                        size = 0
                        for expected in manifest.files():
                            key = object_key(model, version, expected.file)
                            size += self._download(key, work, expected, cancelled)
                            with work.open_read(expected.file) as f:
                                self.verifier.file(f, expected, manifest.chunks_of(expected))
                        work.write_atomic(MANIFEST_NAME, data)
                        work.write_atomic(SIGNATURE_NAME, signature or b"")
                    with root.model_dir(model, create=True) as model_dir:
                        kind = model_dir.kind(version)
                        if kind not in (None, "dir"):
                            raise UnsafeVolume(
                                f"{model_dir.path / version} is a {kind}, not a version "
                                "directory: refusing to replace it"
                            )
                        model_dir.remove(version)  # an earlier copy that no longer verifies
                        sequences.record(model_dir, version, manifest.sequence)
                        incoming.move(name, model_dir, version)
                        model_dir.fsync()
                finally:
                    incoming.remove(name)
        return size

    def _count(self, delta: int) -> None:
        with self._lock:
            self.downloading += delta
            self.most_downloading = max(self.most_downloading, self.downloading)

    def _open(self, key: str, expected: FileRef) -> ObjectStream:
        try:
            return self.store.open(key)
        except ObjectMissing as exc:
            if expected.file != GOLDEN_FILE:
                raise
            raise VerificationError(  # a publish --force that adds one may be under way
                "golden_missing", f"the manifest names {key}, which is not in the store"
            ) from exc

    def _download(
        self, key: str, work: SafeDir, expected: FileRef, cancelled: threading.Event
    ) -> int:
        """Stream ``key`` into ``work``, reading at most the manifest's size plus one."""
        size = expected.size
        self._count(+1)
        try:
            with self._open(key, expected) as stream:
                if stream.length != size:
                    raise VerificationError(
                        "size_mismatch",
                        f"{key} has {stream.length} bytes in the store, the manifest says "
                        f"{size}: refused before downloading",
                    )
                received = 0
                try:
                    with work.create(expected.file) as out:
                        while chunk := stream.read(min(_CHUNK, size + 1 - received)):
                            if cancelled.is_set():
                                raise _Cancelled(key)
                            received += len(chunk)
                            with self._lock:
                                self.received_bytes += len(chunk)
                            if received > size:
                                raise VerificationError(
                                    "size_mismatch",
                                    f"{key} sent more than the manifest's {size} bytes: "
                                    f"stopped after {received}",
                                )
                            out.write(chunk)
                        out.flush()
                        os.fsync(out.fileno())
                except OSError as exc:
                    error = write_error(exc, f"download of {key}")
                    if error is exc:
                        raise
                    raise error from exc
        finally:
            self._count(-1)
        if received < size:  # the connection dropped mid-transfer: worth a retry
            raise StoreError(
                f"truncated download of {key}: {received} of {size} bytes", transient=True
            )
        return received

    def remove_version(self, model: str, version: str) -> None:
        """Delete one version's copy (refused by the server: it is never served)."""
        with self.root() as root:
            try:
                model_dir = root.model_dir(model)
            except FileNotFoundError:
                return
            with model_dir:
                if model_dir.kind(version) == "dir":
                    model_dir.remove(version)
                    log.info("removed refused %s:%s from the volume", model, version)

    def prune(
        self, model: str, keep: int, protect: Collection[str], refused: Collection[str] = ()
    ) -> list[str]:
        """Delete the ``refused`` versions; keep those in ``protect`` (the serving one,
        the previous good one, those the server holds), then the newest others in the
        contract's version order up to ``keep`` in all (versions that follow no published
        rule, such as git SHAs: in the order their builds were published, as accepted
        here). Links are never followed nor counted as versions."""
        with self.root() as root:
            try:
                model_dir = root.model_dir(model)
            except FileNotFoundError:
                return []
            with model_dir:
                entries = list(model_dir.entries())
                for name, kind in entries:
                    if kind == "link":
                        log.warning(
                            "not following the link %s in the volume", model_dir.path / name
                        )
                versions = sorted_versions(
                    (name for name, kind in entries if kind == "dir" and is_valid_name(name)),
                    sequences.publish_order(model_dir),
                )[::-1]
                kept = [v for v in versions if v in protect and v not in refused]
                removed = []
                for name in versions:
                    if name in kept:
                        continue
                    if name not in refused and len(kept) < keep:
                        kept.append(name)
                        continue
                    model_dir.remove(name)
                    removed.append(name)
        if removed:
            log.info("pruned %s versions %s", model, removed)
        return removed
