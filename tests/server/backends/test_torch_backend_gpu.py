"""The GPU load path's stream discipline, on a real GPU (skipped elsewhere): a load copies
on a stream of its own and an inference thread runs on its own, neither on the legacy
default stream, and neither waits for it (nor for the device); closing gives the weights'
memory back; stream-ordered device buffers (the TensorRT backend's) never wait either.

"Never waits" is checked without timing: a spin kernel keeps the default stream busy for
far longer than the work takes, and the default stream must still be busy afterwards.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from model_server.backends.base import ModelFile
from model_server.errors import BadRequest
from tests.support.server import add_version, write_apart

pytestmark = pytest.mark.gpu

NO_CUDA = "needs torch with CUDA and a GPU (run on the device machine)"
BUSY_SECONDS = 5.0  # far longer than loading and running a small MLP


@pytest.fixture(scope="module")
def torch() -> Any:
    torch = pytest.importorskip("torch", reason="torch not installed")
    if not torch.cuda.is_available():
        pytest.skip(NO_CUDA)
    return torch


@pytest.fixture(scope="module")
def cycles_per_second(torch: Any) -> float:
    """The spin kernel's rate, measured with CUDA events once the clock has ramped up
    (an idle H200 reads 345 MHz, a busy one 1980)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(200_000_000)
    start.record()
    torch.cuda._sleep(200_000_000)
    end.record()
    end.synchronize()
    return 200_000_000 / (start.elapsed_time(end) / 1000)


class BusyDefaultStream:
    """A spin kernel on the legacy default stream, and how long the work beside it took
    (for the failure message)."""

    def __init__(self, torch: Any, cycles_per_second: float) -> None:
        self.torch = torch
        self.cycles_per_second = cycles_per_second
        self.started = 0.0

    def __call__(self) -> None:
        with self.torch.cuda.stream(self.torch.cuda.default_stream()):
            self.torch.cuda._sleep(int(BUSY_SECONDS * self.cycles_per_second))
        self.started = time.monotonic()

    def still_busy(self) -> tuple[bool, str]:
        took = time.monotonic() - self.started
        return (
            not self.torch.cuda.default_stream().query(),
            f"the default stream drained: something waited for it (the work took {took:.2f} s "
            f"beside a {BUSY_SECONDS} s spin)",
        )


@pytest.fixture
def busy_default_stream(torch: Any, cycles_per_second: float) -> Iterator[BusyDefaultStream]:
    """Occupies the legacy default stream; waits for it to drain afterwards."""
    busy = BusyDefaultStream(torch, cycles_per_second)
    yield busy
    torch.cuda.default_stream().synchronize()


def _mlp(tmp_path: Path, seed: int) -> tuple[Any, ModelFile]:
    version = add_version(tmp_path / "repo", "mlp", f"v{seed}", seed=seed, hidden=256, depth=4)
    return version, ModelFile.read(version.path)


def test_requests_never_wait_for_the_default_stream(
    torch: Any, busy_default_stream: BusyDefaultStream, tmp_path: Path
) -> None:
    """Graph replays and eager runs of a warmed-up version answer correctly while the
    default stream is busy: they run on their thread's stream and wait for it alone."""
    from model_server.backends.torch_backend import TorchBackend

    version, model = _mlp(tmp_path, 1)
    engine = TorchBackend("cuda").load(model)
    engine.warm_up()  # batch-1 graphs
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    engine.infer({"input": x})  # batch 4: eager, then captured
    eager = TorchBackend("cuda", cuda_graphs=False).load(model)
    eager.infer({"input": x})
    busy_default_stream()
    for batch in (1, 4, 1, 4):
        xb = x[:batch]
        np.testing.assert_allclose(
            engine.infer({"input": xb})["output"], version.expected(xb), atol=1e-4
        )
        np.testing.assert_allclose(
            eager.infer({"input": xb})["output"], version.expected(xb), atol=1e-4
        )
    busy, why = busy_default_stream.still_busy()
    assert busy, why
    engine.close()
    eager.close()


