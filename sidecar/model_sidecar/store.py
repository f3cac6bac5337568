"""Model stores with one layout: ``<prefix>/<model>/<version>/{model file, manifest.json,
manifest.sig}``. S3 (boto3) in clusters; a local directory as the embedded default.

Reading is streamed and bounded: :meth:`ModelStore.open` gives the object's length and
a ``read(n)`` that never asks for more than the caller wants, so a download can stop at
the manifest's size plus one byte whatever the store sends. Store errors are told apart
from the volume's: only the store's own failures become :class:`StoreError`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from model_rollout_contract.layout import StoreUrl
from model_rollout_contract.redact import redact

from .errors import ObjectMissing, StoreError


@dataclass
class ObjectStream:
    """One object being read: its length as the store states it, and its bytes."""

    length: int
    read: Callable[[int], bytes]  # at most n bytes; b"" at the end; raises StoreError
    close: Callable[[], None]

    def __enter__(self) -> ObjectStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ObjectTooLarge(StoreError):
    def __init__(self, key: str, length: int, limit: int) -> None:
        super().__init__(
            f"{key} has {length} bytes, more than the {limit} allowed",
            transient=False,
            code="too_large",
        )


class ModelStore(Protocol):
    description: str
    scope: str  # what a manifest published here binds (StoreUrl.scope)

    def open(self, key: str) -> ObjectStream: ...

    def upload(self, key: str, source: Path) -> None: ...

    def write(self, key: str, data: bytes) -> None: ...

    def list_children(self, prefix: str) -> list[str]:
        """Names of the immediate "subdirectories" under ``prefix``."""
        ...


def read_object(store: ModelStore, key: str, limit: int) -> bytes:
    """A small object whole (a manifest, a signature); refused unread beyond ``limit``."""
    with store.open(key) as stream:
        if stream.length > limit:
            raise ObjectTooLarge(key, stream.length, limit)
        data = stream.read(limit + 1)
        if len(data) > limit:
            raise ObjectTooLarge(key, len(data), limit)
        return data


class LocalStore:
    def __init__(self, root: str | Path, store_id: str | None = None) -> None:
        """``store_id``: the directory's configured identity, which manifests published
        here bind (``file:<id>``; none: ``file:``, see ``StoreUrl.bound_scope``)."""
        self.root = Path(root)
        self.store_id = store_id
        self.description = f"file://{self.root}"
        self.scope = StoreUrl("file", "", str(self.root)).bound_scope(store_id)

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if not path.is_relative_to(self.root.resolve()):
            raise StoreError(f"key {key!r} escapes the store", transient=False)
        return path

    def open(self, key: str) -> ObjectStream:
        try:
            f = self._path(key).open("rb")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectMissing(key) from None
        except OSError as exc:
            raise StoreError(f"cannot read {key}: {exc}", transient=False) from exc

        def read(n: int) -> bytes:
            try:
                return f.read(n)
            except OSError as exc:
                raise StoreError(f"cannot read {key}: {exc}", transient=True) from exc

        return ObjectStream(os.fstat(f.fileno()).st_size, read, f.close)

    def upload(self, key: str, source: Path) -> None:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        shutil.copyfile(source, tmp)
        os.replace(tmp, target)

    def write(self, key: str, data: bytes) -> None:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, target)

    def list_children(self, prefix: str) -> list[str]:
        directory = self._path(prefix) if prefix else self.root
        if not directory.is_dir():
            return []
        return sorted(p.name for p in directory.iterdir() if p.is_dir())


_TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
    "500",
    "502",
    "503",
    "504",
}
_MISSING_CODES = {"NoSuchKey", "NoSuchBucket", "404", "NotFound"}
_CREDENTIAL_CODES = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AccessDenied",
    "InvalidToken",
    "ExpiredToken",
    "AuthorizationHeaderMalformed",
    "403",
}


def _store_error(exc: Exception, key: str) -> StoreError:
    """Missing and refused (credentials) are permanent; throttling, server errors and
    the network are transient; any other error the store names is permanent."""
    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in _MISSING_CODES:
            return ObjectMissing(key)
        if code in _CREDENTIAL_CODES:
            return StoreError(
                f"S3 refused the credentials on {key}: {code}",
                transient=False,
                code="bad_credentials",
            )
        return StoreError(
            f"S3 error on {key}: {code or redact(str(exc))}", transient=code in _TRANSIENT_CODES
        )
    return StoreError(f"S3 unreachable on {key}: {redact(str(exc))}", transient=True)


_S3_ERRORS = (ClientError, BotoCoreError, OSError)


class S3Store:
    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        connect_timeout: float = 3.0,
        read_timeout: float = 10.0,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.description = f"s3://{bucket}/{self.prefix}"
        self.scope = StoreUrl("s3", bucket, self.prefix).scope
        # a session of its own: credentials are read from the environment now, not from
        # boto3's process-wide default session (cached when first used)
        self.client = boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None,
            config=Config(
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                retries={"max_attempts": 1},
                s3={"addressing_style": "path"},
            ),
        )

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def open(self, key: str) -> ObjectStream:
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
        except _S3_ERRORS as exc:
            raise _store_error(exc, key) from exc
        body = response["Body"]

        def read(n: int) -> bytes:
            try:
                return bytes(body.read(n))
            except _S3_ERRORS as exc:
                raise _store_error(exc, key) from exc

        def close() -> None:
            with contextlib.suppress(*_S3_ERRORS):
                body.close()

        return ObjectStream(int(response.get("ContentLength", 0)), read, close)

    def upload(self, key: str, source: Path) -> None:
        try:
            self.client.upload_file(str(source), self.bucket, self._key(key))
        except _S3_ERRORS as exc:
            raise _store_error(exc, key) from exc

    def write(self, key: str, data: bytes) -> None:
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)
        except _S3_ERRORS as exc:
            raise _store_error(exc, key) from exc

    def list_children(self, prefix: str) -> list[str]:
        full = (
            self._key(prefix.strip("/") + "/")
            if prefix
            else (f"{self.prefix}/" if self.prefix else "")
        )
        try:
            paginator = self.client.get_paginator("list_objects_v2")
            names = set()
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full, Delimiter="/"):
                for common in page.get("CommonPrefixes", []):
                    names.add(common["Prefix"][len(full) :].strip("/"))
            return sorted(names)
        except _S3_ERRORS as exc:
            raise _store_error(exc, prefix) from exc


def open_store(
    url: str, endpoint_url: str | None = None, store_id: str | None = None
) -> ModelStore:
    """``s3://bucket/prefix`` or ``file:///dir`` (or a plain directory path); a
    ``store_id`` names a directory store only (``InvalidStoreId`` for an S3 one)."""
    parsed = StoreUrl.parse(url)
    if parsed.scheme == "s3":
        parsed.bound_scope(store_id)  # refuses an id
        return S3Store(parsed.bucket, parsed.path, endpoint_url=endpoint_url)
    return LocalStore(parsed.path, store_id)
