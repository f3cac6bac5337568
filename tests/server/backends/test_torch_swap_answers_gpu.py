"""Every answer is its version's, exactly, while versions load and swap on the GPU.

Many clients send distinct inputs (so a buffer shared between requests, or between a
serving version and one warming up, shows as a wrong row) while the engine manager loads
version after version of a 25 MiB MLP beside the serving one. Each answer is then checked
against the float64 reference of the version it names. Batch 1 and several rows per
request (with dynamic batching on), quick runs on and off.

The figures of a long run on the device machine (``SWAP_ANSWERS_LOADS``,
``SWAP_ANSWERS_STEADY_S``) are in the README; by default each case takes 50 loads.
"""

from __future__ import annotations

import asyncio
import os
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from model_rollout_contract.manifest import sha256_file
from model_rollout_e2e.onnx_models import MlpWeights, write_mlp
from model_server.config import ServerConfig
from model_server.files.spare_copies import SpareCopies
from model_server.lifecycle.engine_manager import EngineManager
from model_server.lifecycle.repository import ModelRepository
from model_server.observability.audit import AuditLog
from model_server.observability.metrics import ServerMetrics
from model_server.scheduling.batching import BatchPolicy
from model_server.scheduling.runner import Runner

pytestmark = pytest.mark.gpu

LOADS = int(os.environ.get("SWAP_ANSWERS_LOADS", "50"))
STEADY_S = float(os.environ.get("SWAP_ANSWERS_STEADY_S", "0.05"))
CLIENTS = 16
IN_DIM, HIDDEN, OUT_DIM, DEPTH = 64, 1024, 16, 8  # 25 MiB of float32 weights
TOLERANCE = 2e-3  # float32 on the GPU against float64; versions differ by ~0.3


@pytest.fixture(scope="module")
def torch() -> Any:
    torch = pytest.importorskip("torch", reason="torch not installed (GPU tier)")
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA and a GPU (run on the device machine)")
    return torch


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """v1 .. v(LOADS + 1), each with weights of its own, and their digests."""
    root = tmp_path_factory.mktemp("repo")
    made: dict[str, Any] = {}
    for n in range(1, LOADS + 2):
        path = root / "mlp" / f"v{n}" / "model.onnx"
        weights = write_mlp(path, n, in_dim=IN_DIM, hidden=HIDDEN, out_dim=OUT_DIM, depth=DEPTH)
        made[f"v{n}"] = (weights, sha256_file(path))
    return root, made


def reference(weights: MlpWeights, x: np.ndarray) -> np.ndarray:
    out = x.astype(np.float64)
    for i, (w, b) in enumerate(weights.layers):
        out = out @ w.astype(np.float64) + b
        if i < len(weights.layers) - 1:
            out = np.maximum(out, 0)
    return out


@dataclass
class Answers:
    """What the clients got, by the version each answer named."""

    inputs: dict[str, list[np.ndarray]] = field(default_factory=dict)
    outputs: dict[str, list[np.ndarray]] = field(default_factory=dict)
    count: int = 0

    def add(self, version: str, x: np.ndarray, y: np.ndarray) -> None:
        self.inputs.setdefault(version, []).append(x)
        self.outputs.setdefault(version, []).append(y)
        self.count += 1

    def wrong(self, weights: dict[str, Any]) -> list[str]:
        """One line per wrong answer: its version, how far from that version's output."""
        found = []
        for version, xs in self.inputs.items():
            x, y = np.concatenate(xs), np.concatenate(self.outputs[version])
            error = np.abs(y - reference(weights[version][0], x)).max(axis=1)
            for row in np.flatnonzero(error > TOLERANCE):
                found.append(f"{version}: row {row} off by {error[row]:.3g}")
        return found


async def serve_and_swap(
    root: Path, made: dict[str, Any], rows: int, quick_run_us: int
) -> tuple[Answers, int, int]:
    """The answers, the loads, and how many loads read into the last one's pages (as
    the server does by default: ``--spare-copy-mb``)."""
    from model_server.backends.torch_backend import TorchBackend

    spares = SpareCopies(ServerConfig.spare_copy_mb * 2**20)
    threads = ThreadPoolExecutor(4, thread_name_prefix="infer")
    batching = BatchPolicy(32, 200e-6, 4, frozenset({"mlp"})) if rows > 1 else BatchPolicy()
    manager = EngineManager(
        TorchBackend("cuda", pin_copies=True),  # weights uploaded from the kept pages
        ModelRepository(root, spares),
        ServerMetrics(),
        AuditLog(),
        retain=2,
    )
    runner = Runner(
        manager.metrics,
        manager.row_limits,
        executor=threads,
        batching=batching,
        quick_run_s=quick_run_us / 1e6,
    )
    manager.register("mlp")
    await manager.load("mlp", "v1", expected_sha256=made["v1"][1])
    answers, loading = Answers(), True

    async def client(seed: int) -> None:
        rng = np.random.default_rng(seed)
        while loading:
            x = rng.standard_normal((rows, IN_DIM)).astype(np.float32)
            version, out = await runner.infer(manager.slot("mlp"), {"input": x})
            answers.add(version.version, x, np.asarray(out["output"]))
            await asyncio.sleep(0)  # a quick run answers inline: let the loads run

    clients = [asyncio.create_task(client(seed)) for seed in range(CLIENTS)]
    loads = 0
    try:
        for n in range(2, LOADS + 2):
            await asyncio.sleep(random.uniform(0, 2 * STEADY_S))
            swap = await manager.load("mlp", f"v{n}", expected_sha256=made[f"v{n}"][1])
            assert swap.to_version == f"v{n}"
            loads += 1
        await asyncio.sleep(STEADY_S)
    finally:
        loading = False
        await asyncio.gather(*clients)
        runner.close()
        threads.shutdown()
    return answers, loads, spares.taken


@pytest.mark.parametrize("rows", [1, 4], ids=["batch1", "batched"])
@pytest.mark.parametrize("quick_run_us", [300, 0], ids=["quick", "no-quick"])
def test_every_answer_is_the_output_of_the_version_it_names(
    torch: Any, versions: tuple[Path, dict[str, Any]], rows: int, quick_run_us: int
) -> None:
    root, made = versions
    answers, loads, reused = asyncio.run(serve_and_swap(root, made, rows, quick_run_us))
    wrong = answers.wrong(made)
    print(
        f"rows={rows} quick_run_us={quick_run_us}: {answers.count} answers over {loads} "
        f"loads, {reused} into the pages of the version before"
    )
    assert loads == LOADS
    assert reused >= LOADS // 2  # the engine lets its bytes go: the next load reuses them
    assert len(answers.inputs) > LOADS // 2  # the clients saw most versions
    assert not wrong, f"{len(wrong)} of {answers.count} answers wrong: {wrong[:10]}"
