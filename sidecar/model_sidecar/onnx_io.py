"""What an ONNX model takes and produces, read from its graph: the manifest's ``shapes``
and the golden set's check both come from here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx.helper import tensor_dtype_to_np_dtype

Dims = tuple[int | str, ...]  # a string: a dimension the model leaves open (its name)


@dataclass(frozen=True)
class TensorSpec:
    dtype: np.dtype
    dims: Dims

    def accepts(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == len(self.dims) and all(
            isinstance(d, str) or d == s for d, s in zip(self.dims, shape, strict=True)
        )


@dataclass(frozen=True)
class ModelIO:
    inputs: dict[str, TensorSpec]  # initializers excluded
    outputs: dict[str, TensorSpec]

    def shapes(self) -> dict[str, list[int | str]]:
        """``{tensor: dims}`` of inputs and outputs, as the manifest records them."""
        return {name: list(spec.dims) for name, spec in {**self.inputs, **self.outputs}.items()}


def _specs(values: list[onnx.ValueInfoProto], skip: set[str]) -> dict[str, TensorSpec]:
    found = {}
    for value in values:
        if value.name in skip:
            continue
        tensor = value.type.tensor_type
        dims = tuple(
            d.dim_value if d.HasField("dim_value") else d.dim_param for d in tensor.shape.dim
        )
        found[value.name] = TensorSpec(np.dtype(tensor_dtype_to_np_dtype(tensor.elem_type)), dims)
    return found


def read_model_io(path: Path) -> ModelIO:
    model = onnx.load(str(path), load_external_data=False)
    initializers = {init.name for init in model.graph.initializer}
    return ModelIO(
        _specs(list(model.graph.input), initializers),
        _specs(list(model.graph.output), initializers),
    )
