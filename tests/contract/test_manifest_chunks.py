"""The manifest's per-chunk digests of the model file (issue 33): signed like the whole
file's, parsed strictly, and absent from the encoding of a manifest without them, so
manifests signed before them still verify."""

from __future__ import annotations

import hashlib
import io
import json
import os

import pytest

from model_rollout_contract.manifest import (
    MAX_CHUNK_SIZE,
    MIN_CHUNK_SIZE,
    Chunks,
    Manifest,
    ManifestError,
    sha256_stream_chunked,
)

MIB = 2**20
# as main encoded it before chunks existed (sorted keys, no spaces, golden and binding)
OLD = (
    b'{"builder":{"tool":"t"},"created_at":"2026-12-01T00:00:00Z","file":"model.onnx",'
    b'"golden":{"file":"golden.npz","sha256":"' + b"cd" * 32 + b'","size":3},"model":"mlp",'
    b'"precision":"fp32","sequence":7,"sha256":"' + b"ab" * 32 + b'","shapes":{"input":[8]},'
    b'"size":5,"store":"file:x","version":"v1"}'
)


def manifest_json(size: int, chunks: object) -> bytes:
    return json.dumps(
        {"model": "mlp", "version": "v1", "file": "model.onnx", "sha256": "a" * 64,
         "size": size, "chunks": chunks}
    ).encode()  # fmt: skip


def test_a_manifest_without_chunks_encodes_to_its_old_signed_bytes() -> None:
    manifest = Manifest.from_bytes(OLD)
    assert manifest.chunks is None
    assert manifest.to_bytes() == OLD
    assert b"chunks" not in Manifest("mlp", "v1", "model.onnx", "a" * 64, 5).to_bytes()
    # null is absent too
    assert Manifest.from_bytes(manifest_json(5, None)).chunks is None


def test_chunks_are_each_chunk_s_digest_and_round_trip() -> None:
    data = os.urandom(2 * MIB + 3)
    whole, chunks = sha256_stream_chunked(io.BytesIO(data), MIB)
    assert whole == hashlib.sha256(data).hexdigest()
    assert chunks == Chunks(MIB, tuple(
        hashlib.sha256(data[i : i + MIB]).hexdigest() for i in (0, MIB, 2 * MIB)
    ))  # fmt: skip
    assert chunks.span(2, len(data)) == (2 * MIB, 2 * MIB + 3)
    manifest = Manifest("mlp", "v1", "model.onnx", whole, len(data), chunks=chunks)
    assert Manifest.from_bytes(manifest.to_bytes()) == manifest
    assert manifest.chunks_of(manifest.files()[0]) == chunks


@pytest.mark.parametrize("size", [0, MIB, MIB + 1, 5 * MIB])
def test_an_exact_multiple_has_no_empty_last_chunk(size: int) -> None:
    _, chunks = sha256_stream_chunked(io.BytesIO(b"\1" * size), MIB)
    assert len(chunks.sha256) == -(-size // MIB)
    Manifest.from_bytes(manifest_json(size, {"size": MIB, "sha256": list(chunks.sha256)}))


@pytest.mark.parametrize(
    ("size", "chunks", "wanted"),
    [
        (5, [], "an object or null"),
        (5, {"size": MIB}, "exactly size and sha256"),
        (5, {"size": MIB, "sha256": ["a" * 64], "extra": 1}, "exactly size and sha256"),
        (5, {"size": MIB // 2, "sha256": ["a" * 64]}, "power of two"),
        (5, {"size": 2 * MAX_CHUNK_SIZE, "sha256": ["a" * 64]}, "power of two"),
        (5, {"size": 3 * MIB, "sha256": ["a" * 64]}, "power of two"),
        (5, {"size": True, "sha256": ["a" * 64]}, "power of two"),
        (5, {"size": float(MIB), "sha256": ["a" * 64]}, "power of two"),
        (5, {"size": MIB, "sha256": ["A" * 64]}, "lowercase hex"),
        (5, {"size": MIB, "sha256": ["a" * 63]}, "lowercase hex"),
        (5, {"size": MIB, "sha256": "a" * 64}, "lowercase hex"),
        (5, {"size": MIB, "sha256": []}, "has 0 sha256"),
        (5, {"size": MIB, "sha256": ["a" * 64] * 2}, "has 2 sha256"),
        (MIB + 1, {"size": MIB, "sha256": ["a" * 64]}, "has 2"),
        (0, {"size": MIB, "sha256": ["a" * 64]}, "has 0"),
    ],
)
def test_bad_chunks_are_not_a_manifest(size: int, chunks: object, wanted: str) -> None:
    with pytest.raises(ManifestError, match=wanted):
        Manifest.from_bytes(manifest_json(size, chunks))


def test_the_chunk_size_bounds_are_accepted() -> None:
    for chunk in (MIN_CHUNK_SIZE, MAX_CHUNK_SIZE):
        parsed = Manifest.from_bytes(manifest_json(5, {"size": chunk, "sha256": ["b" * 64]}))
        assert parsed.chunks == Chunks(chunk, ("b" * 64,))
