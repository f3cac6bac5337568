"""A version whose manifest holds chunk digests is checked by them as it is read, on
several threads, never hashed whole (issue 33: one sha256 stream was the load's floor);
a flipped byte, a file cut short or extended, is refused like a wrong digest and the
serving version keeps serving. A manifest without chunk digests loads as before."""

from __future__ import annotations

from pathlib import Path

import pytest

from model_rollout_contract.manifest import MANIFEST_NAME, Manifest
from model_server.backends.onnxruntime_backend import OnnxRuntimeBackend
from model_server.errors import LoadRefused
from model_server.files import chunk_verifier, private_copy
from model_server.lifecycle.engine_manager import EngineManager
from model_server.lifecycle.load_stages import HASH_WAIT, READ_HASH
from model_server.lifecycle.repository import ModelRepository
from model_server.observability.audit import AuditLog
from model_server.observability.metrics import ServerMetrics
from tests.support.server import add_version

MIB = 2**20


@pytest.fixture(autouse=True)
def two_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks are checked on 2 threads, whatever this machine's cores."""
    monkeypatch.setattr(chunk_verifier, "WORKERS", 2)


@pytest.fixture
def manager(tmp_path: Path) -> EngineManager:
    """v1 with a manifest of old (no chunk digests); v2 and v3 in 1 MiB chunks (4 MiB
    and a bit: the last chunk is partial)."""
    add_version(tmp_path, "mlp", "v1", seed=1, hidden=64)
    for i in (2, 3):
        add_version(tmp_path, "mlp", f"v{i}", seed=i, chunk_size=MIB, hidden=1024)
    engines = EngineManager(
        OnnxRuntimeBackend(), ModelRepository(tmp_path), ServerMetrics(), AuditLog()
    )
    engines.register("mlp")
    return engines


def manifest_of(root: Path, version: str) -> Manifest:
    return Manifest.from_bytes((root / "mlp" / version / MANIFEST_NAME).read_bytes())


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def checks_made(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each whole-file hash (``stream``) and chunk check (``chunks``) of the loads."""
    made: list[str] = []
    for name, kind in (("ChunkHasher", "stream"), ("ChunkVerifier", "chunks")):
        real = getattr(private_copy, name)

        def record(*args: object, real: type = real, kind: str = kind, **kwargs: object) -> object:
            made.append(kind)
            return real(*args, **kwargs)

        monkeypatch.setattr(private_copy, name, record)
    return made


async def test_chunk_digests_check_the_file_and_old_manifests_hash_it_whole(
    manager: EngineManager, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = checks_made(monkeypatch)
    try:
        await manager.load("mlp", "v1")
        assert made == ["stream"]
        result = await manager.load("mlp", "v2")
        assert made == ["stream", "chunks"]  # v2's file was never hashed whole
        assert {READ_HASH, HASH_WAIT} <= set(result.stages_s)
        current = manager.slot("mlp").current
        assert current is not None and current.version == "v2"
        assert current.sha256 == manifest_of(tmp_path, "v2").sha256
    finally:
        manager.close()


async def test_without_threads_to_spare_the_file_is_hashed_whole_and_still_checked(
    manager: EngineManager, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One hashing thread (2 cores): one stream starts sooner than whole chunks would;
    its digest is compared with the manifest's, which the chunks are signed with."""
    monkeypatch.setattr(chunk_verifier, "WORKERS", 1)
    made = checks_made(monkeypatch)
    path = tmp_path / "mlp" / "v2" / "model.onnx"
    try:
        await manager.load("mlp", "v3")
        assert made == ["stream"]
        flip_byte(path, MIB + 123)
        with pytest.raises(LoadRefused, match=r"sha256 of model\.onnx is"):
            await manager.load("mlp", "v2")
        current = manager.slot("mlp").current
        assert current is not None and current.version == "v3"
    finally:
        manager.close()


@pytest.mark.parametrize(("where", "chunk"), [("middle", 1), ("last", 4)])
async def test_a_flipped_byte_is_refused_by_its_chunk_and_the_old_version_serves(
    manager: EngineManager, tmp_path: Path, where: str, chunk: int
) -> None:
    """A byte of a middle chunk, or of the last, partial one."""
    path = tmp_path / "mlp" / "v2" / "model.onnx"
    size = path.stat().st_size
    assert 4 * MIB < size < 5 * MIB
    offset = MIB + 123 if where == "middle" else size - 3
    try:
        await manager.load("mlp", "v1")
        flip_byte(path, offset)
        with pytest.raises(LoadRefused) as refused:
            await manager.load("mlp", "v2")
        assert f"(chunk {chunk} of 5)" in refused.value.message
        assert "its manifest says" in refused.value.message
        current = manager.slot("mlp").current
        assert current is not None and current.version == "v1"
        await manager.load("mlp", "v3")  # a good one still loads
        current = manager.slot("mlp").current
        assert current is not None and current.version == "v3"
    finally:
        manager.close()


@pytest.mark.parametrize("change", ["truncate", "extend"])
async def test_a_file_cut_short_or_extended_is_refused_and_the_old_version_serves(
    manager: EngineManager, tmp_path: Path, change: str
) -> None:
    path = tmp_path / "mlp" / "v2" / "model.onnx"
    size = path.stat().st_size
    try:
        await manager.load("mlp", "v1")
        with open(path, "r+b") as f:
            f.truncate(size - 1 if change == "truncate" else size + 1)
        with pytest.raises(LoadRefused) as refused:
            await manager.load("mlp", "v2")
        told = size - 1 if change == "truncate" else size + 1
        assert f"has {told} bytes, its manifest says {size}" in refused.value.message
        current = manager.slot("mlp").current
        assert current is not None and current.version == "v1"
    finally:
        manager.close()


async def test_the_callers_digest_is_still_checked_against_the_manifests(
    manager: EngineManager, tmp_path: Path
) -> None:
    """The sidecar's digest (the control socket's ``sha256``) must be the one the chunk
    digests are signed with: another build's manifest beside the file is refused."""
    try:
        await manager.load("mlp", "v1")
        with pytest.raises(LoadRefused, match="expected"):
            await manager.load("mlp", "v2", expected_sha256=manifest_of(tmp_path, "v3").sha256)
        current = manager.slot("mlp").current
        assert current is not None and current.version == "v1"
    finally:
        manager.close()
