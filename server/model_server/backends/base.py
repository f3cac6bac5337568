"""The small interface every inference backend implements."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from model_rollout_contract.manifest import sha256_bytes

from ..private_copy import PrivateCopy


class BackendUnavailable(RuntimeError):
    """The backend's runtime (TensorRT, CUDA, torch) is not installed or has no device."""


@dataclass(frozen=True)
class ModelFile:
    """A model file's bytes, read once, and their digest. Backends load ``data`` and never
    reopen ``path``: what was hashed (and checked against the manifest) is what is loaded,
    whatever happens to the file afterwards."""

    path: Path  # where the bytes were read: for names, the suffix and messages only
    data: bytes | memoryview = field(repr=False)  # read-only (the server's: a PrivateCopy)
    sha256: str
    # where ``data`` lives when the server read it: a memfd this process can open
    private: PrivateCopy | None = field(default=None, repr=False, compare=False)

    @property
    def size(self) -> int:
        return len(self.data)

    def loadable(self) -> str | bytes:
        """What a runtime that loads from a path or from ``bytes`` only is given: the
        private copy's path (the same bytes, no copy made), else the bytes."""
        if self.private is not None and self.private.path is not None:
            return self.private.path
        return self.data if isinstance(self.data, bytes) else bytes(self.data)

    def release(self) -> None:
        """Let the bytes go now, on this thread (see :meth:`PrivateCopy.close`); ``data``
        is unusable after."""
        if self.private is not None:
            self.private.close()

    @classmethod
    def read(cls, path: str | Path) -> ModelFile:
        """Read a file that needs no trust checks (tools, benchmarks); the server reads
        through :meth:`model_server.repository.ModelRepository.read_announced`."""
        data = Path(path).read_bytes()
        return cls(Path(path), data, sha256_bytes(data))


@dataclass(frozen=True)
class TensorSpec:
    """Name, numpy dtype and shape of an input or output; ``-1`` marks a dynamic axis.
    ``symbols`` names the dynamic axes the model names (ONNX's ``dim_param``, None for the
    others; empty when the backend does not say): inputs whose axes share a name must
    agree on their size, as the model's graph assumes."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    symbols: tuple[str | None, ...] = field(default=(), kw_only=True)

    def accepts_shape(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == len(self.shape) and all(
            want < 0 or want == got for want, got in zip(self.shape, shape, strict=True)
        )

    def example(self, dynamic_size: int = 1) -> np.ndarray:
        """A zero tensor usable for warm-up: dynamic axes get ``dynamic_size``."""
        shape = tuple(dim if dim > 0 else dynamic_size for dim in self.shape)
        return np.zeros(shape, dtype=self.dtype)


@runtime_checkable
class Engine(Protocol):
    """A loaded model version. ``infer`` must be safe to call from several threads.

    An engine may also have ``infer_if_quick(feeds, budget_s)``: the outputs, computed
    on the calling thread (the event loop's), if it knows this run takes at most
    ``budget_s``; else None, and the request goes to an inference thread. The torch
    engine's CUDA graph replays do (tens of microseconds of GPU work, less than the
    hop to a thread and back costs).

    An engine may also have ``bytes_per_row``: what one row of a request (the first
    axis) takes while it runs, which bounds the rows of a request
    (:mod:`model_server.request_limits`); ONNX Runtime's estimates it from the graph."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    platform: str

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


class Backend(Protocol):
    name: str

    def estimate_memory_bytes(self, model: ModelFile) -> int:
        """A conservative guess of what loading ``model`` will hold, reserved in the memory
        budget before the load starts."""
        ...

    def load(self, model: ModelFile) -> Engine:
        """An engine built from ``model.data`` (never from the file at ``model.path``)."""
        ...
