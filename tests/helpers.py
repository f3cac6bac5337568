"""Helpers shared by the test modules: model repositories and v2 request bodies."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from model_rollout_contract.manifest import Manifest, sha256_file
from model_rollout_e2e.loadgen import v2_body
from model_rollout_e2e.onnx_models import INPUT_NAME, MlpWeights, reference_forward, write_mlp

IN_DIM = 8


@dataclass
class Version:
    name: str
    path: Path
    weights: MlpWeights
    sha256: str

    def expected(self, x: np.ndarray) -> np.ndarray:
        return reference_forward(self.weights, x)


def add_version(
    root: Path, model: str, version: str, seed: int, manifest: bool = True, **dims: int
) -> Version:
    path = root / model / version / "model.onnx"
    weights = write_mlp(path, seed, in_dim=IN_DIM, **dims)
    digest = sha256_file(path)
    if manifest:
        m = Manifest(
            model=model.split("/")[-1],
            version=version,
            file="model.onnx",
            sha256=digest,
            size=path.stat().st_size,
        )
        (path.parent / "manifest.json").write_bytes(m.to_bytes())
    return Version(version, path, weights, digest)


def infer_body(x: np.ndarray) -> dict[str, Any]:
    return v2_body(x, INPUT_NAME)


def output_of(response_json: dict[str, Any]) -> np.ndarray:
    out = response_json["outputs"][0]
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def which_version(versions: dict[str, Version], x: np.ndarray, answer: dict[str, Any]) -> str:
    """The version whose reference output the answer matches; asserts it is the claimed one."""
    got = output_of(answer)
    matches = [n for n, v in versions.items() if np.allclose(got, v.expected(x), atol=1e-4)]
    assert matches == [answer["model_version"]], (
        f"answer claims {answer['model_version']} but matches {matches}: {json.dumps(answer)[:200]}"
    )
    return matches[0]
