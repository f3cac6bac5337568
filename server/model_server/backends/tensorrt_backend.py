"""TensorRT: the production backend.

``tensorrt`` is imported lazily, on first use, so the server imports and runs on
machines without it; asking for this backend there raises ``BackendUnavailable`` with a
message saying what to install.

* ``.engine``/``.plan`` files are deserialized directly.
* ``.onnx`` files are compiled once through the :class:`EngineCache` (key: model SHA-256,
  TensorRT version, GPU name, precision, shape profile); other processes wait on the
  cache's file lock and reuse the result.
* Each concurrent request borrows an execution context from a pool; each context owns a
  CUDA stream and device buffers, so requests never share mutable state.
* Dynamic shapes are served through the engine's first optimization profile.
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from model_rollout_contract.manifest import sha256_file

from ..engine_cache import CacheKey, EngineCache
from .base import BackendUnavailable, TensorSpec
from .cuda_memory import CudaStream, DeviceBuffer, device_count, device_name


def import_tensorrt() -> Any:
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise BackendUnavailable(
            "the TensorRT backend needs NVIDIA TensorRT >= 10 and a CUDA GPU: "
            "pip install 'model-rollout[tensorrt]' (or use --backend onnxruntime)"
        ) from exc
    if device_count() == 0:
        raise BackendUnavailable("the TensorRT backend needs a CUDA GPU; none is visible")
    return trt


@dataclass(frozen=True)
class ShapeProfile:
    """min/opt/max shapes per input, for dynamic axes (TensorRT optimization profile)."""

    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = field(
        default_factory=dict
    )

    def key(self) -> str:
        if not self.shapes:
            return "static"
        return "+".join(
            f"{name}:" + "-".join("x".join(map(str, s)) for s in triple)
            for name, triple in sorted(self.shapes.items())
        )


@dataclass
class _ExecutionSlot:
    context: Any
    stream: CudaStream
    buffers: dict[str, DeviceBuffer]

    def close(self) -> None:
        for buffer in self.buffers.values():
            buffer.free()
        self.stream.close()


class TensorRTEngine:
    platform = "tensorrt_plan"

    def __init__(self, trt: Any, engine: Any, contexts: int) -> None:
        self._trt = trt
        self._engine = engine
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        specs = {
            n: TensorSpec(
                n,
                np.dtype(trt.nptype(engine.get_tensor_dtype(n))),
                tuple(engine.get_tensor_shape(n)),
            )
            for n in names
        }
        is_input = {n: engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT for n in names}
        self.inputs = tuple(specs[n] for n in names if is_input[n])
        self.outputs = tuple(specs[n] for n in names if not is_input[n])
        self._pool: queue.Queue[_ExecutionSlot] = queue.Queue()
        self._slots: list[_ExecutionSlot] = []
        for _ in range(contexts):
            context = engine.create_execution_context()
            if context is None:
                raise RuntimeError(
                    "TensorRT could not create an execution context (out of memory?)"
                )
            slot = _ExecutionSlot(context, CudaStream(), {n: DeviceBuffer() for n in names})
            self._slots.append(slot)
            self._pool.put(slot)

    @property
    def device_memory_bytes(self) -> int:
        return int(self._engine.device_memory_size) * len(self._slots)

    @contextlib.contextmanager
    def _borrow(self) -> Iterator[_ExecutionSlot]:
        slot = self._pool.get()
        try:
            yield slot
        finally:
            self._pool.put(slot)

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self._borrow() as slot:
            ctx = slot.context
            for spec in self.inputs:
                array = np.ascontiguousarray(feeds[spec.name], dtype=spec.dtype)
                if not ctx.set_input_shape(spec.name, array.shape):
                    raise ValueError(
                        f"shape {array.shape} outside the engine's profile for {spec.name}"
                    )
                buffer = slot.buffers[spec.name]
                buffer.copy_from_host(array, slot.stream)
                ctx.set_tensor_address(spec.name, buffer.ptr)
            results: dict[str, np.ndarray] = {}
            for spec in self.outputs:
                shape = tuple(ctx.get_tensor_shape(spec.name))
                out = np.empty(shape, dtype=spec.dtype)
                ctx.set_tensor_address(spec.name, slot.buffers[spec.name].ensure(out.nbytes))
                results[spec.name] = out
            if not ctx.execute_async_v3(int(slot.stream.handle)):
                raise RuntimeError("TensorRT execution failed")
            for name, out in results.items():
                slot.buffers[name].copy_to_host(out, slot.stream)
            slot.stream.synchronize()
            return results

    def close(self) -> None:
        for slot in self._slots:
            slot.close()
        self._slots.clear()
        self._engine = None


class TensorRTBackend:
    name = "tensorrt"

    def __init__(
        self,
        cache: EngineCache | None = None,
        precision: str = "fp16",
        profile: ShapeProfile | None = None,
        contexts: int = 2,
        workspace_bytes: int = 1 << 30,
    ) -> None:
        self._trt = import_tensorrt()
        self._logger = self._trt.Logger(self._trt.Logger.WARNING)
        self._runtime = self._trt.Runtime(self._logger)
        self.cache = cache
        self.precision = precision
        self.profile = profile or ShapeProfile()
        self.contexts = contexts
        self.workspace_bytes = workspace_bytes

    def estimate_memory_bytes(self, path: Path) -> int:
        # weights live in the plan; activations roughly scale with it, per context
        return path.stat().st_size * (1 + self.contexts)

    def cache_key(self, onnx_path: Path) -> CacheKey:
        return CacheKey(
            model_name=onnx_path.parent.parent.name or onnx_path.stem,
            model_sha256=sha256_file(onnx_path),
            runtime=f"trt{self._trt.__version__}",
            device=device_name(),
            precision=self.precision,
            shape_profile=self.profile.key(),
        )

    def build(self, onnx_path: Path, out_path: Path) -> None:
        trt = self._trt
        builder = trt.Builder(self._logger)
        network = builder.create_network(0)  # explicit batch is the only mode in TRT 10
        parser = trt.OnnxParser(network, self._logger)
        if not parser.parse(onnx_path.read_bytes()):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise ValueError(f"TensorRT could not parse {onnx_path.name}: {errors}")
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, self.workspace_bytes)
        if self.precision == "fp16":
            config.set_flag(trt.BuilderFlag.FP16)
        elif self.precision == "int8":
            config.set_flag(trt.BuilderFlag.INT8)
        if self.profile.shapes:
            opt_profile = builder.create_optimization_profile()
            for name, (lo, opt, hi) in self.profile.shapes.items():
                opt_profile.set_shape(name, lo, opt, hi)
            config.add_optimization_profile(opt_profile)
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise RuntimeError(f"TensorRT failed to build an engine for {onnx_path.name}")
        out_path.write_bytes(bytes(serialized))

    def _deserialize(self, data: bytes) -> TensorRTEngine:
        engine = self._runtime.deserialize_cuda_engine(data)
        if engine is None:
            raise ValueError("not a valid TensorRT engine for this TensorRT version and GPU")
        return TensorRTEngine(self._trt, engine, self.contexts)

    def load(self, path: Path) -> TensorRTEngine:
        if path.suffix == ".onnx":
            if self.cache is None:
                raise ValueError("building from ONNX needs an engine cache directory")
            with self.cache.open(self.cache_key(path), lambda tmp: self.build(path, tmp)) as hit:
                return self._deserialize(hit.path.read_bytes())
        return self._deserialize(path.read_bytes())
