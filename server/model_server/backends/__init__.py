"""Backend selection. TensorRT and torch are imported only when asked for."""

from __future__ import annotations

from pathlib import Path

from model_server.backends.base import Backend, BackendUnavailable, Engine, ModelFile
from model_server.backends.engine_cache import EngineCache
from model_server.protocol.tensor_spec import TensorSpec

__all__ = [
    "BACKEND_NAMES",
    "Backend",
    "BackendUnavailable",
    "Engine",
    "ModelFile",
    "TensorSpec",
    "make_backend",
]

BACKEND_NAMES = ("onnxruntime", "tensorrt", "torch")


def make_backend(name: str, cache_dir: Path | None = None, **options: object) -> Backend:
    """Create a backend by name; raises ``BackendUnavailable`` if its runtime is missing."""
    if name == "onnxruntime":
        from model_server.backends.onnxruntime_backend import OnnxRuntimeBackend

        cache = EngineCache(cache_dir, suffix="onnx") if cache_dir else None
        return OnnxRuntimeBackend(cache=cache)
    if name == "tensorrt":
        from model_server.backends.tensorrt_backend import TensorRTBackend

        cache = EngineCache(cache_dir, suffix="engine") if cache_dir else None
        return TensorRTBackend(cache=cache, **options)  # type: ignore[arg-type]
    if name == "torch":
        from model_server.backends.torch_backend import TorchBackend

        return TorchBackend(**options)  # type: ignore[arg-type]
    raise ValueError(f"unknown backend {name!r}; choose one of {BACKEND_NAMES}")
