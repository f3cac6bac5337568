"""TensorRT: the production backend, for TensorRT 10 (>= 10.8) and 11.

``tensorrt`` is imported lazily, on first use, so the server imports and runs on
machines without it; asking for this backend there raises ``BackendUnavailable`` with a
message saying what is missing (TensorRT, cuda-python, a driver that matches it, a GPU).

* ``.engine``/``.plan`` files are deserialized directly; ``.onnx`` files are built once
  through the :class:`EngineCache` (see ``tensorrt_build``) and reused by other processes.
* Each concurrent request borrows an execution context from a pool. Every context owns a
  non-blocking CUDA stream, its own optimization profile (required for concurrent use
  with dynamic shapes), and device and pinned host buffers allocated once at that
  profile's maximum shapes; a request is two async copies, one enqueue and one
  synchronize. Device buffers are allocated and freed in stream order on that stream, so
  a version loading or closing never waits for the device (nor makes the serving
  version's requests wait).
* ``device_memory_bytes`` counts what the engine really holds: weights, each context's
  scratch memory and the I/O buffers.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from model_server.backends import cuda_memory
from model_server.backends.base import BackendUnavailable, ModelFile
from model_server.backends.engine_cache import CacheKey, EngineCache
from model_server.backends.tensorrt_build import (
    BuildOptions,
    BuildRefused,
    DynamicBounds,
    ShapeProfile,
    build_engine,
)
from model_server.errors import BadRequest
from model_server.protocol.tensor_spec import TensorSpec

__all__ = [
    "BuildRefused",
    "DynamicBounds",
    "ShapeProfile",
    "TensorRTBackend",
    "TensorRTEngine",
    "import_tensorrt",
]

log = logging.getLogger(__name__)

MIN_VERSION = (10, 8)  # the oldest runtime API checked (tests/server/backends/test_tensorrt_api.py)
MAX_VERSION = (11, 4)  # the newest checked: later releases are refused until checked
MAX_MAJOR = MAX_VERSION[0]

# TensorRT I/O types the server can hand to clients as numpy arrays. BF16, FP8, INT4, FP4
# and E8M0 have no numpy type: engines must keep their I/O in one of these (ModelOpt's
# keep_io_types) and may compute in anything inside.
_NUMPY_TYPES = {
    "FLOAT": np.float32,
    "HALF": np.float16,
    "INT8": np.int8,
    "INT32": np.int32,
    "INT64": np.int64,
    "BOOL": np.bool_,
    "UINT8": np.uint8,
}


def version_tuple(text: str) -> tuple[int, int]:
    parts = [*text.split("."), "0"]
    return int(parts[0]), int(parts[1])


def check_version(text: str) -> int:
    """The TensorRT major version, or ``BackendUnavailable`` outside what is supported."""
    version = version_tuple(text)
    if not MIN_VERSION <= version <= MAX_VERSION:
        raise BackendUnavailable(
            f"TensorRT {text} is not supported: this backend is checked against TensorRT "
            f"{MIN_VERSION[0]}.{MIN_VERSION[1]} to {MAX_VERSION[0]}.{MAX_VERSION[1]}"
        )
    return version[0]


def import_tensorrt() -> Any:
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise BackendUnavailable(
            "the TensorRT backend needs NVIDIA TensorRT >= 10.8 and a CUDA GPU: "
            "pip install 'model-rollout[tensorrt]' (or use --backend onnxruntime)"
        ) from exc
    check_version(trt.__version__)
    if cuda_memory.cuda_report().devices == 0:
        raise BackendUnavailable("the TensorRT backend needs a CUDA GPU; none is visible")
    return trt


def numpy_dtype(trt: Any, dtype: Any, tensor: str) -> np.dtype:
    """The numpy type of a TensorRT I/O tensor, or a refusal that names the tensor."""
    for name, numpy_type in _NUMPY_TYPES.items():
        if dtype == getattr(trt.DataType, name):
            return np.dtype(numpy_type)
    raise ValueError(
        f"tensor {tensor} is {getattr(dtype, 'name', dtype)}, which has no numpy type: keep "
        f"the engine's inputs and outputs in {', '.join(_NUMPY_TYPES)} (e.g. ModelOpt "
        "AutoCast with keep_io_types)"
    )


@dataclass(frozen=True)
class ProfiledTensorSpec(TensorSpec):
    """A TensorSpec whose dynamic axes have a profile: warm-up uses its opt shape, which
    is valid even when the profile's minimum is above 1."""

    min_shape: tuple[int, ...] = ()
    opt_shape: tuple[int, ...] = ()
    max_shape: tuple[int, ...] = ()

    def example(self, dynamic_size: int = 1) -> np.ndarray:
        if self.opt_shape:
            return np.zeros(self.opt_shape, dtype=self.dtype)
        return super().example(dynamic_size)


