"""Publish a signed model version to a store (the release side of the pipeline)."""

from __future__ import annotations

import getpass
import platform
import time
from pathlib import Path

import onnx

from model_rollout_contract.layout import object_key
from model_rollout_contract.manifest import (
    MANIFEST_NAME,
    MODEL_FILE_NAMES,
    SIGNATURE_NAME,
    Manifest,
    sha256_file,
)
from model_rollout_contract.names import check_name

from .signing import load_private_key, sign
from .store import ModelStore


def onnx_shapes(path: Path) -> dict[str, list[int | str]]:
    model = onnx.load(str(path), load_external_data=False)
    shapes: dict[str, list[int | str]] = {}
    for value in list(model.graph.input) + list(model.graph.output):
        dims = value.type.tensor_type.shape.dim
        shapes[value.name] = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in dims]
    initializers = {init.name for init in model.graph.initializer}
    return {k: v for k, v in shapes.items() if k not in initializers}


def publish(
    store: ModelStore, model: str, version: str, file: Path, key_path: Path, precision: str = "fp32"
) -> Manifest:
    check_name("model", model)
    check_name("version", version)
    name = "model.onnx" if file.suffix == ".onnx" else "model.engine"
    assert name in MODEL_FILE_NAMES
    manifest = Manifest(
        model=model,
        version=version,
        file=name,
        sha256=sha256_file(file),
        size=file.stat().st_size,
        precision=precision,
        shapes=onnx_shapes(file) if name == "model.onnx" else {},
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        builder={
            "host": platform.node(),
            "user": getpass.getuser(),
            "tool": "model-sidecar publish",
        },
    )
    data = manifest.to_bytes()
    signature = sign(load_private_key(key_path), data)
    # the manifest goes last: its presence marks the version as complete
    store.upload(object_key(model, version, name), file)
    store.write(object_key(model, version, SIGNATURE_NAME), signature)
    store.write(object_key(model, version, MANIFEST_NAME), data)
    return manifest
