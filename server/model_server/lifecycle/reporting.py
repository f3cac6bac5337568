"""What the server says about a load, swap or rollback — metrics, the audit log and the
log — in one place, fed by one :class:`LifecycleEvent` record."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from model_server.errors import ServingError
from model_server.lifecycle.model_slot import ModelSlot
from model_server.observability.audit import AuditEvent, AuditLog
from model_server.observability.metrics import ServerMetrics

log = logging.getLogger("model_server.lifecycle")


@dataclass(frozen=True)
class LifecycleEvent:
    action: str  # load | rollback
    slot: ModelSlot
    version: str
    who: str  # admin, startup, socket:uid=…,pid=…
    source: str  # http | socket | startup
    result: str  # success | failure | noop
    from_version: str | None = None
    digest: str | None = None
    duration_s: float = 0.0
    error: ServingError | None = None  # for failures
    # a load's seconds per stage (load_stages), adding up to duration_s
    stages_s: Mapping[str, float] = field(default_factory=dict)


class Reporter:
    def __init__(self, metrics: ServerMetrics, audit: AuditLog) -> None:
        self.metrics = metrics
        self.audit = audit

    def report(self, event: LifecycleEvent) -> None:
        model = event.slot.key
        self._count(event)
        self.audit.record(
            AuditEvent(
                event.action,
                model,
                event.version,
                event.who,
                event.source,
                event.result,
                from_version=event.from_version,
                digest=event.digest,
                duration_s=round(event.duration_s, 6),
                error=event.error.message if event.error else None,
            )
        )
        # the fields a JSON line carries beside the message (--log-format json)
        fields = {"model": model, "version": event.version, "action": event.action}
        if event.result == "success":
            log.info(
                "%s now serves %s (was %s) after %.1f ms",
                model,
                event.version,
                event.from_version,
                event.duration_s * 1000,
                extra=fields,
            )
        elif event.result == "failure" and event.error is not None:
            log.warning(
                "refused %s:%s, still serving %s: %s",
                model,
                event.version,
                event.from_version,
                event.error.message,
                extra={**fields, "code": event.error.code},
            )

    def _count(self, event: LifecycleEvent) -> None:
        model, m = event.slot.key, self.metrics
        if event.result == "failure":
            m.reload_failure.labels(model, event.error.code if event.error else "unknown").inc()
            return
        if event.result != "success":
            return
        m.reload_success.labels(model).inc()
        if event.action == "load":
            m.load_duration.labels(model).observe(event.duration_s)
            for stage, seconds in event.stages_s.items():
                m.load_stage_duration.labels(model, stage).observe(seconds)
