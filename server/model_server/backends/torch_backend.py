"""PyTorch executor for simple ONNX graphs, with the weights in device memory.

It runs the dense subset of ONNX that MLP-style models use (MatMul, Gemm, Add, Relu,
...), which is what lets the engine manager's double buffering be measured with real GPU
memory on machines that have CUDA and torch but no TensorRT. Graphs with other
operators are refused at load time with the list of what is missing.

A load must not slow down the version that is serving meanwhile, so on a GPU
(:mod:`.torch_gpu`):

* the weights are read without one long protobuf parse (:mod:`.onnx_weights`) and copied
  on the load's own CUDA stream, through two reused pinned staging buffers of
  ``chunk_bytes``; the load waits for its own stream only, never for the device;
* each inference thread has its own stream and pinned I/O buffers, made on its first
  request: a request is one async copy in per input, its kernels, one async copy out per
  output and one synchronize of that stream;
* its kernels are one CUDA graph replay where a graph for its input shapes is free
  (warm-up captures them, on the loader's thread, for the batch-1 shapes; other shapes,
  such as dynamic batching's, run their kernels one by one: captures on request threads
  broke the CUDA context under load);
* per request only the activations get a dictionary; the weights are bound to the graph's
  nodes once, at load.

On the CPU the same code runs without streams and graphs (the staging buffers are then
plain memory), so the chunked load is tested on machines without a GPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from model_server.backends import onnx_weights, torch_gpu
from model_server.backends.base import BackendUnavailable, ModelFile
from model_server.backends.replay_times import ReplayTimes
from model_server.errors import BadRequest
from model_server.protocol.tensor_spec import TensorSpec

log = logging.getLogger(__name__)

GRAPHS_PER_SHAPE = 8  # concurrent requests of one shape that replay a graph
GRAPH_SHAPES = 1  # input shapes captured per engine: the batch-1 ones, at warm-up
REPLAYS_TIMED = 7  # at warm-up: they seed the replay times (see replay_times)


# cuBLAS keeps one workspace per (handle, stream) and a CUDA graph bakes the address of the
# one its capture used into its GEMMs: every graph an engine captures on the loader's
# stream, and that loader's eager runs while the next version warms up, would share one
# scratch buffer across threads. Without a workspace no two runs share scratch memory.
# Read by torch when cuBLAS first runs, so set before any GEMM; an operator's own value wins.
CUBLAS_ENVIRONMENT = {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"}


# What torch's own shape checks say when inputs the server accepted (dynamic axes unnamed
# or named apart, a row count a Reshape cannot take) do not fit the graph: torch raises
# them as RuntimeError, like its memory and device faults, which stay the server's.
_SHAPE_CHECKS = (
    "shapes cannot be multiplied",  # MatMul, Gemm
    "must match the size of tensor",  # element-wise broadcasting
    "is invalid for input of size",  # Reshape
    "sizes of tensors must match",  # Concat
    "size mismatch",
    "expected size for first two dimensions",  # batched MatMul
)
_SERVER_FAULTS = ("out of memory", "cuda error", "cublas", "cudnn", "illegal", "device-side")


def input_error(exc: Exception) -> str | None:
    """The message of a run's failure that is the inputs' (a shape check: the client's
    400), else None: a memory, device or any other fault stays the server's."""
    if not isinstance(exc, RuntimeError):
        return None
    message = str(exc)
    lower = message.lower()
    if any(fault in lower for fault in _SERVER_FAULTS):
        return None
    if not any(check in lower for check in _SHAPE_CHECKS):
        return None
    return f"the model cannot run these inputs: {message.strip()}"


def import_torch() -> Any:
    for name, value in CUBLAS_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
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


Op = Callable[[Any, list[Any], dict[str, Any]], Any]

