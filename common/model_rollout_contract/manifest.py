"""The per-version manifest: what the store holds, the sidecar verifies (Ed25519 over its
exact bytes) and the server checks again before loading.

A version directory, in the store and on the pod's volume (Triton-style)::

    <model>/<version>/model.onnx | model.engine | model.plan
    <model>/<version>/manifest.json   (uploaded last: its presence marks a complete version)
    <model>/<version>/manifest.sig    (Ed25519 over manifest.json's bytes)

Besides the model file's digest and size, a signed manifest binds *where* and *which
build*: ``store`` (the store it was published to, :attr:`.layout.StoreUrl.scope`) and
``sequence`` (a publish sequence that grows with every publish of the same version), so
that a signed manifest copied into another team's prefix, or an older signed build of the
same version, can be told apart. Both are optional in the format, so manifests written
before them still parse (the server reads them); the sidecar refuses a signed manifest
that lacks them.

``golden`` (optional) names the version's golden set (:mod:`.canary`'s format), stored
beside the model as ``golden.npz``: ``{"file": "golden.npz", "sha256": ..., "size": ...}``.
The signature covers it, so the golden set is verified like the model file.

``chunks`` (optional) holds the model file's sha256 per ``size`` bytes (the last chunk may
be shorter): ``{"size": 8388608, "sha256": [...]}``. Signed like the whole-file digest, so
a reader may verify the file by its chunks, on several threads at once, instead of one
sha256 stream that cannot be split. The publisher writes both, and the sidecar checks
both, so a manifest whose chunks describe other bytes than its ``sha256`` never reaches
the server. A manifest without it encodes as before (its signature still verifies).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from .canary import GOLDEN_FILE

MANIFEST_NAME = "manifest.json"
SIGNATURE_NAME = "manifest.sig"
MODEL_FILE_NAMES = ("model.onnx", "model.engine", "model.plan")
BOUND_FIELDS = ("store", "sequence")  # what a signature binds beyond model and version
MAX_MANIFEST_BYTES = 1 << 20  # larger manifest objects are refused unread
MAX_SIGNATURE_BYTES = 1 << 10  # an Ed25519 signature is 64 bytes
_HASH_CHUNK = 1 << 20
MIN_CHUNK_SIZE = 1 << 20  # a chunk size is a power of two within these bounds
MAX_CHUNK_SIZE = 1 << 28
DEFAULT_CHUNK_SIZE = 8 << 20  # what publish writes: 50 digests for 400 MiB


class ManifestError(ValueError):
    """Manifest bytes that are not a valid manifest."""


@dataclass(frozen=True)
class FileRef:
    """A file of the version a manifest names, with what it must hash to."""

    file: str
    sha256: str  # 64 lowercase hex digits
    size: int  # bytes

    @classmethod
    def golden(cls, raw: object) -> FileRef:
        """The ``golden`` field: always ``GOLDEN_FILE`` (a fixed name, so a manifest
        cannot point a reader at another path)."""
        if not isinstance(raw, dict):
            raise ManifestError("manifest golden must be an object or null")
        if raw.get("file") != GOLDEN_FILE:
            raise ManifestError(f"manifest golden file must be {GOLDEN_FILE!r}")
        if not is_sha256(raw.get("sha256")):
            raise ManifestError("manifest golden sha256 must be 64 lowercase hex digits")
        size = raw.get("size")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ManifestError("manifest golden size must be a non-negative integer")
        return cls(GOLDEN_FILE, raw["sha256"], size)


@dataclass(frozen=True)
class Chunks:
    """The model file's sha256 per ``size`` bytes, in order (the last chunk may be
    shorter; an empty file has none)."""

    size: int  # bytes per chunk: a power of two, MIN_CHUNK_SIZE to MAX_CHUNK_SIZE
    sha256: tuple[str, ...]  # 64 lowercase hex digits each

    @staticmethod
    def count_for(file_size: int, chunk_size: int) -> int:
        """How many chunks a file of ``file_size`` bytes has."""
        return -(-file_size // chunk_size)

    def span(self, index: int, file_size: int) -> tuple[int, int]:
        """The byte range ``[start, end)`` of chunk ``index`` of a ``file_size`` file."""
        start = index * self.size
        return start, min(file_size, start + self.size)

    @classmethod
    def parse(cls, raw: object, file_size: int) -> Chunks:
        """The ``chunks`` field of a manifest whose model file has ``file_size`` bytes."""
        if not isinstance(raw, dict):
            raise ManifestError("manifest chunks must be an object or null")
        if set(raw) != {"size", "sha256"}:
            raise ManifestError("manifest chunks must hold exactly size and sha256")
        size, digests = raw["size"], raw["sha256"]
        if (
            isinstance(size, bool)
            or not isinstance(size, int)
            or not MIN_CHUNK_SIZE <= size <= MAX_CHUNK_SIZE
            or size & (size - 1)
        ):
            raise ManifestError(
                f"manifest chunks size must be a power of two from {MIN_CHUNK_SIZE} to "
                f"{MAX_CHUNK_SIZE} bytes, not {size!r}"
            )
        if not isinstance(digests, list) or not all(is_sha256(d) for d in digests):
            raise ManifestError("manifest chunks sha256 must be a list of 64 lowercase hex digits")
        wanted = cls.count_for(file_size, size)
        if len(digests) != wanted:
            raise ManifestError(
                f"manifest chunks has {len(digests)} sha256, a file of {file_size} bytes "
                f"in chunks of {size} has {wanted}"
            )
        return cls(size, tuple(digests))


@dataclass(frozen=True)
class Manifest:
    model: str
    version: str
    file: str  # one of MODEL_FILE_NAMES
    sha256: str  # of the model file: 64 lowercase hex digits
    size: int  # of the model file, in bytes
    precision: str = "fp32"
    shapes: dict[str, Any] = field(default_factory=dict)
    created_at: str = ""
    builder: dict[str, Any] = field(default_factory=dict)
    store: str | None = None  # the store's scope it was published to (None: not bound)
    sequence: int | None = None  # publish sequence of this version (None: not bound)
    golden: FileRef | None = None  # the version's golden set (None: it has none)
    chunks: Chunks | None = None  # the model file's per-chunk digests (None: it has none)

    def to_bytes(self) -> bytes:
        """Canonical encoding: the exact bytes that are signed. Without ``chunks`` the
        key is left out, so a manifest from before it encodes to its signed bytes."""
        encoded = asdict(self)
        if self.chunks is None:
            del encoded["chunks"]
        return json.dumps(encoded, sort_keys=True, separators=(",", ":")).encode()

    def files(self) -> tuple[FileRef, ...]:
        """Every file of the version besides the manifest: the model, then the golden set."""
        model = FileRef(self.file, self.sha256, self.size)
        return (model, self.golden) if self.golden is not None else (model,)

    def chunks_of(self, ref: FileRef) -> Chunks | None:
        """The per-chunk digests of a file :meth:`files` names: the model file's only."""
        return self.chunks if ref.file == self.file else None

    def unbound(self) -> list[str]:
        """The binding fields this manifest lacks (signed before they existed)."""
        return [name for name in BOUND_FIELDS if getattr(self, name) is None]

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        try:
            raw = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise ManifestError(f"manifest is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ManifestError("manifest must be a JSON object")
        missing = [k for k in ("model", "version", "file", "sha256", "size") if k not in raw]
        if missing:
            raise ManifestError(f"manifest lacks fields: {', '.join(missing)}")
        if raw["file"] not in MODEL_FILE_NAMES:
            raise ManifestError(
                f"manifest names file {raw['file']!r}; expected one of {MODEL_FILE_NAMES}"
            )
        if not is_sha256(raw["sha256"]):
            raise ManifestError("manifest sha256 must be 64 lowercase hex digits")
        for key, optional in (("size", False), ("sequence", True)):
            value = raw.get(key)
            if optional and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ManifestError(f"manifest {key} must be a non-negative integer")
        if raw.get("store") is not None and not isinstance(raw["store"], str):
            raise ManifestError("manifest store must be a string")
        known = set(cls.__dataclass_fields__)
        fields = {k: v for k, v in raw.items() if k in known}
        if fields.get("golden") is not None:
            fields["golden"] = FileRef.golden(fields["golden"])
        if fields.get("chunks") is not None:
            fields["chunks"] = Chunks.parse(fields["chunks"], raw["size"])
        try:
            return cls(**fields)
        except TypeError as exc:
            raise ManifestError(f"manifest has bad field types: {exc}") from exc


def is_sha256(value: object) -> bool:
    return (
        isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
    )


def sha256_stream(stream: BinaryIO) -> str:
    """SHA-256 of what is left in an open binary file (one already opened safely)."""
    h = hashlib.sha256()
    while chunk := stream.read(_HASH_CHUNK):
        h.update(chunk)
    return h.hexdigest()


def sha256_file(path: str | Path) -> str:
    """SHA-256 of a file, streamed so large engines never sit in memory twice."""
    with open(path, "rb") as f:
        return sha256_stream(f)


def sha256_stream_chunked(stream: BinaryIO, chunk_size: int) -> tuple[str, Chunks]:
    """SHA-256 of what is left in an open binary file, and of each ``chunk_size`` bytes
    of it, in one read of the stream."""
    whole, part = hashlib.sha256(), hashlib.sha256()
    digests: list[str] = []
    filled = 0  # bytes in ``part``
    while data := stream.read(_HASH_CHUNK):
        view = memoryview(data)
        while view:
            piece, view = view[: chunk_size - filled], view[chunk_size - filled :]
            whole.update(piece)
            part.update(piece)
            filled += len(piece)
            if filled == chunk_size:
                digests.append(part.hexdigest())
                part, filled = hashlib.sha256(), 0
    if filled:
        digests.append(part.hexdigest())
    return whole.hexdigest(), Chunks(chunk_size, tuple(digests))


def sha256_file_chunked(
    path: str | Path, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> tuple[str, Chunks]:
    """:func:`sha256_stream_chunked` of a file."""
    with open(path, "rb") as f:
        return sha256_stream_chunked(f, chunk_size)


def sha256_bytes(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()
