"""A private copy kept for the next version of its size (model_server.files.spare_copies):
the next read fills pages already there, and what it hands on is still exactly the
file's bytes, hashed as read, in a memfd no one else can write."""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

from model_rollout_contract.manifest import Chunks
from model_rollout_e2e.onnx_models import write_mlp
from model_server.backends.onnxruntime_backend import OnnxRuntimeBackend
from model_server.files import chunk_verifier
from model_server.files.chunk_verifier import ExpectedBytes, Mismatch
from model_server.files.private_copy import HashedCopy, free, read_into_private_copy
from model_server.files.spare_copies import SpareCopies
from model_server.lifecycle.load_pipeline import LoadPipeline
from model_server.lifecycle.repository import ModelRepository
from tests.support.server import write_manifest

SIZE = 3 * 2**20 + 123  # not whole pages: the last one is partly the file's


def read(
    path: Path, spares: SpareCopies | None, expected: ExpectedBytes | None = None
) -> HashedCopy:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        return read_into_private_copy(
            fd, size, path.name, str(path), chunk_bytes=2**20, expected=expected, spares=spares
        )
    finally:
        os.close(fd)


def write(path: Path, seed: int, size: int = SIZE) -> bytes:
    data = np.random.default_rng(seed).bytes(size)
    path.write_bytes(data)
    return data


def test_the_next_read_of_that_size_fills_the_kept_copy_with_its_own_bytes(
    tmp_path: Path,
) -> None:
    spares = SpareCopies(64 * 2**20)
    write(tmp_path / "v1", 1)
    first = read(tmp_path / "v1", spares)
    memfd_path = first.copy.path
    assert memfd_path is not None
    first.copy.close()
    assert spares.held_bytes() == SIZE
    assert first.copy.path is None  # closed: no longer this copy's to hand out

    data = write(tmp_path / "v2", 2)
    second = read(tmp_path / "v2", spares)
    assert spares.taken == 1 and spares.held_bytes() == 0
    assert second.copy.path == memfd_path  # the same memfd, filled again
    assert bytes(second.copy.view) == data
    assert second.sha256 == hashlib.sha256(data).hexdigest()
    assert Path(memfd_path).read_bytes() == data  # through the path a runtime opens
    assert os.stat(memfd_path).st_mode & 0o777 == 0o400
    fd = os.open(memfd_path, os.O_RDONLY)
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SHRINK
    finally:
        os.close(fd)
    second.copy.close()


def test_a_file_of_another_size_gets_new_pages_and_the_spare_stays(tmp_path: Path) -> None:
    spares = SpareCopies(64 * 2**20)
    write(tmp_path / "v1", 1)
    read(tmp_path / "v1", spares).copy.close()
    data = write(tmp_path / "v2", 2, SIZE + 4096)
    other = read(tmp_path / "v2", spares)
    assert spares.taken == 0 and spares.held_bytes() == SIZE
    assert bytes(other.copy.view) == data
    other.copy.close()
    assert spares.held_bytes() == SIZE + SIZE + 4096


def test_the_budget_keeps_the_newest_and_frees_the_rest(tmp_path: Path) -> None:
    spares = SpareCopies(SIZE + 10)
    write(tmp_path / "v1", 1)
    write(tmp_path / "v2", 2)
    first = read(tmp_path / "v1", spares)
    second = read(tmp_path / "v2", spares)
    first.copy.close()
    second.copy.close()  # displaces the first: both do not fit
    assert spares.held_bytes() == SIZE
    assert first.copy.mapping is not None and first.copy.mapping.closed
    assert second.copy.mapping is not None and not second.copy.mapping.closed

    nothing = SpareCopies(0)
    third = read(tmp_path / "v1", nothing)
    third.copy.close()
    assert nothing.held_bytes() == 0
    assert third.copy.mapping is not None and third.copy.mapping.closed


