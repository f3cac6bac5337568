"""The plugin's commands. Each reads the resource, checks that the operation makes sense
for where its rollout stands (a clear refusal otherwise), writes one merge patch, says
what it did and, with ``wait``, follows the rollout to its result."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any, TextIO

from model_rollout_contract.annotations import (
    ABORT,
    CHANGE_CAUSE,
    FULL_PROMOTION_SUFFIX,
    PROMOTE,
    RETRY,
    full_promotion_id,
    promotion_id,
)
from model_rollout_contract.states import CanaryStep, Phase, RolloutResult, RolloutStage
from model_rollout_contract.tracks import TrackKeys

from .cause import change_cause
from .errors import NOTHING_TO_DO, OK, ROLLOUT_FAILED, TIMED_OUT, USAGE, CliError
from .follow import Outcome, follow, rollout_on
from .history import history_table, key, keys, known_versions, previous_success
from .kube import Cluster
from .pausing import unpause_patch
from .track import checked_keys, described, subject, track_view
from .view import Progress, event_objects, pod_objects, render, wants_colour

DEFAULT_TIMEOUT_S = 600.0
_TIMELESS = datetime.min.replace(tzinfo=timezone.utc)  # every age renders as 0s


@dataclass(frozen=True)
class Follow:
    """``--wait`` and ``--timeout``; where progress lines go."""

    wait: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S
    out: TextIO = sys.stdout


def _rollout(md: dict[str, Any]) -> dict[str, Any]:
    return dict((md.get("status") or {}).get("rollout") or {})


def _running(md: dict[str, Any]) -> bool:
    status = md.get("status") or {}
    stage = _rollout(md).get("stage")
    phase = status.get("phase")
    return stage in (RolloutStage.CANARY, RolloutStage.BATCHES) and phase in (
        Phase.CANARY,
        Phase.PROGRESSING,
        Phase.ROLLING_BACK,
    )


def _follow(
    cluster: Cluster,
    name: str,
    version: str,
    known: set[tuple[str | None, str | None]],
    how: Follow,
    expected: RolloutResult = RolloutResult.SUCCEEDED,
    generation: int | None = None,
    new_entry: bool = True,
    track: str | None = None,
) -> Outcome:
    show = Progress(how.out)
    view = None if track is None else (lambda md: track_view(md, track))
    return follow(
        cluster, name, version, known, how.timeout_s, expected, generation, show, new_entry,
        view,
    )  # fmt: skip


def _report(outcome: Outcome, out: TextIO) -> int:
    print(f"result: {outcome.result}" + (f": {outcome.reason}" if outcome.reason else ""), file=out)
    return outcome.code


def _current_entry_known(md: dict[str, Any]) -> set[tuple[str | None, str | None]]:
    """Every entry but the newest: what following the rollout in progress skips."""
    return keys(md) - ({key(e) for e in _newest(md)})


def _newest(md: dict[str, Any]) -> list[dict[str, Any]]:
    history = (md.get("status") or {}).get("history") or []
    return [history[0]] if history and isinstance(history[0], dict) else []


def watch_code(md: dict[str, Any]) -> int:
    """The exit code of a watch whose ``--timeout`` passed, as ``--wait``'s: 0 where every
    pod serves spec.version (the operator has seen that spec), 1 where the rollout failed
    or the spec was refused, 3 while it still runs."""
    meta, status = md.get("metadata") or {}, md.get("status") or {}
    observed, generation = status.get("observedGeneration"), meta.get("generation")
    seen = not isinstance(generation, int) or (isinstance(observed, int) and observed >= generation)
    if status.get("phase") in (Phase.DEGRADED, Phase.INVALID) and seen:
        return ROLLOUT_FAILED
    on_target = status.get("currentVersion") == (md.get("spec") or {}).get("version")
    if status.get("phase") == Phase.AVAILABLE and on_target and seen:
        return OK
    return TIMED_OUT


def status_json(
    md: dict[str, Any], pods: list[dict[str, Any]], events: list[dict[str, Any]]
) -> str:
    """The resource as the API has it, with what the text view shows beside it: its pods
    (``kubectl model status``'s table, a row an object) and its events, oldest first."""
    return json.dumps(
        {**md, "pods": pod_objects(pods), "events": event_objects(events)}, indent=2, sort_keys=True
    )


def status(
    cluster: Cluster, name: str, watch: bool, output: str, timeout_s: float, interval_s: float
) -> int:
    """One view (exit 0), or with ``watch`` a view redrawn until Ctrl-C or ``timeout_s``
    (then the exit code :func:`watch_code` gives)."""
    out = sys.stdout
    colour = wants_colour(out)
    deadline = time.monotonic() + timeout_s if timeout_s else None
    shown, last = None, None
    while True:
        try:
            md = cluster.get(name)
            pods, events = cluster.pods(name), cluster.events(name)
        except CliError as exc:  # the --timeout passed during a read: the last view counts
            if exc.code == TIMED_OUT and last is not None:
                return watch_code(last)
            raise
        last = md
        if output == "json":
            print(status_json(md, pods, events))
            return OK
        text = render(md, pods, events, datetime.now(timezone.utc), colour)
        if not watch:
            print(text)
            return OK
        if colour:  # a live view: redraw in place
            out.write("\x1b[H\x1b[2J" + text + "\n")
            out.flush()
        else:  # a log: a new view only when something changed, not each clock tick
            fingerprint = render(md, pods, events, _TIMELESS)
            if fingerprint != shown:
                print(text + "\n---", flush=True)
            shown = fingerprint
        if deadline is None:
            time.sleep(interval_s)
            continue
        left = deadline - time.monotonic()
        if left <= 0:
            return watch_code(md)
        time.sleep(min(interval_s, left))


def _read(cluster: Cluster, name: str, track: str | None) -> tuple[dict[str, Any], TrackKeys]:
    """The resource as ``track``'s rollout sees it (track.py), and the track's keys."""
    resource = cluster.get(name)
    keys = checked_keys(resource, name, track)
    return track_view(resource, track), keys


def _promotable_fully(md: dict[str, Any], what: str) -> None:
    """A full promotion needs a running rollout (at its canary or its batches)."""
    if not _running(md):
        phase = (md.get("status") or {}).get("phase")
        raise CliError(f"nothing to promote: {what} is {phase}, no rollout runs", NOTHING_TO_DO)


def promote(
    cluster: Cluster, name: str, how: Follow, track: str | None = None, full: bool = False
) -> int:
    """``full``: skip what remains of the rollout (the canary hold and its analysis, the
    remaining batches and their jitter). A paused resource is resumed, as by Argo's."""
    md, own = _read(cluster, name, track)
    template = _template_rollout(md, track)
    if template.get("stage") in (RolloutStage.CANARY, RolloutStage.BATCHES):
        return _promote_template(cluster, name, md, template, how, full)
    rollout = _rollout(md)
    spec = md.get("spec") or {}
    phase = (md.get("status") or {}).get("phase")
    what = subject(name, track)
    if full:
        _promotable_fully(md, what)
    elif phase != Phase.CANARY or rollout.get("stage") != RolloutStage.CANARY:
        raise CliError(
            f"nothing to promote: {what} is {phase}, not held at a canary", NOTHING_TO_DO
        )
    elif not (spec.get("canary") or {}).get("manualPromote"):
        raise CliError(
            f"{name}'s canary promotes itself after canary.pauseSeconds (and a passed "
            "analysis); the promote annotation is read with canary.manualPromote: true",
            NOTHING_TO_DO,
        )
    version = str(rollout.get("toVersion"))
    value = (full_promotion_id if full else promotion_id)(
        version, float(rollout.get("startedAt") or 0)
    )
    resume = unpause_patch(md)
    cluster.patch(name, {"metadata": {"annotations": {own.promote: value}}, **resume})
    what_of = f"rollout of {version} fully promoted" if full else f"canary of {version} promoted"
    step = (rollout.get("stage"), rollout.get("canaryStep"))
    if step == (RolloutStage.CANARY, CanaryStep.SHADOW):
        # in the shadow step a promote only approves (the checks decide); --full skips it
        what_of = (
            f"rollout of {version} fully promoted, its shadow step skipped with no check "
            "passed (it answers users untested)"
            if full
            else f"canary of {version} approved: it goes live after a passed shadow check, "
            "and on to the batches after a passed check of the live step"
        )
    print(
        f"{described(name, track)}: {what_of} ({own.promote}={value})"
        + (f"; {name} resumed (spec.paused: false)" if resume else ""),
        file=how.out,
    )
    if not how.wait:
        return OK
    known = _current_entry_known(md)
    return _report(_follow(cluster, name, version, known, how, track=track), how.out)


def _promote_template(
    cluster: Cluster,
    name: str,
    md: dict[str, Any],
    template: dict[str, Any],
    how: Follow,
    full: bool,
) -> int:
    """Promote a pod template's rollout (an image change): its canary, or with ``full``
    every remaining pod at once. It is followed by ``status --watch``, not waited for."""
    canary = template.get("stage") == RolloutStage.CANARY
    if not full and not canary:
        raise CliError(f"nothing to promote: {name}'s pod template rollout is past its "
                       "canary (--full moves every remaining pod)", NOTHING_TO_DO)  # fmt: skip
    if not full and not ((md.get("spec") or {}).get("canary") or {}).get("manualPromote"):
        raise CliError(
            f"{name}'s canary promotes itself after canary.pauseSeconds; the promote "
            "annotation is read with canary.manualPromote: true",
            NOTHING_TO_DO,
        )
    value = str(template.get("promoteWith")) + (FULL_PROMOTION_SUFFIX if full else "")
    resume = unpause_patch(md)
    cluster.patch(name, {"metadata": {"annotations": {PROMOTE: value}}, **resume})
    target = (template.get("to") or {}).get("deployment")
    what_of = "fully promoted" if full else "canary promoted"
    print(
        f"{described(name, None)}: pod template rollout to {target} {what_of} ({PROMOTE}={value})"
        + (f"; {name} resumed (spec.paused: false)" if resume else ""),
        file=how.out,
    )
    return OK


def _template_rollout(md: dict[str, Any], track: str | None) -> dict[str, Any]:
    """``status.templateRollout`` (an image change's), which only the resource's own
    commands act on (a tenant's track has none of its own)."""
    raw = (md.get("status") or {}).get("templateRollout") if track is None else None
    return dict(raw) if isinstance(raw, dict) else {}


def _act_on_template(
    cluster: Cluster, name: str, template: dict[str, Any], key: str, done: str, how: Follow
) -> int:
    """Abort or retry a pod template's rollout: the annotation ``key`` names it by its id
    (``promoteWith``; a version's name holds no ``@``, so the operator tells the two
    apart). It is followed by ``status --watch``, not waited for."""
    value = str(template.get("promoteWith"))
    cluster.patch(name, {"metadata": {"annotations": {key: value}}})
    target = (template.get("to") or {}).get("deployment")
    stable = (template.get("from") or {}).get("deployment")
    print(
        f"{described(name, None)}: pod template rollout to {target} {done} ({key}={value}); "
        + (f"its pods go back to {stable}" if key == ABORT else f"it starts again from {stable}"),
        file=how.out,
    )
    return OK


def abort(cluster: Cluster, name: str, how: Follow, track: str | None = None) -> int:
    md, own = _read(cluster, name, track)
    template = _template_rollout(md, track)
    if template.get("stage") in (RolloutStage.CANARY, RolloutStage.BATCHES):
        return _act_on_template(cluster, name, template, ABORT, "aborted", how)
    status = md.get("status") or {}
    version = str(_rollout(md).get("toVersion"))
    what = subject(name, track)
    if not _running(md):
        raise CliError(f"nothing to abort: {what} is {status.get('phase')}", NOTHING_TO_DO)
    if status.get("currentVersion") in (None, version):
        raise CliError(
            f"nothing to abort to: {what} has no stable version to go back to from {version} "
            "(its first deployment)",
            NOTHING_TO_DO,
        )
    cluster.patch(name, {"metadata": {"annotations": {own.abort: version}}})
    print(
        f"{described(name, track)}: version rollout of {version} aborted; pods go back to "
        f"{status.get('currentVersion')}",
        file=how.out,
    )
    if not how.wait:
        return OK
    known = _current_entry_known(md)
    outcome = _follow(cluster, name, version, known, how, RolloutResult.ABORTED, track=track)
    if outcome.result == RolloutResult.SUCCEEDED:  # the operator read the abort too late
        why = f"the rollout of {version} had completed before the abort; to go back: "
        back = (
            f"kubectl model rollback {name}"
            if track is None
            else f"set the version of {track} in spec.tenants.models back"
        )
        outcome = replace(outcome, reason=why + back)
    return _report(outcome, how.out)


def retry(cluster: Cluster, name: str, how: Follow, track: str | None = None) -> int:
    """The failed rollout of ``spec.version``, or the failed pod template rollout; of both,
    the one that started last (a second retry restarts the other)."""
    md, own = _read(cluster, name, track)
    version = str((md.get("spec") or {}).get("version"))
    rollout = _rollout(md)
    version_failed = (
        rollout.get("stage") == RolloutStage.FAILED and rollout.get("toVersion") == version
    )
    template = _template_rollout(md, track)
    if template.get("stage") == RolloutStage.FAILED and (
        not version_failed
        or float(template.get("startedAt") or 0) >= float(rollout.get("startedAt") or 0)
    ):
        return _act_on_template(cluster, name, template, RETRY, "retried", how)
    if not version_failed:
        phase = (md.get("status") or {}).get("phase")
        raise CliError(
            f"nothing to retry: the rollout of {version} has not failed ({phase})", NOTHING_TO_DO
        )
    known = keys(md)
    annotations = {own.retry: version}
    if track is None:
        # the change-cause annotation is one for every track: a tenant's retry leaves it
        # alone, or it could overwrite a release's that the operator has not read yet
        annotations[CHANGE_CAUSE] = change_cause("retry", version)
    cluster.patch(name, {"metadata": {"annotations": annotations}})
    print(f"{described(name, track)}: version rollout of {version} retried", file=how.out)
    if not how.wait:
        return OK
    return _report(_follow(cluster, name, version, known, how, track=track), how.out)


def _rollback_to(md: dict[str, Any], name: str, to: str | None, force: bool = False) -> str:
    """The version a rollback sets, or a refusal: nothing to roll back to, or (unless
    ``force``) a ``to`` the resource has no record of (see :func:`~.history.known_versions`):
    a version never published would start a canary toward nothing."""
    version = to or previous_success(md)
    if version is None:
        raise CliError(
            f"nothing to roll back to: {name}'s history has no earlier Succeeded rollout "
            "(name one with --to)",
            NOTHING_TO_DO,
        )
    if version == (md.get("spec") or {}).get("version"):
        raise CliError(f"{name} is at {version} already (spec.version)", NOTHING_TO_DO)
    known = known_versions(md)
    if not force and version not in known:
        others = ", ".join(v for v in known if v != (md.get("spec") or {}).get("version"))
        raise CliError(
            f"{name} has no record of {version}: no pod served it and the operator never found "
            f"it in the store (status.history, status.verifiedVersions); its rollback would "
            f"start a canary toward a version the pods may not find. Known: {others or 'none'}"
            f"; pass --force if {version} is published",
            USAGE,
        )
    return version


def rollback(
    cluster: Cluster,
    name: str,
    to: str | None,
    how: Follow,
    force: bool = False,
    dry_run: bool = False,
) -> int:
    """Set spec.version to the previous success (or ``to``); ``dry_run``: say what would
    be set, and write nothing (the same checks, the API's server-side dry run)."""

    def decide(md: dict[str, Any]) -> dict[str, Any]:
        version = _rollback_to(md, name, to, force)
        cause = change_cause("rollback", version)
        return {"metadata": {"annotations": {CHANGE_CAUSE: cause}}, "spec": {"version": version}}

    md, answer = cluster.patch_read(name, decide, dry_run=dry_run)
    version = _rollback_to(md, name, to, force)
    print(
        f"modeldeployment {name}: {'would roll' if dry_run else 'rolling'} back from "
        f"{(md.get('spec') or {}).get('version')} to {version}"
        + (" (dry run: nothing written)" if dry_run else ""),
        file=how.out,
    )
    if not how.wait or dry_run:
        return OK
    generation = (answer.get("metadata") or {}).get("generation")
    outcome = _follow(
        cluster, name, version, keys(md), how, generation=generation,
        new_entry=not rollout_on(md, version),
    )  # fmt: skip
    return _report(outcome, how.out)


def history(cluster: Cluster, name: str, limit: int, output: str) -> int:
    md = cluster.get(name)
    if output == "json":
        raw = (md.get("status") or {}).get("history") or []
        print(json.dumps(raw[:limit], indent=2))
    else:
        print(history_table(md, limit, datetime.now(timezone.utc)))
    return OK
