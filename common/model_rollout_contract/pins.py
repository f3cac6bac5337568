"""Publish sequences pinned by the operator: for each version whose rollout it started,
the ``sequence`` of the version's manifest in the store at that moment
(:mod:`.manifest`). The sidecars refuse an older build of a pinned version, also on a
pod whose volume has no memory of what it accepted before (a new pod).

Kept in the ModelDeployment's status (``pinnedSequences``) and given to the pods as the
track's pod annotation and ConfigMap key (:class:`~.tracks.TrackKeys` ``pins`` and
``configmap_pins_key``), as one JSON object: ``{"v2": 1764700000123456789}``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from .names import is_valid_name

MAX_PINS = 32  # versions pinned at once (the operator keeps those it may still serve)
MAX_SEQUENCE = (1 << 63) - 1  # an int64 (the CRD's format)
_MAX_TEXT = 4096


class InvalidPins(ValueError):
    """Text that is not a map of version names to publish sequences."""


def pins_text(pins: Mapping[str, int]) -> str:
    return json.dumps(dict(sorted(pins.items())), separators=(",", ":"))


def _sequence(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_SEQUENCE


def parse_pins(text: str) -> dict[str, int]:
    if len(text) > _MAX_TEXT:
        raise InvalidPins(f"pinned sequences of {len(text)} characters, more than {_MAX_TEXT}")
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InvalidPins(f"pinned sequences are not JSON: {exc}") from exc
    if not isinstance(raw, dict) or len(raw) > MAX_PINS:
        raise InvalidPins(f"pinned sequences must be an object of at most {MAX_PINS} versions")
    for version, sequence in raw.items():
        if not is_valid_name(version) or not _sequence(sequence):
            raise InvalidPins(
                f"pinned sequence {version!r}: {sequence!r} is not a version name and a "
                "publish sequence (an integer from 0 to 2^63-1)"
            )
    return dict(raw)
