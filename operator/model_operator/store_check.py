"""Does a version exist in the model store? Checked before a rollout starts, by reading
the version's manifest (the store layout of :mod:`model_rollout_contract.layout`), whose
publish sequence the operator pins for the rollout (:mod:`model_rollout_contract.pins`)
when its signature verifies (:mod:`.signatures`).
The messages become conditions and events that anyone who can read the resource sees:
credentials written into a URL (the operator's own ``AWS_ENDPOINT_URL``, say) are cut
out of them."""

from __future__ import annotations

import asyncio
import base64
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from model_rollout_contract.layout import StoreUrl, object_key
from model_rollout_contract.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    MAX_SIGNATURE_BYTES,
    SIGNATURE_NAME,
)
from model_rollout_contract.redact import redact

from .signatures import verified_sequence
from .spec import ModelDeploymentSpec

_MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})


class VersionCheck(Enum):
    PRESENT = "present"
    MISSING = "missing"
    UNREACHABLE = "unreachable"
    SKIPPED = "skipped"  # a PVC store is not reachable from the operator


@dataclass(frozen=True)
class StoreAnswer:
    result: VersionCheck
    message: str  # redacted
    # the publish sequence of the version's manifest (PRESENT only; None: its signature
    # does not verify, it names none, or is not one the sidecars would accept anyway)
    sequence: int | None = None


def _read_object(
    url: StoreUrl, endpoint: str | None, key: str, credentials: dict[str, str] | None, limit: int
) -> bytes | None:
    """An object's bytes (at most ``limit`` + 1), ``None`` when the store does not hold
    it."""
    given = credentials or {}
    # a session of its own per check: boto3's default session caches the credentials it
    # first resolved (from the environment), so a rotated key would never be seen
    client = boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint or None,
        aws_access_key_id=given.get("aws_access_key_id"),
        aws_secret_access_key=given.get("aws_secret_access_key"),
        aws_session_token=given.get("aws_session_token"),
        config=Config(
            connect_timeout=3,
            read_timeout=10,
            retries={"max_attempts": 1},
            s3={"addressing_style": "path"},
        ),
    )
    try:
        answer = client.get_object(Bucket=url.bucket, Key=url.key(key))
    except ClientError as exc:
        if str(exc.response.get("Error", {}).get("Code", "")) in _MISSING_CODES:
            return None
        raise
    body = answer["Body"]
    try:
        return bytes(body.read(limit + 1))
    finally:
        body.close()


def boto_credentials(secret_data: dict[str, str]) -> dict[str, str]:
    """boto3 keyword arguments from a credentials Secret's (base64-encoded) data: the keys
    the pods get too (``manifests.STORE_CREDENTIAL_KEYS``)."""
    names = {
        "AWS_ACCESS_KEY_ID": "aws_access_key_id",
        "AWS_SECRET_ACCESS_KEY": "aws_secret_access_key",
        "AWS_SESSION_TOKEN": "aws_session_token",
    }
    out = {}
    for key, argument in names.items():
        if key in secret_data:
            out[argument] = base64.b64decode(secret_data[key]).decode()
    return out


async def check_version(
    spec: ModelDeploymentSpec,
    credentials: dict[str, str] | None = None,
    keys: Sequence[Ed25519PublicKey] = (),
) -> StoreAnswer:
    """``credentials``: the resource's own (from ``spec.store.credentialsSecret``);
    without them the operator's environment is used. ``keys``: those the pods trust; a
    sequence is taken only from a manifest signed by one of them (none without keys).
    The message is redacted."""
    answer = await _check_version(spec, credentials, keys)
    return StoreAnswer(answer.result, redact(answer.message), answer.sequence)


async def _check_version(
    spec: ModelDeploymentSpec,
    credentials: dict[str, str] | None,
    keys: Sequence[Ed25519PublicKey],
) -> StoreAnswer:
    if not spec.store.url:
        return StoreAnswer(VersionCheck.SKIPPED, "store is a volume; not checked by the operator")
    key = object_key(spec.model, spec.version, MANIFEST_NAME)
    signature: bytes | None = None
    try:
        url = StoreUrl.parse(spec.store.url)
        read = functools.partial(_read_object, url, spec.store.endpoint, credentials=credentials)
        data = await asyncio.to_thread(read, key, limit=MAX_MANIFEST_BYTES)
        if data is not None and keys:
            sig_key = object_key(spec.model, spec.version, SIGNATURE_NAME)
            signature = await asyncio.to_thread(read, sig_key, limit=MAX_SIGNATURE_BYTES)
    except (ClientError, BotoCoreError, OSError, ValueError) as exc:
        return StoreAnswer(
            VersionCheck.UNREACHABLE, f"model store {spec.store.url} unreachable: {exc}"
        )
    if data is None:
        return StoreAnswer(
            VersionCheck.MISSING,
            f"version {spec.version} of {spec.model} is not in "
            f"{spec.store.url} (no {MANIFEST_NAME})",
        )
    sequence = None
    if len(data) <= MAX_MANIFEST_BYTES:
        sequence = verified_sequence(data, signature, keys, spec.model, spec.version, url.scope)
    return StoreAnswer(VersionCheck.PRESENT, "ok", sequence)
