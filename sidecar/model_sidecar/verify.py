"""Checks a version must pass before anything is handed to the server."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from model_rollout_contract.manifest import Manifest, ManifestError, sha256_file

from .errors import VerificationError
from .signing import Ed25519PublicKey, is_valid


@dataclass
class Verifier:
    public_key: Ed25519PublicKey | None
    trusted_dir: Path
    allowed_digests: frozenset[str] | None = None

    def manifest(self, model: str, version: str, data: bytes, signature: bytes | None) -> Manifest:
        if self.public_key is not None:
            if not signature:
                raise VerificationError("unsigned", f"{model}:{version} has no manifest signature")
            if not is_valid(self.public_key, signature, data):
                raise VerificationError(
                    "bad_signature",
                    f"{model}:{version}: manifest signature does not verify "
                    "against the trusted public key",
                )
        try:
            manifest = Manifest.from_bytes(data)
        except ManifestError as exc:
            raise VerificationError("bad_manifest", f"{model}:{version}: {exc}") from exc
        if (manifest.model, manifest.version) != (model, version):
            raise VerificationError(
                "bad_manifest",
                f"manifest is for {manifest.model}:{manifest.version}, not {model}:{version}",
            )
        if self.allowed_digests is not None and manifest.sha256 not in self.allowed_digests:
            raise VerificationError(
                "not_allowed",
                f"{model}:{version} digest {manifest.sha256} is not on the allow-list",
            )
        return manifest

    def file(self, path: Path, manifest: Manifest) -> None:
        if not path.resolve().is_relative_to(self.trusted_dir.resolve()):
            raise VerificationError(
                "untrusted_path", f"{path} is outside the trusted directory {self.trusted_dir}"
            )
        size = path.stat().st_size
        if size != manifest.size:
            raise VerificationError(
                "size_mismatch",
                f"{path.name} has {size} bytes, manifest says {manifest.size} "
                "(truncated download?)",
            )
        digest = sha256_file(path)
        if digest != manifest.sha256:
            raise VerificationError(
                "digest_mismatch",
                f"{path.name} sha256 {digest} does not match the manifest's {manifest.sha256}",
            )
