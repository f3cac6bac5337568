"""KServe v2 JSON: a request's JSON (the whole body, or the header before binary tensor
data) -> checked feeds, outputs -> the response's JSON.

Plain functions of their arguments, so that :mod:`.codec_workers` can run them in
another process for large bodies. Parsed and written with orjson, and strict both ways
(RFC 8259): a bare ``NaN`` or ``Infinity`` in a request is refused, and none is ever
written; non-finite floats travel as the strings ``"NaN"``, ``"Infinity"`` and
``"-Infinity"``."""

from __future__ import annotations

import codecs
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from model_server.errors import BadRequest, UnsupportedMediaType
from model_server.protocol.tensor_spec import TensorSpec
from model_server.protocol.tensors import (
    BinaryInput,
    BinaryOutput,
    decode_input_list,
    encode_outputs,
    parameters_of,
)

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class InferenceRequest:
    feeds: dict[str, np.ndarray]
    id: str | None
    outputs: Any  # the body's ``outputs`` as given; checked against the model's results
    # the binary tensor data extension: every output as binary data unless an output's
    # own ``parameters.binary_data`` says otherwise
    binary_output: bool = False


@dataclass(frozen=True)
class DecodedRequest:
    """A request's JSON, decoded: its binary inputs (if any) are still to be read from
    the bytes after the JSON (:func:`.binary_codec.read_binary_inputs`)."""

    request: InferenceRequest
    binary: tuple[BinaryInput, ...] = field(default=())


_BARE = ("-Infinity", "Infinity", "NaN")  # the tokens Python's json writes for them


def _text(raw: Buffer, charset: str) -> Buffer | str:
    """The body as orjson reads it: UTF-8 as it is (orjson checks it), any other text
    encoding decoded. Only text encodings: ``str()`` refuses the codecs that transform
    bytes (rot13, hex, base64, zlib, bz2…), which would otherwise run on the event loop
    as a "charset" and inflate a small body into a huge one."""
    shown = repr(charset[:40])
    try:
        utf8 = codecs.lookup(charset).name == "utf-8"
    except (LookupError, ValueError) as exc:  # ValueError: a NUL in the name
        raise UnsupportedMediaType(f"unknown charset {shown}") from exc
    if utf8:
        return raw
    try:
        return str(raw, charset)
    except LookupError as exc:
        raise UnsupportedMediaType(f"charset {shown} is not a text encoding") from exc
    except ValueError as exc:  # UnicodeDecodeError, or a codec's own UnicodeError
        raise BadRequest(f"request body is not {shown}: {exc}") from exc


def parse_json(raw: Buffer, charset: str = "utf-8") -> Any:
    """A JSON body (strict RFC 8259), in ``charset`` (an unknown one, or one that is not
    a text encoding, is ``UnsupportedMediaType``)."""
    text = _text(raw, charset)
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        at = exc.doc[max(0, exc.pos - 1) : exc.pos + 9] if isinstance(exc.doc, str) else ""
        bare = next((t for t in _BARE if t in at), None)
        if bare is not None:
            raise BadRequest(
                f"request body is not valid JSON: {bare} is not JSON: send the string "
                f"{bare!r} for a non-finite value"
            ) from exc
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc


def _flag(parameters: Mapping[str, Any], key: str, what: str) -> bool | None:
    value = parameters.get(key)
    if value is not None and not isinstance(value, bool):
        raise BadRequest(f"{what}: {key!r} must be a boolean")
    return value


def _check_outputs(outputs: Any) -> None:
    """The requested outputs' form (their names are checked against the model's results
    once it has run): objects with a name and, if any, boolean ``binary_data``."""
    if outputs is None:
        return
    if not isinstance(outputs, list):
        raise BadRequest("'outputs' must be a list of objects with a 'name'")
    for item in outputs:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise BadRequest("each requested output must be an object with a 'name' string")
        what = f"output {item['name']!r}"
        parameters = parameters_of(item, what)
        if "classification" in parameters:
            raise BadRequest(f"{what}: the classification extension is not supported")
        if "shared_memory_region" in parameters:
            raise BadRequest(f"{what}: the shared-memory extension is not supported")
        _flag(parameters, "binary_data", what)


def decode_header(raw: Buffer, charset: str, specs: tuple[TensorSpec, ...]) -> DecodedRequest:
    """A v2 inference request's JSON, its inputs checked against ``specs``."""
    body = parse_json(raw, charset)
    decoded = decode_input_list(body, specs)  # also checks that the body is an object
    request_id = body.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise BadRequest("'id' must be a string")
    parameters = parameters_of(body, "request")
    if parameters.get("sequence_id") not in (None, 0, ""):
        raise BadRequest("the sequence extension is not supported")
    binary_output = _flag(parameters, "binary_data_output", "request") or False
    outputs = body.get("outputs")
    _check_outputs(outputs)
    request = InferenceRequest(decoded.feeds, request_id or None, outputs, binary_output)
    return DecodedRequest(request, decoded.binary)


def binary_output_names(request: InferenceRequest, names: list[str]) -> set[str]:
    """Of the outputs ``names`` being answered, those the request wants as binary data:
    an output's own ``binary_data`` wins over the request's ``binary_data_output``."""
    own: dict[str, bool] = {}
    if isinstance(request.outputs, list):
        for item in request.outputs:
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                flag = item.get("parameters", {}).get("binary_data")
                if isinstance(flag, bool):
                    own[item["name"]] = flag
    return {n for n in names if own.get(n, request.binary_output)}


def encode_response(
    model_name: str,
    model_version: str,
    request_id: str,
    outputs: Mapping[str, np.ndarray | BinaryOutput],
) -> bytes:
    """The response's JSON (binary outputs only described: their bytes follow it)."""
    body = {
        "model_name": model_name,
        "model_version": model_version,
        "id": request_id,
        "outputs": encode_outputs(outputs),
    }
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def output_elements(outputs: Mapping[str, np.ndarray | BinaryOutput]) -> int:
    """The values the response's JSON carries (binary outputs carry none there)."""
    return sum(int(a.size) for a in outputs.values() if isinstance(a, np.ndarray))
