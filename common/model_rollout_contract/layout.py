"""Where versions live: the model store's keys and the pod volume's files.

Store: ``<prefix>/<model>/<version>/<file>`` under ``s3://bucket/prefix`` or a local
directory (``file:///dir``). Volume (the server's repository, written by the sidecar)::

    <volume>/[<tenant>/]<model>/<version>/...   verified versions (see manifest)
    <volume>/<model>/CURRENT                    the version a (re)started server serves
    <volume>/<model>/TRAFFIC                    a canary pod's traffic policy (JSON, as the
                                                pod annotation ``canary.TRAFFIC_POLICY``):
                                                a restarted server whose CURRENT is its
                                                candidate loads the stable version first,
                                                then the candidate under the policy
    <volume>/<model>/.accepted-sequences.json   per version, the newest publish sequence
                                                the sidecar accepted (older builds refused)
    <volume>/.incoming/                         downloads in progress, never served; swept
                                                when the sidecar starts

The sidecar reaches every one of these through directory file descriptors and never
follows a symbolic link below ``<volume>`` (the volume is shared with the server).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlparse

CURRENT_FILE = "CURRENT"
TRAFFIC_FILE = "TRAFFIC"
INCOMING_DIR = ".incoming"
ACCEPTED_FILE = ".accepted-sequences.json"
FILE_STORE_SCOPE = "file:"  # a directory store without an id: see StoreUrl.bound_scope
# a directory store's configured id (a DNS-1123 label, dots allowed): what names it in the
# scope a manifest binds, since its path differs between the publisher and the pods
STORE_ID_PATTERN = re.compile(r"[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?")
STORE_ID_RULE = (
    "1-63 lowercase letters, digits, '.' or '-', starting and ending with a letter or digit"
)


class InvalidStoreId(ValueError):
    """A store id that breaks :data:`STORE_ID_RULE`, or one given to an S3 store."""


def check_store_id(value: object) -> str:
    if not isinstance(value, str) or STORE_ID_PATTERN.fullmatch(value) is None:
        raise InvalidStoreId(f"invalid store id {value!r}: {STORE_ID_RULE}")
    return value


def object_key(model: str, version: str, name: str) -> str:
    """Key of one file of a version, relative to the store's prefix."""
    return f"{model}/{version}/{name}"


@dataclass(frozen=True)
class StoreUrl:
    """A parsed store URL: ``s3://bucket/prefix`` or ``file:///dir`` (or a plain path)."""

    scheme: str  # "s3" | "file"
    bucket: str  # S3 only
    path: str  # S3: the prefix without slashes at either end; file: the directory

    @classmethod
    def parse(cls, url: str) -> StoreUrl:
        parsed = urlparse(url)
        if parsed.scheme == "s3":
            if not parsed.netloc:
                raise ValueError(f"store URL {url!r} names no bucket")
            return cls("s3", parsed.netloc, parsed.path.strip("/"))
        if parsed.scheme in ("", "file"):
            return cls("file", "", parsed.path if parsed.scheme else url)
        raise ValueError(f"unsupported store URL {url!r}: use s3://bucket/prefix or file:///dir")

    def key(self, relative: str) -> str:
        """The full S3 key (prefix included) of a key relative to the prefix."""
        return f"{self.path}/{relative}" if self.path else relative

    @property
    def scope(self) -> str:
        """:meth:`bound_scope` of a store given no id."""
        return self.bound_scope(None)

    def bound_scope(self, store_id: str | None) -> str:
        """What a signed manifest binds as its ``store``: ``s3://bucket/prefix`` (the
        endpoint left out, so the same bucket through another endpoint is the same store),
        or for a directory store ``file:<store id>`` — a directory is mounted at different
        paths by the publisher and by the pods, so its path cannot name it; its configured
        id does. Without an id it is ``file:``, as every directory store was named before
        ids existed: versions signed for any other directory store pass (docs/security.md,
        "Keys and replays"). An S3 store is named by its bucket and prefix: an id is refused."""
        if self.scheme == "s3":
            if store_id is not None:
                raise InvalidStoreId(
                    "a store id names a directory store; an S3 store is named by its bucket "
                    "and prefix"
                )
            return f"s3://{self.bucket}/{self.path}" if self.path else f"s3://{self.bucket}"
        return FILE_STORE_SCOPE + (check_store_id(store_id) if store_id is not None else "")

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.path}" if self.scheme == "s3" else f"file://{self.path}"
