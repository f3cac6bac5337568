"""How a new version gets into memory: read the model file once (inside the trusted
repository, no link followed), hash those bytes and check them against the expected
digest (the caller's, else the version's manifest: a version with neither is refused;
where the manifest has chunk digests, the bytes are checked by them instead, and the
digest they are signed with is the file's),
load the same bytes, warm up, and answer the golden set its manifest names (read
and checked against the manifest's digest like the model). Every step runs on the
loader's threads, never on the event loop or an inference thread, and any failure is a
``LoadRefused`` (``GoldenMismatch`` for wrong answers to the golden set)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from model_rollout_contract.canary import GOLDEN_FILE
from model_rollout_contract.manifest import is_sha256, sha256_bytes
from model_server.backends.base import Backend, Engine, ModelFile
from model_server.errors import BadRequest, LoadRefused, ServingError
from model_server.lifecycle.golden import GoldenSet
from model_server.lifecycle.load_stages import (
    ENGINE,
    GOLDEN,
    GOLDEN_PARSE,
    RELEASE,
    WARM_UP,
    LoadStages,
)
from model_server.lifecycle.model_slot import LoadedVersion
from model_server.lifecycle.repository import ModelRepository, VersionFiles


def normalized_digest(sha256: str | None) -> str | None:
    """A digest as the server compares it: 64 lowercase hex digits, however written."""
    if sha256 is None:
        return None
    lowered = sha256.lower()
    if not is_sha256(lowered):
        raise BadRequest(f"sha256 must be 64 hex digits, not {sha256[:80]!r}")
    return lowered


def warm_up(engine: Engine) -> None:
    """Run one inference with zeros; refuse engines that fail or produce NaN/inf.

    An engine with a ``warm_up`` of its own (TensorRT: every pooled context at its own
    profile's opt shape) runs that first, so no context meets traffic cold or broken."""
    own = getattr(engine, "warm_up", None)
    if callable(own):
        own()
    feeds = {spec.name: spec.example() for spec in engine.inputs}
    outputs = engine.infer(feeds)
    for spec in engine.outputs:
        if spec.name not in outputs:
            raise ValueError(f"warm-up produced no output {spec.name!r}")
        out = np.asarray(outputs[spec.name])
        if out.dtype.kind == "f" and not np.all(np.isfinite(out)):
            raise ValueError(f"warm-up output {spec.name!r} is not finite")


@dataclass(frozen=True)
class CheckedVersion:
    """A version's bytes as read and checked: the model file and its golden set."""

    model: ModelFile
    golden: GoldenSet | None


def _golden(what: str, files: VersionFiles) -> GoldenSet | None:
    """The golden set the manifest names, its size and digest checked, parsed."""
    manifest = files.manifest
    if manifest is None or manifest.golden is None:
        return None
    if manifest.sha256 != files.model.sha256:  # not this file's manifest: nor its golden set
        raise LoadRefused(
            f"{what}: its manifest names a golden set but describes another model file "
            f"(sha256 {manifest.sha256}, the file's is {files.model.sha256})"
        )
    data, ref = files.golden or b"", manifest.golden
    digest = sha256_bytes(data)
    if len(data) != ref.size or digest != ref.sha256:
        raise LoadRefused(
            f"{what}: {GOLDEN_FILE} has {len(data)} bytes of sha256 {digest}; its manifest "
            f"says {ref.size} bytes of sha256 {ref.sha256}"
        )
    try:
        return GoldenSet.from_bytes(data)
    except LoadRefused as exc:
        raise LoadRefused(f"{what}: {exc.message}") from exc


def _timed_load(backend: Backend, model: ModelFile, stages: LoadStages) -> Engine:
    """``backend.load(model)``, its time in ``stages``: the stages the engine reports
    (``load_stages``: seconds by name, as ONNX Runtime's session or torch's upload), and
    the rest of the call as ``engine``."""
    started = time.perf_counter()
    engine = backend.load(model)
    took = time.perf_counter() - started
    reported = getattr(engine, "load_stages", None) or {}
    stages.merge(reported)
    rest = took - sum(reported.values())
    if rest > 0 or not reported:
        stages.add(ENGINE, max(0.0, rest))
    return engine


def _close_unused(future: asyncio.Future[LoadedVersion]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().engine.close()


class LoadPipeline:
    def __init__(self, backend: Backend, repository: ModelRepository) -> None:
        self.backend = backend
        self.repository = repository
        # loads get their own threads: a long load or warm-up never takes an inference thread
        self._threads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="load")
        # private copies go here: a loaded version's once its engine holds its own (off the
        # load's path: 59 ms for 400 MiB on the H100 host), and those of versions never
        # loaded, not queued behind a long build when it is memory that refused them
        self._releases = ThreadPoolExecutor(max_workers=1, thread_name_prefix="release")
        self._pending: set[Future[None]] = set()  # releases a next read waits for
        self._pending_lock = threading.Lock()

    def _read_checked(
        self,
        key: str,
        version: str,
        path: Path | None,
        expected: str | None,
        stages: LoadStages,
    ) -> CheckedVersion:
        what = f"{key}:{version}"
        self._wait_for_releases(stages)
        if path is None:
            files = self.repository.read_version(key, version, stages)
        else:
            files = self.repository.read_announced(path, what, stages)
        if expected is None and files.manifest is not None:
            expected = normalized_digest(files.manifest.sha256)
        model = files.model
        try:
            if expected is None:  # nothing to check its bytes against: never served so
                raise LoadRefused(
                    f"{what}: no manifest.json beside {model.path.name} and no sha256 in the "
                    "request: its bytes cannot be verified"
                )
            if model.sha256 != expected:
                raise LoadRefused(
                    f"{what}: sha256 of {model.path.name} is {model.sha256}, expected {expected}"
                )
            if files.golden is None:
                return CheckedVersion(model, _golden(what, files))
            with stages.stage(GOLDEN_PARSE):
                return CheckedVersion(model, _golden(what, files))
        except BaseException:  # refused: its bytes go here, not with the error on the loop
            model.release()
            raise

    async def read(
        self,
        key: str,
        version: str,
        path: Path | None,
        expected_sha256: str | None,
        stages: LoadStages | None = None,
    ) -> CheckedVersion:
        """The model file's bytes, read once and checked against the expected digest
        (the caller's, else the version's manifest), and its golden set, checked against
        the manifest's digest; ``expected_sha256`` is normalized. Each stage's time is
        added to ``stages``."""
        future = asyncio.get_running_loop().run_in_executor(
            self._threads,
            self._read_checked,
            key,
            version,
            path,
            expected_sha256,
            stages or LoadStages(),
        )
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:  # the read goes on: its bytes go on a loader thread
            future.add_done_callback(self._discard_read)
            raise

    def _discard_read(self, future: asyncio.Future[CheckedVersion]) -> None:
        if not future.cancelled() and future.exception() is None:
            self.discard(future.result())

    def _load_and_warm(
        self,
        key: str,
        version: str,
        checked: CheckedVersion,
        estimate: int,
        stages: LoadStages,
    ) -> LoadedVersion:
        try:
            return self._make(key, version, checked, estimate, stages)
        finally:  # the engine holds its own copy: unmap the file's bytes, not on the loop
            self._release_later(checked.model)

    def _make(
        self,
        key: str,
        version: str,
        checked: CheckedVersion,
        estimate: int,
        stages: LoadStages,
    ) -> LoadedVersion:
        model = checked.model
        try:
            engine = _timed_load(self.backend, model, stages)
        except ServingError:
            raise
        except Exception as exc:  # a corrupt engine can raise anything from the runtime
            raise LoadRefused(f"{key}:{version} failed to load: {exc}") from exc
        try:
            with stages.stage(WARM_UP):
                warm_up(engine)
        except Exception as exc:
            engine.close()
            raise LoadRefused(f"{key}:{version} failed its warm-up inference: {exc}") from exc
        if checked.golden is not None:
            try:
                with stages.stage(GOLDEN):
                    checked.golden.check(engine, f"{key}:{version}")
            except BaseException:
                engine.close()
                raise
        memory = getattr(engine, "device_memory_bytes", None) or estimate
        return LoadedVersion(key, version, model.path, model.sha256, engine, int(memory))

    async def load(
        self,
        key: str,
        version: str,
        checked: CheckedVersion,
        estimate: int,
        stages: LoadStages | None = None,
    ) -> LoadedVersion:
        """Load the checked model, warm it up and run its golden set, on a loader thread,
        each stage's time added to ``stages``. If the caller is cancelled meanwhile, the
        thread still finishes; the engine it made is then closed."""
        future = asyncio.get_running_loop().run_in_executor(
            self._threads,
            self._load_and_warm,
            key,
            version,
            checked,
            estimate,
            stages or LoadStages(),
        )
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(_close_unused)
            raise

    def discard(self, checked: CheckedVersion | None) -> None:
        """Let the bytes of a version read but never handed to :meth:`load` (refused for
        memory, or cancelled) go on the release thread, not on the caller's event loop."""
        if checked is not None:
            self._release_later(checked.model)

    def _release_later(self, model: ModelFile) -> None:
        """Let ``model``'s private copy go on the release thread; the next read waits
        for it (:meth:`_wait_for_releases`)."""
        try:
            future = self._releases.submit(model.release)
        except RuntimeError:  # shut down: let them go here
            model.release()
            return
        with self._pending_lock:
            self._pending.add(future)
        future.add_done_callback(self._released)

    def _released(self, future: Future[None]) -> None:
        with self._pending_lock:
            self._pending.discard(future)

    def _wait_for_releases(self, stages: LoadStages) -> None:
        """Before a read, on its loader thread: wait for the private copies handed to the
        release thread so far, so that at most the loads in flight hold a copy that is
        no longer needed (they never pile up), and a load waits only when the release
        before it has not finished (the wait is its ``release`` stage)."""
        with self._pending_lock:
            pending = bool(self._pending)
        if pending:
            with stages.stage(RELEASE):
                self.settle()

    def settle(self) -> None:
        """Wait until every private copy handed to the release thread so far is let go."""
        with self._pending_lock:
            pending = list(self._pending)
        wait(pending)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        self._releases.shutdown(wait=False)  # what is queued still goes, on its thread
