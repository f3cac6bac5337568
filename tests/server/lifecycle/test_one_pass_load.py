"""A load reads and hashes a model file in one pass (issue 33): a file changed or cut
short while read is refused and the serving version keeps serving."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from model_server.backends.onnxruntime_backend import OnnxRuntimeBackend
from model_server.errors import LoadRefused
from model_server.files import private_copy
from model_server.lifecycle.engine_manager import EngineManager
from model_server.lifecycle.load_stages import HASH_WAIT, READ_HASH
from model_server.lifecycle.repository import ModelRepository
from model_server.observability.audit import AuditLog
from model_server.observability.metrics import ServerMetrics
from tests.support.server import add_version

CHUNK = 4096


@pytest.fixture
def manager(tmp_path: Path) -> EngineManager:
    for i in (1, 2, 3):
        add_version(tmp_path, "mlp", f"v{i}", seed=i, hidden=64)
    engines = EngineManager(
        OnnxRuntimeBackend(), ModelRepository(tmp_path), ServerMetrics(), AuditLog()
    )
    engines.register("mlp")
    return engines


def change_v2_after_its_first_chunk(
    monkeypatch: pytest.MonkeyPatch, root: Path, change: str
) -> None:
    """v2's file is rewritten (``rewrite``) or cut short (``shrink``) once its first
    chunk is in the private copy."""
    monkeypatch.setattr(private_copy, "CHUNK_BYTES", CHUNK)
    path = root / "mlp" / "v2" / "model.onnx"
    assert path.stat().st_size > 2 * CHUNK
    real = os.sendfile

    def sendfile(out_fd: int, in_fd: int, offset: int, count: int) -> int:
        n = real(out_fd, in_fd, offset, count)
        if offset == 0 and os.fstat(in_fd).st_ino == path.stat().st_ino:
            with open(path, "r+b") as f:
                if change == "shrink":
                    f.truncate(CHUNK + 1)
                else:
                    f.seek(CHUNK + 7)
                    f.write(b"\xff\x00\xff")
        return n

    monkeypatch.setattr(os, "sendfile", sendfile)


@pytest.mark.parametrize("change", ["rewrite", "shrink"])
async def test_a_file_changed_midway_is_refused_and_the_old_version_serves(
    manager: EngineManager, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    try:
        await manager.load("mlp", "v1")
        change_v2_after_its_first_chunk(monkeypatch, tmp_path, change)
        with pytest.raises(LoadRefused) as refused:
            await manager.load("mlp", "v2")
        wanted = "sha256 of model.onnx is" if change == "rewrite" else "changed size"
        assert wanted in refused.value.message
        current = manager.slot("mlp").current
        assert current is not None and current.version == "v1"
    finally:
        manager.close()


async def test_a_load_reports_its_read_and_hash_as_one_pass(manager: EngineManager) -> None:
    try:
        result = await manager.load("mlp", "v1")
        assert {READ_HASH, HASH_WAIT} <= set(result.stages_s)
        assert "hash" not in result.stages_s
    finally:
        manager.close()
