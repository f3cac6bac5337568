"""``.status`` of a ModelDeployment, built from a plan and the observed pods."""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timezone
from typing import Any

from .planner import Plan
from .pods import PodView


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(
    type_: str, ok: bool, reason: str, message: str, now: float, existing: list[dict[str, Any]]
) -> dict[str, Any]:
    """A condition whose lastTransitionTime only moves when its status flips."""
    status = "True" if ok else "False"
    before = next((c for c in existing if c.get("type") == type_), None)
    since = before.get("lastTransitionTime") if before and before.get("status") == status else None
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since or iso(now),
    }


def build_status(
    plan: Plan,
    pods: list[PodView],
    replicas: int,
    generation: int | None,
    now: float,
    existing_conditions: list[dict[str, Any]],
) -> dict[str, Any]:
    versions = Counter(p.serving for p in pods if p.serving)
    ready = sum(p.ready for p in pods)
    target = plan.state.to_version
    rolling = plan.phase in ("Progressing", "Canary", "RollingBack")
    degraded = plan.phase == "Degraded"
    conditions = [
        condition("SpecValid", True, "Valid", "spec accepted", now, existing_conditions),
        condition(
            "Progressing",
            rolling,
            plan.reason if rolling else "Idle",
            plan.message if rolling else "no rollout in progress",
            now,
            existing_conditions,
        ),
        condition(
            "Available",
            ready >= max(1, replicas) or replicas == 0,
            "MinimumReplicasAvailable" if pods else "NoPods",
            f"{ready}/{replicas} pods ready",
            now,
            existing_conditions,
        ),
        condition(
            "Degraded",
            degraded,
            plan.reason if degraded else "Healthy",
            plan.message if degraded else "no failures",
            now,
            existing_conditions,
        ),
    ]
    status: dict[str, Any] = {
        "phase": plan.phase,
        "message": plan.message,
        "currentVersion": plan.stable_version,
        "previousVersion": plan.previous_version,
        "targetVersion": target,
        "replicas": len(pods),
        "readyReplicas": ready,
        "updatedReplicas": sum(p.serves(target) for p in pods),
        "versions": dict(sorted(versions.items())),
        "rollout": plan.state.to_status(),
        "conditions": conditions,
        "lastUpdateTime": iso(now),
    }
    if generation is not None:
        status["observedGeneration"] = generation
    return status


def invalid_status(
    problems: list[str],
    generation: int | None,
    now: float,
    existing_conditions: list[dict[str, Any]],
) -> dict[str, Any]:
    """Only the verdict changes; versions, counts and the rollout state are left alone."""
    message = "; ".join(problems)
    status: dict[str, Any] = {
        "phase": "Invalid",
        "message": message,
        "conditions": [
            condition("SpecValid", False, "InvalidSpec", message, now, existing_conditions),
            *[c for c in existing_conditions if c.get("type") in ("Progressing", "Available")],
            condition("Degraded", True, "InvalidSpec", message, now, existing_conditions),
        ],
    }
    if generation is not None:
        status["observedGeneration"] = generation
    return status


def merge_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``new`` as an RFC 7386 merge patch over ``old``: keys that disappeared become
    ``None`` (deletions), recursively; lists are replaced whole."""
    patch: dict[str, Any] = {key: None for key in old if key not in new}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, dict) and isinstance(before, dict):
            patch[key] = merge_patch(before, value)
        else:
            patch[key] = value
    return patch
