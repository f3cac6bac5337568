"""The status view of one ModelDeployment (``kubectl model status``): phase, versions,
each tenant model's rollout, pods per serving version, the canary analysis, recent
history and events, as the demo shows a rollout. Colour only on a terminal that wants
it; the same words otherwise."""

from __future__ import annotations

import os
import time
from collections import Counter
from datetime import datetime
from typing import Any, TextIO

from model_rollout_contract.annotations import (
    PROMOTE,
    SIDECAR_STATUS,
    TARGET_VERSION,
    promotion_id,
)
from model_rollout_contract.report import SidecarReport
from model_rollout_contract.states import CanaryStep, Phase, RolloutStage
from model_rollout_contract.versions import sorted_versions

from .history import entries, history_order
from .table import cut, since, table
from .tenants import NO_REPORT, tenant_lines, tenant_tracks

RECENT_EVENTS = 8
RECENT_HISTORY = 5
_COLOURS = {
    Phase.AVAILABLE: "32",  # green
    Phase.CANARY: "33",  # yellow
    Phase.PROGRESSING: "33",
    Phase.ROLLING_BACK: "33",
    Phase.DEGRADED: "31",  # red
    Phase.INVALID: "31",
    "Warning": "31",
}


def by_version(counts: dict[str, int], md: dict[str, Any]) -> list[tuple[str, int]]:
    """Counts per version, oldest version first (the contract's order; the rollout
    history's where the versions have none, such as git SHAs)."""
    versions = sorted_versions(set(counts) - {NO_REPORT}, history_order(md))
    return [(v, counts[v]) for v in [NO_REPORT, *versions] if v in counts]


def wants_colour(stream: TextIO) -> bool:
    """A terminal, and no NO_COLOR (https://no-color.org) or dumb TERM."""
    isatty = getattr(stream, "isatty", None)
    return bool(
        isatty is not None
        and isatty()
        and "NO_COLOR" not in os.environ
        and os.environ.get("TERM") != "dumb"
    )


def paint(text: str, key: str, colour: bool) -> str:
    code = _COLOURS.get(key)
    return f"\x1b[{code}m{text}\x1b[0m" if colour and code else text


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    for c in status.get("conditions") or []:
        if isinstance(c, dict) and c.get("type") == kind:
            return c
    return {}


def phase_reason(status: dict[str, Any]) -> str:
    """The planner's reason for the phase (CanaryPause, AwaitingPromotion, ...)."""
    for kind in ("Progressing", "Degraded"):
        c = condition(status, kind)
        if c.get("status") == "True":
            return str(c.get("reason") or "")
    return ""


def paused_text(md: dict[str, Any]) -> str | None:
    """What ``spec.paused`` holds, for the views (``None``: not paused): the operator's
    ``Paused`` condition, once it has seen the spec."""
    if (md.get("spec") or {}).get("paused") is not True:
        return None
    name = (md.get("metadata") or {}).get("name")
    held = condition(md.get("status") or {}, "Paused")
    said = str(held.get("message") or "") if held.get("status") == "True" else ""
    return f"yes (kubectl model resume {name}): {said or 'spec.paused is true'}"


def analysis_text(analysis: dict[str, Any], colour: bool) -> str:
    """The last canary analysis of a rollout: its result, checks and why."""
    result = str(analysis.get("lastResult") or "no check yet")
    return (
        f"{paint(result, 'Warning' if result == 'Failed' else '', colour)}"
        f" ({analysis.get('checks', 0)} checks, {analysis.get('failures', 0)} failed)"
        + (f": {cut(str(analysis['message']), 140)}" if analysis.get("message") else "")
    )


def canary_step_text(rollout: dict[str, Any]) -> str | None:
    """The canary's step (``status.rollout.canaryStep``) and how its shadow step went,
    for a rollout whose canary has a shadow step (``None``: none, or no canary now)."""
    step, shadow = rollout.get("canaryStep"), rollout.get("shadowResult")
    stage = rollout.get("stage")
    if stage not in (RolloutStage.CANARY, RolloutStage.FAILED) or step not in tuple(CanaryStep):
        return None
    if step == CanaryStep.LIVE and not shadow:
        return None  # a canary live from the start: no steps to tell apart
    if stage == RolloutStage.FAILED:
        if not rollout.get("rolledBack") or rollout.get("batch"):
            return None  # a load refused, or rolled back in the batches: no canary step
        ended = f"{step} (rolled back in this step"
        return ended + ("; no user got an answer of the candidate)" if step == "shadow" else ")")
    if step == CanaryStep.SHADOW:
        return "shadow (the candidate answers only mirrored requests; live after a passed check)"
    return f"live (shadow step {shadow})"


