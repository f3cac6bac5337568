"""The small interface every inference backend implements."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np


class BackendUnavailable(RuntimeError):
    """The backend's runtime (TensorRT, CUDA, torch) is not installed or has no device."""


@dataclass(frozen=True)
class TensorSpec:
    """Name, numpy dtype and shape of an input or output; ``-1`` marks a dynamic axis."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

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
    """A loaded model version. ``infer`` must be safe to call from several threads."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    platform: str

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


class Backend(Protocol):
    name: str

    def estimate_memory_bytes(self, path: Path) -> int:
        """A conservative guess of what loading ``path`` will hold, checked before loading."""
        ...

    def load(self, path: Path) -> Engine: ...
