"""How a new version gets into memory: verify (the digest of the file, inside the trusted
repository), make room (the memory budget), load, warm up. Every step runs on the
loader's threads, never on an inference thread, and any failure is a ``LoadRefused``
(or ``MemoryBudgetExceeded``) with the serving version untouched."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from model_rollout_contract.manifest import sha256_file

from .backends.base import Backend, Engine
from .errors import LoadRefused, MemoryBudgetExceeded, ServingError
from .model_slot import LoadedVersion, ModelSlot
from .repository import ModelRepository


def warm_up(engine: Engine) -> None:
    """Run one inference with zeros; refuse engines that fail or produce NaN/inf."""
    feeds = {spec.name: spec.example() for spec in engine.inputs}
    outputs = engine.infer(feeds)
    for spec in engine.outputs:
        if spec.name not in outputs:
            raise ValueError(f"warm-up produced no output {spec.name!r}")
        out = np.asarray(outputs[spec.name])
        if out.dtype.kind == "f" and not np.all(np.isfinite(out)):
            raise ValueError(f"warm-up output {spec.name!r} is not finite")


def _close_unused(future: asyncio.Future[LoadedVersion]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().engine.close()


class LoadPipeline:
    def __init__(
        self,
        backend: Backend,
        repository: ModelRepository,
        held_bytes: Callable[[], int],
        memory_budget_bytes: int | None = None,
    ) -> None:
        self.backend = backend
        self.repository = repository
        self.held_bytes = held_bytes  # memory held by every model's loaded versions
        self.memory_budget_bytes = memory_budget_bytes
        # loads get their own threads: a long load or warm-up never takes an inference thread
        self._threads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="load")

    async def _off_loop(self, fn: Callable[..., object], *args: object) -> object:
        return await asyncio.get_running_loop().run_in_executor(self._threads, fn, *args)

    async def _load_off_loop(
        self, key: str, version: str, path: Path, digest: str
    ) -> LoadedVersion:
        """Load on a loader thread. If the caller is cancelled meanwhile, the thread still
        finishes; the engine it made is then closed, never leaked."""
        future = asyncio.get_running_loop().run_in_executor(
            self._threads, self._load_and_warm, key, version, path, digest
        )
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(_close_unused)
            raise

    async def verify(
        self, key: str, version: str, path: Path | None, expected_sha256: str | None
    ) -> tuple[Path, str]:
        """The model file inside the repository and its digest, checked against the
        expected one (the caller's, else the version's manifest)."""
        if path is None:
            resolved = self.repository.resolve(key, version)
            path = resolved.path
            if expected_sha256 is None and resolved.manifest is not None:
                expected_sha256 = resolved.manifest.sha256
        else:
            path = self.repository.check_trusted(path)
            if not path.is_file():
                raise LoadRefused(f"{path} does not exist")
        digest = str(await self._off_loop(sha256_file, path))
        if expected_sha256 is not None and digest != expected_sha256.lower():
            raise LoadRefused(
                f"{key}:{version}: sha256 of {path.name} is {digest}, expected {expected_sha256}"
            )
        return path, digest

    def make_room(self, slot: ModelSlot, needed: int) -> None:
        budget = self.memory_budget_bytes
        if budget is None:
            return
        while self.held_bytes() + needed > budget:
            if slot.evict_oldest_retained() is None:
                held = self.held_bytes()
                raise MemoryBudgetExceeded(
                    f"loading {slot.key} needs about {needed / 2**20:.1f} MiB beside the "
                    f"{held / 2**20:.1f} MiB already held; the memory budget is "
                    f"{budget / 2**20:.1f} MiB"
                )

    def _load_and_warm(self, key: str, version: str, path: Path, digest: str) -> LoadedVersion:
        engine = self.backend.load(path)
        try:
            warm_up(engine)
        except Exception as exc:
            engine.close()
            raise LoadRefused(f"{key}:{version} failed its warm-up inference: {exc}") from exc
        memory = getattr(engine, "device_memory_bytes", None) or self.backend.estimate_memory_bytes(
            path
        )
        return LoadedVersion(key, version, path, digest, engine, int(memory))

    async def run(
        self, slot: ModelSlot, version: str, path: Path | None, expected_sha256: str | None
    ) -> tuple[LoadedVersion | None, str | None, ServingError | None]:
        """Verify, make room, load, warm up: ``(loaded, digest, None)``, or
        ``(None, digest-if-known, error)``."""
        digest: str | None = None
        try:
            model_path, digest = await self.verify(slot.key, version, path, expected_sha256)
            self.make_room(slot, self.backend.estimate_memory_bytes(model_path))
            loaded = await self._load_off_loop(slot.key, version, model_path, digest)
        except ServingError as exc:
            return None, digest, exc
        except Exception as exc:  # a corrupt engine can raise anything from the runtime
            refused = LoadRefused(f"{slot.key}:{version} failed to load: {exc}")
            refused.__cause__ = exc
            return None, digest, refused
        assert isinstance(loaded, LoadedVersion)
        return loaded, digest, None

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
