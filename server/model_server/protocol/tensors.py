"""KServe v2 (open inference protocol) tensors <-> numpy arrays, with validation.

Every form a tensor arrives in (JSON ``data``, binary data after an HTTP body's JSON
header, a gRPC request's contents) goes through the same checks here: the name is one
of the model's inputs, given once; the datatype is the model's; the shape fits the
model's and counts at most ``MAX_ELEMENTS`` values; the values are of the datatype's
kind and exactly fill the shape."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from model_server.errors import BadRequest
from model_server.protocol.tensor_spec import TensorSpec

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
    "BYTES": np.dtype(object),  # each element a ``bytes`` object
}
_NUMPY_TO_V2 = {dtype: name for name, dtype in _V2_TO_NUMPY.items()}
# Triton's model configuration names (model_config.proto's DataType) of the v2 datatypes
_CONFIG_TYPES = {name: f"TYPE_{name}" for name in _V2_TO_NUMPY} | {"BYTES": "TYPE_STRING"}
MAX_ELEMENTS = 16 * 1024 * 1024


def v2_datatype(dtype: np.dtype) -> str:
    return _NUMPY_TO_V2.get(np.dtype(dtype), "BYTES")


def config_datatype(dtype: np.dtype) -> str:
    """The datatype as Triton's model configuration names it (``TYPE_FP32``)."""
    return _CONFIG_TYPES[v2_datatype(dtype)]


def numpy_dtype(datatype: Any, name: str) -> np.dtype:
    """The numpy dtype of a v2 datatype name; anything else is a ``BadRequest``."""
    dtype = _V2_TO_NUMPY.get(datatype) if isinstance(datatype, str) else None
    if dtype is None:
        raise BadRequest(f"input {name!r}: unsupported datatype {_excerpt(datatype)}")
    return dtype


def spec_to_json(spec: TensorSpec) -> dict[str, Any]:
    return {"name": spec.name, "datatype": v2_datatype(spec.dtype), "shape": list(spec.shape)}


def parse_shape(raw: Any, name: str) -> tuple[int, ...]:
    if not isinstance(raw, list | tuple) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in raw
    ):
        raise BadRequest(f"input {name!r}: 'shape' must be a list of non-negative integers")
    shape = tuple(raw)
    if math.prod(shape) > MAX_ELEMENTS:  # Python integers: no overflow, no wrap to 0
        raise BadRequest(f"input {name!r}: more than {MAX_ELEMENTS} elements")
    return shape


class InputChecker:
    """The checks every input gets, whatever form its values come in: a known name, given
    once, the model's datatype, a shape that fits, the same size as the inputs before it
    for each named dynamic axis they share (``TensorSpec.symbols``: else the runtime
    fails mid-graph, a 500 that was the client's mistake); and that none is missing at
    the end."""

    def __init__(self, specs: tuple[TensorSpec, ...]) -> None:
        self.by_name = {spec.name: spec for spec in specs}
        self.seen: set[str] = set()
        self.sizes: dict[str, tuple[int, str]] = {}  # a named axis: its size, and whose

    def check(self, name: Any, datatype: Any, shape: Any) -> tuple[np.dtype, tuple[int, ...]]:
        """The dtype and shape of input ``name``, checked against the model's spec."""
        if not isinstance(name, str):
            raise BadRequest("each input must be an object with a 'name'")
        spec = self.by_name.get(name)
        if spec is None:
            expected = sorted(self.by_name)
            raise BadRequest(f"unknown input {_excerpt(name)}; model expects {expected}")
        if name in self.seen:
            raise BadRequest(f"input {name!r} given twice")
        self.seen.add(name)
        dtype = numpy_dtype(datatype, name)
        if dtype != spec.dtype:
            raise BadRequest(
                f"input {name!r}: datatype {datatype} does not match model's "
                f"{v2_datatype(spec.dtype)}"
            )
        checked = parse_shape(shape, name)
        if not spec.accepts_shape(checked):
            raise BadRequest(
                f"input {name!r}: shape {list(checked)} does not fit model shape {list(spec.shape)}"
            )
        self._check_symbols(spec, checked)
        return dtype, checked

    def _check_symbols(self, spec: TensorSpec, shape: tuple[int, ...]) -> None:
        for symbol, size in zip(spec.symbols, shape, strict=False):
            if symbol is None:
                continue
            first = self.sizes.setdefault(symbol, (size, spec.name))
            if first[0] != size:
                raise BadRequest(
                    f"inputs {first[1]!r} and {spec.name!r} share the model's axis "
                    f"{symbol!r} but give it sizes {first[0]} and {size}"
                )

    def finish(self) -> None:
        missing = sorted(set(self.by_name) - self.seen)
        if missing:
            raise BadRequest(f"missing inputs: {missing}")


