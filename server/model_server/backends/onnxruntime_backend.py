"""ONNX Runtime on the CPU: the embedded default backend.

A session is made from the verified bytes without ONNX Runtime copying the weights: the
graph goes to it without them (a small protobuf: :mod:`.onnx_weights` walks the file),
and each weight is handed over as an ``OrtValue`` over the model's private copy
(``SessionOptions.add_external_initializers``), which the engine then keeps until it is
closed. ONNX Runtime neither reads the file again nor parses 25 MiB of protobuf nor
copies the weights before packing them (a load of the 25 MiB MLP: 23 ms of session
instead of 57, bench/results/NOTES.md). A model the walk cannot split (an ORT-format
file, weights stored outside the file or of a type without a numpy form) is loaded
from its bytes as before.

Graph optimisation is done once per (model, runtime, CPU) and the optimised model is
kept in the engine cache, mirroring how TensorRT engines are cached. A load that misses
the cache serves the session it made from the verified bytes at once and writes the
entry afterwards, on the cache's own thread, for the next process (a second session
and a file written and read back are no part of a swap).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument, RuntimeException

from model_server.backends import onnx_weights
from model_server.backends.base import ModelFile
from model_server.backends.cpu_priority import lower_this_thread
from model_server.backends.device_info import cpu_name
from model_server.backends.engine_cache import CacheKey, EngineCache
from model_server.backends.onnx_rows import bytes_per_row
from model_server.errors import BadRequest
from model_server.protocol.tensor_spec import TensorSpec

_ORT_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int16)": np.int16,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
}


def _spec(arg: ort.NodeArg) -> TensorSpec:
    dtype = _ORT_TYPES.get(arg.type)
    if dtype is None:
        raise ValueError(f"tensor {arg.name!r} has unsupported type {arg.type}")
    shape = tuple(d if isinstance(d, int) and d > 0 else -1 for d in arg.shape)
    symbols = tuple(d if isinstance(d, str) and d else None for d in arg.shape)
    return TensorSpec(arg.name, np.dtype(dtype), shape, symbols=symbols)


# What a kernel's own shape checks say when inputs the server accepted (their dynamic
# axes unnamed or named apart, or a row count a Reshape cannot take) do not fit the
# graph: ONNX Runtime raises these as FAIL, not INVALID_ARGUMENT. Lower case.
_KERNEL_FAILED = "non-zero status code returned while running"
_SHAPE_CHECKS = (
    "attempting to broadcast an axis",  # element-wise ops
    "cannot be reshaped to the requested shape",  # Reshape
    "dimension mismatch",  # MatMul, Gemm
    "dimensions must match",  # Concat
    "mismatched dimensions",  # Concat
    "invalid input shape",
)
_SERVER_FAULTS = ("allocate", "bad allocation", "out of memory")


def input_error(exc: Exception) -> str | None:
    """The message of a run's failure that is the inputs' (a kernel's shape check: the
    client's 400), else None: a memory, device or any other fault stays the server's."""
    if not isinstance(exc, (Fail, RuntimeException)):
        return None
    message = str(exc)
    lower = message.lower()
    if _KERNEL_FAILED not in lower or any(fault in lower for fault in _SERVER_FAULTS):
        return None
    if not any(check in lower for check in _SHAPE_CHECKS):
        return None
    return f"the model cannot run these inputs: {message.strip()}"


CPU = ["CPUExecutionProvider"]
# a flatbuffer's file identifier, bytes 4 to 8 of an ORT-format model
ORT_FORMAT_IDENTIFIER = b"ORTM"
# the location a weight handed over as an OrtValue names: never a file that is read
SUPPLIED = "supplied-by-the-model-server"
_TYPED_FIELDS = ("float_data", "int32_data", "int64_data", "double_data", "uint64_data")
# smaller initializers stay in the graph: ONNX Runtime's shape inference reads some while
# it builds the graph (a Reshape's shape, a Resize's scales), before any is supplied
SUPPLIED_FROM_BYTES = 64 * 1024
CACHE_BUILD_NICE = 10  # how much lower than the server's the cache builds' CPU priority is

log = logging.getLogger(__name__)


def _lower_priority() -> None:
    """The cache's thread: its builds wait for serving's and loads' CPU."""
    lower_this_thread(CACHE_BUILD_NICE)


def _release_on(releases: ThreadPoolExecutor | None, model: ModelFile) -> None:
    if releases is not None:
        try:
            releases.submit(model.release)
            return
        except RuntimeError:  # shut down: let them go here
            pass
    model.release()


def _timed(stages: dict[str, float], name: str, started: float) -> float:
    now = time.perf_counter()
    stages[name] = stages.get(name, 0.0) + now - started
    return now


def split_weights(data: bytes | memoryview) -> tuple[bytes, list[str], list[np.ndarray]] | None:
    """The model's graph with each (top-level) initializer of at least
    :data:`SUPPLIED_FROM_BYTES` marked as supplied from outside, and those initializers'
    names and arrays (read-only views of ``data`` where the file stores them raw); the
    smaller ones keep their bytes in the graph. None where the walk cannot split the
    model: ONNX Runtime then gets the bytes whole."""
    try:
        model, weights = onnx_weights.load(data)
    except Exception:  # not a model the walk knows: ONNX Runtime judges the bytes
        return None
    names, arrays = [], []
    for tensor, weight in zip(model.graph.initializer, weights, strict=True):
        for typed in _TYPED_FIELDS:
            tensor.ClearField(typed)
        if weight.nbytes < SUPPLIED_FROM_BYTES:
            tensor.raw_data = weight.data.tobytes()
            continue
        tensor.ClearField("external_data")
        tensor.data_location = onnx.TensorProto.EXTERNAL
        entry = tensor.external_data.add()
        entry.key, entry.value = "location", SUPPLIED
        names.append(weight.name)
        arrays.append(weight.array())
    return model.SerializeToString(), names, arrays


class OnnxRuntimeEngine:
    platform = "onnxruntime_onnx"

    def __init__(
        self,
        session: ort.InferenceSession,
        bytes_per_row: int | None = None,
        weights_in: ModelFile | None = None,
        keep: Any = None,
        load_stages: Mapping[str, float] | None = None,
        releases: ThreadPoolExecutor | None = None,
    ) -> None:
        """``weights_in``: the model whose private copy holds this session's weights
        (``keep``: the options and values that hand them over), let go at :meth:`close`
        on ``releases``' thread (never on the closing one: the event loop, often);
        ``load_stages``: the load's seconds per stage, for the load pipeline."""
        self._session: ort.InferenceSession | None = session
        # what one row of a request takes while it runs (onnx_rows; None: not known)
        self.bytes_per_row = bytes_per_row
        self._weights_in = weights_in
        self._keep = keep
        self._releases = releases
        self.load_stages = dict(load_stages or {})
        self._closed = threading.Event()
        self.inputs = tuple(_spec(a) for a in session.get_inputs())
        self.outputs = tuple(_spec(a) for a in session.get_outputs())

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        session = self._session
        if session is None:
            raise RuntimeError("engine is closed")
        names = [o.name for o in self.outputs]
        try:
            results = session.run(names, dict(feeds))
        except InvalidArgument as exc:  # a shape or type it refuses: the client's inputs
            raise BadRequest(str(exc)) from None
        except (Fail, RuntimeException) as exc:
            message = input_error(exc)
            if message is None:
                raise
            raise BadRequest(message) from None
        return dict(zip(names, results, strict=True))

    @property
    def holds_model_bytes(self) -> bool:
        """Whether the session runs on the model's private copy (freed at :meth:`close`)."""
        return self._weights_in is not None

    def close(self) -> None:
        self._session = None  # the session frees its memory when the last reference goes
        self._keep = None  # the OrtValues over the private copy, and the arrays under them
        weights_in, self._weights_in = self._weights_in, None
        if weights_in is not None:  # after the last view of it: its pages go back there
            _release_on(self._releases, weights_in)
        self._closed.set()


class OnnxRuntimeBackend:
    name = "onnxruntime"
    #: ONNX Runtime holds the weights plus its arena; twice the file is a safe estimate.
    memory_factor = 2.0

    def __init__(self, cache: EngineCache | None = None, intra_op_threads: int = 1) -> None:
        self.cache = cache
        self.intra_op_threads = intra_op_threads
        self.last_cache_hit: bool | None = None
        # cache entries a load missed are built here, after the load: one at a time
        self._cache_builds = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="ort-cache", initializer=_lower_priority
        )
        # the private copies closed engines ran on are let go here
        self._releases = ThreadPoolExecutor(max_workers=1, thread_name_prefix="release")

    def estimate_memory_bytes(self, model: ModelFile) -> int:
        return int(model.size * self.memory_factor)

    def _options(self) -> ort.SessionOptions:
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.intra_op_threads
        options.inter_op_num_threads = 1
        return options

    def cache_key(self, model: ModelFile) -> CacheKey:
        return CacheKey(
            model_name=model.path.parent.parent.name or model.path.stem,
            model_sha256=model.sha256,
            runtime=f"ort{ort.__version__}",
            device=cpu_name(),
            precision="fp32",
            shape_profile="dynamic",
        )

    @staticmethod
    def _source(model: ModelFile, options: ort.SessionOptions) -> str | bytes:
        """What the session loads (see ``ModelFile.loadable``). ONNX Runtime tells its
        own ORT format from ONNX by the bytes, but for a path by a ``.ort`` suffix, which
        the private copy's path has not: so it is told."""
        if bytes(model.data[4:8]) == ORT_FORMAT_IDENTIFIER:
            options.add_session_config_entry("session.load_model_format", "ORT")
        return model.loadable()

    def load(self, model: ModelFile) -> OnnxRuntimeEngine:
        """Build the session from the verified bytes. With a cache, an entry for their
        digest is loaded from its bytes as the cache checked them (never from its file,
        which could change after the check); on a miss, the session is made from the
        model's own bytes and the entry is written afterwards (:meth:`_build_later`)."""
        stages: dict[str, float] = {}
        started = time.perf_counter()
        if self.cache is not None:
            key = self.cache_key(model)
            cached = self.cache.get(key)
            started = _timed(stages, "cache", started)
            self.last_cache_hit = cached is not None
            if cached is not None:
                # already optimised for this CPU: skip the expensive passes on every load
                session, keep = self._session(cached, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
                started = _timed(stages, "session", started)
                rows = self._bytes_per_row(model)
                _timed(stages, "row_estimate", started)
                return OnnxRuntimeEngine(session, rows, None, keep, stages)
        session, keep = self._session(model, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
        started = _timed(stages, "session", started)
        rows = self._bytes_per_row(model)
        started = _timed(stages, "row_estimate", started)
        weights_in = model if keep is not None and model.private is not None else None
        if self.cache is not None:
            self._build_later(model, key)
            _timed(stages, "cache", started)
        return OnnxRuntimeEngine(session, rows, weights_in, keep, stages, self._releases)

    def _session(
        self, source: ModelFile | bytes, level: ort.GraphOptimizationLevel
    ) -> tuple[ort.InferenceSession, Any]:
        """A session of ``source`` (a model's verified bytes, or a checked cache entry)
        at ``level``, and what keeps its weights alive: its weights handed over where the
        model splits (:func:`split_weights`), else (None) ONNX Runtime's own copy."""
        options = self._options()
        options.graph_optimization_level = level
        data = source.data if isinstance(source, ModelFile) else source
        split = None if bytes(data[4:8]) == ORT_FORMAT_IDENTIFIER else split_weights(data)
        if split is None:
            loadable = self._source(source, options) if isinstance(source, ModelFile) else source
            return ort.InferenceSession(loadable, options, providers=CPU), None
        graph, names, arrays = split
        values = [ort.OrtValue.ortvalue_from_numpy(array) for array in arrays]
        if names:
            options.add_external_initializers(names, values)
        session = ort.InferenceSession(graph, options, providers=CPU)
        return session, (options, values, arrays)

    def _build_later(self, model: ModelFile, key: CacheKey) -> None:
        """Write the cache entry of ``model``'s verified bytes on the cache's thread (at a
        lower CPU priority), after this load. ONNX Runtime reads them there through a
        descriptor of their own to the private copy (its session lets the GIL go; a copy
        of the bytes would hold it), while a view held meanwhile keeps the pages from
        being let go; the build then lets them go if it held them last. Bytes with no
        private copy are copied (tools and tests); nothing is built from bytes already
        let go (the next load of them builds)."""
        cache = self.cache
        if cache is None:
            return
        try:
            held = np.frombuffer(model.data, np.uint8)  # the pages stay while it lives
        except ValueError:  # let go already
            return
        source: str | bytes
        fd = None
        path = model.private.path if model.private is not None else None
        if path is not None:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            source = f"/proc/self/fd/{fd}"
        else:
            source = bytes(held)

        def build() -> None:
            try:
                with cache.open(key, lambda tmp: self._optimize(source, held, tmp)):
                    pass
            except Exception as exc:  # the served session is fine: the next load builds
                log.warning("engine cache: no entry for %s: %s", key.model_name, exc)
            finally:
                if fd is not None:
                    os.close(fd)

        def build_then_release() -> None:
            nonlocal held
            build()
            del held
            model.release()  # a no-op while the engine still runs on the bytes

        try:
            self._cache_builds.submit(build_then_release)
        except RuntimeError:  # shut down
            if fd is not None:
                os.close(fd)

    def _optimize(self, source: str | bytes, head: np.ndarray, target: Path) -> None:
        options = self._options()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.optimized_model_filepath = str(target)
        options.log_severity_level = 3  # the CPU-specific warning: the key says so already
        if head[4:8].tobytes() == ORT_FORMAT_IDENTIFIER:
            options.add_session_config_entry("session.load_model_format", "ORT")
        ort.InferenceSession(source, options, providers=CPU)

    def settle(self) -> None:
        """Wait for the cache entries being written and the bytes being let go (tests,
        and an orderly exit)."""
        self._cache_builds.submit(lambda: None).result()
        self._releases.submit(lambda: None).result()

    @staticmethod
    def _bytes_per_row(model: ModelFile) -> int | None:
        """The model's memory per row (an ORT-format file has no ONNX graph to read)."""
        if bytes(model.data[4:8]) == ORT_FORMAT_IDENTIFIER:
            return None
        return bytes_per_row(model.data)