def test_staged_copies_never_wait_for_the_default_stream(
    torch: Any, busy_default_stream: BusyDefaultStream
) -> None:
    """A load's copies (64 MiB through 8 MiB pinned chunks) finish, byte for byte,
    while the default stream is busy: they wait for the load's stream alone."""
    from model_server.backends import torch_gpu

    data = np.random.default_rng(0).integers(0, 256, 64 * 2**20 + 12, dtype=np.uint8)
    target = torch.empty(data.size, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream(priority=torch_gpu.LOAD_PRIORITY)
    upload = torch_gpu.StagedUpload(torch, 8 * 2**20, stream)
    busy_default_stream()
    with torch.cuda.stream(stream):
        upload.copy(target, memoryview(data))
    upload.finish()
    busy, why = busy_default_stream.still_busy()
    assert busy, why
    assert upload.pieces == 9
    assert bytes(target.cpu().numpy()) == data.tobytes()


def test_copies_and_kernels_run_on_their_own_streams(
    torch: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The current stream during every staged copy is the load's (one, not the default),
    and during every request the thread's own (one per thread, not the load's)."""
    from model_server.backends import torch_backend, torch_gpu

    seen_load: list[Any] = []
    seen_infer: dict[str, set[Any]] = {}
    real_copy, real_run = torch_gpu.StagedUpload.copy, torch_backend.TorchEngine._run

    def spy_copy(self: Any, target: Any, source: memoryview) -> None:
        seen_load.append(torch.cuda.current_stream())
        real_copy(self, target, source)

    def spy_run(self: Any, steps: Any, activations: Any) -> None:
        name = threading.current_thread().name
        seen_infer.setdefault(name, set()).add(torch.cuda.current_stream())
        real_run(self, steps, activations)

    monkeypatch.setattr(torch_gpu.StagedUpload, "copy", spy_copy)
    monkeypatch.setattr(torch_backend.TorchEngine, "_run", spy_run)
    version, model = _mlp(tmp_path, 3)
    # without graphs, so that every request runs its kernels through _run
    engine = torch_backend.TorchBackend("cuda", chunk_bytes=4096, cuda_graphs=False).load(model)

    def requests() -> None:
        for _ in range(3):
            engine.infer({"input": np.ones((2, 8), np.float32)})

    threads = [threading.Thread(target=requests, name=f"infer-{i}") for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    default = torch.cuda.default_stream()
    assert len(seen_load) == 8 and len(set(seen_load)) == 1 and seen_load[0] != default
    assert sorted(seen_infer) == [f"infer-{i}" for i in range(4)]
    streams = [next(iter(s)) for s in seen_infer.values()]
    assert all(len(s) == 1 for s in seen_infer.values())  # a thread keeps its stream
    assert len(set(streams)) == 4 and default not in streams and seen_load[0] not in streams
    x = np.ones((2, 8), np.float32)
    np.testing.assert_allclose(engine.infer({"input": x})["output"], version.expected(x), atol=1e-4)
    engine.close()


def test_closing_gives_the_weights_memory_back(torch: Any, tmp_path: Path) -> None:
    from model_server.backends.torch_backend import TorchBackend

    version = add_version(tmp_path / "repo", "mlp", "v1", seed=4, hidden=1024, depth=4)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    engine = TorchBackend("cuda").load(ModelFile.read(version.path))
    engine.warm_up()
    engine.infer({"input": np.ones((3, 8), np.float32)})
    held = torch.cuda.memory_allocated()
    assert held - before >= engine.device_memory_bytes > 4 * 2**20
    engine.close()
    # the weights and the graphs' memory; what stays is cuBLAS's workspace for this
    # thread's stream (made by its first request), about 32 MiB, not the engine's
    freed = held - torch.cuda.memory_allocated()
    assert freed >= engine_bytes(version)
    assert torch.cuda.memory_allocated() - before <= 64 * 2**20


def engine_bytes(version: Any) -> int:
    return sum(w.nbytes + b.nbytes for w, b in version.weights.layers)


def test_graph_replays_answer_like_the_eager_run_from_many_threads(
    torch: Any, tmp_path: Path
) -> None:
    """More threads than graphs per shape, mixed batch sizes (as dynamic batching sends
    them, 1 to 16 rows): replays and eager runs side by side, every answer the reference
    for its own input, and no graph captured on a request's thread."""
    from model_server.backends import torch_backend

    version, model = _mlp(tmp_path, 5)
    engine = torch_backend.TorchBackend("cuda").load(model)
    engine.warm_up()
    assert engine.graphs_captured == torch_backend.GRAPHS_PER_SHAPE
    wrong: list[str] = []

    def worker(index: int) -> None:
        rng = np.random.default_rng(index)
        for step in range(60):
            x = rng.standard_normal((1 + (index * 7 + step) % 16, 8)).astype(np.float32)
            got = engine.infer({"input": x})["output"]
            if not np.allclose(got, version.expected(x), atol=1e-4):
                wrong.append(f"thread {index} step {step}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert wrong == []
    assert engine.graphs_captured == torch_backend.GRAPHS_PER_SHAPE  # warm-up's alone
    engine.close()


@pytest.fixture(scope="module")
def cuda_memory(torch: Any) -> Any:
    if importlib.util.find_spec("cuda") is None:
        pytest.skip("needs cuda-python (cuda.bindings)")
    from model_server.backends import cuda_memory

    return cuda_memory


def test_stream_ordered_device_buffers_never_wait_for_the_default_stream(
    torch: Any, cuda_memory: Any, busy_default_stream: BusyDefaultStream
) -> None:
    """The TensorRT backend's buffers: allocated, round-tripped and freed on a context's
    non-blocking stream while the default stream is busy."""
    stream = cuda_memory.CudaStream()
    host = cuda_memory.PinnedBuffer(4096)
    back = cuda_memory.PinnedBuffer(4096)
    busy_default_stream()
    device = cuda_memory.DeviceBuffer(4096, stream)
    data = np.arange(1024, dtype=np.float32)
    np.copyto(host.view(np.float32, (1024,)), data)
    device.copy_from(host, 4096, stream)
    device.copy_to(back, 4096, stream)
    stream.synchronize()
    np.testing.assert_array_equal(back.view(np.float32, (1024,)), data)
    device.free()
    stream.synchronize()
    busy, why = busy_default_stream.still_busy()
    assert busy, why
    stream.close()
    host.free()
    back.free()


def test_a_quick_run_replays_a_graph_on_the_calling_thread(torch: Any, tmp_path: Path) -> None:
    """Warm-up times the replays; ``infer_if_quick`` then answers as ``infer`` does for
    the captured (batch-1) shape within that budget, and declines any other shape or a
    budget below the replay's time, so those go to an inference thread."""
    from model_server.backends import replay_times, torch_backend

    version, model = _mlp(tmp_path, 6)
    engine = torch_backend.TorchBackend("cuda").load(model)
    engine.warm_up()
    replay, times = engine.replay_seconds, engine.replay_times
    assert replay is not None and replay > 0 and times is not None
    x = np.random.default_rng(0).standard_normal((1, 8)).astype(np.float32)
    quick = engine.infer_if_quick({"input": x}, replay * 2)
    assert quick is not None
    np.testing.assert_allclose(quick["output"], version.expected(x), atol=1e-4)
    assert engine.infer_if_quick({"input": x}, replay / 2) is None
    assert engine.infer_if_quick({"input": np.ones((2, 8), np.float32)}, 1.0) is None
    assert engine.graphs_captured == torch_backend.GRAPHS_PER_SHAPE
    budget = 1.0  # the window is driven by hand from here: no real time decides
    times.note(50.0)  # one outlier changes nothing
    assert engine.infer_if_quick({"input": x}, budget) is not None
    for _ in range(replay_times.REPLAY_WINDOW):  # replays slowed down (a busy GPU)
        times.note(10.0)
    assert engine.infer_if_quick({"input": x}, budget) is None
    for _ in range(replay_times.REPLAY_WINDOW):  # quick again, as the threads' replays show
        times.note(0.001)
    assert engine.infer_if_quick({"input": x}, budget) is not None
    engine.close()
    assert engine.infer_if_quick({"input": x}, 1.0) is None


def test_every_replay_is_timed_by_the_gpu_wherever_it_runs(
    torch: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The defect, on the H200 host: replays were timed by the host clock, and at 16
    clients the inference threads' replays (and then the event loop's probes) were timed
    with their waits for the GIL, so once quick runs were off they never came back
    (server time 11.8 ms in one run, 0.28 ms in the one before). Now each replay, on a
    thread or on the loop, notes the GPU's time from its two CUDA events."""
    from model_server.backends import replay_times, torch_backend

    _, model = _mlp(tmp_path, 6)
    engine = torch_backend.TorchBackend("cuda").load(model)
    engine.warm_up()
    noted: list[float] = []
    monkeypatch.setattr(replay_times.ReplayTimes, "note", lambda self, s: noted.append(s))
    x = np.ones((1, 8), np.float32)
    for _ in range(5):
        engine.infer({"input": x})  # replays the captured graph on this (a worker's) thread
    assert engine.infer_if_quick({"input": x}, 1.0) is not None
    assert len(noted) == 6 and all(0 < seconds < 1 for seconds in noted)
    graphs = engine._graphs
    assert graphs is not None
    captured = graphs.borrow(torch_backend._shape_key({"input": x}))
    assert captured is not None and captured.gpu_seconds in noted  # the events' time
    assert captured.whole  # copies and events inside the graph: no host step timed
    graphs.give_back(torch_backend._shape_key({"input": x}), captured)
    engine.close()


def test_a_torch_without_external_events_captures_kernels_alone_and_answers(
    torch: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fallback on a real GPU: with ``external`` events refused, graphs hold their
    kernels alone, their copies and events queued around the launch, and still answer
    as the model does and time their replays."""
    from model_server.backends import torch_backend

    real_event = torch.cuda.Event

    def event(*args: Any, external: bool = False, **kwargs: Any) -> Any:
        if external:
            raise TypeError("__new__() got an unexpected keyword argument 'external'")
        return real_event(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "Event", event)
    version, model = _mlp(tmp_path, 6)
    engine = torch_backend.TorchBackend("cuda").load(model)
    engine.warm_up()
    x = np.random.default_rng(1).standard_normal((1, 8)).astype(np.float32)
    for _ in range(3):
        np.testing.assert_allclose(
            engine.infer({"input": x})["output"], version.expected(x), atol=1e-4
        )
    graphs = engine._graphs
    assert graphs is not None and engine.replay_seconds is not None
    key = torch_backend._shape_key({"input": x})
    captured = graphs.borrow(key)
    assert captured is not None and not captured.whole and captured.gpu_seconds is not None
    graphs.give_back(key, captured)
    engine.close()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_torch_engine_raises_bad_request_for_a_shape_failure(
    tmp_path: Path, device: str
) -> None:
    torch = pytest.importorskip("torch", reason="torch not installed (GPU tier)")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA and a GPU (run on the device machine)")
    from model_server.backends.torch_backend import TorchBackend

    path = tmp_path / "apart" / "v1" / "model.onnx"
    write_apart(path)
    engine = TorchBackend(device).load(ModelFile.read(path))
    with pytest.raises(BadRequest, match="must match the size of tensor"):
        engine.infer({"a": np.ones((2, 3), np.float32), "b": np.ones((3, 3), np.float32)})
    fine = engine.infer({"a": np.ones((2, 3), np.float32), "b": np.ones((2, 3), np.float32)})
    assert np.array_equal(fine["y"], np.full((2, 3), 2, np.float32))  # the engine still runs


def test_a_kept_private_copy_is_registered_once_and_uploaded_with_no_staging(
    torch: Any, tmp_path: Path
) -> None:
    """With spare copies (the server's default) the torch backend registers a private
    copy's pages with CUDA at its first load; the next version, read into the same
    pages, is copied to the device straight from them, and answers as itself. The
    registration is undone when the pages go."""
    from model_rollout_e2e.onnx_models import reference_forward
    from model_server.backends.torch_backend import TorchBackend
    from model_server.backends.torch_gpu import HOST_PIN
    from model_server.files.spare_copies import SpareCopies
    from model_server.lifecycle.repository import ModelRepository

    versions = [
        add_version(tmp_path / "repo", "mlp", f"v{n}", seed=n, hidden=512, depth=4) for n in (1, 2)
    ]
    spares = SpareCopies(2**30)
    repository = ModelRepository(tmp_path / "repo", spares)
    backend = TorchBackend("cuda", pin_copies=True)
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    stages = []
    try:
        for version in versions:
            model = repository.read_version("mlp", version.name).model
            engine = backend.load(model)
            assert model.private is not None and HOST_PIN in model.private.pins
            assert engine.direct_bytes == engine_bytes(version)  # every weight, unstaged
            stages.append(engine.load_stages)
            model.release()  # kept for the next version, still registered
            out = engine.infer({"input": x})["output"]
            np.testing.assert_allclose(out, reference_forward(version.weights, x), atol=2e-3)
            engine.close()
        assert spares.taken == 1
    finally:
        repository.close()  # unregisters, then gives the pages back
    assert spares.held_bytes() == 0
    assert stages[0]["pin"] >= 0 and "upload" in stages[1]
