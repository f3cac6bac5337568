"""Ed25519 keys and manifest signatures (``cryptography``; PEM bundles split by ``pem``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pem
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey


def generate_keypair(private_path: Path, public_path: Path) -> None:
    key = Ed25519PrivateKey.generate()
    private_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    private_path.chmod(0o600)
    public_path.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )


def load_private_key(path: Path) -> Ed25519PrivateKey:
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path} is not an Ed25519 private key")
    return key


def load_public_key(data: bytes) -> Ed25519PublicKey:
    key = serialization.load_pem_public_key(data)
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError("the trusted key is not an Ed25519 public key")
    return key


def load_trusted_keys(path: Path) -> tuple[Ed25519PublicKey, ...]:
    """The keys a manifest may be signed with: every public key of a PEM file (a bundle
    of several, for rotation) or of every ``*.pem`` file in a directory (a mounted
    Secret: its hidden ``..data`` entries are left out). Anything else in those files —
    a private key by mistake, a certificate — is refused rather than skipped."""
    files = (
        sorted(p for p in path.iterdir() if p.suffix == ".pem" and not p.name.startswith("."))
        if path.is_dir()
        else [path]
    )
    keys: list[Ed25519PublicKey] = []
    for file in files:
        blocks = pem.parse(file.read_bytes())
        if not blocks:
            raise ValueError(f"{file} holds no PEM block")
        for block in blocks:
            if not isinstance(block, pem.PublicKey):
                raise ValueError(
                    f"{file} holds a {type(block).__name__} block; only public keys are trusted"
                )
            try:
                keys.append(load_public_key(block.as_bytes()))
            except ValueError as exc:
                raise ValueError(f"{file}: {exc}") from exc
    if not keys:
        raise ValueError(f"{path} holds no *.pem file with a public key")
    return tuple(keys)


def sign(key: Ed25519PrivateKey, message: bytes) -> bytes:
    return key.sign(message)


def is_valid(keys: Sequence[Ed25519PublicKey], signature: bytes, message: bytes) -> bool:
    """True when any of ``keys`` verifies the signature."""
    for key in keys:
        try:
            key.verify(signature, message)
        except InvalidSignature:
            continue
        return True
    return False
