"""Which manifests the operator may take a publish sequence from (its pins,
:mod:`model_rollout_contract.pins`): only one whose Ed25519 signature verifies under a
key the resource's pods trust (its public key Secret, every ``*.pem`` entry) and that
binds this store, model and version: the sidecars' rules (``model_sidecar.verify``), so
that a manifest anyone with write access to the store could forge, with a sequence far
in the future, never pins a version against its genuine builds."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence

import pem
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from model_rollout_contract.manifest import MAX_SIGNATURE_BYTES, Manifest, ManifestError

KEY_SUFFIX = ".pem"  # the Secret's entries that hold keys (the sidecars read the same)


def secret_keys(data: Mapping[str, str]) -> tuple[Ed25519PublicKey, ...]:
    """The public keys of a Secret's ``data`` (base64): every PEM block of every
    ``*.pem`` entry. Raises ``ValueError`` for an entry that holds anything else, as the
    sidecars refuse such a Secret."""
    keys: list[Ed25519PublicKey] = []
    for name in sorted(data):
        if not name.endswith(KEY_SUFFIX) or name.startswith("."):
            continue
        try:
            raw = base64.b64decode(data[name], validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"{name} is not base64") from exc
        blocks = pem.parse(raw)
        if not blocks:
            raise ValueError(f"{name} holds no PEM block")
        for block in blocks:
            key = (
                serialization.load_pem_public_key(block.as_bytes())
                if isinstance(block, pem.PublicKey)
                else None
            )
            if not isinstance(key, Ed25519PublicKey):
                raise ValueError(f"{name} holds something other than an Ed25519 public key")
            keys.append(key)
    return tuple(keys)


def verified_sequence(
    data: bytes,
    signature: bytes | None,
    keys: Sequence[Ed25519PublicKey],
    model: str,
    version: str,
    scope: str,
) -> int | None:
    """The publish sequence of a manifest the sidecars would accept (signed by one of
    ``keys``, for ``model:version`` in the store ``scope``, binding both); ``None`` for
    any other, and without keys."""
    if not keys or not signature or len(signature) > MAX_SIGNATURE_BYTES:
        return None
    if not any(_verifies(key, signature, data) for key in keys):
        return None
    try:
        manifest = Manifest.from_bytes(data)
    except ManifestError:
        return None
    if (manifest.model, manifest.version, manifest.store) != (model, version, scope):
        return None
    return manifest.sequence  # None when unbound: the sidecars refuse it too


def _verifies(key: Ed25519PublicKey, signature: bytes, data: bytes) -> bool:
    try:
        key.verify(signature, data)
    except InvalidSignature:
        return False
    return True
