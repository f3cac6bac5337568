"""Engine runs quick enough for the event loop (the torch backend's CUDA graph replays):
the engine manager runs them there, counted like any run, and hands every other run to an
inference thread; ``--quick-run-us 0`` turns it off. (The torch side is checked on the
GPU in ``test_torch_backend_gpu.py``.)"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

from model_server.backends.base import ModelFile
from model_server.backends.onnxruntime_backend import OnnxRuntimeBackend
from model_server.config import QUICK_RUN_US, parse_args
from model_server.lifecycle.engine_manager import EngineManager
from model_server.lifecycle.repository import ModelRepository
from model_server.observability.audit import AuditLog
from model_server.observability.metrics import ServerMetrics
from model_server.scheduling.runner import Runner
from tests.support.server import add_version

X = np.ones((1, 8), np.float32)


class QuickBackend(OnnxRuntimeBackend):
    """ONNX Runtime engines that offer quick runs for 1-row inputs (as a captured graph
    is for batch-1 shapes) and record the thread every run is made on."""

    def __init__(self, run_seconds: float) -> None:
        super().__init__()
        self.run_seconds = run_seconds
        self.runs: list[tuple[str, str]] = []  # (how, thread)

    def load(self, model: ModelFile):  # type: ignore[override]
        engine = super().load(model)
        backend, inner = self, engine.infer

        def infer(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
            backend.runs.append(("thread", threading.current_thread().name))
            return inner(feeds)

        def infer_if_quick(
            feeds: Mapping[str, np.ndarray], budget_s: float
        ) -> dict[str, np.ndarray] | None:
            if backend.run_seconds > budget_s or feeds["input"].shape[0] != 1:
                return None
            backend.runs.append(("quick", threading.current_thread().name))
            return inner(feeds)

        engine.infer = infer  # type: ignore[method-assign]
        engine.infer_if_quick = infer_if_quick  # type: ignore[attr-defined]
        return engine


def manager(root: Path, backend: QuickBackend) -> EngineManager:
    m = EngineManager(backend, ModelRepository(root), ServerMetrics(), AuditLog())
    m.register("mlp")
    return m


async def test_a_quick_run_is_made_on_the_event_loop_and_counted(tmp_path: Path) -> None:
    version = add_version(tmp_path, "mlp", "v1", seed=1)
    backend = QuickBackend(run_seconds=100e-6)
    m = manager(tmp_path, backend)
    runner = Runner(m.metrics, m.row_limits, quick_run_s=300e-6)
    try:
        await m.load("mlp", "v1")
        backend.runs.clear()  # the warm-up's
        served, out = await runner.infer(m.slot("mlp"), {"input": X})
        np.testing.assert_allclose(out["output"], version.expected(X), atol=1e-5)
        assert backend.runs == [("quick", threading.current_thread().name)]
        assert served.metrics.engine_latency._sum.get() > 0  # timed like any run
        assert served.metrics.output_values._value.get() == out["output"].size
        backend.runs.clear()
        x2 = np.ones((2, 8), np.float32)  # no quick run for this shape: a thread's
        _, out2 = await runner.infer(m.slot("mlp"), {"input": x2})
        np.testing.assert_allclose(out2["output"], version.expected(x2), atol=1e-5)
        ((how, thread),) = backend.runs
        assert how == "thread" and thread != threading.current_thread().name
        assert served.in_flight == 0
    finally:
        m.close()


@pytest.mark.parametrize(
    ("run_seconds", "quick_run_s"), [(500e-6, 300e-6), (100e-6, 0.0)], ids=["slow", "off"]
)
async def test_runs_longer_than_the_budget_or_with_it_off_go_to_a_thread(
    tmp_path: Path, run_seconds: float, quick_run_s: float
) -> None:
    add_version(tmp_path, "mlp", "v1", seed=1)
    backend = QuickBackend(run_seconds)
    m = manager(tmp_path, backend)
    runner = Runner(m.metrics, m.row_limits, quick_run_s=quick_run_s)
    try:
        await m.load("mlp", "v1")
        backend.runs.clear()
        await runner.infer(m.slot("mlp"), {"input": X})
        ((how, thread),) = backend.runs
        assert how == "thread" and thread != threading.current_thread().name
    finally:
        m.close()


def test_the_flag_sets_the_budget_and_refuses_nonsense(tmp_path: Path) -> None:
    base = ["--repository", str(tmp_path)]
    assert parse_args(base).quick_run_us == QUICK_RUN_US
    assert parse_args([*base, "--quick-run-us", "0"]).quick_run_us == 0
    with pytest.raises(SystemExit):
        parse_args([*base, "--quick-run-us", "-1"])
