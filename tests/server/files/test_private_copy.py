"""Model bytes as the server reads them: one private copy, read-only, that ONNX Runtime
opens by path without a second copy, and that is let go without holding the GIL.

The defect behind it, on the H200 host: right after a 400 MiB swap, every request in
flight waited 15 to 23 ms while the event loop freed the model's ``bytes`` (the kernel
takes the pages back with the GIL held). A mapping is unmapped with the GIL released;
these tests pin the structure that guarantees it (no timed assertion)."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import fcntl
import gc
import json
import mmap
import os
import threading
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from model_rollout_contract.manifest import sha256_file
from model_rollout_e2e.onnx_models import write_mlp
from model_server.backends.base import ModelFile
from model_server.backends.onnxruntime_backend import OnnxRuntimeBackend
from model_server.backends.torch_backend import TorchBackend
from model_server.errors import MemoryBudgetExceeded, ServingError
from model_server.files import chunk_verifier, private_copy
from model_server.files.private_copy import PrivateCopy, read_into_private_copy
from model_server.lifecycle.engine_manager import EngineManager
from model_server.lifecycle.load_pipeline import LoadPipeline
from model_server.lifecycle.repository import ModelRepository
from model_server.observability.audit import AuditLog
from model_server.observability.metrics import ServerMetrics
from tests.support.server import add_version, write_manifest


@pytest.fixture
def repo(tmp_path: Path) -> tuple[ModelRepository, Path]:
    path = tmp_path / "repo" / "mlp" / "v1" / "model.onnx"
    write_mlp(path, 1, in_dim=8, hidden=16, out_dim=4, depth=2)
    write_manifest(path)
    return ModelRepository(tmp_path / "repo"), path


@pytest.fixture
def unmapped_on(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The thread (its name's prefix: load, release, MainThread) of each
    ``PrivateCopy.close`` while the test runs."""
    threads: list[str] = []
    real_close = PrivateCopy.close

    def close(self: PrivateCopy) -> None:
        threads.append(threading.current_thread().name.split("_")[0])
        real_close(self)

    monkeypatch.setattr(PrivateCopy, "close", close)
    return threads


def load_through_a_pipeline(repository: ModelRepository) -> PrivateCopy:
    """Read and load v1 through a load pipeline (ONNX Runtime), then close its engine:
    the private copy it was read into, as the load left it."""
    backend = OnnxRuntimeBackend()
    pipeline = LoadPipeline(backend, repository)

    async def load() -> PrivateCopy:
        checked = await pipeline.read("mlp", "v1", None, None)
        private = checked.model.private
        assert private is not None and private.mapping is not None
        assert not private.mapping.closed
        loaded = await pipeline.load("mlp", "v1", checked, 0)
        pipeline.settle()  # its private copy goes on the release thread
        loaded.engine.close()
        backend.settle()
        return private

    try:
        return asyncio.run(load())
    finally:
        pipeline.close()


def test_model_bytes_are_a_read_only_mapping_with_the_files_bytes(
    repo: tuple[ModelRepository, Path],
) -> None:
    repository, path = repo
    model = repository.read_version("mlp", "v1").model
    assert isinstance(model.data, memoryview) and isinstance(model.data.obj, mmap.mmap)
    assert model.data.readonly
    with pytest.raises(TypeError):
        model.data[0] = 0
    assert model.data == path.read_bytes() and model.size == path.stat().st_size
    assert model.sha256 == sha256_file(path)
    assert model.private is not None and model.private.path is not None
    assert model.loadable() == model.private.path
    with open(model.private.path, "rb") as f:  # what ONNX Runtime is given: the same bytes
        assert f.read() == path.read_bytes()
    announced = repository.read_announced(path, "mlp:v1").model
    assert isinstance(announced.data, memoryview) and announced.sha256 == model.sha256


def test_the_private_copy_is_the_bytes_read_not_the_file_changed_later(
    repo: tuple[ModelRepository, Path],
) -> None:
    repository, path = repo
    model = repository.read_version("mlp", "v1").model
    original = path.read_bytes()
    path.write_bytes(b"\0" * len(original))  # rewritten in place after the read
    assert model.data == original
    assert model.private is not None and model.private.path is not None
    with open(model.private.path, "rb") as f:
        assert f.read() == original


