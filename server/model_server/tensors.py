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
_V2_NAME = {"b": "BOOL", "i": "integer", "u": "unsigned integer", "f": "number"}
# JSON has no NaN or infinities: they travel as these strings, as in protobuf's JSON mapping
NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_END = object()


class _Values:
    """The values of ``data`` (flat, or nested as the shape), one at a time, each of the
    JSON type the datatype takes: no null, no other string, and no boolean for a number
    (nor a number for BOOL). Consumed by ``np.fromiter``, so no list of every value is
    ever built beside the array, and nothing past the shape's count is read."""

    def __init__(self, data: list[Any], name: str, dtype: np.dtype, shape: tuple[int, ...]):
        self.name = name
        self.kind = dtype.kind
        self.depths = {1, max(1, len(shape))}
        self.stack: list[Any] = [iter(data)]
        self.count = 0

    def __iter__(self) -> _Values:
        return self

    def __next__(self) -> Any:
        stack, name = self.stack, self.name
        while stack:
            item = next(stack[-1], _END)
            if item is _END:
                stack.pop()
            elif isinstance(item, list):
                if len(stack) > 32:
                    raise BadRequest(f"input {name!r}: 'data' is nested too deeply")
                stack.append(iter(item))
            else:
                if len(stack) not in self.depths:
                    raise BadRequest(f"input {name!r}: 'data' must be flat or nested as its shape")
                self.count += 1
                return self._value(item)
        raise StopIteration

    def _value(self, item: Any) -> Any:
        kind = self.kind
        if isinstance(item, _JSON_KINDS[kind]) and (kind == "b" or not isinstance(item, bool)):
            return item
        if kind == "f" and isinstance(item, str) and item in NON_FINITE:
            return NON_FINITE[item]
        raise BadRequest(f"input {self.name!r}: {_excerpt(item)} is not a {_V2_NAME[kind]} value")


def _excerpt(value: Any) -> str:
    text = repr(value) if not isinstance(value, list | dict) else type(value).__name__
    return text if len(text) <= 80 else text[:77] + "..."


def _array(data: list[Any], name: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    expected = math.prod(shape)
    values = _Values(data, name, dtype, shape)
    try:
        array = np.fromiter(values, dtype=dtype, count=expected)
    except ValueError as exc:
        if values.count < expected and not values.stack:  # the iterator ran dry
            raise BadRequest(
                f"input {name!r}: {values.count} values do not fill its shape"
            ) from exc
        raise BadRequest(f"input {name!r}: data is not {v2_datatype(dtype)}: {exc}") from exc
    except (TypeError, OverflowError) as exc:
        raise BadRequest(f"input {name!r}: data is not {v2_datatype(dtype)}: {exc}") from exc
    if next(values, _END) is not _END:
        raise BadRequest(f"input {name!r}: more values than its shape {list(shape)} holds")
    return array.reshape(shape)


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
        feeds[name] = _array(data, name, dtype, shape)
    missing = sorted(set(by_name) - set(feeds))
    if missing:
        raise BadRequest(f"missing inputs: {missing}")
    return feeds


def select_outputs(
    results: Mapping[str, np.ndarray], requested: Any = None
) -> dict[str, np.ndarray]:
    """The outputs a request asked for (``outputs: [{"name": …}]``), all by default."""
    if not isinstance(requested, list) or not requested:
        return dict(results)
    wanted = [o.get("name") if isinstance(o, dict) else None for o in requested]
    names = [n for n in wanted if isinstance(n, str)]
    if len(names) != len(requested):
        raise BadRequest("each requested output must be an object with a 'name' string")
    unknown = [n for n in names if n not in results]
    if unknown:
        raise BadRequest(f"unknown outputs requested: {[_excerpt(n) for n in unknown]}")
    return {n: results[n] for n in names}


def _json_data(array: np.ndarray) -> list[Any]:
    """The values as JSON can carry them: NaN and infinities as ``NON_FINITE``'s strings."""
    data: list[Any] = array.ravel().tolist()
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        data = [
            v if math.isfinite(v) else ("NaN" if v != v else "Infinity" if v > 0 else "-Infinity")
            for v in data
        ]
    return data


def encode_outputs(outputs: Mapping[str, np.ndarray]) -> list[dict[str, Any]]:
    return [
        {
            "name": name,
            "datatype": v2_datatype(array.dtype),
            "shape": list(array.shape),
            "data": _json_data(array),
        }
        for name, array in outputs.items()
    ]