_JSON_KINDS: dict[str, tuple[type, ...]] = {
    "b": (bool,),
    "i": (int,),
    "u": (int,),
    "f": (int, float),
    "O": (str,),
}
_V2_NAME = {"b": "BOOL", "i": "integer", "u": "unsigned integer", "f": "number", "O": "string"}
# JSON has no NaN or infinities: they travel as these strings, as in protobuf's JSON mapping
NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_END = object()


class _Values:
    """The values of ``data`` (flat, or nested as the shape), one at a time, each of the
    JSON type the datatype takes: no null, no other string, and no boolean for a number
    (nor a number for BOOL). Consumed by ``np.fromiter``, so no list of every value is
    ever built beside the array; one value past the shape's count is refused, nothing
    further is read."""

    def __init__(self, data: list[Any], name: str, dtype: np.dtype, shape: tuple[int, ...]):
        self.name = name
        self.kind = dtype.kind
        self.depths = {1, max(1, len(shape))}
        self.stack: list[Any] = [iter(data)]
        self.count = 0
        self.shape = shape
        self.limit = math.prod(shape)

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
                if self.count == self.limit:
                    raise BadRequest(
                        f"input {name!r}: more values than its shape {list(self.shape)} holds"
                    )
                self.count += 1
                return self._value(item)
        raise StopIteration

    def _value(self, item: Any) -> Any:
        kind = self.kind
        if isinstance(item, _JSON_KINDS[kind]) and (kind == "b" or not isinstance(item, bool)):
            return item.encode() if isinstance(item, str) else item  # BYTES: UTF-8
        if kind == "f" and isinstance(item, str) and item in NON_FINITE:
            return NON_FINITE[item]
        raise BadRequest(f"input {self.name!r}: {_excerpt(item)} is not a {_V2_NAME[kind]} value")


def _excerpt(value: Any) -> str:
    text = repr(value) if not isinstance(value, list | dict) else type(value).__name__
    return text if len(text) <= 80 else text[:77] + "..."


# the exact Python types (``type(v) in``, so no bool for a number) a flat ``data`` list of
# each kind may hold for numpy to convert it at once; any other list takes ``_Values``
_FAST_TYPES: dict[str, frozenset[type]] = {
    "b": frozenset({bool}),
    "i": frozenset({int}),
    "u": frozenset({int}),
    "f": frozenset({int, float}),
}


def _fast_array(data: list[Any], dtype: np.dtype, expected: int) -> np.ndarray | None:
    """A flat list of plain numbers (the common case) converted by numpy in one call:
    about seven times faster than value by value. ``None``: not that case."""
    allowed = _FAST_TYPES.get(dtype.kind)
    if allowed is None or len(data) != expected or not set(map(type, data)) <= allowed:
        return None
    return np.array(data, dtype=dtype)


