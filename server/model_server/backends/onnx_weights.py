"""An ONNX model's graph and its weights, without one long protobuf parse.

``onnx.load_model_from_string`` parses the whole file in C while holding the GIL (tens
of ms per 100 MiB), and reading each ``raw_data`` copies it, again under the GIL. While a
version loads beside the serving one, every
inference thread and the event loop wait for those stretches. So this module walks the
protobuf wire format of the few enclosing messages (ModelProto -> GraphProto ->
TensorProto) to find each initializer's ``raw_data``, parses with ``onnx`` only what is
left (the graph without its weight bytes: small and quick), and hands the weights out as
views of the model's own bytes. Copying them (numpy releases the GIL) is the backend's
business, in bounded chunks.

Only the raw bytes are moved; everything protobuf means by the message, including every
field this walk does not know, reaches ``onnx`` unchanged, and a file the walk cannot
follow is parsed whole by ``onnx`` instead (same result, just the long parse).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

# field numbers of onnx.proto (stable since ONNX 1.0)
_MODEL_GRAPH = 7
_GRAPH_INITIALIZER = 5
_TENSOR_RAW_DATA = 9
_TENSOR_DATA_LOCATION = 14
_LEN = 2  # wire type of length-delimited fields (messages, bytes)


@dataclass(frozen=True)
class Weight:
    """One initializer: its bytes (little-endian, C order) are a view of the model's bytes
    where the file stores them raw, else of an array made from the typed fields."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    data: memoryview

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def array(self) -> np.ndarray:
        """A read-only numpy view of the bytes (no copy)."""
        return np.frombuffer(self.data, dtype=self.dtype).reshape(self.shape)


class _Malformed(Exception):
    """The walk cannot follow these bytes; ``onnx`` parses them whole instead."""


def _varint(data: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise _Malformed
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


@dataclass(frozen=True)
class _Field:
    number: int
    wire: int
    start: int  # where the tag begins
    body: int  # where the value (for LEN: its bytes) begins
    end: int  # one past the value


def _fields(data: memoryview, start: int, end: int) -> list[_Field]:
    """The top-level fields of the message in ``data[start:end]``, values unparsed."""
    fields = []
    pos = start
    while pos < end:
        tag_at = pos
        tag, pos = _varint(data, pos, end)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            _, after = _varint(data, pos, end)
            body = pos
        elif wire == 1:
            body, after = pos, pos + 8
        elif wire == _LEN:
            length, body = _varint(data, pos, end)
            after = body + length
        elif wire == 5:
            body, after = pos, pos + 4
        else:  # groups (deprecated) and invalid wire types
            raise _Malformed
        if number == 0 or after > end:
            raise _Malformed
        fields.append(_Field(number, wire, tag_at, body, after))
        pos = after
    return fields


def _len_field(number: int, payload: bytes) -> bytes:
    return _encode_varint(number << 3 | _LEN) + _encode_varint(len(payload)) + payload


def _without(data: memoryview, fields: list[_Field], dropped: list[_Field]) -> bytes:
    skip = {id(f) for f in dropped}
    return b"".join(bytes(data[f.start : f.end]) for f in fields if id(f) not in skip)


def _split(data: memoryview) -> tuple[bytes, list[memoryview | None]]:
    """The model's bytes without any initializer's raw_data, and each initializer's raw
    bytes in order (None where it has none)."""
    top = _fields(data, 0, len(data))
    graphs = [f for f in top if f.number == _MODEL_GRAPH and f.wire == _LEN]
    if len(graphs) != 1:  # several graph fields merge in protobuf: leave that to onnx
        raise _Malformed
    graph = graphs[0]
    raws: list[memoryview | None] = []
    parts = []
    for field in _fields(data, graph.body, graph.end):
        if field.number != _GRAPH_INITIALIZER or field.wire != _LEN:
            parts.append(bytes(data[field.start : field.end]))
            continue
        tensor = _fields(data, field.body, field.end)
        raw = [f for f in tensor if f.number == _TENSOR_RAW_DATA and f.wire == _LEN]
        raws.append(data[raw[-1].body : raw[-1].end] if raw else None)  # the last one wins
        parts.append(_len_field(_GRAPH_INITIALIZER, _without(data, tensor, raw)))
    head = b"".join(bytes(data[f.start : f.end]) for f in top if f.end <= graph.start)
    tail = b"".join(bytes(data[f.start : f.end]) for f in top if f.start >= graph.end)
    return head + _len_field(_MODEL_GRAPH, b"".join(parts)) + tail, raws


def _numpy_dtype(tensor: onnx.TensorProto) -> np.dtype:
    try:
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
    except (KeyError, TypeError, ValueError):
        dtype = np.dtype(object)
    if dtype.kind not in "biuf":  # strings, and types numpy has no plain form of
        name = onnx.TensorProto.DataType.Name(tensor.data_type)
        raise ValueError(f"initializer {tensor.name!r} is {name}, which has no numpy type")
    return dtype


def load(data: bytes | memoryview) -> tuple[onnx.ModelProto, list[Weight]]:
    """The model (its initializers without ``raw_data``) and every initializer's weight.

    A bad model raises ``ValueError``, or ``onnx``'s own ``DecodeError``."""
    view = memoryview(data)
    raws: list[memoryview | None]
    try:
        if sys.byteorder != "little":  # raw_data is little-endian: let numpy_helper swap
            raise _Malformed
        skeleton, raws = _split(view)
        model = onnx.load_model_from_string(skeleton)
    except _Malformed:  # rare (a model the walk cannot follow): onnx parses bytes only
        model = onnx.load_model_from_string(bytes(data))
        raws = [None] * len(model.graph.initializer)
    if len(raws) != len(model.graph.initializer):  # cannot happen if the walk is right
        raise ValueError("the model's initializers could not be read")
    weights = []
    for tensor, raw in zip(model.graph.initializer, raws, strict=True):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            raise ValueError(
                f"initializer {tensor.name!r} keeps its data outside the model file, "
                "which this backend does not read"
            )
        dtype = _numpy_dtype(tensor)
        shape = tuple(int(d) for d in tensor.dims)
        if raw is None:  # typed fields (float_data, ...), or a file the walk did not follow
            array = np.ascontiguousarray(numpy_helper.to_array(tensor), dtype=dtype)
            raw = memoryview(array.reshape(-1).view(np.uint8).data)
        count = int(np.prod(shape, dtype=np.int64))
        if raw.nbytes != count * dtype.itemsize:
            raise ValueError(
                f"initializer {tensor.name!r} has {raw.nbytes} bytes; its shape {shape} of "
                f"{dtype} needs {count * dtype.itemsize}"
            )
        weights.append(Weight(tensor.name, dtype, shape, raw))
    return model, weights
