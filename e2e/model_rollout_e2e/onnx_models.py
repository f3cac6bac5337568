"""Small real ONNX models (MatMul/Add/Relu MLPs) built with ``onnx.helper``.

Used by the demo, the benchmarks and the tests; no weights are downloaded. The same
seed always gives the same weights, and :func:`reference_forward` computes what any
correct backend must answer, so a response can be attributed to exactly one version.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from model_rollout_contract.manifest import Manifest, sha256_file, sha256_file_chunked

INPUT_NAME = "input"
OUTPUT_NAME = "output"


@dataclass(frozen=True)
class MlpWeights:
    layers: tuple[tuple[np.ndarray, np.ndarray], ...]
    # a broken model: NaN outputs for inputs whose first value is above this (so that it
    # passes a warm-up on zeros, and fails on real traffic)
    nan_above: float | None = None

    @classmethod
    def random(cls, seed: int, in_dim: int, hidden: int, out_dim: int, depth: int) -> MlpWeights:
        rng = np.random.default_rng(seed)
        dims = [in_dim] + [hidden] * (depth - 1) + [out_dim]
        return cls(
            tuple(
                (
                    (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32),
                    rng.standard_normal(b).astype(np.float32) * 0.1,
                )
                for a, b in itertools.pairwise(dims)
            )
        )


def build_mlp(weights: MlpWeights) -> onnx.ModelProto:
    nodes, inits = [], []
    current = INPUT_NAME
    for i, (w, b) in enumerate(weights.layers):
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        last = i == len(weights.layers) - 1
        nodes.append(helper.make_node("MatMul", [current, f"w{i}"], [f"mm{i}"]))
        added = OUTPUT_NAME if last and weights.nan_above is None else f"add{i}"
        nodes.append(helper.make_node("Add", [f"mm{i}", f"b{i}"], [added]))
        if not last:
            nodes.append(helper.make_node("Relu", [added], [f"relu{i}"]))
            current = f"relu{i}"
    if weights.nan_above is not None:  # + 0 * sqrt(nan_above - x[:, :1]): NaN above it
        last_add = f"add{len(weights.layers) - 1}"
        inits += [
            numpy_helper.from_array(np.array([0], np.int64), "first"),
            numpy_helper.from_array(np.array([1], np.int64), "second"),
            numpy_helper.from_array(np.array([1], np.int64), "axis1"),
            numpy_helper.from_array(np.array(weights.nan_above, np.float32), "nan_above"),
            numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
        ]
        nodes += [
            helper.make_node("Slice", [INPUT_NAME, "first", "second", "axis1"], ["x0"]),
            helper.make_node("Sub", ["nan_above", "x0"], ["room"]),
            helper.make_node("Sqrt", ["room"], ["root"]),
            helper.make_node("Mul", ["root", "zero"], ["poison"]),
            helper.make_node("Add", [last_add, "poison"], [OUTPUT_NAME]),
        ]
    in_dim = weights.layers[0][0].shape[0]
    out_dim = weights.layers[-1][0].shape[1]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, ["batch", in_dim])],
        [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, ["batch", out_dim])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # readable by older runtimes too
    onnx.checker.check_model(model)
    return model


def reference_forward(weights: MlpWeights, x: np.ndarray) -> np.ndarray:
    out = x.astype(np.float32)
    for i, (w, b) in enumerate(weights.layers):
        out = out @ w + b
        if i < len(weights.layers) - 1:
            out = np.maximum(out, 0)
    if weights.nan_above is not None:
        with np.errstate(invalid="ignore"):
            out = out + 0 * np.sqrt(weights.nan_above - x[:, :1].astype(np.float32))
    return out


def write_mlp(
    path: str | Path,
    seed: int,
    in_dim: int = 8,
    hidden: int = 16,
    out_dim: int = 4,
    depth: int = 3,
    nan_above: float | None = None,
) -> MlpWeights:
    """Write an MLP to ``path`` and return its weights (for reference outputs);
    ``nan_above``: a broken one (see :class:`MlpWeights`)."""
    weights = MlpWeights.random(seed, in_dim, hidden, out_dim, depth)
    if nan_above is not None:
        weights = MlpWeights(weights.layers, nan_above)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(build_mlp(weights), str(path))
    return weights


def publish_mlp(
    root: Path, model: str, version: str, seed: int, chunk_size: int | None = None, **dims: int
) -> tuple[Path, MlpWeights]:
    """An MLP at ``root/model/version/model.onnx`` with its (unsigned) manifest beside it,
    which the server needs to check the file's digest, with its digest per ``chunk_size``
    bytes if given; ``dims``: :func:`write_mlp`'s."""
    path = root / model / version / "model.onnx"
    weights = write_mlp(path, seed, **dims)
    digest, chunks = sha256_file_chunked(path, chunk_size) if chunk_size else (None, None)
    manifest = Manifest(
        model, version, path.name, digest or sha256_file(path), path.stat().st_size,
        chunks=chunks,
    )  # fmt: skip
    (path.parent / "manifest.json").write_bytes(manifest.to_bytes())
    return path, weights
