"""Device memory, streams and copies through cuda-python (``cuda.bindings``).

Kept apart from the TensorRT backend so it can be exercised on any NVIDIA GPU, with or
without TensorRT installed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import BackendUnavailable


def _runtime() -> Any:
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cudart  # type: ignore[no-redef]  # older cuda-python
        except ImportError as exc:
            raise BackendUnavailable(
                "CUDA memory needs cuda-python: pip install 'model-rollout[tensorrt]'"
            ) from exc
    return cudart


def _check(result: Any) -> Any:
    """cuda-python returns ``(err, *values)``; raise on any error."""
    cudart = _runtime()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cudart.cudaError_t.cudaSuccess:
        name = cudart.cudaGetErrorName(err)[1]
        raise RuntimeError(
            f"CUDA call failed: {name.decode() if isinstance(name, bytes) else name}"
        )
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def device_count() -> int:
    try:
        return int(_check(_runtime().cudaGetDeviceCount()))
    except (BackendUnavailable, RuntimeError):
        return 0


def device_name(index: int = 0) -> str:
    props = _check(_runtime().cudaGetDeviceProperties(index))
    name = props.name
    return (name.decode() if isinstance(name, bytes) else str(name)).rstrip("\x00")


class CudaStream:
    def __init__(self) -> None:
        self.handle = _check(_runtime().cudaStreamCreate())

    def synchronize(self) -> None:
        _check(_runtime().cudaStreamSynchronize(self.handle))

    def close(self) -> None:
        if self.handle is not None:
            _check(_runtime().cudaStreamDestroy(self.handle))
            self.handle = None


class DeviceBuffer:
    """A growable device allocation reused across requests by one execution context."""

    def __init__(self) -> None:
        self.ptr = 0
        self.nbytes = 0

    def ensure(self, nbytes: int) -> int:
        if nbytes > self.nbytes:
            self.free()
            self.ptr = int(_check(_runtime().cudaMalloc(max(nbytes, 1))))
            self.nbytes = nbytes
        return self.ptr

    def copy_from_host(self, array: np.ndarray, stream: CudaStream) -> None:
        cudart = _runtime()
        host = np.ascontiguousarray(array)
        self.ensure(host.nbytes)
        _check(
            cudart.cudaMemcpyAsync(
                self.ptr,
                host.ctypes.data,
                host.nbytes,
                cudart.cudaMemcpyKind.cudaMemcpyHostToDevice,
                stream.handle,
            )
        )
        stream.synchronize()  # ``host`` may be a temporary: finish before it goes

    def copy_to_host(self, out: np.ndarray, stream: CudaStream) -> None:
        cudart = _runtime()
        _check(
            cudart.cudaMemcpyAsync(
                out.ctypes.data,
                self.ptr,
                out.nbytes,
                cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost,
                stream.handle,
            )
        )

    def free(self) -> None:
        if self.ptr:
            _check(_runtime().cudaFree(self.ptr))
            self.ptr = 0
            self.nbytes = 0
