"""The TensorRT engine pool's logic, on a fake engine and host memory standing in for the GPU.

What is faked is TensorRT's engine and CUDA's memory, which cannot run here; what is
tested is this backend's own logic: which profile each pooled context uses, the warm-up
shapes, the memory accounting, the copies of one request, close() and clean-up on failure.
The fake enforces the rules the real runtime does (a context may only take shapes inside
its active profile; concurrently used contexts must hold distinct profiles). The real
bindings' API is checked in test_tensorrt_api.py; a real GPU run is test_tensorrt_gpu.py.
"""

from __future__ import annotations

import enum
import gc
import threading
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from model_server.backends.base import BackendUnavailable, ModelFile
from model_server.backends.tensorrt_backend import (
    TensorRTBackend,
    TensorRTEngine,
    check_version,
)
from model_server.errors import BadRequest
from model_server.lifecycle.load_pipeline import warm_up


class DataType(enum.Enum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    INT64 = 6
    BF16 = 7
    FP8 = 8


class TensorIOMode(enum.Enum):
    INPUT = 1
    OUTPUT = 2


class EngineStat(enum.Enum):
    TOTAL_WEIGHTS_SIZE = 0


# --- host memory in place of the GPU's ---------------------------------------------------
class Memory:
    """Every fake allocation, so tests can see what was freed."""

    def __init__(self) -> None:
        self.by_ptr: dict[int, np.ndarray] = {}
        self.live = 0
        self.streams_open = 0
        self.synchronizes = 0

    def module(self) -> Any:
        memory = self

        class CudaStream:
            address = 0

            def __init__(self) -> None:
                memory.streams_open += 1
                self.open = True

            def synchronize(self) -> None:
                memory.synchronizes += 1

            def close(self) -> None:
                if self.open:
                    memory.streams_open -= 1
                    self.open = False

        class Buffer:
            def __init__(self, nbytes: int) -> None:
                self.nbytes = max(nbytes, 1)
                self.mem: np.ndarray | None = np.zeros(self.nbytes, dtype=np.uint8)
                self.ptr = self.mem.ctypes.data
                memory.by_ptr[self.ptr] = self.mem
                memory.live += 1

            def free(self) -> None:
                if self.mem is not None:
                    del memory.by_ptr[self.ptr]
                    self.mem = None
                    self.ptr = 0
                    memory.live -= 1

            def view(self, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
                assert self.mem is not None
                count = int(np.prod(shape))
                return (
                    self.mem.view(np.uint8)[: count * np.dtype(dtype).itemsize]
                    .view(dtype)
                    .reshape(shape)
                )

        class DeviceBuffer(Buffer):
            def __init__(self, nbytes: int, stream: Any = None) -> None:
                super().__init__(nbytes)
                self.stream = stream  # stream-ordered, as the real one
                assert stream is not None and stream.open, "device buffers need the slot's stream"

            def copy_from(self, host: Buffer, nbytes: int, stream: Any) -> None:
                assert self.mem is not None and host.mem is not None
                self.mem[:nbytes] = host.mem[:nbytes]

            def copy_to(self, host: Buffer, nbytes: int, stream: Any) -> None:
                assert self.mem is not None and host.mem is not None
                host.mem[:nbytes] = self.mem[:nbytes]

        return SimpleNamespace(
            CudaStream=CudaStream, DeviceBuffer=DeviceBuffer, PinnedBuffer=Buffer
        )


# --- an engine computing a small MLP, enforcing the runtime's rules -----------------------
IN, OUT = 8, 4
RNG = np.random.default_rng(0)
W = RNG.standard_normal((IN, OUT)).astype(np.float32)


def reference(x: np.ndarray) -> np.ndarray:
    return np.maximum(x @ W, 0)


class FakeContext:
    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine  # as in the real bindings, a context keeps its engine alive
        self.profile: int | None = None if engine.dynamic else 0
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}
        self.busy = threading.Lock()

    def set_optimization_profile_async(self, index: int, stream: int) -> bool:
        if index in self.engine.profiles_in_use or index >= len(self.engine.profiles):
            return False
        self.engine.profiles_in_use.add(index)
        self.profile = index
        return True

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        assert self.profile is not None, "dynamic shapes before a profile was chosen"
        if self.engine.dynamic:
            lo, _, hi = self.engine.profiles[self.profile]
            if not lo <= shape[0] <= hi or tuple(shape[1:]) != (IN,):
                return False
        self.shapes[name] = tuple(shape)
        return True

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        if name == "output":
            if self.engine.data_dependent:
                return (-1, OUT)
            return (self.shapes["input"][0], OUT)
        return self.shapes[name]

    def set_tensor_address(self, name: str, ptr: int) -> bool:
        if self.engine.refuse_addresses:
            return False
        self.addresses[name] = ptr
        return True

    def execute_async_v3(self, stream: int) -> bool:
        assert self.busy.acquire(blocking=False), "one context used by two requests at once"
        try:
            batch = self.shapes["input"][0]
            memory = self.engine.memory.by_ptr
            x = memory[self.addresses["input"]].view(np.float32)[: batch * IN].reshape(batch, IN)
            self.engine.executed.append((self.profile, batch))
            out = memory[self.addresses["output"]].view(np.float32)[: batch * OUT]
            out[:] = reference(x).reshape(-1)
            return True
        finally:
            self.busy.release()


class FakeEngine:
    def __init__(
        self,
        memory: Memory,
        profiles: list[tuple[int, int, int]] | None = None,
        input_type: DataType = DataType.FLOAT,
        fail_context_at: int | None = None,
        data_dependent: bool = False,
        refuse_addresses: bool = False,
        shape_tensor: str | None = None,
    ) -> None:
        self.memory = memory
        self.shape_tensor = shape_tensor
        self.profiles = profiles if profiles is not None else [(1, 8, 64)]
        self.dynamic = bool(profiles is None or profiles)
        self.input_type = input_type
        self.fail_context_at = fail_context_at
        self.data_dependent = data_dependent
        self.refuse_addresses = refuse_addresses
        self.profiles_in_use: set[int] = set()
        self.contexts_made = 0
        self.executed: list[tuple[int | None, int]] = []
        self.num_io_tensors = 2
        self.num_optimization_profiles = len(self.profiles)

    def get_tensor_name(self, i: int) -> str:
        return ["input", "output"][i]

    def get_tensor_mode(self, name: str) -> TensorIOMode:
        return TensorIOMode.INPUT if name == "input" else TensorIOMode.OUTPUT

    def get_tensor_dtype(self, name: str) -> DataType:
        return self.input_type if name == "input" else DataType.FLOAT

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        batch = -1 if self.dynamic else 16
        return (batch, IN) if name == "input" else (batch, OUT)

    def get_tensor_profile_shape(self, name: str, profile: int) -> list[tuple[int, ...]]:
        lo, opt, hi = self.profiles[profile]
        return [(lo, IN), (opt, IN), (hi, IN)]

    def create_execution_context(self) -> FakeContext | None:
        self.contexts_made += 1
        if self.fail_context_at == self.contexts_made:
            return None
        return FakeContext(self)

    def is_shape_inference_io(self, name: str) -> bool:
        return self.shape_tensor == name

    device_memory_size_v2 = 1500  # per context: the maximum over profiles (STATIC)

    def get_engine_stat(self, stat: EngineStat) -> int:
        assert stat is EngineStat.TOTAL_WEIGHTS_SIZE
        return W.nbytes


TRT = SimpleNamespace(
    __version__="10.16.1.11", DataType=DataType, TensorIOMode=TensorIOMode, EngineStat=EngineStat
)


def make(memory: Memory, contexts: int = 2, **engine_args: Any) -> tuple[TensorRTEngine, Any]:
    engine = FakeEngine(memory, **engine_args)
    return TensorRTEngine(TRT, engine, contexts, plan_bytes=123, cuda=memory.module()), engine


# --- tests -------------------------------------------------------------------------------
def test_each_pooled_context_gets_its_own_profile() -> None:
    memory = Memory()
    pool, engine = make(memory, contexts=3, profiles=[(1, 8, 64)] * 3)
    assert pool.contexts == 3
    assert engine.profiles_in_use == {0, 1, 2}
    # an engine with fewer profiles than contexts asked for serves with fewer contexts
    fewer, _ = make(Memory(), contexts=3, profiles=[(1, 8, 64)] * 2)
    assert fewer.contexts == 2


def test_static_shapes_share_profile_zero() -> None:
    pool, engine = make(Memory(), contexts=3, profiles=[])
    assert pool.contexts == 3
    assert engine.profiles_in_use == set()  # no profile switch was asked for
    x = RNG.standard_normal((16, IN)).astype(np.float32)
    np.testing.assert_allclose(pool.infer({"input": x})["output"], reference(x), rtol=1e-6)


def test_warm_up_runs_every_context_at_its_opt_shape_even_when_min_is_above_one() -> None:
    pool, engine = make(Memory(), contexts=2, profiles=[(4, 6, 32), (4, 6, 32)])
    warm_up(pool)  # the server's warm-up: the engine's own, then one checked inference
    # every context at its own profile's opt shape, then the check at the opt shape
    assert sorted(engine.executed[:2]) == [(0, 6), (1, 6)]
    assert engine.executed[2][1] == 6 and len(engine.executed) == 3
    assert all(batch >= 4 for _, batch in engine.executed)
    assert pool.inputs[0].example().shape == (6, IN)


def test_memory_counts_weights_scratch_per_profile_and_io_buffers() -> None:
    pool, _ = make(Memory(), contexts=2, profiles=[(1, 8, 64)] * 2)
    io_per_context = 64 * IN * 4 + 64 * OUT * 4  # buffers at the profile's maximum
    assert pool.device_memory_bytes == W.nbytes + 2 * 1500 + 2 * io_per_context


def test_memory_falls_back_to_the_plan_size_before_get_engine_stat() -> None:
    class Old:  # TensorRT < 10.14: everything but get_engine_stat
        def __init__(self, inner: FakeEngine) -> None:
            self._inner = inner

        def __getattr__(self, name: str) -> Any:
            if name == "get_engine_stat":
                raise AttributeError(name)
            return getattr(self._inner, name)

    memory = Memory()
    pool = TensorRTEngine(TRT, Old(FakeEngine(memory)), 1, plan_bytes=123, cuda=memory.module())
    assert pool.device_memory_bytes == 123 + 1500 + 64 * IN * 4 + 64 * OUT * 4


def test_one_synchronize_per_request_and_answers_match_the_reference() -> None:
    memory = Memory()
    pool, _ = make(memory)
    before = memory.synchronizes
    x = RNG.standard_normal((5, IN)).astype(np.float32)
    out = pool.infer({"input": x})["output"]
    assert memory.synchronizes == before + 1
    np.testing.assert_allclose(out, reference(x), rtol=1e-6)
    out[:] = 0  # the answer is the caller's own copy, not the staging buffer
    np.testing.assert_allclose(pool.infer({"input": x})["output"], reference(x), rtol=1e-6)


def test_threads_with_mixed_batch_sizes_get_their_own_answers() -> None:
    pool, engine = make(Memory(), contexts=3, profiles=[(1, 8, 64)] * 3)
    failures: list[str] = []

    def client(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(100):
            x = rng.standard_normal((int(rng.integers(1, 65)), IN)).astype(np.float32)
            out = pool.infer({"input": x})["output"]
            if not np.allclose(out, reference(x), rtol=1e-5):
                failures.append(f"batch {x.shape[0]}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert {profile for profile, _ in engine.executed} == {0, 1, 2}


@pytest.mark.parametrize("shape", [(65, IN), (0, IN), (3, IN + 1), (IN,)])
def test_shapes_outside_the_profile_are_a_bad_request(shape: tuple[int, ...]) -> None:
    """A client error, answered 400 (a ValueError would be a 500)."""
    pool, _ = make(Memory())
    with pytest.raises(BadRequest, match="outside"):
        pool.infer({"input": np.zeros(shape, dtype=np.float32)})


def test_only_profiles_like_profile_zero_are_pooled() -> None:
    """A plan with other profiles (trtexec can build those) serves only on the profiles
    whose bounds the engine's metadata promises, so no request depends on which context
    it borrows."""
    pool, engine = make(Memory(), contexts=3, profiles=[(1, 8, 64), (1, 2, 4), (1, 8, 64)])
    assert pool.contexts == 2 and engine.profiles_in_use == {0, 2}
    x = np.ones((40, IN), dtype=np.float32)
    for _ in range(6):  # any context takes a batch of 40
        np.testing.assert_allclose(pool.infer({"input": x})["output"], reference(x), rtol=1e-6)


def test_a_closed_engine_refuses_instead_of_hanging() -> None:
    pool, _ = make(Memory())
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.infer({"input": np.ones((1, IN), dtype=np.float32)})


def test_shape_tensors_are_refused() -> None:
    memory = Memory()
    with pytest.raises(ValueError, match="shape tensor"):
        make(memory, shape_tensor="input")
    assert memory.live == 0


def test_close_frees_buffers_streams_and_lets_the_engine_go() -> None:
    memory = Memory()
    pool, engine = make(memory, contexts=2, profiles=[(1, 8, 64)] * 2)
    gone = weakref.ref(engine)
    del engine
    assert memory.live == 8 and memory.streams_open == 2  # 2 contexts x 2 tensors x 2
    pool.close()
    assert memory.live == 0 and memory.streams_open == 0
    gc.disable()  # freed by reference counting, at once, not by a later collection
    try:
        assert gone() is None
    finally:
        gc.enable()
    assert pool.device_memory_bytes == 0


def test_a_failing_context_releases_what_was_already_made() -> None:
    memory = Memory()
    with pytest.raises(RuntimeError, match="execution context"):
        make(memory, contexts=3, profiles=[(1, 8, 64)] * 3, fail_context_at=2)
    assert memory.live == 0 and memory.streams_open == 0


def test_a_refused_tensor_address_is_an_error() -> None:
    memory = Memory()
    with pytest.raises(RuntimeError, match="address"):
        make(memory, refuse_addresses=True)
    assert memory.live == 0


def test_io_without_a_numpy_type_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"input is BF16.*no numpy type"):
        make(Memory(), input_type=DataType.BF16)


def test_data_dependent_output_shapes_are_refused() -> None:
    memory = Memory()
    with pytest.raises(ValueError, match="data-dependent"):
        make(memory, data_dependent=True)
    assert memory.live == 0


@pytest.mark.parametrize("version", ["10.7.0", "9.3.0", "12.0.0"])
def test_unsupported_tensorrt_versions_are_refused(version: str) -> None:
    with pytest.raises(BackendUnavailable, match=f"TensorRT {version} is not supported"):
        check_version(version)
    assert check_version("10.8.0.43") == 10 and check_version("11.4.0.106") == 11


class FakeRuntime:
    def __init__(self, logger: Any) -> None:
        self.engine_host_code_allowed = False
        self.loaded: list[str] = []
        self.memory = Memory()

    def get_plugin_registry(self) -> Any:
        def load_library(path: str) -> object | None:
            self.loaded.append(path)
            return object() if Path(path).exists() else None

        return SimpleNamespace(load_library=load_library)

    def deserialize_cuda_engine(self, data: bytes) -> FakeEngine | None:
        return FakeEngine(self.memory) if data == b"plan" else None


class Logger:
    WARNING = 2

    def __init__(self, level: int) -> None:
        self.level = level


def fake_trt_module() -> Any:
    return SimpleNamespace(**vars(TRT), Logger=Logger, Runtime=FakeRuntime)


def test_host_code_and_plugin_libraries_are_opt_in(tmp_path: Path) -> None:
    backend = TensorRTBackend(trt=fake_trt_module())
    assert backend._runtime.engine_host_code_allowed is False
    assert backend._plan_runtime.engine_host_code_allowed is False
    library = tmp_path / "libplugin.so"
    library.write_bytes(b"")
    trusted = TensorRTBackend(
        trt=fake_trt_module(), host_code_allowed=True, plugin_libraries=(library,)
    )
    # host code only for verified repository plans, never for engine-cache entries
    assert trusted._plan_runtime.engine_host_code_allowed is True
    assert trusted._runtime.engine_host_code_allowed is False
    assert trusted._runtime.loaded == [str(library)]
    with pytest.raises(BackendUnavailable, match="plugin library"):
        TensorRTBackend(trt=fake_trt_module(), plugin_libraries=(tmp_path / "missing.so",))


def test_a_plan_that_does_not_deserialize_is_refused(tmp_path: Path) -> None:
    backend = TensorRTBackend(trt=fake_trt_module())
    path = tmp_path / "m" / "v1" / "model.engine"
    with pytest.raises(ValueError, match="not a valid TensorRT engine"):
        backend.load(ModelFile(path, b"garbage", "0" * 64))
