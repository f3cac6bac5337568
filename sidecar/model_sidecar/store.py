"""Model stores with one layout: ``<prefix>/<model>/<version>/{model file, manifest.json,
manifest.sig}``. S3 (boto3) in clusters; a local directory as the embedded default."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Protocol

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from model_rollout_contract.layout import StoreUrl

from .errors import ObjectMissing, StoreError


class ModelStore(Protocol):
    description: str

    def read(self, key: str) -> bytes: ...

    def download(self, key: str, dest: Path) -> int:
        """Stream an object to ``dest``; returns bytes written."""
        ...

    def upload(self, key: str, source: Path) -> None: ...

    def write(self, key: str, data: bytes) -> None: ...

    def list_children(self, prefix: str) -> list[str]:
        """Names of the immediate "subdirectories" under ``prefix``."""
        ...


class LocalStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.description = f"file://{self.root}"

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if not path.is_relative_to(self.root.resolve()):
            raise StoreError(f"key {key!r} escapes the store", transient=False)
        return path

    def read(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise ObjectMissing(key) from None

    def download(self, key: str, dest: Path) -> int:
        source = self._path(key)
        if not source.is_file():
            raise ObjectMissing(key)
        shutil.copyfile(source, dest)
        return dest.stat().st_size

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
    "InternalError",
    "ServiceUnavailable",
    "RequestTimeout",
    "503",
    "500",
}


def _store_error(exc: Exception, key: str) -> StoreError:
    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in ("NoSuchKey", "404", "NotFound"):
            return ObjectMissing(key)
        return StoreError(f"S3 error on {key}: {code or exc}", transient=code in _TRANSIENT_CODES)
    return StoreError(f"S3 unreachable on {key}: {exc}", transient=True)


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
        self.client = boto3.client(
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

    def read(self, key: str) -> bytes:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]
            return bytes(body.read())
        except (ClientError, BotoCoreError, OSError) as exc:
            raise _store_error(exc, key) from exc

    def download(self, key: str, dest: Path) -> int:
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            written = 0
            with dest.open("wb") as f:
                for chunk in response["Body"].iter_chunks(1 << 20):
                    f.write(chunk)
                    written += len(chunk)
                f.flush()
                os.fsync(f.fileno())
            return written
        except (ClientError, BotoCoreError, OSError) as exc:
            raise _store_error(exc, key) from exc

    def upload(self, key: str, source: Path) -> None:
        try:
            self.client.upload_file(str(source), self.bucket, self._key(key))
        except (ClientError, BotoCoreError, OSError) as exc:
            raise _store_error(exc, key) from exc

    def write(self, key: str, data: bytes) -> None:
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)
        except (ClientError, BotoCoreError, OSError) as exc:
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
        except (ClientError, BotoCoreError, OSError) as exc:
            raise _store_error(exc, prefix) from exc


def open_store(url: str, endpoint_url: str | None = None) -> ModelStore:
    """``s3://bucket/prefix`` or ``file:///dir`` (or a plain directory path)."""
    parsed = StoreUrl.parse(url)
    if parsed.scheme == "s3":
        return S3Store(parsed.bucket, parsed.path, endpoint_url=endpoint_url)
    return LocalStore(parsed.path)
