"""Device memory, pinned host memory, streams and copies through cuda-python.

Kept apart from the TensorRT backend so it can be exercised on any NVIDIA GPU, with or
without TensorRT installed. Streams are created non-blocking, so they never serialise
against the legacy default stream (which a model load on another thread may be using);
host staging buffers are pinned, so copies are truly asynchronous and one synchronize
per request is enough.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from model_server.backends.base import BackendUnavailable

# the cuda-python majors this module is tested with (cuda-bindings 12.9 and 13.5)
SUPPORTED_CUDA_PYTHON_MAJORS = (12, 13)


@functools.cache
def _runtime() -> Any:
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
    except ImportError as exc:
        raise BackendUnavailable(
            "CUDA memory needs cuda-python 12.6 or newer (cuda.bindings): "
            "pip install 'model-rollout[tensorrt]'"
        ) from exc
    return cudart


def _error_name(err: Any) -> str:
    name = _runtime().cudaGetErrorName(err)[1]
    return name.decode() if isinstance(name, bytes) else str(name)


def _check(result: Any) -> Any:
    """cuda-python returns ``(err, *values)``; raise on any error."""
    cudart = _runtime()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cudart.cudaError_t.cudaSuccess:
        raise RuntimeError(f"CUDA call failed: {_error_name(err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _version_text(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


@dataclass(frozen=True)
class CudaReport:
    """What a process can use: GPUs, and the driver's and cuda-python's CUDA versions."""

    devices: int
    driver_version: int  # 0 when no NVIDIA driver is loaded
    runtime_version: int  # the CUDA version cuda-python was built for


def cuda_report() -> CudaReport:
    """Diagnose the CUDA stack, raising ``BackendUnavailable`` with the actual cause.

    "No GPU" is said only when the driver answers and counts none: a missing cuda-python,
    a missing driver and a cuda-python built for a newer CUDA than the driver supports
    (cuda-python 13 on a CUDA 12 driver) each get their own message.
    """
    cudart = _runtime()
    driver = int(_check(cudart.cudaDriverGetVersion()))
    runtime = int(_check(cudart.cudaRuntimeGetVersion()))
    err, count = cudart.cudaGetDeviceCount()
    if err == cudart.cudaError_t.cudaSuccess:
        return CudaReport(int(count), driver, runtime)
    if err == cudart.cudaError_t.cudaErrorNoDevice:  # e.g. CUDA_VISIBLE_DEVICES is empty
        return CudaReport(0, driver, runtime)
    if driver == 0:
        raise BackendUnavailable("no NVIDIA driver is loaded (cudaDriverGetVersion gives 0)")
    # an older driver minor is fine (CUDA minor-version compatibility); another major is not
    if err == cudart.cudaError_t.cudaErrorInsufficientDriver or driver // 1000 < runtime // 1000:
        raise BackendUnavailable(
            f"cuda-python is built for CUDA {_version_text(runtime)} but the NVIDIA driver "
            f"supports CUDA {_version_text(driver)}: install cuda-python "
            f"{driver // 1000}.x (pip install 'cuda-python>={driver // 1000},"
            f"<{driver // 1000 + 1}') or upgrade the driver"
        )
    raise BackendUnavailable(f"CUDA cannot count devices: {_error_name(err)}")


def device_count() -> int:
    """GPUs visible to this process; 0 also when CUDA is unusable (see ``cuda_report``)."""
    try:
        return cuda_report().devices
    except BackendUnavailable:
        return 0


def device_name(index: int = 0) -> str:
    props = _check(_runtime().cudaGetDeviceProperties(index))
    name = props.name
    return (name.decode() if isinstance(name, bytes) else str(name)).rstrip("\x00")


def memory_info() -> tuple[int, int]:
    """(free, total) bytes of the current device."""
    free, total = _check(_runtime().cudaMemGetInfo())
    return int(free), int(total)


def native_handle(handle: Any) -> int:
    """The integer address TensorRT wants for a ``cudaStream_t``.

    ``int(cudaStream_t)`` is deprecated in cuda-bindings 13; ``get_cuda_native_handle`` is
    the supported spelling in both 12.x and 13.x.
    """
    from cuda.bindings.utils import get_cuda_native_handle

    return int(get_cuda_native_handle(handle))


class CudaStream:
    """A non-blocking stream: it never waits on (or holds up) the legacy default stream."""

    def __init__(self) -> None:
        cudart = _runtime()
        self.handle = _check(cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking))

    @property
    def address(self) -> int:
        return native_handle(self.handle)

    def synchronize(self) -> None:
        _check(_runtime().cudaStreamSynchronize(self.handle))

    def close(self) -> None:
        if self.handle is not None:
            _check(_runtime().cudaStreamDestroy(self.handle))
            self.handle = None


class DeviceBuffer:
    """A device allocation reused across requests by one execution context.

    With a ``stream`` it is stream-ordered (``cudaMallocAsync``/``cudaFreeAsync``): plain
    ``cudaMalloc`` is an implicit synchronization point between streams and ``cudaFree``
    waits for the whole device, so a version loading or closing would stall the requests
    of the version serving beside it."""

    def __init__(self, nbytes: int = 0, stream: CudaStream | None = None) -> None:
        self.ptr = 0
        self.nbytes = 0
        self.stream = stream
        if nbytes:
            self.ensure(nbytes)

    def ensure(self, nbytes: int) -> int:
        if nbytes > self.nbytes:
            self.free()
            cudart = _runtime()
            size = max(nbytes, 1)
            if self.stream is None:
                self.ptr = int(_check(cudart.cudaMalloc(size)))
            else:
                self.ptr = int(_check(cudart.cudaMallocAsync(size, self.stream.handle)))
            self.nbytes = nbytes
        return self.ptr

    def copy_from(self, host: PinnedBuffer, nbytes: int, stream: CudaStream) -> None:
        """Asynchronous: ``host`` must stay untouched until ``stream`` is synchronized."""
        cudart = _runtime()
        _check(
            cudart.cudaMemcpyAsync(
                self.ptr,
                host.ptr,
                nbytes,
                cudart.cudaMemcpyKind.cudaMemcpyHostToDevice,
                stream.handle,
            )
        )

    def copy_to(self, host: PinnedBuffer, nbytes: int, stream: CudaStream) -> None:
        cudart = _runtime()
        _check(
            cudart.cudaMemcpyAsync(
                host.ptr,
                self.ptr,
                nbytes,
                cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost,
                stream.handle,
            )
        )

    def free(self) -> None:
        """Stream-ordered buffers are freed after the work queued on their stream."""
        if self.ptr:
            cudart = _runtime()
            if self.stream is None:
                _check(cudart.cudaFree(self.ptr))
            else:
                _check(cudart.cudaFreeAsync(self.ptr, self.stream.handle))
            self.ptr = 0
            self.nbytes = 0


class PinnedBuffer:
    """Page-locked host memory: the staging area of asynchronous copies."""

    def __init__(self, nbytes: int) -> None:
        cudart = _runtime()
        self.nbytes = max(nbytes, 1)
        self.ptr = int(_check(cudart.cudaHostAlloc(self.nbytes, cudart.cudaHostAllocDefault)))

    def view(self, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """A numpy array over the first bytes of this buffer (no copy)."""
        count = int(np.prod(shape, dtype=np.int64))
        nbytes = count * np.dtype(dtype).itemsize
        if nbytes > self.nbytes:
            raise ValueError(f"{nbytes} bytes do not fit a {self.nbytes}-byte staging buffer")
        raw = (ctypes.c_byte * self.nbytes).from_address(self.ptr)
        return np.frombuffer(memoryview(raw).cast("B"), dtype=dtype, count=count).reshape(shape)

    def free(self) -> None:
        if self.ptr:
            _check(_runtime().cudaFreeHost(self.ptr))
            self.ptr = 0
