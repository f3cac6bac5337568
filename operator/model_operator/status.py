"""``.status`` of a ModelDeployment: built from a plan and the observed pods, and the
rollout state persisted to and read back from it (which is what makes the operator
restart-safe)."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from datetime import datetime, timezone
from typing import Any

from model_rollout_contract.states import (
    CanaryStep,
    ConditionType,
    Phase,
    RolloutStage,
    SidecarState,
)

from .planner import PAUSED_REASON, Plan, RolloutState
from .pods import PodView


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(w.title() for w in rest)


_ROLLOUT_KEYS = {_camel(k): k for k in RolloutState.__dataclass_fields__}


def rollout_to_status(state: RolloutState) -> dict[str, Any]:
    """``status.rollout``: the state's fields in camelCase, enums as their values."""
    return {
        _camel(k): (str(v) if isinstance(v, (RolloutStage, CanaryStep)) else v)
        for k, v in asdict(state).items()
    }


def rollout_from_status(raw: Any) -> RolloutState | None:
    """The state ``rollout_to_status`` wrote, or ``None`` for a missing or foreign one."""
    if not isinstance(raw, dict) or not isinstance(raw.get("toVersion"), str):
        return None
    fields = {_ROLLOUT_KEYS[k]: v for k, v in raw.items() if k in _ROLLOUT_KEYS}
    try:
        fields["stage"] = RolloutStage(fields.get("stage", RolloutStage.BATCHES))
        # stored before the canary had steps: its canary was live from the start
        fields["canary_step"] = CanaryStep(fields.get("canary_step", CanaryStep.LIVE))
        return RolloutState(**fields)
    except (TypeError, ValueError):
        return None


# whether the sidecars check signatures (False only with spec.allowUnsigned); a condition
# of its own, so that running unsigned is visible wherever conditions are read
SIGNATURES_VERIFIED = ConditionType.SIGNATURES_VERIFIED
UNSIGNED_REASON = "AllowUnsigned"
UNSIGNED_MESSAGE = (
    "spec.allowUnsigned: the sidecars load model versions without checking their signatures"
    " (development only)"
)


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(
    type_: ConditionType | str,
    ok: bool,
    reason: str,
    message: str,
    now: float,
    existing: list[dict[str, Any]],
) -> dict[str, Any]:
    """A condition whose lastTransitionTime only moves when its status flips."""
    status = "True" if ok else "False"
    before = next((c for c in existing if c.get("type") == type_), None)
    since = before.get("lastTransitionTime") if before and before.get("status") == status else None
    return {
        "type": str(type_),
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since or iso(now),
    }


def signatures_condition(
    signing_key: str | None, now: float, existing: list[dict[str, Any]]
) -> dict[str, Any]:
    """``signing_key``: the Secret the sidecars verify against; ``None``: unsigned."""
    if signing_key is None:
        return condition(
            SIGNATURES_VERIFIED, False, UNSIGNED_REASON, UNSIGNED_MESSAGE, now, existing
        )
    message = f"the sidecars verify each version's Ed25519 signature (Secret {signing_key})"
    return condition(SIGNATURES_VERIFIED, True, "PublicKey", message, now, existing)


def was_unsigned(existing: list[dict[str, Any]]) -> bool:
    """Did the status already say so? (The Warning event is posted once, on the change.)"""
    return any(
        c.get("type") == SIGNATURES_VERIFIED and c.get("status") == "False" for c in existing
    )


# the sidecar report codes that say the model store lacks the version or cannot be read,
# and the StoreReachable reason each gives
STORE_CODES = {
    "not_found": "NotInStore",
    "store_unreachable": "StoreUnreachable",
    "store_error": "StoreUnreachable",
    "bad_credentials": "StoreUnreachable",
}
NOT_CHECKED_MESSAGE = (
    "the operator did not check the model store for the target version (a volume store,"
    " or store checks off); no pod reports it missing"
)


