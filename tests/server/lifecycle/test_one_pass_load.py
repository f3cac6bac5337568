"""A load reads and hashes a model file in one pass, and lets its private copy go off
its path (issue 33): a file changed or cut short while read is refused and the serving
version keeps serving; the swap never waits for the previous copy's release, and a next
load waits for it before reading (released copies never pile up). Shown by the order
of events, never by timings."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest

from model_server.backends.onnxruntime_backend import OnnxRuntimeBackend
from model_server.errors import LoadRefused
from model_server.files import private_copy
from model_server.files.private_copy import PrivateCopy
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
    monkeypatch.setattr(private_copy, "MIN_CHUNK_BYTES", CHUNK)
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


async def test_the_swap_does_not_wait_for_the_release_and_the_next_read_does(
    manager: EngineManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """v2's private copy is let go on the release thread, held there until the test
    says: v2 is swapped in meanwhile; v3's read starts only once it is let go."""
    events: list[str] = []
    let_go = threading.Event()
    real_close = PrivateCopy.close
    holding: list[PrivateCopy] = []

    def held_close(self: PrivateCopy) -> None:
        if holding and self is holding[0]:
            let_go.wait(10)  # a bound against a hang only
            events.append("v2 released")
        real_close(self)

    real_read = ModelRepository.read_version
    read_started = threading.Event()

    def recorded_read(self: ModelRepository, key: str, version: str, *args: object):  # type: ignore[no-untyped-def]
        events.append(f"{version} read")
        read_started.set()
        files = real_read(self, key, version, *args)  # type: ignore[arg-type]
        if version == "v2":
            assert files.model.private is not None
            holding.append(files.model.private)
        return files

    monkeypatch.setattr(PrivateCopy, "close", held_close)
    monkeypatch.setattr(ModelRepository, "read_version", recorded_read)
    try:
        await manager.load("mlp", "v1")
        await manager.load("mlp", "v2")
        events.append("v2 swapped")
        read_started.clear()
        v3 = asyncio.ensure_future(manager.load("mlp", "v3"))
        # v3's read must not start while v2's copy is held (waited for a while: a read
        # that did not wait would have started by then)
        await asyncio.to_thread(read_started.wait, 1)
        let_go.set()
        await v3
        assert events == ["v1 read", "v2 read", "v2 swapped", "v2 released", "v3 read"]
    finally:
        let_go.set()
        manager.close()
