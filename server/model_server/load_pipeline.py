"""How a new version gets into memory: read the model file once (inside the trusted
repository, no link followed), hash those bytes and check them against the expected
digest, load the same bytes, warm up. Every step runs on the loader's threads, never on
the event loop or an inference thread, and any failure is a ``LoadRefused``."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from model_rollout_contract.manifest import is_sha256

from .backends.base import Backend, Engine, ModelFile
from .errors import BadRequest, LoadRefused, ServingError
from .model_slot import LoadedVersion
from .repository import ModelRepository


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


def _close_unused(future: asyncio.Future[LoadedVersion]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().engine.close()


class LoadPipeline:
    def __init__(self, backend: Backend, repository: ModelRepository) -> None:
        self.backend = backend
        self.repository = repository
        # loads get their own threads: a long load or warm-up never takes an inference thread
        self._threads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="load")

    def _read_checked(
        self, key: str, version: str, path: Path | None, expected: str | None
    ) -> ModelFile:
        if path is None:
            files = self.repository.read_version(key, version)
            model = files.model
            if expected is None and files.manifest is not None:
                expected = normalized_digest(files.manifest.sha256)
        else:
            model = self.repository.read_model(path)
        if expected is not None and model.sha256 != expected:
            raise LoadRefused(
                f"{key}:{version}: sha256 of {model.path.name} is {model.sha256}, "
                f"expected {expected}"
            )
        return model

    async def read(
        self, key: str, version: str, path: Path | None, expected_sha256: str | None
    ) -> ModelFile:
        """The model file's bytes, read once and checked against the expected digest
        (the caller's, else the version's manifest); ``expected_sha256`` is normalized."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._threads, self._read_checked, key, version, path, expected_sha256
        )

    def _load_and_warm(
        self, key: str, version: str, model: ModelFile, estimate: int
    ) -> LoadedVersion:
        try:
            engine = self.backend.load(model)
        except ServingError:
            raise
        except Exception as exc:  # a corrupt engine can raise anything from the runtime
            raise LoadRefused(f"{key}:{version} failed to load: {exc}") from exc
        try:
            warm_up(engine)
        except Exception as exc:
            engine.close()
            raise LoadRefused(f"{key}:{version} failed its warm-up inference: {exc}") from exc
        memory = getattr(engine, "device_memory_bytes", None) or estimate
        return LoadedVersion(key, version, model.path, model.sha256, engine, int(memory))

    async def load(self, key: str, version: str, model: ModelFile, estimate: int) -> LoadedVersion:
        """Load ``model`` and warm it up on a loader thread. If the caller is cancelled
        meanwhile, the thread still finishes; the engine it made is then closed."""
        future = asyncio.get_running_loop().run_in_executor(
            self._threads, self._load_and_warm, key, version, model, estimate
        )
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(_close_unused)
            raise

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
