"""Following one rollout to its end, through the entry the operator keeps for it in
``status.history``: the release command and the plugin's ``--wait`` share this.

A rollout is found by what it is not: an entry for the version that was not in the
history before the command acted (so a re-release of a version is not mistaken for its
earlier rollout, and no clock is compared with the operator's)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from model_rollout_contract.states import Phase, RolloutResult, RolloutStage

from .errors import OK, ROLLOUT_FAILED, TIMED_OUT, CliError
from .history import entries, key
from .kube import Cluster

POLL_S = 1.0
INVALID = "Invalid"  # the outcome when the operator refused the spec
TIMEOUT = "Timeout"


@dataclass(frozen=True)
class Outcome:
    result: str  # a RolloutResult, INVALID or TIMEOUT
    reason: str
    code: int  # the exit code (errors.py)
    entry: dict[str, Any] = field(default_factory=dict)  # the history entry, if one was seen
    status: dict[str, Any] = field(default_factory=dict)  # the last status read

    def to_json(self) -> dict[str, Any]:
        return {
            "result": self.result,
            "reason": self.reason,
            "exitCode": self.code,
            "phase": self.status.get("phase"),
            "currentVersion": self.status.get("currentVersion"),
            "versions": self.status.get("versions") or {},
            "startedAt": self.entry.get("startedAt"),
            "finishedAt": self.entry.get("finishedAt"),
            "triggeredBy": self.entry.get("triggeredBy"),
        }


def settled(expected: RolloutResult, status: dict[str, Any], version: str) -> bool:
    """The pods are where the result says: all on ``version`` (Available) after a
    success, all on the stable version after an abort."""
    versions = status.get("versions") or {}
    if expected is RolloutResult.SUCCEEDED:
        return status.get("phase") == Phase.AVAILABLE and status.get("currentVersion") == version
    return set(versions) <= {status.get("currentVersion")}


def _seen(status: dict[str, Any], generation: int | None) -> bool:
    """The operator has read the spec we wrote (or there is no write to wait for)."""
    observed = status.get("observedGeneration")
    return generation is None or (isinstance(observed, int) and observed >= generation)


def _finished(
    entry: dict[str, Any], expected: RolloutResult, md: dict[str, Any], version: str
) -> Outcome | None:
    """The outcome a finished entry of this rollout decides (``None`` while it runs).
    Succeeded is recorded only once Available, so it needs no further check; an abort
    is done when the pods are back, or once spec.version moved on."""
    status = md.get("status") or {}
    result = str(entry.get("result"))
    if result == RolloutResult.PROGRESSING:
        return None
    if result == expected:
        moved_on = (md.get("spec") or {}).get("version") != version
        if expected is RolloutResult.SUCCEEDED or moved_on or settled(expected, status, version):
            return Outcome(result, str(entry.get("reason") or ""), OK, entry, status)
        return None
    return Outcome(result, str(entry.get("reason") or result), ROLLOUT_FAILED, entry, status)


def judge(
    md: dict[str, Any],
    version: str,
    known: set[tuple[str | None, str | None]],
    expected: RolloutResult,
    generation: int | None,
    new_entry: bool = True,
) -> Outcome | None:
    """The outcome this state of the resource decides, or ``None`` while it runs.

    This rollout's own entry decides first (a later change of spec.version does not undo
    a result it reached). Without one: the spec refused (Invalid, for the generation we
    wrote), or spec.version moved on before the operator started it (Superseded).
    ``new_entry=False``: the operator's rollout state is on ``version`` already (spec
    set back to it after a refused version), so no entry will come: Available on it,
    once the operator saw our write, is the success."""
    status = md.get("status") or {}
    spec_version = (md.get("spec") or {}).get("version")
    entry = next(
        (e for e in entries(md) if e.get("version") == version and key(e) not in known), None
    )
    if entry is not None:
        decided = _finished(entry, expected, md, version)
        if decided is not None or spec_version == version:
            return decided
        why = f"spec.version changed to {spec_version} before the rollout of {version} ended"
        return Outcome(str(RolloutResult.SUPERSEDED), why, ROLLOUT_FAILED, entry, status)
    if spec_version != version:
        why = f"spec.version changed to {spec_version} before the rollout of {version} started"
        return Outcome(str(RolloutResult.SUPERSEDED), why, ROLLOUT_FAILED, {}, status)
    if not _seen(status, generation):
        return None
    if status.get("phase") == Phase.INVALID:
        why = str(status.get("message") or "spec refused")
        return Outcome(INVALID, why, ROLLOUT_FAILED, {}, status)
    if new_entry:
        return None
    last = next((e for e in entries(md) if e.get("version") == version), {})
    if settled(RolloutResult.SUCCEEDED, status, version):
        why = f"every pod serves {version}"
        return Outcome(str(RolloutResult.SUCCEEDED), why, OK, last, status)
    if (status.get("rollout") or {}).get("stage") == RolloutStage.FAILED:  # failed: still so
        why = str(status.get("message") or last.get("reason") or "Degraded")
        return Outcome(str(last.get("result") or Phase.DEGRADED), why, ROLLOUT_FAILED, last, status)
    return None


def rollout_on(md: dict[str, Any], version: str) -> bool:
    """The operator's rollout state is on ``version`` already (spec.version set back to
    it after a refused version): setting it starts no rollout, so no entry will come."""
    rollout = (md.get("status") or {}).get("rollout") or {}
    ended = rollout.get("stage") in (RolloutStage.COMPLETE, RolloutStage.FAILED)
    return rollout.get("toVersion") == version and ended


def follow(
    cluster: Cluster,
    name: str,
    version: str,
    known: set[tuple[str | None, str | None]],
    timeout_s: float,
    expected: RolloutResult = RolloutResult.SUCCEEDED,
    generation: int | None = None,
    on_update: Callable[[dict[str, Any]], None] | None = None,
    new_entry: bool = True,
    view: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> Outcome:
    """Poll the resource until its rollout to ``version`` (an entry not in ``known``)
    ends, or ``timeout_s`` passes; ``on_update`` sees every state read. ``view``: what
    of the resource is followed (a tenant track's rollout, track.py), all of it without."""
    deadline = time.monotonic() + timeout_s
    md: dict[str, Any] = {}
    while True:
        try:
            md = cluster.get(name)
        except CliError as exc:  # one failed read is not the rollout's end: try again
            if exc.code == TIMED_OUT:  # the command's --timeout, in the middle of a read
                break
            if not exc.transient or time.monotonic() >= deadline:
                raise
            time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
            continue
        if view is not None:
            md = view(md)
        if on_update is not None:
            on_update(md)
        outcome = judge(md, version, known, expected, generation, new_entry)
        if outcome is not None:
            return outcome
        if time.monotonic() >= deadline:
            break
        time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
    status = md.get("status") or {}
    entry = next(
        (e for e in entries(md) if e.get("version") == version and key(e) not in known), {}
    )
    return Outcome(
        TIMEOUT,
        f"no result after {timeout_s:.0f}s; last: {status.get('phase')}: {status.get('message')}",
        TIMED_OUT,
        entry,
        status,
    )
