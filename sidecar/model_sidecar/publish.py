"""Publish a signed model version to a store (the release side of the pipeline).

The signed manifest binds the store (:attr:`~model_rollout_contract.layout.StoreUrl.
scope`), the model, the version and a publish sequence. A version already published is
not overwritten unless ``force`` is given; its new sequence is then above the old one,
so sidecars that accepted the old build take the new one and never go back.

The sequence is ``max(now in nanoseconds, the store's current sequence + 1)``: it grows
with every publish even when the version was deleted from the store in between (the
clock), and even when this machine's clock is behind the last publisher's (the +1).

With ``golden`` (a golden set, :mod:`.golden` checks it first) the manifest names
``golden.npz`` with its digest and size, so the signature covers it too.

The manifest holds the model file's sha256 per ``chunk_size`` bytes beside its whole-file
sha256 (both from one read of the file), so a server may verify it on several threads.

A store writes one object at a time. A new version's manifest goes last: its presence
marks the version complete. A replaced version's manifest and signature go *first*, so
that a fetch between the writes meets a manifest written moments ago that does not match
the old model (or golden set) yet — which the fetcher knows to try again (``publish_in_progress``,
:mod:`.publish_window`) — never the old manifest beside the new model, which it would
have to refuse.
"""

from __future__ import annotations

import getpass
import platform
import time
from pathlib import Path

from model_rollout_contract.canary import GOLDEN_FILE
from model_rollout_contract.layout import object_key
from model_rollout_contract.manifest import (
    DEFAULT_CHUNK_SIZE,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    MODEL_FILE_NAMES,
    SIGNATURE_NAME,
    FileRef,
    Manifest,
    ManifestError,
    sha256_file,
    sha256_file_chunked,
)
from model_rollout_contract.names import check_model_key, check_name

from .errors import ObjectMissing, PublishRefused
from .golden import check_golden
from .onnx_io import read_model_io
from .signing import load_private_key, sign
from .store import ModelStore, read_object


def published_sequence(store: ModelStore, model: str, version: str) -> int | None:
    """The publish sequence of the version in the store: ``None`` when it is not
    published, 0 when its manifest names none (or is not a manifest at all)."""
    try:
        data = read_object(store, object_key(model, version, MANIFEST_NAME), MAX_MANIFEST_BYTES)
    except ObjectMissing:
        return None
    try:
        return Manifest.from_bytes(data).sequence or 0
    except ManifestError:
        return 0


def publish(
    store: ModelStore,
    model: str,
    version: str,
    file: Path,
    key_path: Path,
    precision: str = "fp32",
    *,
    force: bool = False,
    golden: Path | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Manifest:
    """Raises ``BadGolden`` (before anything is written) for a golden set a server could
    not run, ``PublishRefused`` for a version published already (without ``force``)."""
    check_model_key(model)  # a tenant's model is published under its tenant's prefix
    check_name("version", version)
    name = "model.onnx" if file.suffix == ".onnx" else "model.engine"
    assert name in MODEL_FILE_NAMES
    if golden is not None:
        check_golden(golden, file if name == "model.onnx" else None)
    existing = published_sequence(store, model, version)
    if existing is not None and not force:
        raise PublishRefused(
            f"{model}:{version} is published already in {store.description}; "
            "pass --force to replace it (a version is normally never changed)"
        )
    digest, chunks = sha256_file_chunked(file, chunk_size)
    manifest = Manifest(
        model=model,
        version=version,
        file=name,
        sha256=digest,
        size=file.stat().st_size,
        precision=precision,
        shapes=read_model_io(file).shapes() if name == "model.onnx" else {},
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        builder={
            "host": platform.node(),
            "user": getpass.getuser(),
            "tool": "model-sidecar publish",
        },
        store=store.scope,
        sequence=max(time.time_ns(), (existing or 0) + 1),
        golden=(
            FileRef(GOLDEN_FILE, sha256_file(golden), golden.stat().st_size) if golden else None
        ),
        chunks=chunks,
    )
    data = manifest.to_bytes()
    signature = sign(load_private_key(key_path), data)
    manifest_key = object_key(model, version, MANIFEST_NAME)
    signature_key = object_key(model, version, SIGNATURE_NAME)
    payload = [(object_key(model, version, name), file)]
    if golden is not None:
        payload.append((object_key(model, version, GOLDEN_FILE), golden))
    if existing is None:  # new: the manifest last, its presence marks the version complete
        for key, path in payload:
            store.upload(key, path)
        store.write(signature_key, signature)
        store.write(manifest_key, data)
    else:  # replaced: the new manifest first (see above), the new files last
        store.write(manifest_key, data)
        store.write(signature_key, signature)
        for key, path in reversed(payload):
            store.upload(key, path)
    return manifest
