"""A version's golden set (``golden.npz``, format in :mod:`model_rollout_contract.canary`):
inputs and the outputs the version must answer to them, within ``numpy.allclose``'s
tolerance. Run after the warm-up and before the swap, so a version that loads and
answers, but answers wrongly, is refused (422 ``golden_mismatch``) and the serving one
goes on. The file is read with the model (same trusted directory, digest checked against
the manifest) by :mod:`.load_pipeline`; this module only parses and checks it."""

from __future__ import annotations

import io
import math
import zipfile
from dataclasses import dataclass

import numpy as np

from model_rollout_contract.canary import (
    GOLDEN_DEFAULT_ATOL,
    GOLDEN_DEFAULT_RTOL,
    GOLDEN_FILE,
    GOLDEN_INPUT_PREFIX,
    GOLDEN_OUTPUT_PREFIX,
)
from model_server.backends.base import Engine
from model_server.errors import GoldenMismatch, LoadRefused
from model_server.protocol.tensors import v2_datatype


def _tolerance(arrays: dict[str, np.ndarray], key: str, default: float) -> float:
    if key not in arrays:
        return default
    raw = arrays.pop(key)
    if raw.shape != () or raw.dtype.kind not in "iuf":
        raise LoadRefused(f"{GOLDEN_FILE}: {key!r} must be a number, not {raw.dtype} {raw.shape}")
    value = float(raw)
    if not math.isfinite(value) or value < 0:
        raise LoadRefused(f"{GOLDEN_FILE}: {key!r} must be finite and not negative, not {value}")
    return value


@dataclass(frozen=True)
class GoldenSet:
    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]
    atol: float = GOLDEN_DEFAULT_ATOL
    rtol: float = GOLDEN_DEFAULT_RTOL

    @classmethod
    def from_bytes(cls, data: bytes) -> GoldenSet:
        """Parse ``golden.npz`` (no pickles: object arrays are refused)."""
        try:
            loaded = np.load(io.BytesIO(data), allow_pickle=False)
            if not isinstance(loaded, np.lib.npyio.NpzFile):
                raise ValueError("it holds one array, not a set of named arrays")
            with loaded:
                arrays = {name: loaded[name] for name in loaded.files}
        except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
            raise LoadRefused(f"{GOLDEN_FILE} is not a readable .npz file: {exc}") from exc
        atol = _tolerance(arrays, "atol", GOLDEN_DEFAULT_ATOL)
        rtol = _tolerance(arrays, "rtol", GOLDEN_DEFAULT_RTOL)
        inputs, outputs, unknown = {}, {}, []
        for name, array in arrays.items():
            if name.startswith(GOLDEN_INPUT_PREFIX):
                inputs[name.removeprefix(GOLDEN_INPUT_PREFIX)] = array
            elif name.startswith(GOLDEN_OUTPUT_PREFIX):
                outputs[name.removeprefix(GOLDEN_OUTPUT_PREFIX)] = array
            else:
                unknown.append(name)
        if unknown:
            raise LoadRefused(
                f"{GOLDEN_FILE} holds arrays of no known kind: {sorted(unknown)} (expected "
                f"{GOLDEN_INPUT_PREFIX}<name>, {GOLDEN_OUTPUT_PREFIX}<name>, atol, rtol)"
            )
        if not inputs or not outputs:
            raise LoadRefused(f"{GOLDEN_FILE} needs at least one input and one output")
        return cls(inputs, outputs, atol, rtol)

    def _check_inputs(self, engine: Engine) -> None:
        specs = {spec.name: spec for spec in engine.inputs}
        if set(specs) != set(self.inputs):
            raise LoadRefused(
                f"{GOLDEN_FILE} gives inputs {sorted(self.inputs)}; the model takes {sorted(specs)}"
            )
        for name, array in self.inputs.items():
            spec = specs[name]
            if array.dtype != spec.dtype or not spec.accepts_shape(array.shape):
                raise LoadRefused(
                    f"{GOLDEN_FILE}: input {name!r} is {v2_datatype(array.dtype)} "
                    f"{list(array.shape)}; the model takes {v2_datatype(spec.dtype)} "
                    f"{list(spec.shape)}"
                )
        produced = {spec.name for spec in engine.outputs}
        missing = sorted(set(self.outputs) - produced)
        if missing:
            raise LoadRefused(
                f"{GOLDEN_FILE} expects outputs {missing} that the model does not produce "
                f"({sorted(produced)})"
            )

    def check(self, engine: Engine, what: str) -> None:
        """Run the inputs on ``engine``; refuse (``GoldenMismatch``) if an output is
        outside the tolerance, saying by how much at worst."""
        try:
            self._check_inputs(engine)
        except LoadRefused as exc:
            raise LoadRefused(f"{what}: {exc.message}") from None
        try:
            answers = engine.infer(self.inputs)
        except Exception as exc:  # the runtime can raise anything
            raise LoadRefused(f"{what} failed to run its golden inputs: {exc}") from exc
        for name, expected in self.outputs.items():
            got = np.asarray(answers.get(name))
            problem = self._difference(got, expected)
            if problem:
                raise GoldenMismatch(
                    f"{what} fails its golden set: output {name!r} {problem} "
                    f"(atol {self.atol:g}, rtol {self.rtol:g})"
                )

    def _difference(self, got: np.ndarray, expected: np.ndarray) -> str | None:
        """None if ``got`` is within tolerance of ``expected``; else what is worst."""
        if got.shape != expected.shape:
            return f"has shape {list(got.shape)}, expected {list(expected.shape)}"
        if got.dtype.kind not in "biuf" or expected.dtype.kind not in "biuf":
            return None if np.array_equal(got, expected) else "differs from the expected"
        a, b = got.astype(np.float64), expected.astype(np.float64)
        if np.allclose(a, b, atol=self.atol, rtol=self.rtol, equal_nan=True):
            return None
        with np.errstate(invalid="ignore"):
            excess = np.asarray(np.abs(a - b) - (self.atol + self.rtol * np.abs(b)))
        excess[np.isnan(excess)] = np.inf  # NaN where a number was expected, or the reverse
        excess[(a == b) | (np.isnan(a) & np.isnan(b))] = -np.inf  # as allclose: equal
        worst = np.unravel_index(int(np.argmax(excess)), excess.shape)
        outside = int(np.count_nonzero(excess > 0))
        where = [int(i) for i in worst]
        return (
            f"differs by up to {abs(a[worst] - b[worst]):.6g}: {a[worst]:.6g} at {where} where "
            f"{b[worst]:.6g} was expected; {outside} of {a.size} values outside"
        )
