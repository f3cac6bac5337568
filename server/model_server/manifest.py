"""The per-version manifest shared by the model store, the sidecar and the server.

A version directory (Triton-style) looks like::

    <root>/<model>/<version>/model.onnx | model.engine
    <root>/<model>/<version>/manifest.json
    <root>/<model>/<version>/manifest.sig      (Ed25519 over manifest.json bytes)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

MANIFEST_NAME = "manifest.json"
SIGNATURE_NAME = "manifest.sig"
MODEL_FILE_NAMES = ("model.onnx", "model.engine", "model.plan")


class ManifestError(ValueError):
    pass


@dataclass(frozen=True)
class Manifest:
    model: str
    version: str
    file: str
    sha256: str
    size: int
    precision: str = "fp32"
    shapes: dict[str, Any] = field(default_factory=dict)
    created_at: str = ""
    builder: dict[str, Any] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        """Canonical encoding: the exact bytes that are signed."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        try:
            raw = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
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
        sha = str(raw["sha256"])
        if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
            raise ManifestError("manifest sha256 must be 64 lowercase hex digits")
        known = {f for f in cls.__dataclass_fields__}
        try:
            return cls(**{k: v for k, v in raw.items() if k in known})
        except TypeError as exc:
            raise ManifestError(f"manifest has bad field types: {exc}") from exc
