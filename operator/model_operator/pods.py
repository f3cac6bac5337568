"""What the operator needs to know about one pod, read from its Kubernetes object."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from model_rollout_contract.annotations import SIDECAR_STATUS, TARGET_VERSION
from model_rollout_contract.canary import TRAFFIC_POLICY
from model_rollout_contract.report import SidecarReport
from model_rollout_contract.states import SidecarState


@dataclass(frozen=True)
class PodView:
    name: str
    target: str | None = None  # operator-set annotation
    serving: str | None = None  # sidecar report: what the server serves
    reported_target: str | None = None  # the target the sidecar's report is about
    state: SidecarState | None = None  # sidecar report
    reason: str | None = None
    ready: bool = False
    retained: tuple[str, ...] = ()  # sidecar report: versions its server holds besides
    seen_at: float | None = None  # sidecar report: when it saw ``reported_target``
    policy: str | None = None  # operator-set traffic policy annotation
    ip: str | None = None  # status.podIP: where the operator reads its server's /metrics

    def holds(self, version: str) -> bool:
        """Swapping to ``version`` is a pointer swap: the server has it loaded."""
        return self.serving == version or version in self.retained

    def serves(self, version: str) -> bool:
        return self.ready and self.serving == version and self.state is SidecarState.OK

    def refused(self, version: str) -> bool:
        return (
            self.target == version
            and self.reported_target == version
            and self.state is SidecarState.REFUSED
        )

    def loading(self, version: str) -> bool:
        return self.target == version and not self.serves(version) and not self.refused(version)


def pod_view(pod: Mapping[str, Any]) -> PodView:
    meta = pod.get("metadata", {})
    annotations = meta.get("annotations") or {}
    report = SidecarReport.from_json(annotations.get(SIDECAR_STATUS))
    conditions = (pod.get("status") or {}).get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    return PodView(
        name=meta.get("name", ""),
        target=annotations.get(TARGET_VERSION),
        serving=report.serving if report else None,
        reported_target=report.target if report else None,
        state=report.state if report else None,
        reason=report.reason if report else None,
        retained=report.retained if report else (),
        seen_at=report.target_seen_at if report else None,
        ready=ready and not meta.get("deletionTimestamp"),
        policy=annotations.get(TRAFFIC_POLICY),
        ip=(pod.get("status") or {}).get("podIP"),
    )