def test_a_copy_a_view_still_holds_is_never_kept(tmp_path: Path) -> None:
    """Its bytes are still read through the view: a later load must not rewrite them."""
    spares = SpareCopies(64 * 2**20)
    data = write(tmp_path / "v1", 1)
    first = read(tmp_path / "v1", spares)
    held = np.frombuffer(first.copy.view, dtype=np.uint8)
    first.copy.close()
    assert spares.held_bytes() == 0
    write(tmp_path / "v2", 2)
    read(tmp_path / "v2", spares).copy.close()
    assert held.tobytes() == data


def test_a_refused_read_into_a_spare_frees_it_and_keeps_nothing_of_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk that differs from the manifest's: the half-written spare is given back,
    never kept for a later read nor left mapped."""
    monkeypatch.setattr(chunk_verifier, "WORKERS", 2)  # chunks checked as they are read
    spares = SpareCopies(64 * 2**20)
    write(tmp_path / "v1", 1)
    kept = read(tmp_path / "v1", spares)
    kept.copy.close()
    write(tmp_path / "v2", 2)
    other = hashlib.sha256(b"other").hexdigest()
    wrong = ExpectedBytes(SIZE, other, Chunks(2**20, (other,) * 4))
    with pytest.raises(Mismatch):
        read(tmp_path / "v2", spares, expected=wrong)
    assert spares.held_bytes() == 0
    assert kept.copy.mapping is not None and kept.copy.mapping.closed


def test_loads_through_the_pipeline_reuse_the_last_versions_copy(tmp_path: Path) -> None:
    """Two versions of one size loaded by ONNX Runtime in turn: the second is read into
    the first's pages once its engine is made, and serves its own answers."""
    for n in (1, 2):
        path = tmp_path / "repo" / "mlp" / f"v{n}" / "model.onnx"
        write_mlp(path, n, in_dim=8, hidden=16, out_dim=4, depth=2)
        write_manifest(path)
    spares = SpareCopies(64 * 2**20)
    repository = ModelRepository(tmp_path / "repo", spares)
    backend = OnnxRuntimeBackend()
    pipeline = LoadPipeline(backend, repository)
    x = np.ones((1, 8), dtype=np.float32)

    async def load(version: str) -> np.ndarray:
        checked = await pipeline.read("mlp", version, None, None)
        loaded = await pipeline.load("mlp", version, checked, 0)
        pipeline.settle()
        answer = loaded.engine.infer({"input": x})
        loaded.engine.close()
        backend.settle()
        return next(iter(answer.values()))

    try:
        first = asyncio.run(load("v1"))
        assert spares.held_bytes() > 0
        second = asyncio.run(load("v2"))
    finally:
        pipeline.close()
        repository.close()
    assert spares.taken == 1
    assert not np.allclose(first, second)  # v2's weights, not v1's left in the pages
    assert spares.held_bytes() == 0


def test_a_pin_is_kept_with_the_pages_and_undone_only_when_they_go(tmp_path: Path) -> None:
    """A device driver's registration of a copy's pages (the torch backend's
    cudaHostRegister) serves the next version read into them, and is undone before the
    pages are given back, never while they are kept."""
    undone: list[str] = []
    spares = SpareCopies(SIZE)
    write(tmp_path / "v1", 1)
    first = read(tmp_path / "v1", spares)
    assert first.copy.reusable and first.copy.address is not None
    first.copy.pin("driver", lambda: undone.append("v1's pages"))
    first.copy.close()
    assert undone == []  # kept: still registered

    write(tmp_path / "v2", 2)
    second = read(tmp_path / "v2", spares)
    assert "driver" in second.copy.pins  # the next version finds it done
    second.copy.close()
    assert undone == []

    for spare in spares.clear():  # as the repository closes
        free(spare.mapping, spare.closer, spare.pins)
    assert undone == ["v1's pages"]


def test_a_pin_of_a_copy_given_back_is_undone_before_its_pages_go(tmp_path: Path) -> None:
    order: list[str] = []
    write(tmp_path / "v1", 1)
    copy = read(tmp_path / "v1", None).copy
    assert not copy.reusable
    mapping = copy.mapping
    assert mapping is not None
    copy.pin("driver", lambda: order.append(f"undone, mapped={not mapping.closed}"))
    copy.close()
    assert order == ["undone, mapped=True"]
    assert mapping.closed


