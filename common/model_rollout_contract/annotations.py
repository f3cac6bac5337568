"""Names on Kubernetes objects that more than one program reads or writes, and the file
format in which the kubelet projects a pod's annotations (Downward API)."""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone

DOMAIN = "serving.model-rollout.io"

# pod annotations
TARGET_VERSION = f"{DOMAIN}/target-version"  # operator -> sidecar: the version to serve
PREVIOUS_VERSION = f"{DOMAIN}/previous-version"  # operator -> sidecar: pre-pulled for rollback
SIDECAR_STATUS = f"{DOMAIN}/sidecar-status"  # sidecar -> operator: a SidecarReport (JSON)
# operator -> sidecar: the publish sequences pinned when rollouts started (pins.py's JSON);
# older builds of those versions are refused
PINNED_SEQUENCES = f"{DOMAIN}/pinned-sequences"

# ModelDeployment annotation: `kubectl annotate md NAME ...=<promotion id>` promotes its
# canary; `...=<promotion id>+full` (kubectl model promote --full) promotes fully: the canary
# hold, its analysis and the remaining batches are skipped (see full_promotion_id)
PROMOTE = f"{DOMAIN}/promote"
# ModelDeployment annotations of day-2 operations (the kubectl plugin writes them; the
# operator clears each once it has acted on it or ignored it with an Event):
ABORT = f"{DOMAIN}/abort"  # =<version>: the rollout to that version goes back to stable now
RETRY = f"{DOMAIN}/retry"  # =<version>: a failed rollout of spec.version runs again
# (abort and retry =<template rollout id>, status.templateRollout.promoteWith: the same for a
# pod template's rollout; a version's name holds no "@", an id always does)
# why spec.version changed, as kubectl's kubernetes.io/change-cause, in the form
# "<version>: <why>" ("v3: rollback by alice@laptop at 2026-12-04T19:20:01.250Z"; the
# release, rollback and retry commands write it, each use with its own time). The operator
# copies <why> into the history's triggeredBy only for a rollout of <version>, and a timed
# <why> only once: the annotation stays until changed, so a later edit by hand (or a
# GitOps sync) of spec.version is recorded as "spec.version edit", not as the last
# release, also one back to a version the tools once set.
CHANGE_CAUSE = f"{DOMAIN}/change-cause"

# labels the operator puts on what it creates
DEPLOYMENT_LABEL = f"{DOMAIN}/deployment"  # on pods: the ModelDeployment they belong to
# on the pods of a pod template's Deployment after the first (<name>-<digest>): the digest's
# head, so that the operator tells which template a pod runs (none: the first Deployment's)
TEMPLATE_LABEL = f"{DOMAIN}/template"
MODEL_LABEL = f"{DOMAIN}/model"


def promotion_id(version: str, started_at: float) -> str:
    """The promote annotation's value for the rollout to ``version`` that started at
    ``started_at`` (``status.rollout.startedAt``): a promotion never carries over to
    another rollout of the same version."""
    return f"{version}@{int(started_at)}"


# what marks a promote value as a full promotion: neither a version name nor a rollout id
# holds a "+", so the value splits in one way only
FULL_PROMOTION_SUFFIX = "+full"


def full_promotion_id(version: str, started_at: float) -> str:
    """The promote annotation's value that fully promotes the rollout to ``version`` that
    started at ``started_at``: every remaining pod moves now (under maxConcurrentLoads)."""
    return promotion_id(version, started_at) + FULL_PROMOTION_SUFFIX


def parse_promotion(value: str | None) -> tuple[str | None, bool]:
    """A promote annotation's value as (the promotion id it names, whether it is a full
    promotion): the one place that reads the value's form."""
    if value is None:
        return None, False
    if value.endswith(FULL_PROMOTION_SUFFIX):
        return value.removesuffix(FULL_PROMOTION_SUFFIX), True
    return value, False


def change_cause_value(version: str, why: str) -> str:
    """The change-cause annotation's value for setting ``spec.version`` to ``version``."""
    return f"{version}: {why}"


def utc_millis(at: float) -> str:
    """``2026-12-04T19:20:01.250Z``: the time of a tools' cause and of a history entry's
    ``startedAt`` (to the millisecond, so that two in one second differ)."""
    moment = datetime.fromtimestamp(at, tz=timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def timed_cause(why: str, at: float) -> str:
    """``<why> at <UTC time to the millisecond>``: how the tools word a cause, so that no
    two of their uses are alike and one already in the history is known for stale."""
    return f"{why} at {utc_millis(at)}"


def is_timed_cause(why: str) -> bool:
    """Whether ``why`` ends as :func:`timed_cause` ends it (another writer's need not)."""
    return _TIMED.search(why) is not None


_TIMED = re.compile(r" at \d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$")


def change_cause_for(value: str | None, version: str) -> str | None:
    """The ``<why>`` of a change-cause value when it names ``version``, else ``None``
    (absent, another version's, or the older form without a version)."""
    named, sep, why = (value or "").partition(": ")
    return (why.strip() or None) if sep and named == version else None


def parse_downward_annotations(text: str) -> dict[str, str]:
    """Parse a Downward API ``metadata.annotations`` file: ``key="go-quoted value"`` lines."""
    result: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, raw = line.partition("=")
        if not sep or not key.strip():
            continue
        raw = raw.strip()
        try:
            value = json.loads(raw) if raw.startswith('"') else raw
        except json.JSONDecodeError:
            value = raw.strip('"')
        result[key.strip()] = str(value)
    return result


def format_downward_annotations(annotations: dict[str, str]) -> str:
    """What the kubelet writes for ``fieldPath: metadata.annotations`` (sorted, quoted)."""
    return "".join(f"{k}={json.dumps(v)}\n" for k, v in sorted(annotations.items()))
