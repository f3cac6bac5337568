"""The tenant models of a ModelDeployment as ``kubectl model status`` shows them.

Each of ``spec.tenants.models`` is a track with its own staged rollout on the same pods:
the operator keeps its state in ``status.tenants.<track>`` (the fields the resource's own
rollout has at the top level) and tells the pods, and hears from their sidecars, through
the track's own annotations (model_rollout_contract.tracks). Without this section a
platform team rolling out one tenant's model would see nothing of it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from model_rollout_contract.annotations import promotion_id
from model_rollout_contract.report import SidecarReport
from model_rollout_contract.tracks import InvalidTrack, TrackKeys, track_keys
from model_rollout_contract.versions import sorted_versions

from .table import table

NO_REPORT = "-"  # a pod whose sidecar for the track has not reported (yet)


@dataclass(frozen=True)
class TenantTrack:
    """One tenant model's rollout: what its spec asks, what the operator says of it, and
    what the pods' sidecars for it report."""

    track: str
    model: str  # tenant/model
    desired: str  # its spec version ("-": gone from the spec, its status not yet)
    status: dict[str, Any]  # its entry in status.tenants ({} before the operator's first pass)
    pods: dict[str, int] = field(default_factory=dict)  # serving version -> pods


def _keys(track: str) -> TrackKeys | None:
    try:
        return track_keys(track)
    except InvalidTrack:  # not a name the operator would have accepted: no annotations
        return None


def _pods_by_version(pods: list[dict[str, Any]], keys: TrackKeys | None) -> dict[str, int]:
    """Pods per version the track's sidecar reports serving (:data:`NO_REPORT` for pods
    without a report), as the default track's "by version" line counts them."""
    if keys is None:
        return {}
    counted: Counter[str] = Counter()
    for pod in pods:
        annotations = (pod.get("metadata") or {}).get("annotations") or {}
        report = SidecarReport.from_json(annotations.get(keys.sidecar_status))
        counted[(report.serving if report else None) or NO_REPORT] += 1
    order = [NO_REPORT, *sorted_versions(set(counted) - {NO_REPORT})]
    return {v: counted[v] for v in order if v in counted}


def tenant_tracks(md: dict[str, Any], pods: list[dict[str, Any]]) -> list[TenantTrack]:
    """The spec's tenant models in its order, then any track the status still has that
    the spec no longer lists (the operator drops it on its next pass)."""
    models = ((md.get("spec") or {}).get("tenants") or {}).get("models") or []
    states = (md.get("status") or {}).get("tenants") or {}
    states = states if isinstance(states, dict) else {}
    tracks: list[TenantTrack] = []
    for entry in models:
        if not isinstance(entry, dict) or not entry.get("name"):
            continue
        track = str(entry["name"])
        status = states.get(track)
        tracks.append(
            TenantTrack(
                track,
                f"{entry.get('tenant', '?')}/{entry.get('model', '?')}",
                str(entry.get("version") or "-"),
                status if isinstance(status, dict) else {},
                _pods_by_version(pods, _keys(track)),
            )
        )
    listed = {t.track for t in tracks}
    for track in sorted(set(states) - listed):
        status = states[track] if isinstance(states[track], dict) else {}
        model = str(status.get("model") or "?")
        tracks.append(TenantTrack(track, model, "-", status, _pods_by_version(pods, _keys(track))))
    return tracks


def _versions(counts: dict[str, int]) -> str:
    return " ".join(f"{v}={n}" for v, n in counts.items()) or "none"


def tenant_lines(
    name: str,
    tracks: list[TenantTrack],
    phase_reason: Callable[[dict[str, Any]], str],
    analysis_text: Callable[[dict[str, Any]], str],
) -> list[str]:
    """The "Tenants:" section, a row per track and, under the table, what a person may
    act on: the command that promotes a track's held canary (and the annotation it
    writes), and its analysis.
    ``phase_reason`` and ``analysis_text`` are the view's own, so a track reads as the
    deployment's model does."""
    rows: list[list[str]] = []
    notes: list[str] = []
    for t in tracks:
        phase = str(t.status.get("phase") or "Pending")
        reason = phase_reason(t.status)
        rows.append(
            [
                t.track,
                t.model,
                t.desired,
                str(t.status.get("currentVersion") or "-"),
                phase + (f" ({reason})" if reason else ""),
                _versions(t.pods),
                str(t.status.get("message") or ""),
            ]
        )
        rollout = t.status.get("rollout") or {}
        keys = _keys(t.track)
        if reason == "AwaitingPromotion" and rollout.get("toVersion") and keys is not None:
            value = promotion_id(str(rollout["toVersion"]), float(rollout.get("startedAt") or 0))
            notes.append(
                f"promote {t.track}: kubectl model promote {name} --track {t.track}   "
                f"({keys.promote}={value})"
            )
        analysis = t.status.get("analysis") or {}
        if analysis:
            notes.append(f"analysis {t.track}: {analysis_text(analysis)}")
    header = ["TRACK", "TENANT/MODEL", "DESIRED", "STABLE", "PHASE", "PODS", "MESSAGE"]
    return ["", "Tenants:", *("  " + line for line in table(header, rows).splitlines())] + [
        "  " + note for note in notes
    ]
