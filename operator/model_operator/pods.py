"""What the operator needs to know about one pod, read from its Kubernetes object."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from model_rollout_contract.annotations import TEMPLATE_LABEL
from model_rollout_contract.report import SidecarReport
from model_rollout_contract.states import SidecarState
from model_rollout_contract.tracks import DEFAULT_TRACK, TrackKeys


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
    code: str | None = None  # sidecar report: the stable word for ``reason``
    # metadata.creationTimestamp (epoch seconds): a pod created mid-rollout (a scale-up, a
    # replacement) cannot have seen a target before it existed (the planner's deadlines)
    created_at: float | None = None
    # every annotation of the pod, for the views of its other tracks (tenant models); a
    # part of its equality, so that an index keeping views sees a tenant track's change
    annotations: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    # the scheduler cannot place it: its PodScheduled condition's (reason, message)
    unscheduled: tuple[str, str] | None = None
    # its TEMPLATE_LABEL: which pod template's Deployment it belongs to (template_rollout)
    template: str | None = None

    def of_track(self, keys: TrackKeys) -> PodView:
        """The same pod as one track's rollout sees it: that track's target, policy and
        sidecar report (readiness and address are the pod's)."""
        if keys == DEFAULT_TRACK:
            return self
        view = _view(self.name, dict(self.annotations), self.ready, self.ip, keys, self.created_at)
        return replace(view, unscheduled=self.unscheduled, template=self.template)

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

    def loads(self, target: str | None) -> bool:
        """Pointed at ``target``, would its server load it (fetch and warm up a version it
        does not hold)? What ``maxConcurrentLoads`` caps; a pointer swap is no load, nor
        is a target its sidecar refused."""
        if target is None or self.serving == target or target in self.retained:
            return False
        return not (self.reported_target == target and self.state is SidecarState.REFUSED)


def pod_view(pod: Mapping[str, Any]) -> PodView:
    meta = pod.get("metadata", {})
    conditions = (pod.get("status") or {}).get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    view = _view(
        meta.get("name", ""),
        dict(meta.get("annotations") or {}),
        ready and not meta.get("deletionTimestamp"),
        (pod.get("status") or {}).get("podIP"),
        DEFAULT_TRACK,
        _epoch(meta.get("creationTimestamp")),
    )
    template = (meta.get("labels") or {}).get(TEMPLATE_LABEL)
    return replace(view, unscheduled=unscheduled(conditions), template=template)


def unscheduled(conditions: list[dict[str, Any]]) -> tuple[str, str] | None:
    """Why the scheduler has not placed the pod (its PodScheduled condition, False:
    reason ``Unschedulable`` or ``SchedulingGated``, and the scheduler's message), or
    ``None`` when it has, or has not said yet."""
    for condition in conditions:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            return str(condition.get("reason") or "Unschedulable"), str(
                condition.get("message") or ""
            )
    return None


def _epoch(timestamp: object) -> float | None:
    """An API timestamp (``2026-12-06T08:50:31Z``) in epoch seconds; ``None`` if it is not one."""
    if not isinstance(timestamp, str):
        return None
    try:
        parsed = datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed.timestamp() if parsed.tzinfo is not None else None


def _view(
    name: str,
    annotations: Mapping[str, str],
    ready: bool,
    ip: str | None,
    keys: TrackKeys,
    created_at: float | None = None,
) -> PodView:
    report = SidecarReport.from_json(annotations.get(keys.sidecar_status))
    return PodView(
        name=name,
        target=annotations.get(keys.target),
        serving=report.serving if report else None,
        reported_target=report.target if report else None,
        state=report.state if report else None,
        reason=report.reason if report else None,
        code=report.code if report else None,
        retained=report.retained if report else (),
        seen_at=report.target_seen_at if report else None,
        ready=ready,
        policy=annotations.get(keys.traffic),
        ip=ip,
        created_at=created_at,
        annotations=tuple(sorted(annotations.items())),
    )