def _array(data: list[Any], name: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    expected = math.prod(shape)
    try:
        fast = _fast_array(data, dtype, expected)
    except (OverflowError, ValueError) as exc:  # an integer outside the datatype's range
        raise BadRequest(f"input {name!r}: data is not {v2_datatype(dtype)}: {exc}") from exc
    if fast is not None:
        return fast.reshape(shape)
    values = _Values(data, name, dtype, shape)
    try:  # no count: the array grows with the values there are, not to what the shape says
        array = np.fromiter(values, dtype=dtype)
    except (ValueError, TypeError, OverflowError) as exc:
        raise BadRequest(f"input {name!r}: data is not {v2_datatype(dtype)}: {exc}") from exc
    if values.count < expected:
        raise BadRequest(f"input {name!r}: {values.count} values do not fill its shape")
    return array.reshape(shape)


@dataclass(frozen=True)
class BinaryInput:
    """An input whose values follow the body's JSON header as binary data (the binary
    tensor data extension): checked like any input, its bytes still to be read."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    size: int  # its ``binary_data_size``: the bytes it takes in the body


@dataclass(frozen=True)
class DecodedInputs:
    feeds: dict[str, np.ndarray]  # the inputs given as JSON ``data``
    binary: tuple[BinaryInput, ...] = ()  # the others, in the order their bytes follow


def parameters_of(item: Mapping[str, Any], what: str) -> dict[str, Any]:
    """A body's (or tensor's) ``parameters`` object, ``{}`` when absent."""
    parameters = item.get("parameters", {})
    if not isinstance(parameters, dict):
        raise BadRequest(f"{what}: 'parameters' must be an object")
    return parameters


def _binary_size(parameters: dict[str, Any], name: str) -> int | None:
    if "shared_memory_region" in parameters:
        raise BadRequest(f"input {name!r}: the shared-memory extension is not supported")
    size = parameters.get("binary_data_size")
    if size is None:
        return None
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise BadRequest(f"input {name!r}: 'binary_data_size' must be a non-negative integer")
    return size


def decode_input_list(body: Any, specs: tuple[TensorSpec, ...]) -> DecodedInputs:
    """The inputs of a v2 request body, checked against ``specs``: JSON ``data`` turned
    into arrays, binary ones described (with their declared sizes checked where the
    datatype has a fixed size) for :mod:`.binary_codec` to read."""
    if not isinstance(body, dict) or not isinstance(body.get("inputs"), list):
        raise BadRequest("request body must be a JSON object with an 'inputs' list")
    checker = InputChecker(specs)
    feeds: dict[str, np.ndarray] = {}
    binary: list[BinaryInput] = []
    for item in body["inputs"]:
        if not isinstance(item, dict):
            raise BadRequest("each input must be an object with a 'name'")
        name = item.get("name")
        dtype, shape = checker.check(name, item.get("datatype"), item.get("shape"))
        assert isinstance(name, str)  # checked
        size = _binary_size(parameters_of(item, f"input {name!r}"), name)
        data = item.get("data")
        if size is not None:
            if data is not None:
                raise BadRequest(f"input {name!r}: 'data' and 'binary_data_size' both given")
            expected = math.prod(shape) * dtype.itemsize
            if dtype.kind != "O" and size != expected:
                raise BadRequest(
                    f"input {name!r}: binary_data_size {size} does not match its shape "
                    f"{list(shape)} of {v2_datatype(dtype)} ({expected} bytes)"
                )
            binary.append(BinaryInput(name, dtype, shape, size))
            continue
        if not isinstance(data, list):
            raise BadRequest(f"input {name!r}: 'data' must be a list")
        feeds[name] = _array(data, name, dtype, shape)
    checker.finish()
    return DecodedInputs(feeds, tuple(binary))


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


def _text(value: Any, name: str) -> str:
    try:
        return value.decode() if isinstance(value, bytes) else str(value)
    except UnicodeDecodeError:
        raise BadRequest(
            f"output {name!r} holds bytes that are not UTF-8, which JSON cannot carry: ask "
            "for it as binary data"
        ) from None


def _json_data(array: np.ndarray, name: str) -> np.ndarray | list[Any]:
    """The values as JSON can carry them, flat: a finite numeric array as itself (orjson
    writes numpy arrays natively), NaN and infinities as ``NON_FINITE``'s strings, BYTES
    elements as UTF-8 text."""
    flat = np.ascontiguousarray(array).reshape(-1)
    if flat.dtype.kind == "O":
        return [_text(v, name) for v in flat.tolist()]
    if flat.dtype.kind == "f" and not np.isfinite(flat).all():
        return [
            v if math.isfinite(v) else ("NaN" if v != v else "Infinity" if v > 0 else "-Infinity")
            for v in flat.tolist()
        ]
    if not flat.dtype.isnative:
        flat = flat.astype(flat.dtype.newbyteorder("="))
    return flat


@dataclass(frozen=True)
class BinaryOutput:
    """An output answered as binary data after the response's JSON, as the JSON
    describes it."""

    datatype: str
    shape: tuple[int, ...]
    size: int  # its ``binary_data_size``


def encode_outputs(outputs: Mapping[str, np.ndarray | BinaryOutput]) -> list[dict[str, Any]]:
    """The ``outputs`` of a v2 response: arrays with their ``data``, binary ones with
    their ``binary_data_size`` (their bytes follow the JSON, in this order)."""
    encoded = []
    for name, output in outputs.items():
        if isinstance(output, BinaryOutput):
            encoded.append(
                {
                    "name": name,
                    "datatype": output.datatype,
                    "shape": list(output.shape),
                    "parameters": {"binary_data_size": output.size},
                }
            )
        else:
            encoded.append(
                {
                    "name": name,
                    "datatype": v2_datatype(output.dtype),
                    "shape": list(output.shape),
                    "data": _json_data(output, name),
                }
            )
    return encoded
