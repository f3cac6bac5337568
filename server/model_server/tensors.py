"""KServe v2 (open inference protocol) tensors <-> numpy arrays, with validation."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .backends.base import TensorSpec
from .errors import BadRequest

_V2_TO_NUMPY: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
}
_NUMPY_TO_V2 = {dtype: name for name, dtype in _V2_TO_NUMPY.items()}
MAX_ELEMENTS = 16 * 1024 * 1024


def v2_datatype(dtype: np.dtype) -> str:
    return _NUMPY_TO_V2.get(np.dtype(dtype), "BYTES")


def spec_to_json(spec: TensorSpec) -> dict[str, Any]:
    return {"name": spec.name, "datatype": v2_datatype(spec.dtype), "shape": list(spec.shape)}


def _parse_shape(raw: Any, name: str) -> tuple[int, ...]:
    if not isinstance(raw, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in raw
    ):
        raise BadRequest(f"input {name!r}: 'shape' must be a list of non-negative integers")
    shape = tuple(raw)
    if math.prod(shape) > MAX_ELEMENTS:  # Python integers: no overflow, no wrap to 0
        raise BadRequest(f"input {name!r}: more than {MAX_ELEMENTS} elements")
    return shape


_JSON_KINDS: dict[str, tuple[type, ...]] = {
    "b": (bool,),
    "i": (int,),
    "u": (int,),
    "f": (int, float),
}


def _flat_values(data: list[Any], name: str, dtype: np.dtype, shape: tuple[int, ...]) -> list[Any]:
    """The values of ``data`` (flat, or nested as the shape), each of the JSON type the
    datatype takes: no null, no string, and no boolean for a number (nor a number for
    BOOL). Counted while flattening, so a huge body never becomes a huge array first."""
    kinds = _JSON_KINDS[dtype.kind]
    expected, depths = math.prod(shape), {1, max(1, len(shape))}
    values: list[Any] = []
    stack: list[Any] = [iter(data)]
    while stack:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
        elif isinstance(item, list):
            if len(stack) > 32:
                raise BadRequest(f"input {name!r}: 'data' is nested too deeply")
            stack.append(iter(item))
        elif isinstance(item, kinds) and (dtype.kind == "b" or not isinstance(item, bool)):
            if len(stack) not in depths:
                raise BadRequest(f"input {name!r}: 'data' must be flat or nested as {list(shape)}")
            values.append(item)
            if len(values) > expected:
                break
        else:
            raise BadRequest(f"input {name!r}: {item!r} is not a {_V2_NAME[dtype.kind]} value")
    if len(values) != expected:
        raise BadRequest(f"input {name!r}: {len(values)} values do not fill its shape")
    return values


_END = object()
_V2_NAME = {"b": "BOOL", "i": "integer", "u": "unsigned integer", "f": "number"}


def decode_inputs(body: Any, specs: tuple[TensorSpec, ...]) -> dict[str, np.ndarray]:
    """Turn a v2 request body into feeds, checking names, dtypes and shapes."""
    if not isinstance(body, dict) or not isinstance(body.get("inputs"), list):
        raise BadRequest("request body must be a JSON object with an 'inputs' list")
    by_name = {spec.name: spec for spec in specs}
    feeds: dict[str, np.ndarray] = {}
    for item in body["inputs"]:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise BadRequest("each input must be an object with a 'name'")
        name = item["name"]
        spec = by_name.get(name)
        if spec is None:
            raise BadRequest(f"unknown input {name!r}; model expects {sorted(by_name)}")
        if name in feeds:
            raise BadRequest(f"input {name!r} given twice")
        datatype = item.get("datatype")
        dtype = _V2_TO_NUMPY.get(datatype) if isinstance(datatype, str) else None
        if dtype is None:
            raise BadRequest(f"input {name!r}: unsupported datatype {datatype!r}")
        if dtype != spec.dtype:
            raise BadRequest(
                f"input {name!r}: datatype {datatype} does not match model's "
                f"{v2_datatype(spec.dtype)}"
            )
        shape = _parse_shape(item.get("shape"), name)
        if not spec.accepts_shape(shape):
            raise BadRequest(
                f"input {name!r}: shape {list(shape)} does not fit model shape {list(spec.shape)}"
            )
        data = item.get("data")
        if not isinstance(data, list):
            raise BadRequest(f"input {name!r}: 'data' must be a list")
        values = _flat_values(data, name, dtype, shape)
        try:
            array = np.asarray(values, dtype=dtype)
        except (TypeError, ValueError, OverflowError) as exc:
            raise BadRequest(f"input {name!r}: data is not {datatype}: {exc}") from exc
        feeds[name] = array.reshape(shape)
    missing = sorted(set(by_name) - set(feeds))
    if missing:
        raise BadRequest(f"missing inputs: {missing}")
    return feeds


def encode_outputs(
    results: Mapping[str, np.ndarray], requested: Any = None
) -> list[dict[str, Any]]:
    names = list(results)
    if isinstance(requested, list) and requested:
        wanted = [o.get("name") for o in requested if isinstance(o, dict)]
        if not all(isinstance(n, str) for n in wanted):
            raise BadRequest("each requested output must be an object with a 'name' string")
        unknown = [n for n in wanted if n not in results]
        if unknown:
            raise BadRequest(f"unknown outputs requested: {unknown}")
        names = [str(n) for n in wanted]
    return [
        {
            "name": name,
            "datatype": v2_datatype(results[name].dtype),
            "shape": list(results[name].shape),
            "data": results[name].ravel().tolist(),
        }
        for name in names
    ]
