"""Views of more than one thing at a time: ``list`` (every ModelDeployment of a namespace,
or of all with ``-A``, as ``kubectl argo rollouts list rollouts``) and ``tree`` (a
ModelDeployment, its pods, and the versions each pod holds: serving, retained, loading)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from model_rollout_contract.states import SidecarState
from model_rollout_contract.versions import sorted_versions

from .history import entries, history_order
from .table import since, table
from .view import phase_reason, pod_objects

LOADING = (SidecarState.FETCHING, SidecarState.LOADING)


def list_row(md: dict[str, Any], now: datetime, namespaces: bool) -> list[str]:
    meta, spec = md.get("metadata") or {}, md.get("spec") or {}
    status = md.get("status") or {}
    phase = str(status.get("phase") or "Unknown")
    reason = phase_reason(status)
    last = next(iter(entries(md)), {})
    row = [
        str(meta.get("name") or "?"),
        str(spec.get("model") or "-"),
        str(status.get("currentVersion") or "-"),
        str(spec.get("version") or "-"),
        f"{status.get('readyReplicas', 0)}/{spec.get('replicas', '-')}",
        phase + (f" ({reason})" if reason else "") + _paused(md, reason),
        str((status.get("analysis") or {}).get("lastResult") or "-"),
        str(last.get("result") or "-"),
        since(meta.get("creationTimestamp"), now),
    ]
    return [str(meta.get("namespace") or "-"), *row] if namespaces else row


def _paused(md: dict[str, Any], reason: str) -> str:
    """A paused resource says so in its PHASE, also when no rollout is held (yet)."""
    paused = (md.get("spec") or {}).get("paused") is True
    return " paused" if paused and reason != "Paused" else ""


def list_table(items: list[dict[str, Any]], now: datetime, namespaces: bool) -> str:
    """One line each, by namespace and name; ``namespaces``: with a NAMESPACE column."""
    if not items:
        return "no modeldeployments found"
    header = ["NAME", "MODEL", "STABLE", "TARGET", "READY", "PHASE", "ANALYSIS", "LAST", "AGE"]
    if namespaces:
        header = ["NAMESPACE", *header]
    ordered = sorted(
        items,
        key=lambda md: (
            str((md.get("metadata") or {}).get("namespace")),
            str((md.get("metadata") or {}).get("name")),
        ),
    )
    return table(header, [list_row(md, now, namespaces) for md in ordered], last_free=False)


def held_versions(pod: dict[str, Any], history: list[str]) -> list[tuple[str, str]]:
    """(version, what the pod does with it), newest first: ``serving``, ``retained``
    (held beside it, for an instant rollback), ``loading`` (its target, being fetched
    or loaded), ``refused`` or ``error`` (its target, with the sidecar's reason)."""
    held: dict[str, str] = {}
    target, state = pod.get("target"), pod.get("state")
    if pod.get("serving"):
        held[pod["serving"]] = "serving"
    for version in pod.get("retained") or []:
        held.setdefault(version, "retained")
    if target and target not in held:
        if state in LOADING:
            held[target] = f"loading ({state})"
        elif state in (SidecarState.REFUSED, SidecarState.ERROR):
            held[target] = f"{state}: {pod.get('reason') or '-'}"
        else:
            held[target] = "target (no report yet)"
    ordered = sorted_versions(held, history)[::-1]
    return [(v, held[v]) for v in ordered]


def tree(md: dict[str, Any], pods: list[dict[str, Any]]) -> str:
    """The resource, each pod, and each pod's versions, as a tree."""
    meta, spec = md.get("metadata") or {}, md.get("spec") or {}
    status = md.get("status") or {}
    history = history_order(md)
    phase = str(status.get("phase") or "Unknown")
    reason = phase_reason(status)
    lines = [
        f"modeldeployment/{meta.get('name')}  {phase}"
        + (f" ({reason})" if reason else "")
        + f"  model {spec.get('model', '-')}  target {spec.get('version', '-')}"
        f"  stable {status.get('currentVersion') or '-'}"
    ]
    objects = pod_objects(pods)
    if not objects:
        lines.append("└── no pods")
    for i, pod in enumerate(objects):
        last_pod = i == len(objects) - 1
        ready = "ready" if pod["ready"] else "not ready"
        lines.append(f"{'└──' if last_pod else '├──'} pod/{pod['name']}  {ready}")
        versions = held_versions(pod, history)
        stem = "    " if last_pod else "│   "
        for j, (version, what) in enumerate(versions):
            branch = "└──" if j == len(versions) - 1 else "├──"
            lines.append(f"{stem}{branch} {version}  {what}")
    return "\n".join(lines)
