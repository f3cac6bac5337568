"""The sidecar's report: written to a status file and to its pod's
``serving.model-rollout.io/sidecar-status`` annotation, read by the operator.

Wire format (one JSON object, keys sorted)::

    {"model": "m", "target": "v2", "serving": "v1", "state": "refused",
     "code": "size_mismatch", "reason": "size_mismatch: model.onnx has more than ...",
     "sha256": null, "retained": ["v0"],
     "target_seen_at": 1764699999.2, "updated_at": 1764700000.0}

``code`` is a stable word for programs (every failure has its own: ``volume_full``,
``store_unreachable``, ``bad_credentials``, ``size_mismatch``, ``stale_sequence``, ...);
``reason`` says the same for people. In the status file ``updated_at`` is also a
heartbeat: a sidecar rewrites an unchanged report there at least every
:data:`HEARTBEAT_SECONDS`, so a file much older than that comes from a sidecar that is
stuck or gone. The pod annotation is patched only when the report changes (an idle pod
makes no API writes), so there ``updated_at`` is when the report last changed.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from .states import SidecarState

HEARTBEAT_SECONDS = 30.0  # an unchanged report is rewritten to the file at least this often


@dataclass(frozen=True)
class SidecarReport:
    model: str
    target: str | None  # the version the report is about (the pod's target when written)
    serving: str | None  # what the server serves
    state: SidecarState
    reason: str | None = None  # why, for refused and error
    sha256: str | None = None  # digest of the target, once known
    retained: tuple[str, ...] = ()  # versions the server holds beside the serving one
    target_seen_at: float | None = None  # when the sidecar first saw this target (epoch s)
    updated_at: float = 0.0  # seconds since the epoch
    code: str | None = None  # a stable code: for refused and error, and bad_policy with ok

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def same_as(self, other: SidecarReport | None) -> bool:
        """Equal apart from the time it was written."""
        return other is not None and replace(self, updated_at=0.0) == replace(other, updated_at=0.0)

    @classmethod
    def from_json(cls, text: str | None) -> SidecarReport | None:
        """The report, or ``None`` for a missing or malformed one (a pod that has not
        reported yet, or a sidecar of another version of this contract)."""
        if not text:
            return None
        try:
            raw: Any = json.loads(text)
            state = SidecarState(raw["state"])
        except (ValueError, TypeError, KeyError, RecursionError):  # ValueError: bad JSON too
            return None
        if not isinstance(raw, dict):
            return None

        def text_or_none(key: str) -> str | None:
            value = raw.get(key)
            return value if isinstance(value, str) else None

        def seconds(key: str) -> float | None:
            value = raw.get(key)
            if isinstance(value, bool) or not isinstance(value, int | float):
                return None
            try:
                seconds = float(value)
            except OverflowError:  # an integer too large for a float
                return None
            return seconds if math.isfinite(seconds) else None

        retained = raw.get("retained")
        return cls(
            model=text_or_none("model") or "",
            target=text_or_none("target"),
            serving=text_or_none("serving"),
            state=state,
            reason=text_or_none("reason"),
            sha256=text_or_none("sha256"),
            retained=tuple(v for v in retained if isinstance(v, str))
            if isinstance(retained, list)
            else (),
            target_seen_at=seconds("target_seen_at"),
            updated_at=seconds("updated_at") or 0.0,
            code=text_or_none("code"),
        )
