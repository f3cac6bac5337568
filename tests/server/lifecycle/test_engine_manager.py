"""Engine manager semantics below HTTP: reference counting, retention, memory budget."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from model_server.backends.base import ModelFile
from model_server.backends.onnxruntime_backend import OnnxRuntimeBackend
from model_server.errors import Conflict, LoadRefused, MemoryBudgetExceeded
from model_server.lifecycle.engine_manager import EngineManager
from model_server.lifecycle.model_slot import VersionState, VersionStatus
from model_server.lifecycle.repository import ModelRepository
from model_server.observability.audit import AuditLog
from model_server.observability.metrics import ServerMetrics
from model_server.scheduling.runner import Runner
from tests.support.server import GatedBackend, add_version, infer_on


def make_manager(root: Path, retain: int = 2, budget: int | None = None) -> EngineManager:
    manager = EngineManager(
        GatedBackend(),
        ModelRepository(root),
        ServerMetrics(),
        AuditLog(),
        retain=retain,
        memory_budget_bytes=budget,
    )
    manager.register("mlp")
    return manager


@pytest.fixture
def root(tmp_path: Path) -> Path:
    for i in (1, 2, 3):
        add_version(tmp_path, "mlp", f"v{i}", seed=i)
    add_version(tmp_path, "mlp", "vnan", seed=9)
    return tmp_path


X = {"input": np.ones((1, 8), np.float32)}


async def test_old_engine_freed_only_after_its_in_flight_requests(root: Path) -> None:
    manager = make_manager(root, retain=1)
    backend = manager.backend
    assert isinstance(backend, GatedBackend)
    await manager.load("mlp", "v1")
    backend.gate.clear()
    in_flight = [asyncio.create_task(infer_on(manager, "mlp", X)) for _ in range(5)]
    await asyncio.sleep(0.05)
    slot = manager.slot("mlp")
    v1 = slot.current
    assert v1 is not None and v1.in_flight == 5
    loading = asyncio.create_task(manager.load("mlp", "v2"))
    await asyncio.sleep(0.3)
    assert not loading.done()  # its warm-up waits on the gate as well
    backend.gate.set()
    result = await loading
    assert result.from_version == "v1" and result.to_version == "v2"
    answers = await asyncio.gather(*in_flight)
    assert [v.version for v, _ in answers] == ["v1"] * 5  # all pinned to v1, all answered
    assert v1.closed and v1.in_flight == 0
    assert backend.closed == [v1.path]


async def test_retained_version_is_an_instant_rollback(root: Path) -> None:
    manager = make_manager(root, retain=2)
    await manager.load("mlp", "v1")
    await manager.load("mlp", "v2")
    result = await manager.rollback("mlp")
    assert (result.from_version, result.to_version, result.instant) == ("v2", "v1", True)
    assert result.duration_s < 0.01
    await manager.load("mlp", "v3")  # v2 was least recently served: evicted
    assert [v.version for v in manager.slot("mlp").loaded()] == ["v1", "v3"]
    assert manager.slot("mlp").closed_versions == ["v2"]
    with pytest.raises(Conflict):
        await manager.rollback("mlp", "v2")


async def test_warm_up_failure_keeps_old_version(root: Path) -> None:
    manager = make_manager(root)
    await manager.load("mlp", "v1")
    with pytest.raises(LoadRefused, match="warm-up"):
        await manager.load("mlp", "vnan")
    slot = manager.slot("mlp")
    assert slot.current is not None and slot.current.version == "v1"
    assert [v.version for v in slot.loaded()] == ["v1"]
    assert manager.audit.events[-1]["result"] == "failure"


async def test_memory_budget_refuses_a_load_that_does_not_fit(root: Path) -> None:
    size = (root / "mlp" / "v1" / "model.onnx").stat().st_size
    per_version = int(size * OnnxRuntimeBackend.memory_factor)
    # room for two versions (the double buffer) but not three
    manager = make_manager(root, retain=3, budget=int(per_version * 2.5))
    await manager.load("mlp", "v1")
    await manager.load("mlp", "v2")
    await manager.load("mlp", "v3")  # evicts the retained v1 to make room
    assert [v.version for v in manager.slot("mlp").loaded()] == ["v2", "v3"]

    tight = make_manager(root, retain=2, budget=int(per_version * 1.5))
    await tight.load("mlp", "v1")
    with pytest.raises(MemoryBudgetExceeded, match="memory budget"):
        await tight.load("mlp", "v2")
    assert tight.slot("mlp").current.version == "v1"  # type: ignore[union-attr]


async def test_path_outside_repository_is_refused(root: Path, tmp_path_factory) -> None:
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    version = add_version(elsewhere, "mlp", "v9", seed=9)
    manager = make_manager(root)
    await manager.load("mlp", "v1")
    with pytest.raises(Exception, match="outside the trusted model directory"):
        await manager.load("mlp", "v9", path=version.path, expected_sha256=version.sha256)


async def test_a_slow_load_never_blocks_inference(root: Path) -> None:
    """One inference thread only: requests keep being answered while v2 loads."""
    from concurrent.futures import ThreadPoolExecutor

    class SlowLoading(OnnxRuntimeBackend):
        def load(self, model: ModelFile):  # type: ignore[override]
            time.sleep(1.0)
            return super().load(model)

    manager = EngineManager(
        SlowLoading(),
        ModelRepository(root),
        ServerMetrics(),
        AuditLog(),
    )
    runner = Runner(manager.metrics, manager.row_limits, executor=ThreadPoolExecutor(1))
    manager.register("mlp")
    await manager.load("mlp", "v1")
    loading = asyncio.create_task(manager.load("mlp", "v2"))
    await asyncio.sleep(0.1)
    answered = 0
    started = time.monotonic()
    while not loading.done():
        version, _ = await infer_on(manager, "mlp", X, runner)
        assert version.version == "v1"
        answered += 1
    await loading
    assert answered > 20, answered  # about one second of uninterrupted serving
    assert time.monotonic() - started >= 0.8
    manager.close()


async def test_every_version_has_a_lifecycle_state_with_a_reason(root: Path) -> None:
    manager = make_manager(root, retain=2)
    backend = manager.backend
    assert isinstance(backend, GatedBackend)
    slot = manager.slot("mlp")
    await manager.load("mlp", "v1")
    backend.gate.clear()  # v2's warm-up waits: it stays LOADING beside the serving v1
    loading = asyncio.create_task(manager.load("mlp", "v2"))
    await asyncio.sleep(0.2)
    assert slot.states()["v2"].state is VersionState.LOADING
    assert slot.states()["v1"] == VersionStatus(VersionState.READY, "serving")
    backend.gate.set()
    await loading
    assert slot.states()["v1"] == VersionStatus(VersionState.READY, "retained for rollback")
    with pytest.raises(LoadRefused):
        await manager.load("mlp", "vnan")
    refused = slot.states()["vnan"]
    assert refused.state is VersionState.UNAVAILABLE and "warm-up" in refused.reason
    await manager.load("mlp", "v3")  # v1 evicted beyond retain=2, and freed
    assert slot.states()["v1"] == VersionStatus(VersionState.UNAVAILABLE, "unloaded")
    assert {v: s.state for v, s in slot.states().items() if s.state is VersionState.READY} == {
        "v2": VersionState.READY,
        "v3": VersionState.READY,
    }


async def test_a_cancelled_load_is_unavailable_and_its_engine_closed(root: Path) -> None:
    manager = make_manager(root)
    backend = manager.backend
    assert isinstance(backend, GatedBackend)
    await manager.load("mlp", "v1")
    backend.gate.clear()  # v2's warm-up blocks on the loader thread
    loading = asyncio.create_task(manager.load("mlp", "v2"))
    await asyncio.sleep(0.3)
    loading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await loading
    slot = manager.slot("mlp")
    assert slot.states()["v2"] == VersionStatus(VersionState.UNAVAILABLE, "load cancelled")
    backend.gate.set()  # the thread finishes its warm-up; nobody wants the engine
    for _ in range(100):
        if any("v2" in str(p) for p in backend.closed):
            break
        await asyncio.sleep(0.05)
    assert [p.parent.name for p in backend.closed] == ["v2"]
    assert slot.current is not None and slot.current.version == "v1"


async def test_reloading_a_version_with_other_bytes_frees_the_old_engine(root: Path) -> None:
    manager = make_manager(root, retain=2)
    backend = manager.backend
    assert isinstance(backend, GatedBackend)
    await manager.load("mlp", "v1")
    first = manager.slot("mlp").current
    rebuilt = add_version(root, "mlp", "v1", seed=7)  # same name, other digest
    await manager.load("mlp", "v1", expected_sha256=rebuilt.sha256)
    slot = manager.slot("mlp")
    assert slot.current is not first and first is not None and first.closed
    assert [v.version for v in slot.loaded()] == ["v1"]
    assert slot.states()["v1"] == VersionStatus(VersionState.READY, "serving")


async def test_after_shutdown_every_version_is_unavailable(root: Path) -> None:
    manager = make_manager(root, retain=2)
    await manager.load("mlp", "v1")
    await manager.load("mlp", "v2")
    manager.close()
    states = manager.slot("mlp").states()
    assert {v: s.state for v, s in states.items()} == {
        "v1": VersionState.UNAVAILABLE,
        "v2": VersionState.UNAVAILABLE,
    }