@pytest.mark.gpu  # torch is installed where there is a GPU only (its PyPI build is CUDA's)
def test_backends_load_the_private_copy(repo: tuple[ModelRepository, Path]) -> None:
    pytest.importorskip("torch", reason="torch not installed (GPU tier)")
    repository, _ = repo
    model = repository.read_version("mlp", "v1").model
    x = {"input": np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)}
    ort_engine = OnnxRuntimeBackend().load(model)
    torch_engine = TorchBackend("cpu").load(model)
    try:
        want = ort_engine.infer(x)
        got = torch_engine.infer(x)
        assert set(want) == set(got)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5)
    finally:
        ort_engine.close()
        torch_engine.close()


def test_the_memfd_is_closed_once_the_last_view_is_gone(
    repo: tuple[ModelRepository, Path],
) -> None:
    repository, _ = repo
    model = repository.read_version("mlp", "v1").model
    assert model.private is not None
    path = model.private.path
    assert path is not None and os.path.exists(path)
    held = np.frombuffer(model.data, np.uint8)  # a view of the bytes outlives the model
    del model
    gc.collect()
    assert os.path.exists(path)
    del held
    gc.collect()
    assert not os.path.exists(path)


def test_a_load_unmaps_the_bytes_on_a_release_thread(
    repo: tuple[ModelRepository, Path], unmapped_on: list[str]
) -> None:
    """The defect: the event loop dropped the last reference, so it unmapped 400 MiB
    (40 to 50 ms on the H200 host) while every request waited. Then the loader's thread
    let them go, on the load's path (59 ms on the H100 host); now the pipeline's release
    thread does once the engine is made, whether the load succeeds or not; an ONNX
    Runtime session that runs on them (its weights handed over, not copied) keeps them,
    and they go on the backend's release thread once it is closed, never on the closing
    thread."""
    private = load_through_a_pipeline(repo[0])
    assert private.mapping is not None and private.mapping.closed
    assert unmapped_on == ["release", "release"]


def test_releasing_bytes_a_view_still_holds_keeps_them_for_the_view(
    repo: tuple[ModelRepository, Path],
) -> None:
    repository, path = repo
    model = repository.read_version("mlp", "v1").model
    held = np.frombuffer(model.data, np.uint8)
    model.release()  # no error: the mapping stays until the view goes
    assert held.tobytes() == path.read_bytes()


@pytest.mark.parametrize("told", [100, 300], ids=["grew", "shrank"])
def test_a_file_that_changes_size_while_read_is_refused(tmp_path: Path, told: int) -> None:
    path = tmp_path / "model.onnx"
    path.write_bytes(b"x" * 200)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError, match="changed size while it was read"):
            read_into_private_copy(fd, told, "model.onnx", str(path))
    finally:
        os.close(fd)


@pytest.mark.parametrize("refused_after", [None, 0, 4096], ids=["never", "at once", "midway"])
def test_the_kernel_copies_into_the_private_copy_and_a_refusal_reads_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused_after: int | None
) -> None:
    """``sendfile`` fills the memfd (no fault per page); a kernel or file system that
    refuses it, at once or midway, leaves the rest to be read through the mapping."""
    path = tmp_path / "model.onnx"
    data = os.urandom(3 * 4096 + 5)
    path.write_bytes(data)
    calls: list[int] = []
    real = os.sendfile

    def sendfile(out_fd: int, in_fd: int, offset: int, count: int) -> int:
        calls.append(offset)
        if refused_after is not None and offset >= refused_after:
            raise OSError(errno.EINVAL, "refused")
        return real(out_fd, in_fd, offset, min(count, 4096))

    monkeypatch.setattr(os, "sendfile", sendfile)
    fd = os.open(path, os.O_RDONLY)
    try:
        copy = read_into_private_copy(fd, len(data), "model.onnx", str(path)).copy
    finally:
        os.close(fd)
    assert calls and bytes(copy.view) == data
    copy.close()


def test_an_empty_model_file_has_no_mapping(tmp_path: Path) -> None:
    """``mmap`` cannot map 0 bytes: an empty file is empty bytes, refused by the load."""
    path = tmp_path / "repo" / "mlp" / "v1" / "model.onnx"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"")
    model = ModelRepository(tmp_path / "repo").read_version("mlp", "v1").model
    assert model.size == 0 and model.loadable() == b""


async def test_a_version_refused_for_memory_is_unmapped_on_the_release_thread(
    tmp_path: Path, unmapped_on: list[str]
) -> None:
    """Bytes read but never loaded (the budget refused them) go on the release thread,
    never on the event loop that refused them, nor queued behind a loader's long build."""
    add_version(tmp_path, "mlp", "v1", seed=1)
    manager = EngineManager(
        OnnxRuntimeBackend(), ModelRepository(tmp_path), ServerMetrics(), AuditLog(),
        memory_budget_bytes=10,
    )  # fmt: skip
    manager.register("mlp")

    try:
        with pytest.raises(MemoryBudgetExceeded):
            await manager.load("mlp", "v1")
        for _ in range(200):  # the release is handed to the release thread
            if unmapped_on:
                break
            await asyncio.sleep(0.01)
        assert unmapped_on == ["release"]
    finally:
        manager.close()