def lag(md: dict[str, Any]) -> str | None:
    """Why the status may not describe the spec shown beside it: the operator has not yet
    acted on the resource's latest generation (``None``: it has)."""
    generation = (md.get("metadata") or {}).get("generation")
    observed = (md.get("status") or {}).get("observedGeneration")
    if isinstance(generation, int) and isinstance(observed, int) and observed < generation:
        return f"the operator has not yet acted on generation {generation} (status of {observed})"
    return None


def pod_objects(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each pod as the view shows it, by name: ready, the version its server serves, the
    versions it retains beside it, its target, the sidecar's state and why."""
    objects = []
    for pod in sorted(pods, key=lambda p: str((p.get("metadata") or {}).get("name"))):
        meta = pod.get("metadata") or {}
        annotations = meta.get("annotations") or {}
        report = SidecarReport.from_json(annotations.get(SIDECAR_STATUS))
        conditions = (pod.get("status") or {}).get("conditions") or []
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
        objects.append(
            {
                "name": str(meta.get("name") or "?"),
                "ready": ready,
                "serving": report.serving if report else None,
                "retained": list(report.retained) if report else [],
                "target": annotations.get(TARGET_VERSION),
                "state": str(report.state) if report else None,
                "reason": report.reason if report else None,
            }
        )
    return objects


def pod_rows(pods: list[dict[str, Any]]) -> list[list[str]]:
    return [
        [
            p["name"],
            "True" if p["ready"] else "False",
            p["serving"] or "-",
            str(p["target"] or "-"),
            p["state"] or "-",
            p["reason"] or "",
        ]
        for p in pod_objects(pods)
    ]


def event_objects(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events the view shows (the most recent :data:`RECENT_EVENTS`, oldest first)."""
    return [
        {
            "time": _event_time(e),
            "type": str(e.get("type") or "Normal"),
            "reason": str(e.get("reason") or ""),
            "message": str(e.get("message") or ""),
            "count": e.get("count"),
        }
        for e in events[-RECENT_EVENTS:]
    ]


def render(
    md: dict[str, Any],
    pods: list[dict[str, Any]],
    events: list[dict[str, Any]],
    now: datetime,
    colour: bool = False,
) -> str:
    meta, spec = md.get("metadata") or {}, md.get("spec") or {}
    status = md.get("status") or {}
    name = str(meta.get("name"))
    phase = str(status.get("phase") or "Unknown")
    reason = phase_reason(status)
    behind = lag(md)
    shown = f"{paint(phase, phase, colour)}" + (f" ({reason})" if reason else "")
    if behind is not None:  # the phase is of an older spec: never shown as this one's
        shown = f"{paint('Pending', Phase.PROGRESSING, colour)} ({behind}; it said {phase})"
    working_on = status.get("targetVersion")
    target = str(spec.get("version", "-"))
    if behind is not None and working_on and working_on != target:
        target += f"   (the operator still works toward {working_on})"
    lines = [
        f"Name:        {name}",
        f"Namespace:   {meta.get('namespace', '-')}",
        f"Model:       {spec.get('model', '-')}",
        f"Phase:       {shown}",
        f"Message:     {cut(str(status.get('message') or '-'), 160)}",
        f"Stable:      {status.get('currentVersion') or '-'}"
        f"   (previous {status.get('previousVersion') or '-'})",
        f"Target:      {target}",
        f"Replicas:    {spec.get('replicas', '-')} desired | {status.get('readyReplicas', 0)} "
        f"ready | {status.get('updatedReplicas', 0)} updated",
    ]
    paused = paused_text(md)
    if paused is not None:
        lines.append(f"Paused:      {cut(paused, 200)}")
    versions = status.get("versions") or {}
    if versions:
        lines.append(
            "Serving:     " + "  ".join(f"{v}: {n} pods" for v, n in by_version(versions, md))
        )
    rollout = status.get("rollout") or {}
    raw_template = status.get("templateRollout")
    template: dict[str, Any] = raw_template if isinstance(raw_template, dict) else {}
    if template:
        ends = [template.get(end) for end in ("from", "to")]
        moving = [end.get("deployment", "-") if isinstance(end, dict) else "-" for end in ends]
        lines.append(
            f"Template:    {moving[0]} -> {moving[1]}"
            f"   ({template.get('stage', '-')}, {template.get('wanted', 0)} pods wanted; "
            "an image change)"
        )
    if reason == "AwaitingPromotion" and template.get("promoteWith"):
        value = str(template["promoteWith"])
        lines.append(f"Promote:     kubectl model promote {name}   ({PROMOTE}={value})")
    elif reason == "AwaitingPromotion" and rollout.get("toVersion"):
        value = promotion_id(str(rollout["toVersion"]), float(rollout.get("startedAt") or 0))
        lines.append(f"Promote:     kubectl model promote {name}   ({PROMOTE}={value})")
    step = canary_step_text(rollout)
    if step is not None:
        lines.append(f"Canary step: {cut(step, 160)}")
    analysis = status.get("analysis") or {}
    if analysis:  # a version canary's, or (kind template) an image change's canary's
        whose = "pod template canary: " if analysis.get("kind") == "template" else ""
        lines.append(f"Analysis:    {whose}{analysis_text(analysis, colour)}")
    tracks = tenant_tracks(md, pods)
    if tracks:  # only a resource with tenant models has the section
        lines += tenant_lines(name, tracks, phase_reason, lambda a: analysis_text(a, colour))
    lines += ["", "Pods:"]
    rows = pod_rows(pods)
    header = ["NAME", "READY", "SERVING", "TARGET", "STATE", "REASON"]
    lines += _indent(table(header, rows)) if rows else ["  none"]
    counted = Counter(r[2] for r in rows)
    if rows:
        lines.append("  by version: " + "  ".join(f"{v}={n}" for v, n in by_version(counted, md)))
    history = entries(md)[:RECENT_HISTORY]
    lines += ["", "History (most recent first):"]
    if history:
        lines += _indent(
            table(
                ["VERSION", "STARTED", "RESULT", "TRIGGERED BY", "REASON"],
                [
                    [
                        str(e.get("version") or "-"),
                        since(e.get("startedAt"), now) + " ago",
                        paint(str(e.get("result") or "-"), "", colour),
                        str(e.get("triggeredBy") or "-"),
                        str(e.get("reason") or ""),
                    ]
                    for e in history
                ],
            )
        )
    else:
        lines.append("  none")
    recent = events[-RECENT_EVENTS:]
    lines += ["", "Events:"]
    if recent:
        lines += _indent(
            table(
                ["AGE", "TYPE", "REASON", "MESSAGE"],
                [
                    [
                        since(_event_time(e), now),
                        str(e.get("type") or "Normal"),
                        str(e.get("reason") or ""),
                        str(e.get("message") or ""),
                    ]
                    for e in recent
                ],
            )
        )
    else:
        lines.append("  none")
    return "\n".join(lines)


def _event_time(event: dict[str, Any]) -> object:
    return (
        event.get("lastTimestamp")
        or event.get("eventTime")
        or event.get("firstTimestamp")
        or (event.get("metadata") or {}).get("creationTimestamp")
    )


def _indent(text: str) -> list[str]:
    return ["  " + line for line in text.splitlines()]


def progress_line(md: dict[str, Any], elapsed_s: float) -> str:
    """One line of a followed rollout, for a CI log: what changed since the last one."""
    status = md.get("status") or {}
    versions = status.get("versions") or {}
    serving = " ".join(f"{v}={n}" for v, n in by_version(versions, md)) or "none"
    reason = phase_reason(status)
    return (
        f"[{elapsed_s:6.1f}s] {status.get('phase') or 'Pending'}"
        + (f"/{reason}" if reason else "")
        + f": {cut(str(status.get('message') or ''), 120)} | pods serving {serving}"
    )


class Progress:
    """Prints :func:`progress_line` for each state read that changed the line's words
    (not its clock): a rollout followed in a CI log reads as its steps."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.started = time.monotonic()
        self.last: str | None = None

    def __call__(self, md: dict[str, Any]) -> None:
        line = progress_line(md, time.monotonic() - self.started)
        words = line.split("] ", 1)[1]
        if words != self.last:
            print(line, file=self.out, flush=True)
            self.last = words
