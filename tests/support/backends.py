"""A real server on a rigged ONNX Runtime backend, for the tests that must see or steer
each engine run: which version ran how many rows, a run held at a gate, a run that fails
or answers NaN on the inputs a test picks."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping

import numpy as np
from aiohttp.test_utils import TestClient, TestServer

from model_server.app import SERVER, ModelServer
from model_server.backends.base import Engine, ModelFile
from model_server.backends.onnxruntime_backend import OnnxRuntimeBackend
from model_server.config import ServerConfig

Feeds = Mapping[str, np.ndarray]


class RiggedBackend(OnnxRuntimeBackend):
    """ONNX Runtime that records every engine run (version, rows) on the inference threads
    (not the warm-ups on the loader threads, nor the tests' reference runs), and whose
    engines of chosen versions misbehave on cue: wait at a gate (``gate_timeout_s`` at
    most: a hang guard, never a measured bound), raise, or answer NaN for the inputs a
    predicate picks (warm-up's zeros pass)."""

    def __init__(self, gate_timeout_s: float | None = None) -> None:
        super().__init__()
        self.gate_timeout_s = gate_timeout_s
        self.runs: list[tuple[str, int]] = []
        self.gates: dict[str, threading.Event] = {}
        self.waiting: Counter[str] = Counter()  # runs blocked at each gate now
        self.fails: dict[str, Callable[[Feeds], bool]] = {}
        self.nans: dict[str, Callable[[Feeds], bool]] = {}
        self.closed: list[str] = []

    def gate(self, version: str) -> threading.Event:
        return self.gates.setdefault(version, threading.Event())

    def rows(self, version: str | None = None) -> list[int]:
        return [rows for v, rows in self.runs if version in (None, v)]

    def load(self, model: ModelFile) -> Engine:
        engine = super().load(model)
        version, backend = model.path.parent.name, self
        inner_infer, inner_close = engine.infer, engine.close

        def infer(feeds: Feeds) -> dict[str, np.ndarray]:
            if threading.current_thread().name.startswith(("infer", "asyncio")):
                backend.runs.append((version, int(next(iter(feeds.values())).shape[0])))
            gate = backend.gates.get(version)
            if gate is not None and not gate.is_set():
                backend.waiting[version] += 1
                gate.wait(backend.gate_timeout_s)
                backend.waiting[version] -= 1
            if backend.fails.get(version, lambda _: False)(feeds):
                raise RuntimeError(f"{version} cannot run these inputs")
            out = inner_infer(feeds)
            if backend.nans.get(version, lambda _: False)(feeds):
                out = {k: v * np.nan for k, v in out.items()}
            return out

        def close() -> None:
            backend.closed.append(version)
            inner_close()

        engine.infer = infer  # type: ignore[method-assign]
        engine.close = close  # type: ignore[method-assign]
        return engine


@contextlib.asynccontextmanager
async def serving(
    config: ServerConfig, backend: OnnxRuntimeBackend | None = None, **changes: object
) -> AsyncIterator[tuple[TestClient, ModelServer]]:
    """A server of ``config`` with ``changes`` (aiohttp's test server over TCP) and the
    ModelServer behind it."""
    app = ModelServer(dataclasses.replace(config, **changes), backend).make_app()  # type: ignore[arg-type]
    async with TestClient(TestServer(app)) as client:
        yield client, client.app[SERVER]
