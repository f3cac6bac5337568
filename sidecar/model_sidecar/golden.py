"""The golden set's check at publish time (format: :mod:`model_rollout_contract.canary`):
a malformed ``golden.npz`` is refused before anything reaches the store, with the reason,
instead of being signed and then refused by every server that loads the version.

What is checked is what a server needs to run it: a ``.npz`` of named arrays (no
pickles), only ``input/<name>``, ``output/<name>``, ``atol`` and ``rtol``, at least one
input and one output, tolerances that are finite numbers >= 0, and — for an ONNX model —
exactly the model's inputs with its element types and compatible shapes, and outputs the
model produces."""

from __future__ import annotations

import math
import zipfile
from pathlib import Path

import numpy as np

from model_rollout_contract.canary import (
    GOLDEN_FILE,
    GOLDEN_INPUT_PREFIX,
    GOLDEN_OUTPUT_PREFIX,
    MAX_GOLDEN_BYTES,
)

from .errors import BadGolden
from .onnx_io import ModelIO, read_model_io

TOLERANCES = ("atol", "rtol")


def _read(path: Path) -> dict[str, np.ndarray]:
    try:
        size = path.stat().st_size
        if size > MAX_GOLDEN_BYTES:
            raise BadGolden(f"it has {size} bytes, more than the {MAX_GOLDEN_BYTES} allowed")
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            raise ValueError("it holds one array, not a set of named arrays (numpy.savez)")
        with loaded:
            return {name: loaded[name] for name in loaded.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise BadGolden(f"it is not a readable .npz file: {exc}") from exc


def _tolerance(arrays: dict[str, np.ndarray], key: str) -> None:
    if key not in arrays:
        return
    raw = arrays[key]
    if raw.shape != () or raw.dtype.kind not in "iuf":
        raise BadGolden(f"{key!r} must be one number, not {raw.dtype} {list(raw.shape)}")
    if not (math.isfinite(float(raw)) and float(raw) >= 0):
        raise BadGolden(f"{key!r} must be finite and not negative, not {float(raw)}")


def _against_model(
    inputs: dict[str, np.ndarray],
    outputs: dict[str, np.ndarray],
    model: ModelIO,
) -> None:
    takes, produces = model.inputs, model.outputs
    if set(inputs) != set(takes):
        raise BadGolden(f"it gives inputs {sorted(inputs)}; the model takes {sorted(takes)}")
    for name, array in inputs.items():
        spec = takes[name]
        if array.dtype != spec.dtype or not spec.accepts(array.shape):
            raise BadGolden(
                f"input {name!r} is {array.dtype} {list(array.shape)}; the model takes "
                f"{spec.dtype} {list(spec.dims)}"
            )
    unknown = sorted(set(outputs) - set(produces))
    if unknown:
        raise BadGolden(
            f"it expects outputs {unknown} that the model does not produce ({sorted(produces)})"
        )


def check_golden(path: Path, model: Path | None) -> None:
    """Refuse (:class:`~.errors.BadGolden`) a golden set a server could not run;
    ``model``: the ONNX file it goes with (``None``: an engine, not checked against)."""
    try:
        arrays = _read(path)
        for key in TOLERANCES:
            _tolerance(arrays, key)
        inputs = {
            k.removeprefix(GOLDEN_INPUT_PREFIX): v
            for k, v in arrays.items()
            if k.startswith(GOLDEN_INPUT_PREFIX)
        }
        outputs = {
            k.removeprefix(GOLDEN_OUTPUT_PREFIX): v
            for k, v in arrays.items()
            if k.startswith(GOLDEN_OUTPUT_PREFIX)
        }
        unknown = sorted(
            k
            for k in arrays
            if k not in TOLERANCES and not k.startswith((GOLDEN_INPUT_PREFIX, GOLDEN_OUTPUT_PREFIX))
        )
        if unknown or "" in inputs or "" in outputs:
            raise BadGolden(
                f"it holds arrays of no known kind: {unknown or ['input/', 'output/']} "
                f"(expected {GOLDEN_INPUT_PREFIX}<name>, {GOLDEN_OUTPUT_PREFIX}<name>, "
                "atol, rtol)"
            )
        if not inputs or not outputs:
            raise BadGolden(
                f"it needs at least one {GOLDEN_INPUT_PREFIX}<name> and one "
                f"{GOLDEN_OUTPUT_PREFIX}<name> array; it holds {sorted(arrays)}"
            )
        if model is not None:
            _against_model(inputs, outputs, read_model_io(model))
    except BadGolden as exc:
        raise BadGolden(f"--golden {path} ({GOLDEN_FILE}) refused: {exc.message}") from None
