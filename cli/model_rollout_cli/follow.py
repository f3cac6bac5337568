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

from model_rollout_contract.states import Phase, RolloutResult

from .errors import OK, ROLLOUT_FAILED, TIMED_OUT
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


def judge(
    md: dict[str, Any],
    version: str,
    known: set[tuple[str | None, str | None]],
    expected: RolloutResult,
    generation: int | None,
) -> Outcome | None:
    """The outcome this state of the resource decides, or ``None`` while it runs."""
    status = md.get("status") or {}
    entry = next(
        (e for e in entries(md) if e.get("version") == version and key(e) not in known), None
    )
    observed = status.get("observedGeneration")
    if (
        generation is not None
        and isinstance(observed, int)
        and observed >= generation
        and status.get("phase") == Phase.INVALID
    ):
        return Outcome(
            INVALID, str(status.get("message") or "spec refused"), ROLLOUT_FAILED, {}, status
        )
    if entry is None:
        return None
    result = str(entry.get("result"))
    if result == expected:
        if settled(expected, status, version):
            return Outcome(result, str(entry.get("reason") or ""), OK, entry, status)
        return None
    if result != RolloutResult.PROGRESSING:
        return Outcome(result, str(entry.get("reason") or result), ROLLOUT_FAILED, entry, status)
    return None


def follow(
    cluster: Cluster,
    name: str,
    version: str,
    known: set[tuple[str | None, str | None]],
    timeout_s: float,
    expected: RolloutResult = RolloutResult.SUCCEEDED,
    generation: int | None = None,
    on_update: Callable[[dict[str, Any]], None] | None = None,
) -> Outcome:
    """Poll the resource until its rollout to ``version`` (an entry not in ``known``)
    ends, or ``timeout_s`` passes; ``on_update`` sees every state read."""
    deadline = time.monotonic() + timeout_s
    md: dict[str, Any] = {}
    while True:
        md = cluster.get(name)
        if on_update is not None:
            on_update(md)
        outcome = judge(md, version, known, expected, generation)
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
