"""The rollout history the operator keeps in ``status.history`` (most recent first), as a
table, and the questions the commands ask of it."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from model_rollout_contract.states import RolloutResult

from .table import age, table, timestamp


def entries(md: dict[str, Any]) -> list[dict[str, Any]]:
    raw = (md.get("status") or {}).get("history")
    return [e for e in raw if isinstance(e, dict)] if isinstance(raw, list) else []


def key(entry: dict[str, Any]) -> tuple[str | None, str | None]:
    """What tells one rollout from another: its version and when it started."""
    return (entry.get("version"), entry.get("startedAt"))


def keys(md: dict[str, Any]) -> set[tuple[str | None, str | None]]:
    return {key(e) for e in entries(md)}


def previous_success(md: dict[str, Any]) -> str | None:
    """The version to roll back to: the most recent Succeeded rollout of a version other
    than ``spec.version`` (the stable one during a rollout, the one before it after)."""
    current = (md.get("spec") or {}).get("version")
    for entry in entries(md):
        version = entry.get("version")
        if entry.get("result") == RolloutResult.SUCCEEDED and version and version != current:
            return str(version)
    return None


def history_order(md: dict[str, Any]) -> list[str]:
    """The versions of the recorded rollouts, oldest first: the order of versions that
    follow no published rule (model_rollout_contract.versions)."""
    return [str(e["version"]) for e in reversed(entries(md)) if e.get("version")]


def known_versions(md: dict[str, Any]) -> list[str]:
    """The versions the resource records as real: those a rollout of which
    succeeded (pods served them), the stable and previous ones, and those the operator
    found in the store (``status.verifiedVersions``). A version outside them may never
    have been published."""
    status = md.get("status") or {}
    served = [
        str(e["version"])
        for e in reversed(entries(md))
        if e.get("result") == RolloutResult.SUCCEEDED and e.get("version")
    ]
    held = [status.get("previousVersion"), status.get("currentVersion")]
    verified = status.get("verifiedVersions")
    found = verified if isinstance(verified, list) else []
    return list(dict.fromkeys(str(v) for v in [*served, *held, *found] if v))


def duration(entry: dict[str, Any], now: datetime) -> str:
    start = timestamp(entry.get("startedAt"))
    end = timestamp(entry.get("finishedAt")) or now
    if start is None:
        return "-"
    return age((end - start).total_seconds())


def history_table(md: dict[str, Any], limit: int, now: datetime) -> str:
    rows = [
        [
            str(e.get("version") or "-"),
            str(e.get("fromVersion") or "-"),
            str(e.get("startedAt") or "-"),
            str(e.get("finishedAt") or "-"),
            duration(e, now),
            str(e.get("result") or "-"),
            str(e.get("triggeredBy") or "-"),
            str(e.get("reason") or ""),
        ]
        for e in entries(md)[:limit]
    ]
    if not rows:
        return "no rollouts recorded yet"
    header = ["VERSION", "FROM", "STARTED", "FINISHED", "TOOK", "RESULT", "TRIGGERED BY", "REASON"]
    return table(header, rows)
