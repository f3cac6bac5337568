"""Checks a version must pass before anything is handed to the server.

A manifest is accepted when any trusted key verifies its signature and it binds this
store, this model and this version; a signed manifest from before the binding fields
existed is refused (``unbound``): a signature that binds only model and version can be
replayed into another team's prefix. The publish sequence is checked against what was
accepted before, and against the operator's pin, by :mod:`.sequences`, which needs the
volume.

The trusted keys are read again for every verification (:class:`~.signing.TrustedKeys`):
a key removed from the Secret signs nothing from then on; keys that cannot be read trust
nothing (``keys_unreadable``, an error retried with backoff, not a refusal)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO

from model_rollout_contract.canary import MAX_GOLDEN_BYTES
from model_rollout_contract.layout import FILE_STORE_SCOPE
from model_rollout_contract.manifest import (
    Chunks,
    FileRef,
    Manifest,
    ManifestError,
    sha256_stream,
    sha256_stream_chunked,
)

from .errors import KeysUnreadable, VerificationError
from .signing import Ed25519PublicKey, TrustedKeys, is_valid


@dataclass(frozen=True)
class Verifier:
    # trusted keys: a Secret or file read again before each use, or fixed ones; empty:
    # unsigned manifests accepted (development)
    keys: TrustedKeys | Sequence[Ed25519PublicKey]
    store_scope: str  # the store this sidecar reads (StoreUrl.scope)
    allowed_digests: frozenset[str] | None = None

    @property
    def signed(self) -> bool:
        """Whether manifests must be signed (no keys at all: development only)."""
        return isinstance(self.keys, TrustedKeys) or bool(self.keys)

    @property
    def key_generation(self) -> int:
        """Grows whenever the trusted keys change (read them first: :meth:`trusted_keys`)."""
        return self.keys.generation if isinstance(self.keys, TrustedKeys) else 0

    def trusted_keys(self) -> Sequence[Ed25519PublicKey]:
        """The keys trusted now. Raises ``KeysUnreadable`` when they cannot be read."""
        if not isinstance(self.keys, TrustedKeys):
            return self.keys
        try:
            return self.keys.current()
        except (OSError, ValueError) as exc:
            raise KeysUnreadable(
                f"the trusted keys at {self.keys.path} cannot be read ({exc}); nothing is "
                "verified until they can"
            ) from exc

    def manifest(self, model: str, version: str, data: bytes, signature: bytes | None) -> Manifest:
        where = f"{model}:{version}"
        if self.signed:
            keys = self.trusted_keys()
            if not signature:
                raise VerificationError("unsigned", f"{where} has no manifest signature")
            if not is_valid(keys, signature, data):
                raise VerificationError(
                    "bad_signature",
                    f"{where}: manifest signature does not verify against any of the "
                    f"{len(keys)} trusted public key(s)",
                )
        try:
            manifest = Manifest.from_bytes(data)
        except ManifestError as exc:
            raise VerificationError("bad_manifest", f"{where}: {exc}") from exc
        if (manifest.model, manifest.version) != (model, version):
            raise VerificationError(
                "bad_manifest",
                f"manifest is for {manifest.model}:{manifest.version}, not {where}",
            )
        if self.signed and manifest.unbound():
            raise VerificationError(
                "unbound",
                f"{where}: the signed manifest lacks {', '.join(manifest.unbound())} "
                "(published before manifests bound them); publish it again",
            )
        if manifest.store is not None and manifest.store != self.store_scope:
            hint = ""
            if manifest.store == FILE_STORE_SCOPE:
                hint = (
                    " (published before its directory store had an id: publish it again "
                    "with --store-id and --force)"
                )
            raise VerificationError(
                "wrong_store",
                f"{where} was published to {manifest.store}, not to {self.store_scope}{hint}",
            )
        if manifest.golden is not None and manifest.golden.size > MAX_GOLDEN_BYTES:
            raise VerificationError(
                "golden_too_large",
                f"{where}: the manifest's golden set has {manifest.golden.size} bytes, more "
                f"than the {MAX_GOLDEN_BYTES} allowed",
            )
        if self.allowed_digests is not None and manifest.sha256 not in self.allowed_digests:
            raise VerificationError(
                "not_allowed",
                f"{where} digest {manifest.sha256} is not on the allow-list",
            )
        return manifest

    def file(self, stream: BinaryIO, expected: FileRef, chunks: Chunks | None = None) -> None:
        """Size and digest of an open file the manifest names (the model, the golden
        set), opened without following links; with ``chunks`` (:meth:`Manifest.chunks_of`)
        each chunk's digest too, in the same read: the server may check the chunks alone,
        so chunks that disagree with the whole-file digest never reach it."""
        name = expected.file
        size = os.fstat(stream.fileno()).st_size
        if size != expected.size:
            raise VerificationError(
                "size_mismatch",
                f"{name} has {size} bytes, manifest says {expected.size} (truncated download?)",
            )
        stream.seek(0)
        if chunks is None:
            digest = sha256_stream(stream)
        else:
            digest, found = sha256_stream_chunked(stream, chunks.size)
            for index, (got, wanted) in enumerate(zip(found.sha256, chunks.sha256, strict=True)):
                if got != wanted:
                    start, end = chunks.span(index, size)
                    raise VerificationError(
                        "digest_mismatch",
                        f"{name} bytes {start}-{end} (chunk {index} of {len(chunks.sha256)}) "
                        f"have sha256 {got}, the manifest's chunk says {wanted}",
                    )
        if digest != expected.sha256:
            raise VerificationError(
                "digest_mismatch",
                f"{name} sha256 {digest} does not match the manifest's {expected.sha256}",
            )
