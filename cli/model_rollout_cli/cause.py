"""What the tools write in the change-cause annotation, which the operator copies into
the rollout history's ``triggeredBy`` for a rollout of the version it names: the action,
the CI job when run in one, else user@host, and the time (``v3: rollback by
alice@laptop at 2026-12-04T19:20:01.250Z``). The time makes each use its own: the operator
takes a cause that an earlier rollout in the history already carries for a stale one
(the annotation stays until changed), so two rollbacks to v3 by one user must differ."""

from __future__ import annotations

import getpass
import os
import socket
import time
from collections.abc import Mapping

from model_rollout_contract.annotations import change_cause_value, timed_cause

MAX_WHO = 200  # characters of the CI job or user@host (the operator keeps 300 of a cause)


def ci_job(env: Mapping[str, str]) -> str | None:
    """The CI job this runs in, from the variables the common CI systems set."""
    if env.get("GITHUB_ACTIONS") == "true":
        repo, run = env.get("GITHUB_REPOSITORY", "?"), env.get("GITHUB_RUN_ID", "?")
        return f"GitHub Actions {repo} run {run} ({env.get('GITHUB_ACTOR', '?')})"
    if env.get("GITLAB_CI") == "true":
        return f"GitLab CI {env.get('CI_PROJECT_PATH', '?')} job {env.get('CI_JOB_ID', '?')}"
    if env.get("BUILD_URL"):  # Jenkins and others
        return f"CI {env['BUILD_URL']}"
    if env.get("CI") and env.get("CI_JOB_URL"):
        return f"CI {env['CI_JOB_URL']}"
    return None


def who() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry for the uid (a container)
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def change_cause(
    action: str, version: str, env: Mapping[str, str] | None = None, now: float | None = None
) -> str:
    """``v2: release by alice@laptop at 2026-12-04T19:20:01.250Z``, ``v1: rollback by GitHub
    Actions org/repo run 42 (bob) at …``: the annotation's value when setting (or
    retrying) ``version``. Who did it is cut to ``MAX_WHO`` characters, so that the time
    survives the operator's cut of a triggeredBy (a CI job's URL can be long)."""
    who_did = ci_job(os.environ if env is None else env) or who()
    if len(who_did) > MAX_WHO:
        who_did = who_did[: MAX_WHO - 1] + "…"
    why = timed_cause(f"{action} by {who_did}", time.time() if now is None else now)
    return change_cause_value(version, why)