@dataclass
class _ExecutionSlot:
    """One execution context and everything it alone uses."""

    context: Any
    stream: Any
    profile: int
    device: dict[str, Any] = field(default_factory=dict)
    host: dict[str, Any] = field(default_factory=dict)

    @property
    def io_bytes(self) -> int:
        return sum(buffer.nbytes for buffer in self.device.values())

    def close(self) -> None:
        self.context = None  # the context keeps the engine alive: drop it first
        for buffer in (*self.device.values(), *self.host.values()):
            buffer.free()  # device buffers: queued on this slot's stream
        self.device.clear()
        self.host.clear()
        if self.stream is not None:
            self.stream.synchronize()  # the frees are done: the memory is back now
            self.stream.close()
            self.stream = None


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in text)


def _volume(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64))


class TensorRTEngine:
    platform = "tensorrt_plan"

    def __init__(
        self,
        trt: Any,
        engine: Any,
        contexts: int,
        plan_bytes: int = 0,
        cuda: ModuleType = cuda_memory,
    ) -> None:
        """``plan_bytes``: the serialized engine's size, the weights' estimate where
        ``get_engine_stat`` is missing (TensorRT < 10.14)."""
        self._trt = trt
        self._engine = engine
        self._plan_bytes = plan_bytes
        self._cuda = cuda
        self._pool: queue.Queue[_ExecutionSlot] = queue.Queue()
        self._slots: list[_ExecutionSlot] = []
        self._closed = False
        try:
            self._describe()
            for index in self._profiles_to_use(contexts):
                self._add_slot(index)
        except BaseException:
            self.close()
            raise

    # --- set-up -------------------------------------------------------------------------
    def _describe(self) -> None:
        trt, engine = self._trt, self._engine
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        for name in names:
            if engine.is_shape_inference_io(name):
                raise ValueError(
                    f"tensor {name} is a shape tensor (host memory): the server feeds data "
                    "tensors only"
                )
        self._names = names
        is_input = {n: engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT for n in names}
        dtypes = {n: numpy_dtype(trt, engine.get_tensor_dtype(n), n) for n in names}
        shapes = {n: tuple(engine.get_tensor_shape(n)) for n in names}
        self._dynamic = any(-1 in shapes[n] for n in names if is_input[n])
        inputs = []
        for n in (n for n in names if is_input[n]):
            lo, opt, hi = self._profile_shapes(n, 0) if -1 in shapes[n] else ((), (), ())
            inputs.append(ProfiledTensorSpec(n, dtypes[n], shapes[n], lo, opt, hi))
        self._profiled: tuple[ProfiledTensorSpec, ...] = tuple(inputs)
        self.inputs: tuple[TensorSpec, ...] = self._profiled
        self.outputs = tuple(TensorSpec(n, dtypes[n], shapes[n]) for n in names if not is_input[n])

    def _profile_shapes(self, name: str, profile: int) -> tuple[tuple[int, ...], ...]:
        lo, opt, hi = self._engine.get_tensor_profile_shape(name, profile)
        return tuple(lo), tuple(opt), tuple(hi)

    def _profiles_to_use(self, wanted: int) -> list[int]:
        """The profile of each pooled context. Static shapes: contexts share profile 0.
        Dynamic: one profile each (concurrent contexts need distinct ones), and only
        profiles with profile 0's bounds, so that every context accepts exactly what the
        engine's metadata promises (a trtexec plan may carry other profiles)."""
        if not self._dynamic:
            return [0] * wanted
        dynamic = [spec.name for spec in self._profiled if spec.max_shape]
        first = [self._profile_shapes(name, 0) for name in dynamic]
        alike = [
            p
            for p in range(int(self._engine.num_optimization_profiles))
            if [self._profile_shapes(name, p) for name in dynamic] == first
        ]
        if len(alike) < wanted:
            log.warning(
                "engine has %d optimization profiles like profile 0; serving with %d "
                "execution contexts instead of %d (concurrent contexts need one each)",
                len(alike),
                len(alike[:wanted]),
                wanted,
            )
        return alike[:wanted]

    def _add_slot(self, index: int) -> None:
        context = self._engine.create_execution_context()
        if context is None:
            raise RuntimeError("TensorRT could not create an execution context (out of memory?)")
        slot = _ExecutionSlot(context, self._cuda.CudaStream(), index)
        self._slots.append(slot)  # from here on, close() releases it
        if self._dynamic and not context.set_optimization_profile_async(
            slot.profile, slot.stream.address
        ):
            raise RuntimeError(f"TensorRT refused optimization profile {slot.profile}")
        for spec in self._profiled:
            shape = (
                self._profile_shapes(spec.name, slot.profile)[2] if spec.max_shape else spec.shape
            )
            if not context.set_input_shape(spec.name, shape):
                raise RuntimeError(f"TensorRT refused shape {shape} for input {spec.name}")
            self._allocate(slot, spec.name, shape, spec.dtype)
        for output in self.outputs:
            shape = tuple(context.get_tensor_shape(output.name))
            if any(dim < 0 for dim in shape):
                raise ValueError(
                    f"output {output.name} has a data-dependent shape {shape} (e.g. NonZero): "
                    "not supported by this server"
                )
            self._allocate(slot, output.name, shape, output.dtype)
        slot.stream.synchronize()  # the profile switch is asynchronous
        self._pool.put(slot)

    def _allocate(
        self, slot: _ExecutionSlot, name: str, shape: tuple[int, ...], dtype: Any
    ) -> None:
        nbytes = _volume(shape) * np.dtype(dtype).itemsize
        slot.device[name] = self._cuda.DeviceBuffer(nbytes, slot.stream)  # stream-ordered
        slot.host[name] = self._cuda.PinnedBuffer(nbytes)
        if not slot.context.set_tensor_address(name, slot.device[name].ptr):
            raise RuntimeError(f"TensorRT refused the device address of tensor {name}")

    # --- serving ------------------------------------------------------------------------
    @property
    def contexts(self) -> int:
        return len(self._slots)

    @property
    def device_memory_bytes(self) -> int:
        """Weights + each context's scratch memory + I/O buffers. Contexts are created
        with the default (STATIC) allocation strategy, which allocates the maximum over
        all profiles: ``device_memory_size_v2`` per context."""
        engine, trt = self._engine, self._trt
        if engine is None:
            return 0
        if hasattr(engine, "get_engine_stat"):  # TensorRT >= 10.14
            weights = int(engine.get_engine_stat(trt.EngineStat.TOTAL_WEIGHTS_SIZE))
        else:
            weights = self._plan_bytes
        scratch = int(engine.device_memory_size_v2) * len(self._slots)
        return weights + scratch + sum(slot.io_bytes for slot in self._slots)

    @contextlib.contextmanager
    def _borrow(self) -> Iterator[_ExecutionSlot]:
        if self._closed:
            raise RuntimeError("this TensorRT engine is closed")
        slot = self._pool.get()
        try:
            yield slot
        finally:
            self._pool.put(slot)

    def _check_shape(self, spec: ProfiledTensorSpec, shape: tuple[int, ...]) -> None:
        inside = spec.accepts_shape(shape) and (
            not spec.max_shape
            or all(
                lo <= d <= hi
                for lo, d, hi in zip(spec.min_shape, shape, spec.max_shape, strict=True)
            )
        )
        if not inside:
            bounds = f" (profile {spec.min_shape} to {spec.max_shape})" if spec.max_shape else ""
            raise BadRequest(
                f"shape {shape} outside what {spec.name} accepts: {spec.shape}{bounds}"
            )

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        arrays = {
            spec.name: np.asarray(feeds[spec.name], dtype=spec.dtype) for spec in self._profiled
        }
        for spec in self._profiled:
            self._check_shape(spec, arrays[spec.name].shape)
        with self._borrow() as slot:
            return self._run(slot, arrays)

    def _run(self, slot: _ExecutionSlot, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        context, stream = slot.context, slot.stream
        for name, array in arrays.items():
            if not context.set_input_shape(name, array.shape):
                raise BadRequest(f"shape {array.shape} outside the engine's profile for {name}")
            np.copyto(slot.host[name].view(array.dtype, array.shape), array)
            slot.device[name].copy_from(slot.host[name], array.nbytes, stream)
        shapes = {spec.name: tuple(context.get_tensor_shape(spec.name)) for spec in self.outputs}
        if not context.execute_async_v3(stream.address):
            raise RuntimeError("TensorRT execution failed")
        for spec in self.outputs:
            nbytes = _volume(shapes[spec.name]) * spec.dtype.itemsize
            slot.device[spec.name].copy_to(slot.host[spec.name], nbytes, stream)
        stream.synchronize()  # the one wait of a request
        return {
            spec.name: slot.host[spec.name].view(spec.dtype, shapes[spec.name]).copy()
            for spec in self.outputs
        }

    def warm_up(self) -> None:
        """Run every context once at its own profile's opt shape, so that none is cold or
        broken when traffic arrives (a profile's minimum may be above 1)."""
        taken = [self._pool.get() for _ in self._slots]
        try:
            for slot in taken:
                feeds = {}
                for spec in self._profiled:
                    opt = self._profile_shapes(spec.name, slot.profile)[1] if spec.max_shape else ()
                    feeds[spec.name] = np.zeros(opt or spec.shape, dtype=spec.dtype)
                self._run(slot, feeds)
        finally:
            for slot in taken:
                self._pool.put(slot)

    def close(self) -> None:
        """Release every context, buffer and stream, then the engine: GPU memory comes back
        now, not at the next garbage collection. The engine manager closes a version only
        after its last request, so no slot is out of the pool here."""
        self._closed = True
        while True:
            try:
                self._pool.get_nowait()
            except queue.Empty:
                break
        for slot in self._slots:
            slot.close()
        self._slots.clear()
        self._engine = None


class TensorRTBackend:
    name = "tensorrt"

    def __init__(
        self,
        cache: EngineCache | None = None,
        precision: str = "model",
        profile: ShapeProfile | None = None,
        contexts: int = 2,
        workspace_bytes: int = 1 << 30,
        host_code_allowed: bool = False,
        plugin_libraries: tuple[Path, ...] = (),
        trt: Any = None,
    ) -> None:
        """``host_code_allowed``: version-compatible plans carry host code that TensorRT
        runs while deserializing; it is allowed only for plans from the (signed, verified)
        repository, never for engine-cache entries, which this backend builds itself and
        which never need it."""
        self._trt = trt if trt is not None else import_tensorrt()
        self._major = check_version(self._trt.__version__)
        self._logger = self._trt.Logger(self._trt.Logger.WARNING)
        if hasattr(self._trt, "init_libnvinfer_plugins"):  # the full library, not lean
            self._trt.init_libnvinfer_plugins(self._logger, "")
        self._runtime = self._trt.Runtime(self._logger)  # cache entries: no host code
        self._runtime.engine_host_code_allowed = False
        self._plan_runtime = self._runtime  # verified repository plans
        if host_code_allowed:
            self._plan_runtime = self._trt.Runtime(self._logger)
            self._plan_runtime.engine_host_code_allowed = True
        registry = self._runtime.get_plugin_registry()
        for library in plugin_libraries:
            if registry.load_library(str(library)) is None:
                raise BackendUnavailable(f"TensorRT could not load plugin library {library}")
        self.cache = cache
        self.options = BuildOptions(
            precision=precision,
            profile=profile or ShapeProfile(),
            contexts=contexts,
            workspace_bytes=workspace_bytes,
        )

    @property
    def precision(self) -> str:
        return self.options.precision

    @property
    def runtime_tag(self) -> str:
        return f"trt{self._trt.__version__}"

    def estimate_memory_bytes(self, model: ModelFile) -> int:
        """Weights live in the plan and activations roughly scale with it, per context;
        a build that is not cached yet also holds the builder's workspace."""
        estimate = model.size * (1 + self.options.contexts)
        if model.path.suffix == ".onnx" and not self._cached(model):
            estimate += self.options.workspace_bytes
        return estimate

    def _cached(self, model: ModelFile) -> bool:
        return self.cache is not None and self.cache.path_for(self.cache_key(model)).exists()

    def cache_key(self, model: ModelFile) -> CacheKey:
        return CacheKey(
            model_name=model.path.parent.parent.name or model.path.stem,
            model_sha256=model.sha256,
            runtime=self.runtime_tag,
            device=cuda_memory.device_name(),
            precision=self.options.precision,
            shape_profile=f"{self.options.profile.key()}_p{self.options.contexts}",
        )

    def timing_cache_path(self) -> Path | None:
        """One timing cache per TensorRT version and GPU, beside the engines."""
        if self.cache is None:
            return None
        key = f"{self.runtime_tag}_{cuda_memory.device_name()}"
        return self.cache.root / "timing" / f"{_slug(key)}.cache"

    def build(self, model: ModelFile, out_path: Path) -> None:
        options = BuildOptions(
            precision=self.options.precision,
            profile=self.options.profile,
            contexts=self.options.contexts,
            workspace_bytes=self.options.workspace_bytes,
            timing_cache=self.timing_cache_path(),
        )
        # onnx's parser takes bytes only; a build (minutes, once per cache key) copies them
        onnx = (bytes(model.data), model.path)
        build_engine(self._trt, self._logger, self._major, onnx, out_path, options)

    def _deserialize(self, data: bytes | memoryview, runtime: Any) -> TensorRTEngine:
        engine = runtime.deserialize_cuda_engine(data)
        if engine is None:
            raise ValueError("not a valid TensorRT engine for this TensorRT version and GPU")
        return TensorRTEngine(self._trt, engine, self.options.contexts, plan_bytes=len(data))

    def load(self, model: ModelFile) -> TensorRTEngine:
        """``.onnx``: built once per cache key (other processes wait and reuse it);
        ``.engine``/``.plan`` (e.g. from trtexec): the verified bytes, deserialized."""
        if model.path.suffix != ".onnx":
            return self._deserialize(model.data, self._plan_runtime)
        if self.cache is None:  # no cache configured: build for this process only
            with tempfile.TemporaryDirectory(prefix="trt-build-") as tmp:
                plan = Path(tmp) / "model.engine"
                self.build(model, plan)
                return self._deserialize(plan.read_bytes(), self._runtime)
        with self.cache.open(self.cache_key(model), lambda tmp: self.build(model, tmp)) as hit:
            return self._deserialize(hit.data, self._runtime)
