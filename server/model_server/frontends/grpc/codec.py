"""KServe v2 gRPC tensors <-> numpy arrays: a ``ModelInferRequest`` checked against the
routed version's inputs, and outputs as a ``ModelInferResponse``.

An input's values come either in the request's ``raw_input_contents`` (one entry per
input, in the inputs' order: tritonclient's way, and the binary extension's layout, so
:mod:`.binary_codec` reads them) or typed, in the input's ``contents`` (the field of its
datatype: ``fp32_contents`` for FP32, ``int_contents`` for INT8/16/32, …; FP16 has none
and travels raw only). Never both in one request, as the protocol says. Every input gets
the checks of :class:`~model_server.protocol.tensors.InputChecker`, like a JSON or binary one.
Answers carry every output in ``raw_output_contents``, as Triton's do (and as
tritonclient reads them).

Typed values are converted by numpy from the message's repeated fields (4 ms for 4M
FP32, 80 ms for 4M INT64 here); a request of more than ``INLINE_ELEMENTS`` values is
converted on a thread, so that BYTES elements, parsed one by one, do not hold the
event loop."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from model_server.errors import BadRequest
from model_server.frontends.grpc.protocol import grpc_service_pb2 as pb
from model_server.protocol.binary_codec import tensor_bytes, tensor_from_bytes
from model_server.protocol.tensor_spec import TensorSpec
from model_server.protocol.tensors import InputChecker, v2_datatype
from model_server.protocol.v2_codec import InferenceRequest

INLINE_ELEMENTS = 32 * 1024  # requests of up to this many values are decoded on the loop
# the field of InferTensorContents that holds each datatype's values, and its own type
_CONTENTS: dict[str, tuple[str, np.dtype]] = {
    "BOOL": ("bool_contents", np.dtype(np.bool_)),
    "INT8": ("int_contents", np.dtype(np.int32)),
    "INT16": ("int_contents", np.dtype(np.int32)),
    "INT32": ("int_contents", np.dtype(np.int32)),
    "INT64": ("int64_contents", np.dtype(np.int64)),
    "UINT8": ("uint_contents", np.dtype(np.uint32)),
    "UINT16": ("uint_contents", np.dtype(np.uint32)),
    "UINT32": ("uint_contents", np.dtype(np.uint32)),
    "UINT64": ("uint64_contents", np.dtype(np.uint64)),
    "FP32": ("fp32_contents", np.dtype(np.float32)),
    "FP64": ("fp64_contents", np.dtype(np.float64)),
    "BYTES": ("bytes_contents", np.dtype(object)),
}
# parameters naming data this server cannot reach: refused rather than ignored
_SHARED_MEMORY = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")


def _typed(
    tensor: pb.ModelInferRequest.InferInputTensor, dtype: np.dtype, shape: tuple[int, ...]
) -> np.ndarray:
    """An input's values from its typed ``contents``: the field of its datatype, exactly
    as many values as its shape holds, each within the datatype's range."""
    name, datatype = tensor.name, tensor.datatype
    wanted = _CONTENTS.get(datatype)
    if wanted is None:
        raise BadRequest(f"input {name!r}: {datatype} values travel in raw_input_contents only")
    field, wire = wanted
    others = [f.name for f, _ in tensor.contents.ListFields() if f.name != field]
    if others:
        raise BadRequest(f"input {name!r}: {others[0]} given for a {datatype} input ({field})")
    values = getattr(tensor.contents, field)
    count = math.prod(shape)
    if len(values) != count:
        raise BadRequest(
            f"input {name!r}: {len(values)} values in {field} for a shape {list(shape)} "
            f"({count} values)"
        )
    if dtype.kind == "O":
        array = np.empty(count, dtype=object)
        array[:] = list(values)
        return array.reshape(shape)
    array = np.array(values, dtype=wire)
    if wire != dtype:  # INT8/16, UINT8/16: carried in a wider field
        info = np.iinfo(dtype)
        if array.size and (array.min() < info.min or array.max() > info.max):
            raise BadRequest(f"input {name!r}: a value in {field} is outside {datatype}'s range")
        array = array.astype(dtype)
    return array.reshape(shape)


def _check_parameters(parameters: Any, what: str) -> None:
    shared = [p for p in _SHARED_MEMORY if p in parameters]
    if shared:
        raise BadRequest(f"{what}: the shared-memory extension is not supported ({shared[0]})")


def decode_request(
    request: pb.ModelInferRequest, specs: tuple[TensorSpec, ...]
) -> InferenceRequest:
    """The request's inputs as feeds, checked against ``specs``; its id and requested
    outputs as the data plane takes them."""
    if "sequence_id" in request.parameters:  # would be answered as if stateless
        raise BadRequest("sequence_id: stateful (sequence batching) models are not supported")
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise BadRequest(
            f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs: "
            "it holds every input's data, in the inputs' order, or none"
        )
    checker = InputChecker(specs)
    feeds: dict[str, np.ndarray] = {}
    for i, tensor in enumerate(request.inputs):
        dtype, shape = checker.check(tensor.name, tensor.datatype, list(tensor.shape))
        _check_parameters(tensor.parameters, f"input {tensor.name!r}")
        if raw:
            if tensor.HasField("contents"):
                raise BadRequest(
                    f"input {tensor.name!r}: contents given beside raw_input_contents "
                    "(a request uses one or the other)"
                )
            feeds[tensor.name] = tensor_from_bytes(tensor.name, dtype, shape, memoryview(raw[i]))
        else:
            feeds[tensor.name] = _typed(tensor, dtype, shape)
    checker.finish()
    outputs = []
    for output in request.outputs:
        _check_parameters(output.parameters, f"output {output.name!r}")
        if "classification" in output.parameters:
            raise BadRequest(f"output {output.name!r}: classification is not supported")
        outputs.append({"name": output.name})
    return InferenceRequest(feeds, request.id or None, outputs or None)


def encode_response(
    name: str, version: str, request_id: str, outputs: dict[str, np.ndarray]
) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(model_name=name, model_version=version, id=request_id)
    for output_name, array in outputs.items():
        response.outputs.add(
            name=output_name, datatype=v2_datatype(array.dtype), shape=list(array.shape)
        )
        response.raw_output_contents.append(bytes(tensor_bytes(array, output_name)))
    return response


def _elements(request: pb.ModelInferRequest) -> int:
    """The values a request claims to hold (its shapes'; bounded per input by the
    checks, which come later)."""
    return sum(math.prod(max(d, 0) for d in t.shape) for t in request.inputs)


@dataclass(frozen=True)
class GrpcInferRequest:
    """A ``ModelInferRequest`` as the data plane's codec (``RequestCodec``)."""

    request: pb.ModelInferRequest

    async def decode(self, specs: tuple[TensorSpec, ...]) -> InferenceRequest:
        if _elements(self.request) <= INLINE_ELEMENTS:
            return decode_request(self.request, specs)
        return await asyncio.to_thread(decode_request, self.request, specs)

    async def encode(
        self,
        name: str,
        version: str,
        request_id: str,
        outputs: dict[str, np.ndarray],
        request: InferenceRequest,
    ) -> pb.ModelInferResponse:
        return encode_response(name, version, request_id, outputs)
