"""What a backend says of each input and output of a loaded version, and what every codec
checks a request against."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


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
