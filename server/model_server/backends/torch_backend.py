"""PyTorch executor for simple ONNX graphs, with the weights in device memory.

It runs the dense subset of ONNX that MLP-style models use (MatMul, Gemm, Add, Relu,
...), which is what lets the engine manager's double buffering be measured with real GPU
memory on machines that have CUDA and torch but no TensorRT. Graphs with other
operators are refused at load time with the list of what is missing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from .base import BackendUnavailable, ModelFile, TensorSpec


def import_torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise BackendUnavailable("the torch backend needs PyTorch: pip install torch") from exc
    return torch


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _gemm(torch: Any, ins: list[Any], attrs: dict[str, Any]) -> Any:
    a, b = ins[0], ins[1]
    if attrs.get("transA"):
        a = a.transpose(0, 1)
    if attrs.get("transB"):
        b = b.transpose(0, 1)
    out = attrs.get("alpha", 1.0) * torch.matmul(a, b)
    if len(ins) > 2:
        out = out + attrs.get("beta", 1.0) * ins[2]
    return out


_OPS: dict[str, Callable[[Any, list[Any], dict[str, Any]], Any]] = {
    "MatMul": lambda t, i, a: t.matmul(i[0], i[1]),
    "Gemm": _gemm,
    "Add": lambda t, i, a: i[0] + i[1],
    "Sub": lambda t, i, a: i[0] - i[1],
    "Mul": lambda t, i, a: i[0] * i[1],
    "Relu": lambda t, i, a: t.relu(i[0]),
    "Sigmoid": lambda t, i, a: t.sigmoid(i[0]),
    "Tanh": lambda t, i, a: t.tanh(i[0]),
    "Softmax": lambda t, i, a: t.softmax(i[0], dim=a.get("axis", -1)),
    "Identity": lambda t, i, a: i[0],
}

_ONNX_TO_NUMPY: dict[int, type] = {
    onnx.TensorProto.FLOAT: np.float32,
    onnx.TensorProto.FLOAT16: np.float16,
}


def _value_spec(value: onnx.ValueInfoProto) -> TensorSpec:
    tensor = value.type.tensor_type
    dtype = _ONNX_TO_NUMPY.get(tensor.elem_type)
    if dtype is None:
        raise ValueError(f"tensor {value.name!r}: only float32/float16 are supported")
    shape = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tensor.shape.dim)
    return TensorSpec(value.name, np.dtype(dtype), shape)


class TorchEngine:
    platform = "pytorch_onnx_subset"

    def __init__(self, torch: Any, model: onnx.ModelProto, device: str) -> None:
        self._torch = torch
        self._device = device
        graph = model.graph
        unsupported = sorted({n.op_type for n in graph.node} - set(_OPS))
        if unsupported:
            raise ValueError(f"torch backend does not support operators {unsupported}")
        self._weights: dict[str, Any] | None = {
            init.name: torch.from_numpy(numpy_helper.to_array(init).copy()).to(device)
            for init in graph.initializer
        }
        self._nodes = [(n.op_type, list(n.input), list(n.output), _attrs(n)) for n in graph.node]
        self.inputs = tuple(_value_spec(v) for v in graph.input if v.name not in self._weights)
        self.outputs = tuple(_value_spec(v) for v in graph.output)

    @property
    def device_memory_bytes(self) -> int:
        weights = self._weights or {}
        return sum(int(w.element_size() * w.nelement()) for w in weights.values())

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        torch = self._torch
        weights = self._weights
        if weights is None:
            raise RuntimeError("engine is closed")
        with torch.inference_mode():
            values = dict(weights)
            for name, array in feeds.items():
                values[name] = torch.from_numpy(np.ascontiguousarray(array)).to(self._device)
            for op, ins, outs, attrs in self._nodes:
                values[outs[0]] = _OPS[op](torch, [values[i] for i in ins if i], attrs)
            return {s.name: values[s.name].cpu().numpy() for s in self.outputs}

    def close(self) -> None:
        self._weights = None
        if self._device.startswith("cuda"):
            self._torch.cuda.empty_cache()


class TorchBackend:
    name = "torch"

    def __init__(self, device: str | None = None) -> None:
        self._torch = import_torch()
        self.device = device or ("cuda" if self._torch.cuda.is_available() else "cpu")

    def estimate_memory_bytes(self, model: ModelFile) -> int:
        return int(model.size * 1.25)

    def load(self, model: ModelFile) -> TorchEngine:
        return TorchEngine(self._torch, onnx.load_model_from_string(model.data), self.device)