_OPS: dict[str, Op] = {
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


@dataclass(frozen=True)
class _Step:
    """One node: its op, each input as a weight tensor or an activation's name."""

    op: Op
    inputs: tuple[tuple[bool, Any], ...]  # (is_weight, tensor or name)
    output: str
    attrs: dict[str, Any]


def _shape_key(arrays: Mapping[str, np.ndarray]) -> torch_gpu.ShapeKey:
    return tuple((name, a.shape, a.dtype.str) for name, a in arrays.items())


class TorchEngine:
    platform = "pytorch_onnx_subset"

    def __init__(
        self,
        torch: Any,
        data: bytes | memoryview,
        device: str,
        chunk_bytes: int = torch_gpu.CHUNK_BYTES,
        io: torch_gpu.PerThreadIO | None = None,
        graphs: torch_gpu.GraphPool | None = None,
        pinned: tuple[int, int] | None = None,
    ) -> None:
        """``io``: the backend's per-thread streams and buffers; ``graphs``: where this
        engine keeps its CUDA graphs (None: none are captured); ``pinned``: the range of
        ``data`` registered with CUDA (uploaded from there with no staging copy)."""
        self._torch = torch
        self._device = torch.device(device)
        self._gpu = self._device.type == "cuda"
        # the load's seconds per stage, for the load pipeline (load_stages)
        self.load_stages: dict[str, float] = {}
        started = time.perf_counter()
        model, weights = onnx_weights.load(data)
        graph = model.graph
        unsupported = sorted({n.op_type for n in graph.node} - set(_OPS))
        if unsupported:
            raise ValueError(f"torch backend does not support operators {unsupported}")
        started = self._timed("parse", started)
        self.upload_pieces = 0
        self._held_bytes = 0
        self.direct_bytes = 0
        self._weights: dict[str, Any] | None = self._upload(weights, chunk_bytes, pinned)
        started = self._timed("upload", started)
        self._steps: list[_Step] | None = [self._step(n) for n in graph.node]
        self.inputs = tuple(_value_spec(v) for v in graph.input if v.name not in self._weights)
        self.outputs = tuple(_value_spec(v) for v in graph.output)
        if self._gpu:
            self._io: torch_gpu.PerThreadIO | None = io or torch_gpu.PerThreadIO(
                torch, self._device
            )
        else:
            self._io = None
        self._graphs = graphs if self._gpu else None
        # the batch-1 graphs' GPU times per replay: at warm-up, then every replay, on any thread
        self.replay_times: ReplayTimes | None = None
        self._timed("bind", started)

    def _timed(self, stage: str, started: float) -> float:
        now = time.perf_counter()
        self.load_stages[stage] = now - started
        return now

    def _upload(
        self,
        weights: Sequence[onnx_weights.Weight],
        chunk_bytes: int,
        pinned: tuple[int, int] | None,
    ) -> dict[str, Any]:
        """All the weights in one allocation (one ``cudaMalloc`` rather than one per
        tensor), each a view at an aligned offset, filled through the staged upload
        (straight from ``pinned`` memory where the weights are)."""
        torch = self._torch
        stream = None
        if self._gpu:
            stream = torch.cuda.Stream(device=self._device, priority=torch_gpu.LOAD_PRIORITY)
        upload = torch_gpu.StagedUpload(torch, chunk_bytes, stream, pinned)
        offsets, total = [], 0
        for weight in weights:
            offsets.append(total)
            total += torch_gpu.aligned(weight.nbytes)
        tensors = {}
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                flat = torch.empty(total, dtype=torch.uint8, device=self._device)
                for weight, at in zip(weights, offsets, strict=True):
                    dtype = getattr(torch, str(weight.dtype))
                    tensor = flat[at : at + weight.nbytes].view(dtype).view(weight.shape)
                    upload.copy(tensor, weight.data)
                    tensors[weight.name] = tensor
        finally:  # a failed upload too: no copy still reads the private copy once it goes
            upload.finish()
        self.upload_pieces = upload.pieces
        self.direct_bytes = upload.direct_bytes
        self._held_bytes = total
        return tensors

    def _step(self, node: onnx.NodeProto) -> _Step:
        weights = self._weights or {}
        inputs = tuple(
            (True, weights[name]) if name in weights else (False, name)
            for name in node.input
            if name  # an empty name is an omitted optional input
        )
        return _Step(_OPS[node.op_type], inputs, node.output[0], _attrs(node))

    @property
    def device_memory_bytes(self) -> int:
        """The weights' allocation (each tensor rounded up to the alignment)."""
        return self._held_bytes if self._weights is not None else 0

    @property
    def graphs_captured(self) -> int:
        return self._graphs.count() if self._graphs is not None else 0

    def weight(self, name: str) -> np.ndarray:
        """A copy of one weight as the engine holds it (for tests and tools)."""
        if self._weights is None:
            raise RuntimeError("engine is closed")
        return self._weights[name].cpu().numpy().copy()

    def _run(self, steps: list[_Step], activations: dict[str, Any]) -> None:
        torch = self._torch
        for step in steps:
            args = [value if is_weight else activations[value] for is_weight, value in step.inputs]
            activations[step.output] = step.op(torch, args, step.attrs)

    def _value(self, activations: dict[str, Any], name: str) -> Any:
        if name in activations:
            return activations[name]
        return (self._weights or {})[name]  # an output that is a weight itself

    def _outputs(self, steps: list[_Step], inputs: dict[str, Any]) -> list[Any]:
        activations = dict(inputs)
        self._run(steps, activations)
        return [self._value(activations, spec.name) for spec in self.outputs]

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        steps = self._steps
        if steps is None:
            raise RuntimeError("engine is closed")
        arrays = {name: np.ascontiguousarray(array) for name, array in feeds.items()}
        try:
            with self._torch.inference_mode():
                if self._io is None:
                    return self._infer_cpu(steps, arrays)
                return self._infer_gpu(steps, arrays, self._io.get())
        except RuntimeError as exc:  # shape checks run on the host, before any kernel
            message = input_error(exc)
            if message is None:
                raise
            raise BadRequest(message) from None

    def _infer_cpu(
        self, steps: list[_Step], arrays: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        inputs = {name: self._torch.from_numpy(array) for name, array in arrays.items()}
        results = self._outputs(steps, inputs)
        # copies: an output may share memory with an input or a weight
        return {s.name: r.numpy().copy() for s, r in zip(self.outputs, results, strict=True)}

    def _infer_gpu(
        self, steps: list[_Step], arrays: dict[str, np.ndarray], io: torch_gpu.ThreadIO
    ) -> dict[str, np.ndarray]:
        key = _shape_key(arrays)
        graphs = self._graphs
        captured = graphs.borrow(key) if graphs is not None else None
        if graphs is not None and captured is not None:
            try:
                outputs = captured.run(self._torch, io.stream, arrays, self.outputs)
                self._note_replay(captured)
                return outputs
            finally:
                graphs.give_back(key, captured)
        with self._torch.cuda.stream(io.stream):
            staged = self._stage_inputs(arrays, io)
            inputs = {n: t.to(self._device, non_blocking=True) for n, t in staged.items()}
            answer = self._fetch_outputs(self._outputs(steps, inputs), io)
            io.stream.synchronize()  # the one wait of a request, on this thread's stream
        return {s.name: a.numpy().copy() for s, a in zip(self.outputs, answer, strict=True)}

    def infer_if_quick(
        self, feeds: Mapping[str, np.ndarray], budget_s: float
    ) -> dict[str, np.ndarray] | None:
        """Replay a free captured graph for these shapes on this thread, if replays
        typically take at most ``budget_s`` of GPU time; else None (no graph, none free,
        too slow)."""
        steps, graphs, io, times = self._steps, self._graphs, self._io, self.replay_times
        if steps is None or graphs is None or io is None or times is None:
            return None
        if not times.allows(budget_s):
            return None
        arrays = {name: np.ascontiguousarray(array) for name, array in feeds.items()}
        key = _shape_key(arrays)
        captured = graphs.borrow(key)
        if captured is None:
            return None
        try:
            with self._torch.inference_mode():
                outputs = captured.run(self._torch, io.get().stream, arrays, self.outputs)
            self._note_replay(captured)
            return outputs
        finally:
            graphs.give_back(key, captured)

    def _note_replay(self, captured: torch_gpu.Captured) -> None:
        times, seconds = self.replay_times, captured.gpu_seconds
        if times is not None and seconds is not None:
            times.note(seconds)

    @property
    def replay_seconds(self) -> float | None:
        """A typical replay's time (None before warm-up, or without graphs)."""
        return self.replay_times.typical_s if self.replay_times is not None else None

    def _stage_inputs(self, arrays: dict[str, np.ndarray], io: torch_gpu.ThreadIO) -> dict:
        """The inputs, copied into this thread's pinned buffer (as pinned tensors)."""
        torch = self._torch
        buffer = io.host(sum(torch_gpu.aligned(a.nbytes) for a in arrays.values()))
        host = buffer.numpy()
        staged, at = {}, 0
        for name, array in arrays.items():
            np.copyto(host[at : at + array.nbytes].view(array.dtype).reshape(array.shape), array)
            pinned = buffer[at : at + array.nbytes].view(getattr(torch, str(array.dtype)))
            staged[name] = pinned.view(array.shape)
            at += torch_gpu.aligned(array.nbytes)
        return staged

    def _fetch_outputs(self, results: list[Any], io: torch_gpu.ThreadIO) -> list[Any]:
        """Queue the copies of ``results`` into pinned memory; valid once the stream is
        synchronized. They may reuse the inputs' bytes: the stream read those first."""
        buffer = io.host(sum(torch_gpu.aligned(r.numel() * r.element_size()) for r in results))
        copies, at = [], 0
        for result in results:
            nbytes = result.numel() * result.element_size()
            into = buffer[at : at + nbytes].view(result.dtype).view(result.shape)
            into.copy_(result, non_blocking=True)
            copies.append(into)
            at += torch_gpu.aligned(nbytes)
        return copies

    def _capture(
        self,
        steps: list[_Step],
        arrays: dict[str, np.ndarray],
        results: list[Any],
        io: torch_gpu.ThreadIO,
    ) -> torch_gpu.Captured | None:
        """A graph for these input shapes, on this thread's stream, which has just run
        the same kernels eagerly (``results``: their outputs, for the output buffers). A
        graph that cannot be captured is logged, not fatal: requests of that shape run
        without one."""
        try:
            return torch_gpu.capture(
                self._torch,
                io.stream,
                lambda inputs: self._outputs(steps, inputs),
                arrays,
                results,
                self._device,
            )
        except Exception as exc:  # the runtime can refuse a capture with several types
            log.warning("no CUDA graph for input shapes %s: %s", _shape_key(arrays), exc)
            return None

    def warm_up(self) -> None:
        """Capture the graphs of batch-1 requests now, on the loader's thread, rather than
        on the first requests after the swap (the load pipeline calls this)."""
        steps, graphs, io = self._steps, self._graphs, self._io
        if steps is None or graphs is None or io is None:
            return
        arrays = {spec.name: spec.example() for spec in self.inputs}
        self.infer(arrays)  # runs the kernels on this thread's stream
        key = _shape_key(arrays)
        thread = io.get()
        with self._torch.inference_mode(), self._torch.cuda.stream(thread.stream):
            results = self._outputs(steps, {
                name: self._torch.from_numpy(a).to(self._device, non_blocking=True)
                for name, a in arrays.items()
            })  # fmt: skip
            while graphs.reserve(key):
                captured = self._capture(steps, arrays, results, thread)
                graphs.give_back(key, captured)
                if captured is None:
                    break
            thread.stream.synchronize()
        timed = self._time_replays(key, arrays, thread)
        self.replay_times = ReplayTimes(timed) if timed else None

    def _time_replays(
        self, key: torch_gpu.ShapeKey, arrays: dict[str, np.ndarray], io: torch_gpu.ThreadIO
    ) -> list[float]:
        """The GPU times of a few replays of a captured graph; none if none was captured
        (or its replays are not timed)."""
        graphs = self._graphs
        captured = graphs.borrow(key) if graphs is not None else None
        if graphs is None or captured is None:
            return []
        times: list[float] = []
        try:
            with self._torch.inference_mode():
                for _ in range(REPLAYS_TIMED):
                    captured.run(self._torch, io.stream, arrays, self.outputs)
                    if captured.gpu_seconds is not None:
                        times.append(captured.gpu_seconds)
        finally:
            graphs.give_back(key, captured)
        return times

    def close(self) -> None:
        """Drop the weights and graphs: their device memory goes back to torch's
        allocator at once (the engine manager closes a version after its last request,
        whose stream was synchronized). ``torch.cuda.empty_cache()`` is not called: it
        frees with ``cudaFree``, which waits for the whole device, and ``close`` runs on
        the event loop; the allocator reuses the cached blocks for the next load."""
        self._steps = None
        self._weights = None
        if self._graphs is not None:
            self._graphs.close()


class TorchBackend:
    name = "torch"

    def __init__(
        self,
        device: str | None = None,
        chunk_bytes: int = torch_gpu.CHUNK_BYTES,
        cuda_graphs: bool = True,
        pin_copies: bool = False,
    ) -> None:
        """``pin_copies``: register kept private copies with CUDA (see :meth:`_pinned`)."""
        self._torch = import_torch()
        self.pin_copies = pin_copies
        self.device = device or ("cuda" if self._torch.cuda.is_available() else "cpu")
        self.chunk_bytes = chunk_bytes
        self.cuda_graphs = cuda_graphs
        gpu = self._torch.device(self.device).type == "cuda"
        self._io = (
            torch_gpu.PerThreadIO(self._torch, self._torch.device(self.device)) if gpu else None
        )

    def estimate_memory_bytes(self, model: ModelFile) -> int:
        return int(model.size * 1.25)

    def load(self, model: ModelFile) -> TorchEngine:
        graphs = torch_gpu.GraphPool(GRAPHS_PER_SHAPE, GRAPH_SHAPES) if self.cuda_graphs else None
        started = time.perf_counter()
        pinned = self._pinned(model)
        pin_s = time.perf_counter() - started
        engine = TorchEngine(
            self._torch, model.data, self.device, self.chunk_bytes, self._io, graphs, pinned
        )
        engine.load_stages["pin"] = pin_s  # registering a new private copy's pages
        return engine

    def _pinned(self, model: ModelFile) -> tuple[int, int] | None:
        """The range of ``model``'s private copy registered with CUDA, registering it
        first if need be: only a copy kept for later versions (its registration then
        serves them too; pinning a copy for one load costs more than staging it)."""
        private = model.private
        if not self.pin_copies or self._io is None or private is None or not private.reusable:
            return None
        address = private.address
        if address is None:
            return None
        size = model.size
        if torch_gpu.HOST_PIN not in private.pins:
            if not torch_gpu.register_host(self._torch, address, size):
                return None
            torch = self._torch
            private.pin(torch_gpu.HOST_PIN, lambda: torch_gpu.unregister_host(torch, address))
        return address, size
