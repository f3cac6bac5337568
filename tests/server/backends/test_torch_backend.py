"""The torch backend: answers equal to ONNX Runtime's, the weights read without a full
protobuf parse and copied in bounded chunks byte for byte, threads, and close.

Each engine test runs on the CPU here and on CUDA too where there is a GPU (that case
is marked ``gpu``); the stream discipline on a GPU is in ``test_torch_backend_gpu.py``.
"""

from __future__ import annotations

import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from google.protobuf.message import DecodeError
from onnx import TensorProto, helper, numpy_helper

from model_server.backends import onnx_weights
from model_server.backends.base import ModelFile
from tests.support.server import add_version

# torch's PyPI build is CUDA's (several GB): it is installed where there is a GPU only, so
# every test here is in the GPU tier, and runs on the CPU too where torch is installed
pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="torch not installed (GPU tier)")

from model_server.backends.torch_backend import TorchBackend, TorchEngine  # noqa: E402

NO_CUDA = "needs torch with CUDA and a GPU (run on the device machine)"
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA),
        ],
    ),
]


def ort_answer(data: bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    return [np.asarray(out) for out in session.run(None, feeds)]


def save(model: onnx.ModelProto, path: Path) -> ModelFile:
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return ModelFile.read(path)


def gemm_graph(seed: int) -> onnx.ModelProto:
    """Every operator the backend runs, Gemm with transB/alpha/beta, and one weight in
    typed ``float_data`` rather than ``raw_data``."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((6, 5)).astype(np.float32)
    c = rng.standard_normal(6).astype(np.float32)
    m = rng.standard_normal((6, 6)).astype(np.float32)
    scale = rng.standard_normal(6).astype(np.float32)
    typed = helper.make_tensor("shift", TensorProto.FLOAT, [6], rng.standard_normal(6).tolist())
    nodes = [
        helper.make_node("Gemm", ["x", "w", "c"], ["g"], transB=1, alpha=0.5, beta=2.0),
        helper.make_node("Tanh", ["g"], ["t"]),
        helper.make_node("MatMul", ["t", "m"], ["mm"]),
        helper.make_node("Mul", ["mm", "scale"], ["mu"]),
        helper.make_node("Sub", ["mu", "shift"], ["s"]),
        helper.make_node("Sigmoid", ["s"], ["sg"]),
        helper.make_node("Relu", ["s"], ["r"]),
        helper.make_node("Add", ["sg", "r"], ["a"]),
        helper.make_node("Softmax", ["a"], ["sm"], axis=1),
        helper.make_node("Identity", ["sm"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "all_ops",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 6])],
        [
            numpy_helper.from_array(w, "w"),
            numpy_helper.from_array(c, "c"),
            numpy_helper.from_array(m, "m"),
            numpy_helper.from_array(scale, "scale"),
            typed,
        ],
    )
    return _readable(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def _readable(model: onnx.ModelProto) -> onnx.ModelProto:
    model.ir_version = 8  # what older ONNX Runtime releases read, as the MLPs have
    return model


def weights_model(sizes: dict[str, int], seed: int = 0) -> tuple[onnx.ModelProto, dict]:
    """Initializers of the given byte sizes (any bit patterns, NaNs included), and a graph
    that uses the first; metadata after the graph, so the walk has to keep what follows."""
    rng = np.random.default_rng(seed)
    arrays = {
        name: rng.integers(0, 256, size, dtype=np.uint8).view(np.float32)
        for name, size in sizes.items()
    }
    first = next(iter(arrays))
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", first], ["y"])],
        "weights",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [sizes[first] // 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [sizes[first] // 4])],
        [numpy_helper.from_array(a, n) for n, a in arrays.items()],
        doc_string="a graph",
    )
    model = _readable(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    helper.set_model_props(model, {"owner": "tests"})
    return model, arrays


@pytest.mark.parametrize("device", DEVICES)
def test_answers_equal_onnx_runtime_on_an_mlp(device: str, tmp_path: Path) -> None:
    version = add_version(tmp_path, "mlp", "v1", seed=4, hidden=64, depth=4)
    model = ModelFile.read(version.path)
    engine = TorchBackend(device).load(model)
    for batch in (1, 3, 17):
        x = np.random.default_rng(batch).standard_normal((batch, 8)).astype(np.float32)
        (want,) = ort_answer(model.data, {"input": x})
        got = engine.infer({"input": x})["output"]
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    engine.close()


@pytest.mark.parametrize("device", DEVICES)
def test_every_operator_equals_onnx_runtime(device: str, tmp_path: Path) -> None:
    model = save(gemm_graph(seed=7), tmp_path / "ops" / "model.onnx")
    engine = TorchBackend(device).load(model)
    x = np.random.default_rng(1).standard_normal((4, 5)).astype(np.float32)
    (want,) = ort_answer(model.data, {"x": x})
    np.testing.assert_allclose(engine.infer({"x": x})["y"], want, rtol=1e-5, atol=1e-6)
    assert [s.name for s in engine.inputs] == ["x"]  # the weights are not inputs
    engine.close()


CHUNK = 64


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "sizes",
    [
        # around one chunk, and around two
        {"a": CHUNK - 4, "b": CHUNK, "c": CHUNK + 4, "d": 2 * CHUNK - 4, "e": 2 * CHUNK + 4},
        # small tensors packed into one buffer until one straddles its end
        {"a": 4, "b": CHUNK - 8, "c": 8, "d": 4},
        # exactly filling a buffer, then many buffers for one tensor
        {"a": CHUNK, "b": 9 * CHUNK + 12, "c": 4},
    ],
    ids=["boundaries", "packed", "many-chunks"],
)
def test_a_chunked_load_gives_identical_weights(
    device: str, sizes: dict[str, int], tmp_path: Path
) -> None:
    model, arrays = weights_model(sizes)
    engine = TorchBackend(device, chunk_bytes=CHUNK).load(save(model, tmp_path / "w.onnx"))
    for name, array in arrays.items():
        got = engine.weight(name)
        assert got.shape == array.shape
        assert got.view(np.uint8).tobytes() == array.view(np.uint8).tobytes(), name
    total = sum(sizes.values())
    assert engine.upload_pieces >= -(-total // CHUNK)  # never more than a chunk at a time
    # one allocation holds them all, each at an aligned offset
    assert total <= engine.device_memory_bytes < total + 256 * len(sizes)
    engine.close()


@pytest.mark.parametrize("device", DEVICES)
def test_an_engine_says_where_its_load_went(device: str, tmp_path: Path) -> None:
    """The load pipeline reports these stages (load_stages): parse, upload, bind."""
    engine = TorchBackend(device).load(ModelFile.read(add_version(tmp_path, "m", "v1", 1).path))
    assert set(engine.load_stages) == {"parse", "upload", "bind"}
    assert all(seconds >= 0 for seconds in engine.load_stages.values())
    engine.close()


def test_the_walk_gives_what_onnx_parses(tmp_path: Path) -> None:
    """Weights equal numpy_helper's; the rest of the model, metadata after the graph
    included, equals onnx's parse of the whole file without the raw bytes."""
    model, arrays = weights_model({"a": 16, "b": 40, "c": 4})
    model.graph.initializer.append(helper.make_tensor("typed", TensorProto.FLOAT, [2], [1.5, -2]))
    data = model.SerializeToString()
    skeleton, weights = onnx_weights.load(data)
    assert [w.name for w in weights] == ["a", "b", "c", "typed"]
    for weight in weights:
        want = numpy_helper.to_array(
            onnx.load_model_from_string(data).graph.initializer[
                [w.name for w in weights].index(weight.name)
            ]
        )
        assert weight.array().tobytes() == want.tobytes()
    for name in arrays:  # raw bytes are views of the file's bytes: nothing was copied
        assert next(w for w in weights if w.name == name).data.obj is data
    full = onnx.load_model_from_string(data)
    for tensor in full.graph.initializer:
        tensor.ClearField("raw_data")
    assert skeleton == full
    assert skeleton.metadata_props[0].key == "owner"


def test_bytes_the_walk_cannot_follow_go_to_onnx() -> None:
    with pytest.raises(DecodeError):
        onnx_weights.load(b"\x3a\xff\xff\xff\x0f garbage")  # a graph longer than the file
    with pytest.raises(ValueError, match="bytes"):  # raw data that does not fill the shape
        tensor = helper.make_tensor("w", TensorProto.FLOAT, [4], b"\0" * 12, raw=True)
        graph = helper.make_graph([], "g", [], [], [tensor])
        onnx_weights.load(helper.make_model(graph).SerializeToString())


def test_unsupported_operators_are_refused_by_name(tmp_path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"])],
        "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 1, 1])],
        [numpy_helper.from_array(np.ones((1, 1, 3, 3), np.float32), "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ValueError, match=r"\['Conv'\]"):
        TorchBackend("cpu").load(save(model, tmp_path / "conv.onnx"))


@pytest.mark.parametrize("device", DEVICES)
def test_threads_get_their_own_answers(device: str, tmp_path: Path) -> None:
    """Eight threads at once, each with its own batch size and inputs (on a GPU each has
    its own stream and pinned buffers): every answer is the reference for its input."""
    version = add_version(tmp_path, "mlp", "v1", seed=9, hidden=32)
    engine = TorchBackend(device).load(ModelFile.read(version.path))
    wrong: list[str] = []

    def worker(index: int) -> None:
        rng = np.random.default_rng(index)
        for _ in range(40):
            x = rng.standard_normal((1 + index, 8)).astype(np.float32)
            got = engine.infer({"input": x})["output"]
            if got.shape != (1 + index, 4) or not np.allclose(got, version.expected(x), atol=1e-4):
                wrong.append(f"thread {index}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert wrong == []
    engine.close()


@pytest.mark.parametrize("device", DEVICES)
def test_close_frees_the_weights_and_refuses_requests(device: str, tmp_path: Path) -> None:
    version = add_version(tmp_path, "mlp", "v1", seed=3)
    engine: TorchEngine = TorchBackend(device).load(ModelFile.read(version.path))
    x = np.ones((1, 8), np.float32)
    engine.infer({"input": x})
    held = [weakref.ref(t) for t in (engine._weights or {}).values()]
    assert held and engine.device_memory_bytes > 0
    engine.close()
    assert [ref() for ref in held] == [None] * len(held)  # nothing else keeps a weight alive
    assert engine.device_memory_bytes == 0
    with pytest.raises(RuntimeError, match="closed"):
        engine.infer({"input": x})


def test_the_graph_pool_lends_each_graph_to_one_request_at_a_time() -> None:
    from model_server.backends.torch_gpu import Captured, GraphPool

    pool = GraphPool(per_shape=2, max_shapes=1)
    one, other = (("x", (1, 8), "<f4"),), (("x", (2, 8), "<f4"),)
    assert pool.borrow(one) is None  # nothing captured: a request never captures
    assert pool.reserve(one) and pool.reserve(one)  # warm-up: two places for one shape
    assert not pool.reserve(one)  # two per shape
    assert not pool.reserve(other)  # one shape only
    first, second = Captured("g1", {}, [], {}, []), Captured("g2", {}, [], {}, [])
    pool.give_back(one, first)
    pool.give_back(one, None)  # a failed capture keeps its place: no retry storm
    assert pool.borrow(one) is first
    assert pool.borrow(one) is None  # lent out
    pool.give_back(one, first)
    assert pool.count() == 1
    pool.close()
    pool.give_back(one, second)  # a request finishing after close: dropped
    assert pool.count() == 0 and pool.borrow(one) is None


def test_a_replay_of_kernels_alone_is_timed_by_events_around_its_copies_and_graph() -> None:
    """How a replay is timed, step by step, with stand-ins for torch's graph, stream and
    events (the real ones run in test_torch_backend_gpu on a GPU): the first event goes
    before the copy in, the second after the copy out, both on the request's stream, and
    the time is read once the stream is synchronized."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from model_server.backends.torch_gpu import Captured

    steps: list[str] = []

    class Event:
        def __init__(self, name: str) -> None:
            self.name = name

        def record(self, stream: object) -> None:
            steps.append(f"{self.name} on {stream}")

        def elapsed_time(self, other: Event) -> float:
            steps.append(f"elapsed {self.name}..{other.name}")
            return 0.25  # ms

    class Tensor:
        def __init__(self, name: str) -> None:
            self.name = name

        def copy_(self, source: Tensor, non_blocking: bool) -> None:
            steps.append(f"copy {source.name} to {self.name}")

    class Stream:
        def __str__(self) -> str:
            return "stream"

        def synchronize(self) -> None:
            steps.append("synchronize")

    fake_torch = SimpleNamespace(cuda=SimpleNamespace(stream=lambda s: nullcontext()))
    graph = SimpleNamespace(replay=lambda: steps.append("replay"))
    host_in, host_out = np.zeros(2, np.float32), np.ones(2, np.float32)
    captured = Captured(
        graph,
        {"x": Tensor("device x")},
        [Tensor("device y")],
        {"x": (Tensor("pinned x"), host_in)},
        [(Tensor("pinned y"), host_out)],
        Event("started"),
        Event("finished"),
    )
    spec = SimpleNamespace(name="y")
    out = captured.run(fake_torch, Stream(), {"x": np.full(2, 3, np.float32)}, [spec])
    assert steps == [
        "started on stream",
        "copy pinned x to device x",
        "replay",
        "copy device y to pinned y",
        "finished on stream",
        "synchronize",
        "elapsed started..finished",
    ]
    assert captured.gpu_seconds == 0.00025
    np.testing.assert_array_equal(host_in, [3, 3])
    np.testing.assert_array_equal(out["y"], [1, 1])


class _RecordingTorch:
    """Stand-ins for the torch calls a capture makes, each noted in ``steps`` (for the
    capture tests without a GPU); ``refuse`` names what the runtime refuses. A replay
    writes each pinned input plus one into the pinned output, so tests see the bytes a
    replay read and what the caller got back."""

    float32 = "float32"

    def __init__(self, refuse: str = "") -> None:
        from contextlib import nullcontext
        from types import SimpleNamespace

        steps: list[str] = []
        self.steps = steps
        pinned: list[np.ndarray] = []
        self.pinned = pinned

        class Tensor:
            def __init__(self, name: str, host: np.ndarray | None = None) -> None:
                self.name = name
                self._host = host

            def copy_(self, source: Tensor, non_blocking: bool) -> None:
                steps.append(f"copy {source.name} to {self.name}")

            def numpy(self) -> np.ndarray:
                assert self._host is not None
                return self._host

        class Event:
            def __init__(self, enable_timing: bool, external: bool = False) -> None:
                if external and refuse == "external events":
                    raise TypeError("__new__() got an unexpected keyword argument 'external'")
                self.name = "external event" if external else "event"

            def record(self, stream: object) -> None:
                steps.append(f"record {self.name}")

            def elapsed_time(self, other: Event) -> float:
                if refuse == "elapsed time":
                    raise RuntimeError("CUDA error: invalid resource handle")
                steps.append("elapsed")
                return 0.0 if refuse == "zero time" else 0.01

        class Graph:
            def capture_begin(self, capture_error_mode: str) -> None:
                steps.append(f"begin {capture_error_mode}")

            def capture_end(self) -> None:
                steps.append("end")

            def replay(self) -> None:
                steps.append(f"replay of {pinned[0].tolist()}")
                np.copyto(pinned[1], pinned[0] + 1)

        self._tensor = Tensor
        self.stream = SimpleNamespace(synchronize=lambda: steps.append("synchronize"))
        self.cuda = SimpleNamespace(stream=lambda s: nullcontext(), CUDAGraph=Graph, Event=Event)
        self.made = 0
        self.fail_in_capture = False

    def empty(self, shape: tuple[int, ...], dtype: object, **where: object) -> object:
        self.made += 1
        if not where.get("pin_memory"):
            return self._tensor(f"device {self.made}")
        self.pinned.append(np.zeros(shape, np.float32))
        return self._tensor(f"pinned {self.made}", self.pinned[-1])

    def kernels(self, inputs: dict[str, object]) -> list[object]:
        self.steps.append("kernels")
        if self.fail_in_capture:
            raise RuntimeError("operation not permitted when stream is capturing")
        return [self._tensor("device out")]


def _capture(fake: _RecordingTorch) -> Any:
    from types import SimpleNamespace

    from model_server.backends.torch_gpu import capture

    x = np.full(2, 7, np.float32)  # the warm-up's example input
    result = SimpleNamespace(shape=(2,), dtype="float32")
    return capture(fake, fake.stream, fake.kernels, {"x": x}, [result], "cuda")


WHOLE_CAPTURE = [
    "begin thread_local",
    "record external event",
    "copy pinned 2 to device 1",
    "kernels",
    "copy device out to pinned 3",
    "record external event",
    "end",
    "replay of [7.0, 7.0]",  # the check reads the example, not recycled pinned bytes
    "synchronize",
    "elapsed",
]
KERNELS_ALONE = ["begin thread_local", "kernels", "end"]


def test_a_whole_request_is_captured_in_one_graph_with_its_timing_events() -> None:
    """The copies in and out and both timing events are nodes of the graph: a replay is
    one launch, and no host step (where a thread waits for the GIL) falls between the
    events. One replay at capture checks that the events' time can be read."""
    from types import SimpleNamespace

    fake = _RecordingTorch()
    captured = _capture(fake)
    assert fake.steps == WHOLE_CAPTURE
    assert captured.whole
    fake.steps.clear()
    spec = SimpleNamespace(name="y")
    out = captured.run(fake, fake.stream, {"x": np.full(2, 3, np.float32)}, [spec])
    assert fake.steps == ["replay of [3.0, 3.0]", "synchronize", "elapsed"]
    assert captured.gpu_seconds == 0.00001
    np.testing.assert_array_equal(out["y"], [4, 4])
    fake.pinned[1][...] = 0  # the answer is a copy: the next request may reuse the buffer
    np.testing.assert_array_equal(out["y"], [4, 4])


@pytest.mark.parametrize(
    ("refuse", "steps"),
    [
        ("external events", KERNELS_ALONE),
        ("elapsed time", WHOLE_CAPTURE[:-1] + KERNELS_ALONE),
        ("zero time", WHOLE_CAPTURE + KERNELS_ALONE),
    ],
)
def test_a_runtime_refusing_a_whole_capture_gets_the_kernels_alone(
    refuse: str, steps: list[str]
) -> None:
    """A torch without ``external`` events, or a runtime that cannot time events recorded
    by a graph (an error, or a time of 0 that would hold quick runs on for good), gets a
    graph of the kernels alone, with its copies and events queued around the launch.
    Each refusal comes outside a capture: the first capture has ended before the next
    begins."""
    from types import SimpleNamespace

    fake = _RecordingTorch(refuse)
    captured = _capture(fake)
    assert fake.steps == steps
    assert not captured.whole and captured.started is not None
    fake.steps.clear()
    out = captured.run(
        fake, fake.stream, {"x": np.full(2, 3, np.float32)}, [SimpleNamespace(name="y")]
    )
    assert fake.steps[0] == "record event" and fake.steps[2] == "replay of [3.0, 3.0]"
    np.testing.assert_array_equal(out["y"], [4, 4])


def test_a_failure_inside_a_whole_capture_is_not_retried_as_kernels_alone() -> None:
    """torch's ``capture_end`` raising leaves its allocators' capture state behind (a
    review read it in ``CUDAGraph::capture_end``): a second capture on top of it would
    run on a broken allocator. The failure goes to the caller, which leaves the shape
    without a graph."""
    fake = _RecordingTorch()
    fake.fail_in_capture = True
    with pytest.raises(RuntimeError, match="capturing"):
        _capture(fake)
    assert fake.steps == [*WHOLE_CAPTURE[:4], "end"]


def test_a_replay_whose_time_cannot_be_read_still_answers() -> None:
    """Timing must never fail a request whose outputs are ready: a runtime refusing the
    events' time (an event never recorded, not made for timing) leaves the graph
    untimed, and quick runs to the other graphs' times."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from model_server.backends.torch_gpu import Captured

    class Refusing:
        def record(self, stream: object) -> None:
            pass

        def elapsed_time(self, other: object) -> float:
            raise ValueError("Both events must be recorded before calculating elapsed time.")

    class Tensor:
        def copy_(self, source: object, non_blocking: bool) -> None:
            pass

    fake_torch = SimpleNamespace(cuda=SimpleNamespace(stream=lambda s: nullcontext()))
    stream = SimpleNamespace(synchronize=lambda: None)
    host_out = np.ones(2, np.float32)
    captured = Captured(
        SimpleNamespace(replay=lambda: None),
        {"x": Tensor()},
        [Tensor()],
        {"x": (Tensor(), np.zeros(2, np.float32))},
        [(Tensor(), host_out)],
        Refusing(),
        Refusing(),
    )
    spec = SimpleNamespace(name="y")
    for _ in range(2):  # the second replay is not timed at all
        out = captured.run(fake_torch, stream, {"x": np.zeros(2, np.float32)}, [spec])
        np.testing.assert_array_equal(out["y"], [1, 1])
        assert captured.gpu_seconds is None and captured.started is None