def test_a_copy_closed_twice_is_kept_once(tmp_path: Path) -> None:
    """A copy is closed again once its last view goes (the ONNX Runtime cache build and
    the load pipeline each let it go): kept twice, two later reads of its size would
    both fill the same pages, and one version would serve the other's bytes."""
    spares = SpareCopies(64 * 2**20)
    write(tmp_path / "v1", 1)
    first = read(tmp_path / "v1", spares)
    first.copy.close()
    first.copy.close()
    assert spares.held_bytes() == SIZE

    second_data = write(tmp_path / "v2", 2)
    write(tmp_path / "v3", 3)
    second = read(tmp_path / "v2", spares)
    third = read(tmp_path / "v3", spares)  # another tenant's model of that size
    assert second.copy.path != third.copy.path
    assert bytes(second.copy.view) == second_data
    second.copy.close()
    third.copy.close()
    for spare in spares.clear():
        free(spare.mapping, spare.closer, spare.pins)


def test_a_copy_let_go_after_the_repository_closed_is_given_back(tmp_path: Path) -> None:
    """A load still running when the server shuts down lets its copy go afterwards: it
    must not be kept where no one will ever free it (nor undo its pins)."""
    undone: list[str] = []
    write(tmp_path / "v1", 1)
    repository = ModelRepository(tmp_path, SpareCopies(64 * 2**20))
    assert repository.spares is not None
    late = read(tmp_path / "v1", repository.spares)
    late.copy.pin("driver", lambda: undone.append("v1's pages"))
    repository.close()
    late.copy.close()
    assert repository.spares.held_bytes() == 0
    assert late.copy.mapping is not None and late.copy.mapping.closed
    assert undone == ["v1's pages"]


def test_a_pin_of_a_copy_still_viewed_at_close_is_undone_there(tmp_path: Path) -> None:
    """A copy still viewed when let go (a failed torch load's traceback holds its weights'
    views) is never kept: its pages go whenever the view does, unmapped by the garbage
    collector, which knows nothing of a driver's registration. So the registration is
    undone at close, while the pages are still mapped, and the view still reads them."""
    undone: list[str] = []
    spares = SpareCopies(64 * 2**20)
    data = write(tmp_path / "v1", 1)
    copy = read(tmp_path / "v1", spares).copy
    copy.pin("driver", lambda: undone.append("v1's pages"))
    held = np.frombuffer(copy.view, dtype=np.uint8)
    copy.close()
    assert spares.held_bytes() == 0
    assert undone == ["v1's pages"]
    assert copy.pins == {}
    assert held.tobytes() == data


def test_an_onnx_runtime_engine_on_its_own_copy_of_the_weights_keeps_the_pages_once(
    tmp_path: Path,
) -> None:
    """Every initializer small (kept in the graph): the pipeline lets the copy go after
    the load, and the engine lets it go again when closed. Kept twice, the next two
    reads of that size (two tenants' models) would fill the same memfd, and a session
    made from its path would run the other tenant's model."""
    path = tmp_path / "repo" / "mlp" / "v1" / "model.onnx"
    write_mlp(path, 1, in_dim=8, hidden=16, out_dim=4, depth=2)
    write_manifest(path)
    spares = SpareCopies(64 * 2**20)
    repository = ModelRepository(tmp_path / "repo", spares)
    backend = OnnxRuntimeBackend()
    pipeline = LoadPipeline(backend, repository)

    async def load_and_close() -> int:
        checked = await pipeline.read("mlp", "v1", None, None)
        size = checked.model.size
        loaded = await pipeline.load("mlp", "v1", checked, 0)
        pipeline.settle()
        loaded.engine.close()
        backend.settle()
        return size

    try:
        size = asyncio.run(load_and_close())
        assert spares.held_bytes() == size
    finally:
        pipeline.close()
        repository.close()