def store_condition(
    target: str,
    pods: list[PodView],
    problem: str | None,
    checked: bool,
    now: float,
    existing: list[dict[str, Any]],
) -> dict[str, Any]:
    """``StoreReachable``: what the operator's own check found (``problem``: it could
    not ask; ``checked``: it found the target), and what the pods' sidecars report of
    the target: a pod that cannot fetch it contradicts any claim that the store has it."""
    failing = [
        p
        for p in pods
        if p.reported_target == target
        and p.state in (SidecarState.REFUSED, SidecarState.ERROR)
        and p.code in STORE_CODES
    ]
    if problem is not None:
        return condition(
            ConditionType.STORE_REACHABLE, False, "StoreUnreachable", problem, now, existing
        )
    if failing:
        first = failing[0]
        more = f" (and {len(failing) - 1} more pods)" if len(failing) > 1 else ""
        message = f"pod {first.name} cannot fetch {target}: {first.reason or first.code}{more}"
        reason = STORE_CODES[str(first.code)]
        return condition(ConditionType.STORE_REACHABLE, False, reason, message, now, existing)
    if not checked:
        return condition(
            ConditionType.STORE_REACHABLE, True, "NotChecked", NOT_CHECKED_MESSAGE, now, existing
        )
    return condition(
        ConditionType.STORE_REACHABLE,
        True,
        "Reachable",
        "the target version is in the model store",
        now,
        existing,
    )


PAUSED_IDLE_MESSAGE = (
    "spec.paused: no rollout is held now (none runs, or a fast one, which pause never holds);"
    " one that starts waits for kubectl model resume"
)


def paused_condition(
    paused: bool, plan: Plan, now: float, existing: list[dict[str, Any]]
) -> dict[str, Any]:
    """``Paused``: True while ``spec.paused`` is set (``kubectl model pause``), saying what
    it holds; False, reason ``NotPaused``, otherwise (as Argo Rollouts' condition)."""
    if not paused:
        return condition(
            ConditionType.PAUSED, False, "NotPaused", "spec.paused is false", now, existing
        )
    message = plan.message if plan.reason == PAUSED_REASON else PAUSED_IDLE_MESSAGE
    return condition(ConditionType.PAUSED, True, "RolloutPaused", message, now, existing)


def schedulable_condition(
    pods: list[PodView], now: float, existing: list[dict[str, Any]], refused: str | None = None
) -> dict[str, Any]:
    """``PodsSchedulable``: False while the scheduler cannot place a pod, with its
    reason (``Unschedulable``, ``SchedulingGated``) and its message, which names why (no
    node matches the selector or affinity, an untolerated taint, too few GPUs); or while
    the API server refuses to create pods (``refused``: the Deployment's words, reason
    ``FailedCreate``)."""
    if refused is not None:
        message = f"pods cannot be created: {refused}"
        return condition(
            ConditionType.PODS_SCHEDULABLE, False, "FailedCreate", message, now, existing
        )
    waiting = [p for p in pods if p.unscheduled is not None]
    if not waiting:
        return condition(
            ConditionType.PODS_SCHEDULABLE, True, "Scheduled", "no pod waits for a node", now,
            existing,
        )  # fmt: skip
    first = waiting[0]
    reason, why = first.unscheduled or ("Unschedulable", "")
    more = f" (and {len(waiting) - 1} more pods)" if len(waiting) > 1 else ""
    message = f"pod {first.name} cannot be scheduled: {why or reason}{more}"
    return condition(ConditionType.PODS_SCHEDULABLE, False, reason, message, now, existing)


