"""The newest publish sequence accepted for each version, kept on the volume
(``<volume>/<model>/.accepted-sequences.json``, :data:`~model_rollout_contract.layout.
ACCEPTED_FILE`) so that a restarted sidecar still refuses an older signed build of a
version it has accepted a newer build of (a replay).

The file is written atomically and never through a link (:class:`~.volume.SafeDir`). An
unreadable one is an error, not an empty memory: forgetting would let a replay through.
It lives as long as the volume does (the pod's ``emptyDir``); a new pod starts empty. Its
first fetch is held to the sequence the operator pinned when the version's rollout
started (``model_rollout_contract.pins``), given to the pod in its annotations and the
ConfigMap.
"""

from __future__ import annotations

import json

from model_rollout_contract.layout import ACCEPTED_FILE
from model_rollout_contract.names import is_valid_name

from .errors import VerificationError, VolumeError
from .volume import SafeDir

_MAX_BYTES = 1 << 20


def _load(model_dir: SafeDir) -> dict[str, int]:
    try:
        raw = json.loads(model_dir.read_bytes(ACCEPTED_FILE, _MAX_BYTES))
    except FileNotFoundError:
        return {}
    except (ValueError, RecursionError) as exc:
        raise VolumeError(
            f"{model_dir.path / ACCEPTED_FILE} is not readable ({exc}); "
            "delete it to forget the accepted publish sequences"
        ) from exc
    if not isinstance(raw, dict) or not all(
        is_valid_name(k) and isinstance(v, int) and not isinstance(v, bool) for k, v in raw.items()
    ):
        raise VolumeError(f"{model_dir.path / ACCEPTED_FILE} is not a map of sequences")
    return raw


def publish_order(model_dir: SafeDir) -> list[str]:
    """The versions accepted here, oldest published first: the order of versions that
    follow no published rule (model_rollout_contract.versions), such as git SHAs."""
    try:
        known = _load(model_dir)
    except VolumeError:  # the fetch that needs the file says so; an order can do without
        return []
    return sorted(known, key=lambda v: known[v])


def accepted(model_dir: SafeDir, version: str) -> int | None:
    return _load(model_dir).get(version)


def check(
    model_dir: SafeDir | None,
    model: str,
    version: str,
    sequence: int | None,
    pinned: int | None = None,
) -> None:
    """Refuse ``sequence`` when it is older than ``pinned`` (the operator's pin; a
    manifest with no sequence is older than any), or when a newer build of the version
    was accepted before on this volume (``model_dir``; ``None``: not asked)."""
    if pinned is not None and (sequence is None or sequence < pinned):
        has = "no publish sequence" if sequence is None else f"publish sequence {sequence}"
        raise VerificationError(
            "stale_sequence",
            f"{model}:{version} has {has}, older than {pinned}, the one the operator pinned "
            "when its rollout started: an older build (replayed into the store?) is not served",
        )
    if model_dir is None or sequence is None:
        return
    newest = accepted(model_dir, version)
    if newest is not None and sequence < newest:
        raise VerificationError(
            "stale_sequence",
            f"{model}:{version} has publish sequence {sequence}, older than {newest} "
            "accepted before: an older build is not served again",
        )


def record(model_dir: SafeDir, version: str, sequence: int | None) -> None:
    """Remember ``sequence`` as accepted for ``version`` (never lowering what is kept)."""
    if sequence is None:
        return
    sequences = _load(model_dir)
    if sequences.get(version, -1) >= sequence:
        return
    sequences[version] = sequence
    model_dir.write_atomic(ACCEPTED_FILE, json.dumps(sequences, sort_keys=True).encode())