# -- found by review ----------------------------------------------------------------


def test_the_memfd_cannot_be_rewritten_or_resized_once_read(
    repo: tuple[ModelRepository, Path],
) -> None:
    """Another process of the same user could open ``/proc/<pid>/fd/N`` for writing and
    change the bytes after they were hashed: the memfd is now its owner's to read only,
    and sealed against growing and shrinking (a shrink would fault its readers)."""
    repository, _ = repo
    model = repository.read_version("mlp", "v1").model
    assert model.private is not None and model.private.path is not None
    assert os.stat(model.private.path).st_mode & 0o777 == 0o400
    fd = os.open(model.private.path, os.O_RDONLY)
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SHRINK
    finally:
        os.close(fd)


def test_a_kernel_refusing_the_hole_neither_fails_the_load_nor_keeps_the_bytes(
    repo: tuple[ModelRepository, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ``OSError`` from giving pages back used to replace the engine the load had
    made (a 500, the version left loading, its memory reserved for ever)."""
    repository, _ = repo

    def refuse(mapping: mmap.mmap) -> None:
        raise OSError(errno.EOPNOTSUPP, "not on this file system")

    monkeypatch.setattr(private_copy, "punch_hole", refuse)
    private = load_through_a_pipeline(repository)
    assert private.mapping is not None and private.mapping.closed


def test_pages_go_back_in_one_call_that_lets_the_gil_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The defect, on the H200 host: pages went back 2 MiB at a time through
    ``mmap.madvise``, which holds the GIL, so a 400 MiB release asked for the GIL back
    200 times while the serving threads held it, and p99 while loading went to 4.5x
    steady. Now one ``madvise`` through ctypes (a foreign call without the GIL) empties
    the memfd, the last partial page too, before its mapping is unmapped."""
    path = tmp_path / "model.onnx"
    path.write_bytes(os.urandom(8 * 2**20 + 123))
    fd = os.open(path, os.O_RDONLY)
    try:
        copy = read_into_private_copy(fd, path.stat().st_size, "model", str(path)).copy
    finally:
        os.close(fd)
    memfd = copy.path
    assert memfd is not None and os.stat(memfd).st_blocks > 0
    holes: list[int] = []  # blocks the memfd holds after each hole
    real_punch_hole = private_copy.punch_hole

    def punch_hole(mapping: mmap.mmap) -> None:
        real_punch_hole(mapping)
        holes.append(os.stat(memfd).st_blocks)

    monkeypatch.setattr(private_copy, "punch_hole", punch_hole)
    copy.close()
    assert holes == [0]
    assert copy.mapping is not None and copy.mapping.closed
    madvise = private_copy._MADVISE
    assert madvise is not None
    assert not type(madvise)._flags_ & ctypes._FUNCFLAG_PYTHONAPI  # type: ignore[attr-defined]


def test_the_hole_is_punched_by_address_not_by_a_descriptor_number(tmp_path: Path) -> None:
    """A review found the hole punched through the memfd's number: a number closed (the
    finalizer at exit, a second close) and reused by another file would have had that
    file's bytes zeroed. Now the mapping's own address is advised, so a file that got
    the number keeps every byte, and the copy's pages still go."""
    source = tmp_path / "model.onnx"
    source.write_bytes(os.urandom(3 * mmap.PAGESIZE))
    fd = os.open(source, os.O_RDONLY)
    try:
        copy = read_into_private_copy(fd, source.stat().st_size, "model", str(source)).copy
    finally:
        os.close(fd)
    assert copy.path is not None and copy._memfd_closer is not None
    number = int(copy.path.rsplit("/", 1)[1])
    ours = os.open(copy.path, os.O_RDONLY)  # the copy's file, to look at once its number is gone
    other = os.memfd_create("audit.log")  # a file that can always have holes punched
    try:
        os.write(other, b"x" * 8192)
        copy._memfd_closer()  # the memfd's number closed (as at exit) while the mapping stays
        os.dup2(other, number)  # and taken by another file, at once
        copy.close()
        assert os.pread(number, 8192, 0) == b"x" * 8192
        assert os.fstat(ours).st_blocks == 0  # the copy's own pages went
        assert copy.mapping is not None and copy.mapping.closed
    finally:
        for descriptor in (ours, other, number):
            os.close(descriptor)


@pytest.mark.parametrize("refusal", ["digest", "manifest", "chunk"])
def test_bytes_of_a_version_refused_at_its_read_go_on_the_loaders_thread(
    repo: tuple[ModelRepository, Path],
    refusal: str,
    unmapped_on: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A wrong digest or chunk digest raised with the copy alive: the error carried it
    to the event loop, which unmapped it (77 to 95 ms for 400 MiB). A bad manifest is
    refused before the model file is read (it is read first: it may hold the chunk
    digests the file is checked by)."""
    repository, path = repo
    if refusal == "manifest":
        (path.parent / "manifest.json").write_text("{not json")
    if refusal == "chunk":  # checked by its chunks, on 2 threads
        monkeypatch.setattr(chunk_verifier, "WORKERS", 2)
        write_manifest(path, 2**20)
        raw = json.loads((path.parent / "manifest.json").read_bytes())
        raw["chunks"]["sha256"] = ["0" * 64]
        (path.parent / "manifest.json").write_text(json.dumps(raw))
    expected = "0" * 64 if refusal == "digest" else None
    pipeline = LoadPipeline(OnnxRuntimeBackend(), repository)

    async def read() -> None:
        with pytest.raises(ServingError):
            await pipeline.read("mlp", "v1", None, expected)

    try:
        asyncio.run(read())
        assert unmapped_on == ([] if refusal == "manifest" else ["load"])
    finally:
        pipeline.close()


def test_a_released_model_is_not_loadable(repo: tuple[ModelRepository, Path]) -> None:
    """After release the memfd path read zeros, and later another file: refused now."""
    repository, _ = repo
    model = repository.read_version("mlp", "v1").model
    model.release()
    assert model.private is not None and model.private.path is None
    with pytest.raises(ValueError):
        model.loadable()


def test_without_proc_a_runtime_is_given_the_bytes() -> None:
    copy = PrivateCopy(memoryview(b"onnx bytes"), "/nonexistent/proc/self/fd/7")
    model = ModelFile(Path("model.onnx"), copy.view, "0" * 64, copy)
    assert model.loadable() == b"onnx bytes"


def test_an_ort_format_model_named_model_onnx_still_loads(tmp_path: Path) -> None:
    """ONNX Runtime tells its ORT format by the bytes, but by a ``.ort`` suffix for a
    path: the private copy's path has none, so the backend says which format it is."""
    source = tmp_path / "source.onnx"
    write_mlp(source, 1, in_dim=8, hidden=16, out_dim=4, depth=2)
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "model.ort")
    options.add_session_config_entry("session.save_model_format", "ORT")
    ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
    version = tmp_path / "repo" / "mlp" / "v1"
    version.mkdir(parents=True)
    (version / "model.onnx").write_bytes((tmp_path / "model.ort").read_bytes())
    model = ModelRepository(tmp_path / "repo").read_version("mlp", "v1").model
    engine = OnnxRuntimeBackend().load(model)
    try:
        x = {"input": np.ones((1, 8), np.float32)}
        want = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"]).run(None, x)
        np.testing.assert_allclose(engine.infer(x)["output"], want[0], rtol=1e-5)
    finally:
        engine.close()


async def test_bytes_of_a_load_cancelled_while_it_reads_go_on_the_release_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unmapped_on: list[str]
) -> None:
    """The read goes on after its caller is cancelled; its bytes were then dropped with
    the finished future, on the event loop."""
    add_version(tmp_path, "mlp", "v1", seed=1)
    read_started, finish_read = threading.Event(), threading.Event()
    real_read = LoadPipeline._read_checked

    def held_read(self: LoadPipeline, *args: object) -> object:
        checked = real_read(self, *args)  # type: ignore[arg-type]
        read_started.set()
        finish_read.wait(10)
        return checked

    monkeypatch.setattr(LoadPipeline, "_read_checked", held_read)

    manager = EngineManager(
        OnnxRuntimeBackend(), ModelRepository(tmp_path), ServerMetrics(), AuditLog()
    )
    manager.register("mlp")
    try:
        load = asyncio.ensure_future(manager.load("mlp", "v1"))
        await asyncio.to_thread(read_started.wait, 10)
        load.cancel()
        with pytest.raises(asyncio.CancelledError):
            await load
        finish_read.set()
        for _ in range(200):
            if unmapped_on:
                break
            await asyncio.sleep(0.01)
        assert unmapped_on == ["release"]
    finally:
        finish_read.set()
        manager.close()
