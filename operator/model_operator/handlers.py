"""kopf handlers, event-driven.

One daemon per ModelDeployment runs every pass for that resource (observe, plan, act,
write status), so observations, decisions and the status they produce never race each
other; all decisions are made by the pure functions in :mod:`planner`, :mod:`manifests`
and :mod:`status`. The daemon sleeps until something happens: a watch on the pods this
operator labels keeps an index (no LIST per pass) and wakes the owning resource's daemon
on every pod event; a change of the resource itself wakes it too; a timer remains only
for deadlines and jitter (the planner's :func:`~.planner.next_deadline`) and as a
resync period.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import kopf

from model_rollout_contract.annotations import (
    ABORT,
    CHANGE_CAUSE,
    DEPLOYMENT_LABEL,
    PROMOTE,
    RETRY,
)
from model_rollout_contract.states import Phase

from . import cluster
from .analysis import AnalysisState, Sample
from .analysis_sources import read_canary
from .cluster import ApplyResult
from .config import OperatorConfig
from .constants import GROUP, PLURAL, VERSION
from .errors import SpecError, TransientApiError
from .history import record
from .kube_client import ApiEndpoint, KubeClient
from .manifests import children, configmap, digest
from .metrics import OperatorMetrics
from .planner import Event, RolloutState, analysing, next_deadline, plan_rollout
from .pods import PodView, pod_view
from .spec import ModelDeploymentSpec, parse_spec
from .status import (
    UNSIGNED_MESSAGE,
    UNSIGNED_REASON,
    build_status,
    invalid_status,
    merge_patch,
    rollout_from_status,
    was_unsigned,
)
from .store_check import VersionCheck, boto_credentials, check_version

_rng = random.SystemRandom()
API_RETRY_DELAY_S = 2.0  # after a transient API error, kopf restarts the daemon this late
STORE_RETRY_S = 5.0  # an unreachable store is asked again this late
CHILDREN_CHECK_S = 10.0  # children are compared with the live objects at least this often
_VOLATILE = ("lastUpdateTime",)  # status fields that alone are no reason to write


def _config(memo: Any) -> OperatorConfig:
    return getattr(memo, "config", None) or OperatorConfig()


def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    config = _config(memo)
    # kopf's own log lines ("Handler ... succeeded", on every pod event) are not posted as
    # Kubernetes Events; the rollout's events are posted explicitly (see _post)
    settings.posting.level = logging.WARNING
    settings.scanning.disabled = config.disable_scanning
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    memo.metrics = metrics = OperatorMetrics()
    endpoint = ApiEndpoint.from_url_or_cluster(config.kube_api)

    def count_error(status: int) -> None:
        metrics.api_errors.labels(str(status)).inc()

    memo.api = KubeClient(endpoint, on_error=count_error) if endpoint is not None else None
    memo.wakers = {}  # (namespace, name) -> asyncio.Event of that resource's daemon


async def serve_metrics(memo: kopf.Memo, **_: Any) -> None:
    port = _config(memo).metrics_port
    memo.metrics_runner = await memo.metrics.serve(port) if port else None


async def close_api(memo: kopf.Memo, **_: Any) -> None:
    api: KubeClient | None = getattr(memo, "api", None)
    if api is not None:
        await api.close()
    runner = getattr(memo, "metrics_runner", None)
    if runner is not None:
        await runner.cleanup()


def login(memo: kopf.Memo, **kwargs: Any) -> kopf.ConnectionInfo | None:
    config = _config(memo)
    if config.kube_api:
        return kopf.ConnectionInfo(server=config.kube_api, insecure=True)
    return kopf.login_via_client(memo=memo, **kwargs) or kopf.login_with_service_account(
        memo=memo, **kwargs
    )


def adopted(obj: dict[str, Any], owner: kopf.Body) -> dict[str, Any]:
    """Owner references, so deleting the ModelDeployment deletes what it created."""
    kopf.adopt(obj, owner=owner)
    return obj


def _conditions(status: dict[str, Any]) -> list[dict[str, Any]]:
    raw = status.get("conditions")
    return raw if isinstance(raw, list) else []


def _post(body: kopf.Body, reason: str, message: str, warning: bool = False) -> None:
    """A Kubernetes Event on the resource (kopf posts it in the background)."""
    kopf.event(body, type="Warning" if warning else "Normal", reason=reason, message=message)


def _waker(memo: kopf.Memo, namespace: str, name: str) -> asyncio.Event:
    wakers: dict[tuple[str, str], asyncio.Event] = memo.wakers
    return wakers.setdefault((namespace, name), asyncio.Event())


# -- observing --------------------------------------------------------------------------
def is_live(body: kopf.Body, **_: Any) -> bool:
    """Pods being deleted, and Failed or Succeeded ones (evicted, say), serve nothing and
    count as no replica: the index drops them (kopf purges what stops matching)."""
    if body.get("metadata", {}).get("deletionTimestamp"):
        return False
    return (body.get("status") or {}).get("phase") not in ("Failed", "Succeeded")


def pods_by_deployment(
    namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[tuple[str | None, str], PodView]:
    """Index of the live pods of each ModelDeployment."""
    return {(namespace, str(labels[DEPLOYMENT_LABEL])): pod_view(body)}


def pod_changed(namespace: str | None, labels: kopf.Labels, memo: kopf.Memo, **_: Any) -> None:
    if namespace is not None:
        _waker(memo, namespace, str(labels[DEPLOYMENT_LABEL])).set()


def resource_changed(namespace: str | None, name: str | None, memo: kopf.Memo, **_: Any) -> None:
    if namespace is not None and name is not None:
        _waker(memo, namespace, name).set()


# -- one pass ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Pass:
    status: dict[str, Any]  # the status this pass arrived at
    wake_in: float | None  # seconds until time alone changes the plan
    # Events to post once the status is written: a replica that takes over after a
    # crash between the two repeats the pass, so an event posted before would be posted
    # twice; posted after, it can only be lost (and the status says it all anyway)
    events: tuple[Event, ...] = ()


def _reject(
    body: kopf.Body,
    status: dict[str, Any],
    problems: list[str],
    generation: int | None,
    logger: kopf.Logger,
) -> Pass:
    new = invalid_status(problems, generation, time.time(), _conditions(status))
    events: tuple[Event, ...] = ()
    if status.get("message") != new["message"] or status.get("phase") != Phase.INVALID:
        events = (Event("InvalidSpec", new["message"], warning=True),)
        logger.warning("rejected: %s", new["message"])
    return Pass({**status, **new}, None, events)


async def reconcile_pass(
    body: kopf.Body,
    status: dict[str, Any],
    name: str,
    namespace: str,
    pods: list[PodView],
    memo: kopf.Memo,
    logger: kopf.Logger,
    check_children: bool = True,
) -> Pass:
    """Observe, plan, act. ``status`` is the resource's status as this operator last left
    it; the new one is returned, for the caller to write. ``check_children``: compare
    every child with the live object (recreate what was deleted, restore what drifted);
    otherwise they are applied only when what the resource asks of them changed."""
    meta = body.get("metadata", {})
    generation = meta.get("generation")
    try:
        spec = parse_spec(dict(body.get("spec", {})))
    except SpecError as exc:
        return _reject(body, status, exc.problems, generation, logger)
    config = _config(memo)
    verified = list(status.get("verifiedVersions") or [])
    stable = status.get("currentVersion")
    known = (stable, status.get("previousVersion"))  # served before: never blocked by it
    store_problem: str | None = None
    if config.check_store and spec.version not in verified and spec.version not in known:
        result, message = await _check_store(memo.api, namespace, spec)
        if result is VersionCheck.MISSING:
            return _reject(body, status, [message], generation, logger)
        if result is VersionCheck.UNREACHABLE:  # a condition; the rest of the pass goes on
            logger.warning("%s; will retry", message)
            store_problem = message
            held = rollout_from_status(status.get("rollout"))
            current = held.to_version if held is not None else stable
            if current:  # not yet to a version nobody could check: hold where it is
                spec = replace(spec, version=current)
        else:
            verified = ([*verified, spec.version])[-8:]
    api: KubeClient = memo.api

    objects = [adopted(o, body) for o in children(name, namespace, spec, stable or spec.version)]
    applied = digest(objects)
    events: list[Event] = []
    foreign = list(status.get("foreignChildren") or [])
    if check_children or status.get("appliedHash") != applied:
        results = {
            f"{o['kind']}/{o['metadata']['name']}": await cluster.apply(api, o) for o in objects
        }
        changed = [k for k, r in results.items() if r in (ApplyResult.CREATED, ApplyResult.UPDATED)]
        now_foreign = [k for k, r in results.items() if r is ApplyResult.FOREIGN]
        if changed:
            events.append(Event("Reconciled", f"created or restored {changed}"))
        if now_foreign and now_foreign != foreign:
            message = f"not owned by this resource, left alone: {now_foreign}"
            events.append(Event("ForeignObject", message, warning=True))
        foreign = now_foreign

    annotations = meta.get("annotations") or {}
    promoted = annotations.get(PROMOTE)
    now = time.time()
    rollout = rollout_from_status(status.get("rollout"))
    analysis = AnalysisState.from_status(status.get("analysis"))
    sample = await _read_canary(spec, namespace, stable, rollout, analysis, pods, now)
    plan = plan_rollout(
        spec,
        stable,
        status.get("previousVersion"),
        rollout,
        pods,
        now,
        _rng,
        promoted,
        analysis,
        sample,
        aborted_version=annotations.get(ABORT),
        retried_version=annotations.get(RETRY),
    )
    await cluster.set_targets(api, namespace, plan.actions)
    # one promotion promotes one rollout; an abort or a retry is acted on (or ignored) once
    used = ((PROMOTE,) if plan.promotion_used else ()) + plan.cleared
    if used:
        await cluster.clear_annotations(api, namespace, name, used)
    events += plan.events
    if spec.allow_unsigned and not was_unsigned(_conditions(status)):
        events.append(Event(UNSIGNED_REASON, UNSIGNED_MESSAGE, warning=True))
    new_status = build_status(
        plan,
        pods,
        spec.replicas,
        generation,
        now,
        _conditions(status),
        signing_key=spec.signing_public_key_secret,
        foreign=foreign,
        store_problem=store_problem,
    )
    new_status["appliedHash"] = applied
    new_status["foreignChildren"] = foreign
    new_status["verifiedVersions"] = verified
    new_status["history"] = record(status.get("history"), plan, now, annotations.get(CHANGE_CAUSE))
    if plan.stable_version != stable:  # publish the new default for pods created later
        await cluster.apply(
            api,
            adopted(configmap(name, namespace, spec, plan.stable_version or spec.version), body),
        )
    deadline = next_deadline(spec, plan.state, plan.analysis)
    wake_in = None if deadline is None else max(0.0, deadline - time.time())
    if store_problem is not None:
        wake_in = min(wake_in or STORE_RETRY_S, STORE_RETRY_S)
    return Pass(new_status, wake_in, tuple(events))


async def _read_canary(
    spec: ModelDeploymentSpec,
    namespace: str,
    stable: str | None,
    rollout: RolloutState | None,
    analysis: AnalysisState | None,
    pods: list[PodView],
    now: float,
) -> Sample | None:
    """The canary's figures, when its analysis has a check due (else ``None``)."""
    held = analysing(spec, rollout, analysis)
    if held is None or stable is None or not held.due(now):
        return None
    return await read_canary(spec, namespace, stable, pods, held.window_start, now)


