"""The operator's store check against a real S3 (SeaweedFS): credentials are resolved on
every check, so a key rotated in the operator's environment (or a wrong key first) is
not cached for the life of the process."""

from __future__ import annotations

import base64
import dataclasses
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from model_operator.signatures import secret_keys
from model_operator.spec import parse_spec
from model_operator.store_check import VersionCheck, check_version
from model_rollout_contract.manifest import Manifest
from model_sidecar.signing import load_public_key
from model_sidecar.store import S3Store, read_object
from tests.support.sidecar import make_keys, publish_versions


def spec_for(store: S3Store, endpoint: str) -> Any:
    return parse_spec(
        {
            "model": "mlp",
            "version": "v1",
            "image": "img",
            "store": {"url": f"s3://models/{store.prefix}", "endpoint": endpoint},
            "signingPublicKeySecret": "k",
        }
    )


async def test_credentials_are_resolved_on_every_check(
    s3_env: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3_env.create_bucket("models")
    store = S3Store("models", f"sc-{uuid.uuid4().hex[:8]}", endpoint_url=s3_env.endpoint)
    publish_versions(store, make_keys(tmp_path / "keys"), tmp_path, {"v1": 1})
    spec = spec_for(store, s3_env.endpoint)
    right_key = os.environ["AWS_ACCESS_KEY_ID"]  # s3_env's
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "not-the-key")
    answer = await check_version(spec)
    assert answer.result is VersionCheck.UNREACHABLE, answer.message  # 403 with the wrong key
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", right_key)  # the key is rotated to the right one
    answer = await check_version(spec)
    assert answer.result is VersionCheck.PRESENT, answer.message


async def test_a_sequence_is_pinned_only_from_a_manifest_whose_signature_verifies(
    s3_env: Any, tmp_path: Path
) -> None:
    """Issue 29's pins: the sequence the operator pins comes from a manifest signed by a
    key the pods trust, for this store, model and version; a manifest written into the
    store without the signing key (a sequence far ahead, which would pin every genuine
    build out) pins nothing, and neither does one checked without keys."""
    s3_env.create_bucket("models")
    store = S3Store("models", f"sc-{uuid.uuid4().hex[:8]}", endpoint_url=s3_env.endpoint)
    keys = make_keys(tmp_path / "keys")
    other = make_keys(tmp_path / "other", "other")
    publish_versions(store, keys, tmp_path, {"v1": 1})
    spec = spec_for(store, s3_env.endpoint)
    genuine = Manifest.from_bytes(read_object(store, "mlp/v1/manifest.json", 1 << 20))
    assert genuine.sequence is not None
    trusted = secret_keys({"public.pem": base64.b64encode(keys.public.read_bytes()).decode()})

    answer = await check_version(spec, keys=trusted)
    assert (answer.result, answer.sequence) == (VersionCheck.PRESENT, genuine.sequence)
    answer = await check_version(spec, keys=(load_public_key(other.public.read_bytes()),))
    assert (answer.result, answer.sequence) == (VersionCheck.PRESENT, None)  # another key

    forged = dataclasses.replace(genuine, sequence=genuine.sequence + 10**12)
    store.write("mlp/v1/manifest.json", forged.to_bytes())  # its signature is the old one
    for given in (trusted, ()):
        answer = await check_version(spec, keys=given)
        assert (answer.result, answer.sequence) == (VersionCheck.PRESENT, None)


def test_the_trusted_keys_are_the_secrets_pem_entries() -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    def public(key: Ed25519PrivateKey) -> bytes:
        return key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    a, b = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    bundle = base64.b64encode(public(a) + public(b)).decode()
    found = secret_keys({"public.pem": bundle, "README": "eA==", "..data": "eA=="})
    assert [k.public_bytes_raw() for k in found] == [
        a.public_key().public_bytes_raw(),
        b.public_key().public_bytes_raw(),
    ]
    private = a.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )  # fmt: skip
    with pytest.raises(ValueError):
        secret_keys({"public.pem": base64.b64encode(private).decode()})
