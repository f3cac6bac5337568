"""Is a version being (re)published right now? A store has no transaction over a
version's objects: ``publish --force`` replaces them one by one (the manifest and its
signature first, then the golden set and the model: :mod:`.publish`), so a fetch in
between finds a manifest that does not match the other objects *yet*. Such a mismatch is
``publish_in_progress`` — transient, tried again with backoff — when the manifest in the
store changed since it was read (the fetch straddled a write), or says it was published
less than ``window_s`` ago (the new model is still uploading). Any other mismatch is the
refusal it always was, and a mismatch is never served either way: this only decides
between "refused" and "try again later"."""

from __future__ import annotations

import datetime
import time

from model_rollout_contract.manifest import Manifest, ManifestError

from .errors import StoreError, VerificationError

# how long after its publish a manifest's mismatch may still be an upload in progress: a
# 10 GB model at 20 MB/s takes under 10 minutes
PUBLISH_WINDOW_S = 900.0
# what a fetch sees between a publish's writes: another signature, size or digest, or a
# golden set the new manifest names that is not uploaded yet
MIXED_STATE_REASONS = frozenset(
    {"bad_signature", "size_mismatch", "digest_mismatch", "golden_missing"}
)


def published_at(manifest_data: bytes) -> float | None:
    """The manifest's ``created_at`` (seconds since the epoch), if it has a valid one."""
    try:
        created = Manifest.from_bytes(manifest_data).created_at
        when = datetime.datetime.strptime(created, "%Y-%m-%dT%H:%M:%SZ")
    except (ManifestError, TypeError, ValueError):
        return None
    return when.replace(tzinfo=datetime.timezone.utc).timestamp()


def mid_publish(
    error: VerificationError,
    used: bytes,
    current: bytes | None,
    window_s: float,
    now: float | None = None,
) -> StoreError | None:
    """The transient error to raise instead of ``error`` if a publish may be under way:
    ``used`` is the manifest the fetch checked against, ``current`` the store's manifest
    read again after the mismatch (``None``: gone). ``None`` keeps the refusal."""
    if error.reason not in MIXED_STATE_REASONS or current is None:
        return None
    if current != used:
        why = "the version's manifest changed in the store meanwhile"
    else:
        when = published_at(current)
        age = (time.time() if now is None else now) - when if when is not None else None
        if age is None or abs(age) > window_s:
            return None
        why = f"its manifest was published {age:.0f} s ago"
    return StoreError(
        f"{error.message}; {why}: a publish of this version is under way, trying again",
        transient=True,
        code="publish_in_progress",
    )