def build_status(
    plan: Plan,
    pods: list[PodView],
    replicas: int,
    generation: int | None,
    now: float,
    existing_conditions: list[dict[str, Any]],
    *,
    signing_key: str | None,
    foreign: list[str] | None = None,
    store_problem: str | None = None,
    store_checked: bool = True,
    paused: bool = False,
    pods_refused: str | None = None,
) -> dict[str, Any]:
    """``paused``: ``spec.paused``; ``pods_refused``: why the API server refuses to
    create the Deployment's pods; ``signing_key``: the sidecars' public key Secret,
    ``None`` with allowUnsigned;
    ``foreign``: children that exist under another owner (never adopted);
    ``store_problem``: why ``spec.version`` could not be checked in the model store;
    ``store_checked``: the operator found it there (False: it did not look)."""
    versions = Counter(p.serving for p in pods if p.serving)
    ready = sum(p.ready for p in pods)
    target = plan.state.to_version
    rolling = plan.phase.rolling
    degraded = plan.phase is Phase.DEGRADED
    conditions = [
        condition(
            ConditionType.SPEC_VALID, True, "Valid", "spec accepted", now, existing_conditions
        ),
        condition(
            ConditionType.PROGRESSING,
            rolling,
            # a rollout stopped (failed, or a canary held undecided) is not idle: it says why
            plan.reason if rolling or degraded else "Idle",
            plan.message if rolling or degraded else "no rollout in progress",
            now,
            existing_conditions,
        ),
        condition(
            ConditionType.AVAILABLE,
            ready >= max(1, replicas) or replicas == 0,
            "MinimumReplicasAvailable" if pods else "NoPods",
            f"{ready}/{replicas} pods ready",
            now,
            existing_conditions,
        ),
        condition(
            ConditionType.DEGRADED,
            degraded,
            plan.reason if degraded else "Healthy",
            plan.message if degraded else "no failures",
            now,
            existing_conditions,
        ),
        condition(
            ConditionType.CHILDREN_READY,
            not foreign,
            "ForeignObject" if foreign else "Owned",
            f"not owned by this resource, left alone: {foreign}" if foreign else "all owned",
            now,
            existing_conditions,
        ),
    ]
    conditions.append(
        store_condition(target, pods, store_problem, store_checked, now, existing_conditions)
    )
    conditions.append(signatures_condition(signing_key, now, existing_conditions))
    conditions.append(paused_condition(paused, plan, now, existing_conditions))

    conditions.append(schedulable_condition(pods, now, existing_conditions, pods_refused))
    healthy = plan.phase is Phase.AVAILABLE and not foreign and store_problem is None
    conditions.append(
        condition(
            ConditionType.READY,
            healthy,
            "Available" if healthy else ("ForeignObject" if foreign else str(plan.phase)),
            plan.message,
            now,
            existing_conditions,
        )
    )
    status: dict[str, Any] = {
        "phase": str(plan.phase),
        "message": f"{store_problem}; holding" if store_problem else plan.message,
        "currentVersion": plan.stable_version,
        "previousVersion": plan.previous_version,
        "targetVersion": target,
        "replicas": len(pods),
        "readyReplicas": ready,
        "updatedReplicas": sum(p.serves(target) for p in pods),
        "versions": dict(sorted(versions.items())),
        "rollout": rollout_to_status(plan.state),
        "conditions": conditions,
        "lastUpdateTime": iso(now),
    }
    if plan.analysis is not None and plan.analysis.rollout == plan.state.promotion:
        # the analysis of this rollout only: a verdict on an earlier one (Passed, say,
        # before an abort) must not stand beside a rollout it never judged
        analysis = plan.analysis.to_status()
        if plan.analysis.at is not None:
            analysis["at"] = iso(plan.analysis.at)
        status["analysis"] = analysis
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
        "phase": str(Phase.INVALID),
        "message": message,
        "conditions": [
            condition(
                ConditionType.SPEC_VALID, False, "InvalidSpec", message, now, existing_conditions
            ),
            *[
                c
                for c in existing_conditions
                if c.get("type")
                in (ConditionType.PROGRESSING, ConditionType.AVAILABLE, SIGNATURES_VERIFIED)
            ],
            condition(
                ConditionType.DEGRADED, True, "InvalidSpec", message, now, existing_conditions
            ),
            condition(ConditionType.READY, False, "InvalidSpec", message, now, existing_conditions),
        ],
    }
    if generation is not None:
        status["observedGeneration"] = generation
    return status


def refused_status(
    status: dict[str, Any], http_status: int, message: str, now: float
) -> dict[str, Any]:
    """The API server refused one of the operator's calls (RBAC, admission): ``Ready``
    is False with the server's own message; the rest of the status stays as it was."""
    existing = [c for c in status.get("conditions") or [] if isinstance(c, dict)]
    reason = "Forbidden" if http_status == 403 else "ApiRefused"
    ready = condition(ConditionType.READY, False, reason, message, now, existing)
    kept = [c for c in existing if c.get("type") != ConditionType.READY]
    return {**status, "conditions": [*kept, ready]}


PODS_UNSEEN_REASON = "PodsUnseen"


def pods_unseen_status(status: dict[str, Any], why: str, now: float) -> dict[str, Any]:
    """The operator cannot see the pods (its pod watch keeps failing): ``Ready`` is False
    saying why, and the rollout holds; the rest of the status stays as it was."""
    existing = [c for c in status.get("conditions") or [] if isinstance(c, dict)]
    message = f"{why}; the rollout holds until the pods are seen again"
    ready = condition(ConditionType.READY, False, PODS_UNSEEN_REASON, message, now, existing)
    kept = [c for c in existing if c.get("type") != ConditionType.READY]
    return {**status, "conditions": [*kept, ready]}


def without_nulls(status: dict[str, Any]) -> dict[str, Any]:
    """``status`` as the API server stores it: a null in a merge patch deletes its key, so
    a status that carries nulls (``rollout.batchStartedAt``, ``previousVersion``, …) would
    never equal the stored one and every pass would write it again."""
    return {
        key: without_nulls(value) if isinstance(value, dict) else value
        for key, value in status.items()
        if value is not None
    }


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
