"""Ed25519 keys and manifest signatures (``cryptography``; PEM bundles split by ``pem``)."""

from __future__ import annotations

import os
import threading
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


SECRET_DATA_LINK = "..data"  # a Secret or ConfigMap volume: the link to its current files
_READ_ATTEMPTS = 3  # reads of a Secret that is swapped meanwhile


def _key_files(path: Path) -> list[tuple[str, bytes]]:
    """The ``*.pem`` files of ``path`` (a file, or a directory) with their bytes. In a
    mounted Secret they are read through the directory that its ``..data`` link names
    when they are read, so that an update of the Secret (a new directory, then the link
    swapped in one rename) is seen whole or not at all, never half."""
    if not path.is_dir():
        return [(str(path), path.read_bytes())]
    directory = path
    if (path / SECRET_DATA_LINK).is_symlink():
        directory = path / os.readlink(path / SECRET_DATA_LINK)
    files = sorted(
        p for p in directory.iterdir() if p.suffix == ".pem" and not p.name.startswith(".")
    )
    return [(str(path / file.name), file.read_bytes()) for file in files]


def _parse_keys(path: Path, files: list[tuple[str, bytes]]) -> tuple[Ed25519PublicKey, ...]:
    keys: list[Ed25519PublicKey] = []
    for name, data in files:
        blocks = pem.parse(data)
        if not blocks:
            raise ValueError(f"{name} holds no PEM block")
        for block in blocks:
            if not isinstance(block, pem.PublicKey):
                raise ValueError(
                    f"{name} holds a {type(block).__name__} block; only public keys are trusted"
                )
            try:
                keys.append(load_public_key(block.as_bytes()))
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from exc
    if not keys:
        raise ValueError(f"{path} holds no *.pem file with a public key")
    return tuple(keys)


def _read_key_files(path: Path) -> list[tuple[str, bytes]]:
    """:func:`_key_files`, read again if the Secret was swapped while it was read (the
    directory the link named is deleted after the swap)."""
    for _ in range(_READ_ATTEMPTS - 1):
        try:
            return _key_files(path)
        except FileNotFoundError:
            continue
    return _key_files(path)


def load_trusted_keys(path: Path) -> tuple[Ed25519PublicKey, ...]:
    """The keys a manifest may be signed with: every public key of a PEM file (a bundle
    of several, for rotation) or of every ``*.pem`` file in a directory (a mounted
    Secret: its hidden ``..data`` entries are left out). Anything else in those files —
    a private key by mistake, a certificate — is refused rather than skipped."""
    return _parse_keys(path, _read_key_files(path))


class TrustedKeys:
    """The trusted keys of a file or a mounted Secret, read again before each use.

    The kubelet updates a Secret volume in place (its ``..data`` link swapped to a new
    directory) and the operator does not restart pods for it, so keys read once at start
    would go on trusting a key removed from the Secret. :meth:`current` reads the files
    again (a few small files) and parses them when their bytes changed; ``generation``
    grows with every change, so that what was verified under other keys can be checked
    again. A Secret that cannot be read, or holds no valid key any more, trusts nothing:
    :meth:`current` raises ``ValueError`` or ``OSError`` rather than keep the old keys."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.generation = 0
        self._files: list[tuple[str, bytes]] = []
        self._keys: tuple[Ed25519PublicKey, ...] = ()
        self._lock = threading.Lock()  # verifications run in worker threads
        self.current()  # a Secret that is wrong at start is an error at start

    def current(self) -> tuple[Ed25519PublicKey, ...]:
        with self._lock:
            files = _read_key_files(self.path)
            if files != self._files or not self._keys:
                self._keys = ()  # nothing trusted until the new files parse
                self._keys = _parse_keys(self.path, files)
                self._files = files
                self.generation += 1
            return self._keys


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
