"""KServe v2 JSON bodies: request bytes -> checked feeds, outputs -> response bytes.

Plain functions of their arguments, so that :mod:`.codec_workers` can run them in
another process for large bodies. The JSON is strict both ways (RFC 8259): a bare
``NaN`` or ``Infinity`` in a request is refused, and none is ever written; non-finite
floats travel as the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from .backends.base import TensorSpec
from .errors import BadRequest, UnsupportedMediaType
from .tensors import decode_inputs, encode_outputs


@dataclass(frozen=True)
class InferenceRequest:
    feeds: dict[str, np.ndarray]
    id: str | None
    outputs: Any  # the body's ``outputs`` as given; checked against the model's results


def _no_bare_constants(token: str) -> Any:
    raise ValueError(f"{token} is not JSON: send the string {token!r} for a non-finite value")


def decode_request(raw: bytes, charset: str, specs: tuple[TensorSpec, ...]) -> InferenceRequest:
    """A v2 inference request, its inputs checked against ``specs``."""
    try:
        text = raw.decode(charset)
    except LookupError as exc:
        raise UnsupportedMediaType(f"unknown charset {charset!r}") from exc
    except UnicodeDecodeError as exc:
        raise BadRequest(f"request body is not {charset}: {exc}") from exc
    try:
        body = json.loads(text, parse_constant=_no_bare_constants)
    except (ValueError, RecursionError) as exc:  # ValueError: bad JSON or huge numbers
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    feeds = decode_inputs(body, specs)  # also checks that the body is an object
    request_id = body.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise BadRequest("'id' must be a string")
    return InferenceRequest(feeds, request_id or None, body.get("outputs"))


def encode_response(
    model_name: str, model_version: str, request_id: str, outputs: dict[str, np.ndarray]
) -> bytes:
    body = {
        "model_name": model_name,
        "model_version": model_version,
        "id": request_id,
        "outputs": encode_outputs(outputs),
    }
    return json.dumps(body, allow_nan=False, separators=(",", ":")).encode()


def output_elements(outputs: dict[str, np.ndarray]) -> int:
    return sum(int(a.size) for a in outputs.values())