async def _check_store(
    api: KubeClient, namespace: str, spec: ModelDeploymentSpec
) -> tuple[VersionCheck, str]:
    """Is ``spec.version`` in the store, asked with the resource's own credentials?"""
    secret_name = spec.store.credentials_secret
    if not secret_name or not spec.store.url:
        return await check_version(spec)
    secret = await cluster.get_secret(api, namespace, secret_name)
    if secret is None:
        return VersionCheck.UNREACHABLE, f"credentials Secret {secret_name} not found"
    return await check_version(spec, boto_credentials(dict(secret.get("data") or {})))


def _changed(old: dict[str, Any], new: dict[str, Any]) -> bool:
    def stable(status: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in status.items() if k not in _VOLATILE}

    return stable(old) != stable(new)


async def _sleep(stopped: kopf.DaemonStopped, wake: asyncio.Event, seconds: float) -> None:
    waiters = [asyncio.ensure_future(stopped.wait()), asyncio.ensure_future(wake.wait())]
    try:
        await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


async def follow_rollouts(
    *,
    stopped: kopf.DaemonStopped,
    body: kopf.Body,
    name: str,
    namespace: str | None,
    memo: kopf.Memo,
    logger: kopf.Logger,
    pods_by_deployment: kopf.Index[tuple[str | None, str], PodView] | None = None,
    **_: Any,
) -> None:
    """The resource's daemon: a pass whenever it or one of its pods changes, or a deadline
    comes. Status is written only when it changed; the status this daemon wrote is what
    the next pass starts from (the watch's copy can lag behind a write). A transient API
    failure becomes ``kopf.TemporaryError``: kopf restarts the daemon a little later."""
    assert namespace is not None  # a namespaced resource
    assert pods_by_deployment is not None  # kopf passes every index to every handler
    wake = _waker(memo, namespace, name)
    interval = _config(memo).interval_s
    status = dict(body.get("status") or {})
    children_checked = 0.0
    while not stopped:
        wake.clear()
        pods: Iterable[PodView] = pods_by_deployment.get((namespace, name), [])
        check = time.monotonic() - children_checked >= min(interval, CHILDREN_CHECK_S)
        started = time.monotonic()
        try:
            result = await reconcile_pass(
                body, status, name, namespace, sorted(pods, key=lambda p: p.name), memo, logger,
                check_children=check,
            )  # fmt: skip
            if check:
                children_checked = time.monotonic()
            if _changed(status, result.status):
                patch = merge_patch(status, result.status)
                status = await cluster.patch_status(memo.api, namespace, name, patch) or status
            for event in result.events:
                _post(body, event.reason, event.message, warning=event.warning)
                logger.info("%s: %s", event.reason, event.message)
            metrics: OperatorMetrics = memo.metrics
            metrics.pass_seconds.labels(namespace, name).observe(time.monotonic() - started)
            versions = result.status.get("versions") or {}
            metrics.observe(namespace, name, str(result.status.get("phase")), versions)
        except TransientApiError as exc:
            raise kopf.TemporaryError(f"Kubernetes API: {exc}", delay=API_RETRY_DELAY_S) from exc
        wait = interval if result.wake_in is None else min(result.wake_in, interval)
        await _sleep(stopped, wake, wait)


def register(config: OperatorConfig) -> kopf.OperatorRegistry:
    """A registry with the handlers; ``config.interval_s`` is the resync period."""
    registry = kopf.OperatorRegistry()
    kopf.on.startup(registry=registry)(configure)
    kopf.on.startup(registry=registry)(serve_metrics)
    kopf.on.login(registry=registry)(login)
    kopf.on.cleanup(registry=registry)(close_api)
    ours = {DEPLOYMENT_LABEL: kopf.PRESENT}
    kopf.index("v1", "pods", labels=ours, when=is_live, registry=registry)(pods_by_deployment)
    kopf.on.event("v1", "pods", labels=ours, registry=registry)(pod_changed)
    kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)(resource_changed)
    kopf.daemon(
        GROUP,
        VERSION,
        PLURAL,
        id="rollouts",
        initial_delay=0.0,
        cancellation_timeout=10.0,
        registry=registry,
    )(follow_rollouts)
    return registry
