"""The binary tensor data extension of KServe v2 over HTTP (Triton's
``extension_binary_data.md``): tensors as raw bytes after the body's JSON.

A body of ``Inference-Header-Content-Length`` bytes of JSON is followed by the data of
each input whose ``parameters.binary_data_size`` says how many bytes it takes, in the
order of the inputs. Data is little-endian, row major, without padding; BOOL is one byte
(0 or 1); a BYTES element is a 4-byte little-endian length and that many bytes (parsed
on the event loop: only a model with a BYTES input parses them, and no backend here has
one). Every
size is checked: a declared size that does not match its shape and datatype, a body that
ends early or goes on past the last tensor, or a BYTES element that overruns, is a
``BadRequest`` (400), never a crash.

Inputs are numpy views of the body where that is safe (the bytes aligned for their
datatype; the HTTP transport reads a body so that its binary part starts aligned), so
a large tensor is not copied on its way to the engine. The same layout is gRPC's
``raw_input_contents``/``raw_output_contents``: :func:`tensor_from_bytes` and
:func:`tensor_bytes` serve both."""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping

import numpy as np

from model_server.errors import BadRequest
from model_server.protocol.tensors import BinaryInput, v2_datatype

HEADER_LENGTH = "Inference-Header-Content-Length"
ALIGNMENT = 64  # where the transport starts a body's binary part (a cache line)
_LENGTH = struct.Struct("<I")  # a BYTES element's length prefix


# digits of an Inference-Header-Content-Length worth reading: past any body's length
# already (and Python's int() refuses strings of more than 4300 digits with a ValueError)
_MAX_DIGITS = 18


def declared_header_length(value: str | None) -> int | None:
    """The ``Inference-Header-Content-Length`` header's number, if it is one of at most
    ``_MAX_DIGITS`` ASCII digits (``None``: no header, or not such a number)."""
    if value is None:
        return None
    text = value.strip()
    if not text.isascii() or not text.isdigit() or len(text) > _MAX_DIGITS:
        return None
    return int(text)


def header_length(value: str | None, body_length: int) -> int | None:
    """The JSON header's length from the ``Inference-Header-Content-Length`` header
    (``None``: no header, the whole body is JSON)."""
    if value is None:
        return None
    length = declared_header_length(value)
    if length is None:
        text = value.strip()
        if text.isascii() and text.isdigit():  # a number, but of too many digits
            raise BadRequest(
                f"{HEADER_LENGTH} ({len(text)} digits) is larger than the body "
                f"({body_length} bytes)"
            )
        raise BadRequest(f"{HEADER_LENGTH} must be a non-negative integer, not {value[:40]!r}")
    if length > body_length:
        raise BadRequest(f"{HEADER_LENGTH} {length} is larger than the body ({body_length} bytes)")
    return length


def split_body(body: memoryview, length: int | None) -> tuple[memoryview, memoryview]:
    """The JSON header and the binary part after it."""
    if length is None:
        return body, body[len(body) :]
    return body[:length], body[length:]


def _bytes_elements(data: memoryview, count: int, name: str) -> np.ndarray:
    """``count`` BYTES elements, each a 4-byte length and that many bytes, filling
    ``data`` exactly. The count is checked against the bytes first (each element takes
    at least its 4-byte length), so that the array of ``count`` references is never
    made for a body too short to hold them."""
    offset, end = 0, len(data)
    if count * _LENGTH.size > end:
        raise BadRequest(
            f"input {name!r}: {end} bytes of binary data cannot hold {count} BYTES elements "
            f"(each takes at least {_LENGTH.size} bytes for its length)"
        )
    elements = np.empty(count, dtype=object)
    for i in range(count):
        if offset + 4 > end:
            raise BadRequest(
                f"input {name!r}: its binary data ends after {i} of {count} BYTES elements"
            )
        (size,) = _LENGTH.unpack_from(data, offset)
        offset += 4
        if offset + size > end:
            raise BadRequest(
                f"input {name!r}: BYTES element {i} is {size} bytes, past its binary data"
            )
        elements[i] = bytes(data[offset : offset + size])
        offset += size
    if offset != end:
        raise BadRequest(
            f"input {name!r}: {end - offset} bytes left after its {count} BYTES elements"
        )
    return elements


def tensor_from_bytes(
    name: str, dtype: np.dtype, shape: tuple[int, ...], data: memoryview
) -> np.ndarray:
    """An input tensor from its raw little-endian bytes: a view of ``data`` when the bytes
    are aligned for the datatype (else one copy), the size checked, and BOOL bytes 0 or 1
    (a runtime reads other bytes as it likes: ONNX Runtime reads 2 and 255 as false)."""
    count = math.prod(shape)
    if dtype.kind == "O":
        return _bytes_elements(data, count, name).reshape(shape)
    expected = count * dtype.itemsize
    if len(data) != expected:
        raise BadRequest(
            f"input {name!r}: {len(data)} bytes of binary data for a shape {list(shape)} of "
            f"{v2_datatype(dtype)} ({expected} bytes)"
        )
    if dtype.kind == "b" and count and np.frombuffer(data, np.uint8).max() > 1:
        raise BadRequest(f"input {name!r}: BOOL binary data must be bytes of 0 or 1")
    array = np.frombuffer(data, dtype=dtype.newbyteorder("<"), count=count)
    if not array.flags.aligned:
        array = array.copy()  # engines may read unaligned data slowly, or not at all
    if not array.dtype.isnative:  # a big-endian host
        array = array.astype(dtype)
    return array.reshape(shape)


def read_binary_inputs(
    inputs: tuple[BinaryInput, ...], binary: memoryview
) -> dict[str, np.ndarray]:
    """The binary inputs' tensors, read in order from the part of the body after the
    JSON, which they must fill exactly."""
    feeds: dict[str, np.ndarray] = {}
    offset = 0
    for item in inputs:
        if offset + item.size > len(binary):
            raise BadRequest(
                f"input {item.name!r}: binary_data_size {item.size}, but the body has "
                f"{len(binary) - offset} bytes left after the JSON and the inputs before it"
            )
        view = binary[offset : offset + item.size]
        feeds[item.name] = tensor_from_bytes(item.name, item.dtype, item.shape, view)
        offset += item.size
    if offset != len(binary):
        declared = sum(i.size for i in inputs)
        raise BadRequest(
            f"the body has {len(binary)} bytes after its JSON, but its inputs' "
            f"binary_data_size add up to {declared}"
        )
    return feeds


def _serialize_bytes(array: np.ndarray, name: str) -> bytes:
    parts: list[bytes] = []
    for value in np.ascontiguousarray(array).reshape(-1).tolist():
        raw = value if isinstance(value, bytes) else str(value).encode()
        if len(raw) > 0xFFFFFFFF:
            raise BadRequest(f"output {name!r}: an element of {len(raw)} bytes cannot be framed")
        parts += (_LENGTH.pack(len(raw)), raw)
    return b"".join(parts)


def tensor_bytes(array: np.ndarray, name: str) -> memoryview | bytes:
    """An output's raw little-endian, row-major bytes (no copy when the array already is
    laid out so)."""
    if array.dtype.kind == "O":
        return _serialize_bytes(array, name)
    laid_out = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    return laid_out.reshape(-1).view(np.uint8).data


def binary_outputs(
    outputs: Mapping[str, np.ndarray], names: set[str]
) -> dict[str, memoryview | bytes]:
    """The raw bytes of the outputs ``names``, in the outputs' order (their order in the
    response's JSON, which is the order their bytes follow it in)."""
    return {n: tensor_bytes(a, n) for n, a in outputs.items() if n in names}
