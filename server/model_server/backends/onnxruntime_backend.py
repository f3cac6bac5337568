"""ONNX Runtime on the CPU: the embedded default backend.

Graph optimisation is done once per (model, runtime, CPU) and the optimised model is
kept in the engine cache, mirroring how TensorRT engines are cached.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument, RuntimeException

from model_server.backends.base import ModelFile
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


class OnnxRuntimeEngine:
    platform = "onnxruntime_onnx"

    def __init__(self, session: ort.InferenceSession, bytes_per_row: int | None = None) -> None:
        self._session: ort.InferenceSession | None = session
        # what one row of a request takes while it runs (onnx_rows; None: not known)
        self.bytes_per_row = bytes_per_row
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

    def close(self) -> None:
        self._session = None  # the session frees its memory when the last reference goes
        self._closed.set()


class OnnxRuntimeBackend:
    name = "onnxruntime"
    #: ONNX Runtime holds the weights plus its arena; twice the file is a safe estimate.
    memory_factor = 2.0

    def __init__(self, cache: EngineCache | None = None, intra_op_threads: int = 1) -> None:
        self.cache = cache
        self.intra_op_threads = intra_op_threads
        self.last_cache_hit: bool | None = None

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

    def _optimize(self, model: ModelFile, target: Path) -> None:
        options = self._options()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.optimized_model_filepath = str(target)
        # ORT warns that the result is specific to this CPU: the cache key says so already
        options.log_severity_level = 3
        ort.InferenceSession(self._source(model, options), options, providers=CPU)

    def load(self, model: ModelFile) -> OnnxRuntimeEngine:
        """Build the session from the verified bytes; the cache entry is keyed by their
        digest, and the session is made from the entry's bytes as the cache checked them
        (never from its file, which could change after the check)."""
        if self.cache is None:
            options = self._options()
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            session = ort.InferenceSession(self._source(model, options), options, providers=CPU)
            return OnnxRuntimeEngine(session, self._bytes_per_row(model))
        key = self.cache_key(model)
        with self.cache.open(key, lambda tmp: self._optimize(model, tmp)) as hit:
            self.last_cache_hit = hit.hit
            options = self._options()
            # already optimised for this CPU: skip the expensive passes on every load
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            session = ort.InferenceSession(hit.data, options, providers=["CPUExecutionProvider"])
        return OnnxRuntimeEngine(session, self._bytes_per_row(model))

    @staticmethod
    def _bytes_per_row(model: ModelFile) -> int | None:
        """The model's memory per row (an ORT-format file has no ONNX graph to read)."""
        if bytes(model.data[4:8]) == ORT_FORMAT_IDENTIFIER:
            return None
        return bytes_per_row(model.data)
