"""``status.history``: the last rollouts of a ModelDeployment, most recent first.

Derived on every pass from the history the status already holds and the plan of this
pass, so the status stays the only state: a restarted operator finds the entry of the
rollout in progress (same version, same start) and updates it, and a pass repeated after
a crash before its status write produces the same entries again, never a second one."""

from __future__ import annotations

from typing import Any

from model_rollout_contract.annotations import change_cause_for, is_timed_cause, utc_millis
from model_rollout_contract.defaults import HISTORY_LIMIT
from model_rollout_contract.states import Phase, RolloutResult, RolloutStage

from .planner import RETRIED_EVENT, START_EVENTS, Plan
from .status import iso

SPEC_EDIT = "spec.version edit"  # triggeredBy without a change-cause naming the version
# a retry without a change-cause naming the version (a tenant track's, or one set by hand)
RETRY_ANNOTATION = "retry annotation"
MAX_REASON = 300  # characters of a reason (and of a triggeredBy) kept in an entry


def result_of(plan: Plan) -> RolloutResult:
    """Succeeded once every pod serves the version (Available: a complete rollout with a
    pod still starting, as an initial deployment before its pods exist, is not yet)."""
    state = plan.state
    if state.stage == RolloutStage.COMPLETE:
        available = plan.phase is Phase.AVAILABLE
        return RolloutResult.SUCCEEDED if available else RolloutResult.PROGRESSING
    if state.stage == RolloutStage.FAILED:
        if state.aborted:
            return RolloutResult.ABORTED
        return RolloutResult.ROLLED_BACK if state.rolled_back else RolloutResult.FAILED
    return RolloutResult.PROGRESSING


def started(ts: float) -> str:
    """An entry's ``startedAt``, to the millisecond: it tells one rollout from another (here
    and in the tools), so two rollouts of a version in one second (a retry of a version
    refused at once) must not share it."""
    return utc_millis(ts)


def _short(text: str) -> str:
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 1] + "…"


def _finished(entry: dict[str, Any]) -> bool:
    return entry.get("result") not in (None, str(RolloutResult.PROGRESSING))


def _stale(entries: list[dict[str, Any]], version: str, cause: str) -> bool:
    """Whether ``cause`` is the tools' (timed, so each of their uses is its own) and an
    earlier rollout of ``version`` carries it: the annotation stays until changed, so a
    hand edit back to a version the tools once set finds their old cause naming it.
    Another writer's cause (untimed: an older CLI's, a GitOps manifest's) may repeat and
    is taken as before."""
    return is_timed_cause(cause) and any(
        e.get("version") == version and e.get("triggeredBy") == _short(cause) for e in entries
    )


def record(
    history: Any,
    plan: Plan,
    now: float,
    triggered_by: str | None,
    limit: int = HISTORY_LIMIT,
) -> list[dict[str, Any]]:
    """The history after ``plan``: a new entry when the plan started a rollout (the one
    it replaces, if still running, is Superseded), the running entry's result updated.
    ``triggered_by``: the change-cause annotation, if any; used only when it names the
    version of the rollout that starts and no earlier rollout in the history carries it
    (a stale one, from the last release or an older rollout of this version, is not)."""
    entries = [dict(e) for e in history if isinstance(e, dict)] if isinstance(history, list) else []
    state = plan.state
    key = (state.to_version, started(state.started_at))
    legacy = (state.to_version, iso(state.started_at))  # written before milliseconds were
    index = next(
        (
            i
            for i, e in enumerate(entries)
            if (e.get("version"), e.get("startedAt")) in (key, legacy)
        ),
        None,
    )
    if index is None:
        if not any(e.reason in START_EVENTS for e in plan.events):
            return entries[:limit]  # steady state, or a rollout from before history was kept
        cause = change_cause_for(triggered_by, state.to_version)
        if cause is not None and _stale(entries, state.to_version, cause):
            cause = None  # the annotation left from an earlier rollout of this version
        if cause is None and any(e.reason == RETRIED_EVENT for e in plan.events):
            cause = RETRY_ANNOTATION  # not an edit of spec.version: it did not change
        for entry in entries:
            if not _finished(entry):
                entry.update(
                    result=str(RolloutResult.SUPERSEDED),
                    finishedAt=iso(now),
                    reason=f"spec.version changed to {state.to_version}",
                )
        entries.insert(
            0,
            {
                "version": state.to_version,
                "fromVersion": state.from_version,
                "startedAt": key[1],
                "result": str(RolloutResult.PROGRESSING),
                "reason": plan.reason,
                "triggeredBy": _short(cause or SPEC_EDIT),
            },
        )
        index = 0
    entry = entries[index]
    if not _finished(entry):
        result = result_of(plan)
        entry["result"] = str(result)
        why = (state.failure or plan.message) if result.finished else plan.reason
        entry["reason"] = _short(why)
        if result.finished:
            entry["finishedAt"] = iso(now)
    return entries[:limit]
