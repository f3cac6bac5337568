"""What the operator needs to know about one pod, read from its Kubernetes object."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from model_sidecar.annotations import SIDECAR_STATUS, TARGET_VERSION


@dataclass(frozen=True)
class PodView:
    name: str
    target: str | None = None  # operator-set annotation
    serving: str | None = None  # sidecar report: what the server serves
    reported_target: str | None = None  # the target the sidecar's report is about
    state: str | None = None  # sidecar report: ok | fetching | loading | refused | error
    reason: str | None = None
    ready: bool = False

    def serves(self, version: str) -> bool:
        return self.ready and self.serving == version and self.state == "ok"

    def refused(self, version: str) -> bool:
        return (
            self.target == version and self.reported_target == version and (self.state == "refused")
        )

    def loading(self, version: str) -> bool:
        return self.target == version and not self.serves(version) and not self.refused(version)


def pod_view(pod: dict[str, Any]) -> PodView:
    meta = pod.get("metadata", {})
    annotations = meta.get("annotations") or {}
    try:
        report = json.loads(annotations.get(SIDECAR_STATUS) or "{}")
        if not isinstance(report, dict):
            report = {}
    except json.JSONDecodeError:
        report = {}
    conditions = (pod.get("status") or {}).get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    return PodView(
        name=meta.get("name", ""),
        target=annotations.get(TARGET_VERSION),
        serving=report.get("serving"),
        reported_target=report.get("target"),
        state=report.get("state"),
        reason=report.get("reason"),
        ready=ready and not meta.get("deletionTimestamp"),
    )
