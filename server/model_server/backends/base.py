"""The small interface every inference backend implements."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from model_rollout_contract.manifest import sha256_bytes
from model_server.files.private_copy import PrivateCopy
from model_server.protocol.tensor_spec import TensorSpec


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
        through :meth:`model_server.lifecycle.repository.ModelRepository.read_announced`."""
        data = Path(path).read_bytes()
        return cls(Path(path), data, sha256_bytes(data))


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
    (:mod:`model_server.lifecycle.request_limits`); ONNX Runtime's estimates it from the graph."""

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
