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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import kopf

from model_rollout_contract.annotations import (
    ABORT,
    CHANGE_CAUSE,
    DEPLOYMENT_LABEL,
    PROMOTE,
    RETRY,
)
from model_rollout_contract.names import is_valid_name
from model_rollout_contract.pins import MAX_SEQUENCE
from model_rollout_contract.states import Phase
from model_rollout_contract.tracks import DEFAULT_TRACK, TrackKeys, track_keys

from . import cluster
from .analysis import AnalysisState, Sample
from .analysis_sources import read_canary
from .cluster import ApplyResult
from .config import OperatorConfig
from .constants import GROUP, PLURAL, VERSION
from .errors import ApiError, SpecError, TransientApiError
from .history import record
from .kube_client import KubeClient, connection_info, load_configuration
from .manifests import children, configmap, digest
from .metrics import OperatorMetrics
from .planner import Event, RolloutState, analysing, next_deadline, plan_rollout
from .pods import PodView, pod_view
from .spec import ModelDeploymentSpec, TenantModelSpec, parse_spec, track_spec
from .status import (
    UNSIGNED_MESSAGE,
    UNSIGNED_REASON,
    build_status,
    invalid_status,
    merge_patch,
    refused_status,
    rollout_from_status,
    was_unsigned,
    without_nulls,
)
from .store_check import StoreAnswer, VersionCheck, boto_credentials, check_version

_rng = random.SystemRandom()
API_RETRY_DELAY_S = 2.0  # after a transient API error, kopf restarts the daemon this late
STORE_RETRY_S = 5.0  # an unreachable store is asked again this late
CHILDREN_CHECK_S = 10.0  # children are compared with the live objects at least this often
_VOLATILE = ("lastUpdateTime",)  # status fields that alone are no reason to write


def _config(memo: Any) -> OperatorConfig:
    return getattr(memo, "config", None) or OperatorConfig()


async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    config = _config(memo)
    # kopf's own log lines ("Handler ... succeeded", on every pod event) are not posted as
    # Kubernetes Events; the rollout's events are posted explicitly (see _post)
    settings.posting.level = logging.WARNING
    settings.scanning.disabled = config.disable_scanning
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    memo.metrics = metrics = OperatorMetrics()
    configuration = await load_configuration(config.kube_api, config.kubeconfig)

    def count_error(status: int) -> None:
        metrics.api_errors.labels(str(status)).inc()

    memo.api = KubeClient(configuration, on_error=count_error)
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


async def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    """kopf's connection: the same API server and credentials as the operator's own
    calls, read anew at each login (kopf logs in again on a 401 or at expiry)."""
    config = _config(memo)
    return await connection_info(await load_configuration(config.kube_api, config.kubeconfig))


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
    # annotations acted on (promote, abort, retry): removed once the status is written, so
    # a failed write repeats the pass with them still there, never without them
    cleared: tuple[str, ...] = ()


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
    gate = await _store_gate(memo, config.check_store, namespace, spec, status, logger)
    if gate.missing is not None:
        return _reject(body, status, [gate.missing], generation, logger)
    spec, stable = gate.spec, status.get("currentVersion")
    api: KubeClient = memo.api
    tenants_before: dict[str, Any] = dict(status.get("tenants") or {})
    tenant_versions = {
        t.track: (tenants_before.get(t.track) or {}).get("currentVersion") or t.version
        for t in spec.tenant_models
    }

    pins: dict[str | None, Mapping[str, int]] = {None: gate.pins}
    for t in spec.tenant_models:  # a tenant track's new pins reach the ConfigMap next pass
        pins[t.track] = stored_pins((tenants_before.get(t.track) or {}).get(PINS_FIELD))
    objects = [
        adopted(o, body)
        for o in children(name, namespace, spec, stable or spec.version, tenant_versions, pins)
    ]
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
    own = await _track_pass(
        spec, status, DEFAULT_TRACK, pods, namespace, name, api, generation, annotations,
        foreign=foreign, store_problem=gate.problem, pins=gate.pins,
    )  # fmt: skip
    events += own.events
    if spec.allow_unsigned and not was_unsigned(_conditions(status)):
        events.append(Event(UNSIGNED_REASON, UNSIGNED_MESSAGE, warning=True))
    new_status = own.status
    new_status["appliedHash"] = applied
    new_status["foreignChildren"] = foreign
    new_status["verifiedVersions"] = gate.verified
    new_status[PINS_FIELD] = gate.pins
    wakes = [own.wake_in]
    cleared = list(own.cleared)

    tenants_after: dict[str, Any] = {}
    for tenant in spec.tenant_models:
        passed = await _tenant_pass(
            body, spec, tenant, tenants_before.get(tenant.track) or {}, pods, namespace, name,
            memo, generation, annotations, logger,
        )  # fmt: skip
        tenants_after[tenant.track] = passed.status
        events += passed.events
        wakes.append(passed.wake_in)
        cleared += passed.cleared
    if tenants_after or tenants_before:
        new_status["tenants"] = tenants_after  # a tenant model removed: its status goes
    stables_after = {t: s.get("currentVersion") for t, s in tenants_after.items()}
    stables_before = {t: (tenants_before.get(t) or {}).get("currentVersion") for t in stables_after}
    if new_status.get("currentVersion") != stable or stables_after != stables_before:
        # publish the new defaults for pods created later
        versions = {t.track: stables_after.get(t.track) or t.version for t in spec.tenant_models}
        default = new_status.get("currentVersion") or spec.version
        for track, after in tenants_after.items():
            pins[track] = stored_pins(after.get(PINS_FIELD))
        cm = configmap(name, namespace, spec, default, versions, pins)
        await cluster.apply(api, adopted(cm, body))
    known = [w for w in wakes if w is not None]
    wake_in = min(known) if known else None
    if gate.problem is not None:
        wake_in = min(wake_in or STORE_RETRY_S, STORE_RETRY_S)
    return Pass(new_status, wake_in, tuple(events), tuple(cleared))


PINS_FIELD = "pinnedSequences"  # .status (and each tenant's entry): version -> sequence


def stored_pins(raw: object) -> dict[str, int]:
    """The pins a status holds (entries that are not a version's sequence are dropped:
    the status is this operator's own, but an edit of it must not stop a pass)."""
    if not isinstance(raw, dict):
        return {}
    return {
        version: sequence
        for version, sequence in raw.items()
        if is_valid_name(version)
        and isinstance(sequence, int)
        and not isinstance(sequence, bool)
        and 0 <= sequence <= MAX_SEQUENCE
    }


@dataclass(frozen=True)
class StoreGate:
    """What the store check of a track's ``spec.version`` decided."""

    spec: ModelDeploymentSpec  # its version held where it is while the store is unreachable
    verified: list[str]  # versions found in the store (a few, newest last)
    problem: str | None = None  # the store could not be asked: a condition, and a retry
    missing: str | None = None  # the version is not in the store: the spec is refused
    # the publish sequences pinned when rollouts started (model_rollout_contract.pins):
    # of the versions verified, serving and kept for a rollback
    pins: dict[str, int] = field(default_factory=dict)


async def _store_gate(
    memo: kopf.Memo,
    check_store: bool,
    namespace: str,
    spec: ModelDeploymentSpec,
    status: dict[str, Any],
    logger: kopf.Logger,
) -> StoreGate:
    """Is the track's version in the store? Versions checked before, or served before, are
    never asked again. The sequence of a version found is pinned (never re-read: a build
    written back into the store later is older than the pin)."""
    verified = list(status.get("verifiedVersions") or [])
    stable = status.get("currentVersion")
    known = (stable, status.get("previousVersion"))  # served before: never blocked by it
    pins = stored_pins(status.get(PINS_FIELD))
    if not check_store or spec.version in verified or spec.version in known:
        return StoreGate(spec, verified, pins=_kept(pins, verified, status))
    answer: StoreAnswer = await _check_store(memo.api, namespace, spec)
    if answer.result is VersionCheck.MISSING:
        return StoreGate(spec, verified, missing=answer.message, pins=pins)
    if answer.result is VersionCheck.UNREACHABLE:  # a condition; the rest of the pass goes on
        logger.warning("%s; will retry", answer.message)
        held = rollout_from_status(status.get("rollout"))
        current = held.to_version if held is not None else stable
        if current:  # not yet to a version nobody could check: hold where it is
            spec = replace(spec, version=current)
        return StoreGate(spec, verified, problem=answer.message, pins=pins)
    verified = ([*verified, spec.version])[-8:]
    if answer.sequence is not None:
        pins[spec.version] = max(answer.sequence, pins.get(spec.version, answer.sequence))
    return StoreGate(spec, verified, pins=_kept(pins, verified, status))


def _kept(pins: dict[str, int], verified: list[str], status: dict[str, Any]) -> dict[str, int]:
    """The pins of versions a pod may still be sent to: verified, serving, kept for a
    rollback, or those of the rollout under way."""
    rollout = rollout_from_status(status.get("rollout"))
    wanted = {*verified, status.get("currentVersion"), status.get("previousVersion")}
    if rollout is not None:
        wanted |= {rollout.to_version, rollout.from_version}
    return {version: pins[version] for version in sorted(pins) if version in wanted}


@dataclass(frozen=True)
class TrackPass:
    status: dict[str, Any]
    events: list[Event]
    wake_in: float | None
    cleared: tuple[str, ...] = ()  # its annotations acted on (see Pass.cleared)


async def _track_pass(
    spec: ModelDeploymentSpec,
    status: dict[str, Any],
    keys: TrackKeys,
    pods: list[PodView],
    namespace: str,
    name: str,
    api: KubeClient,
    generation: int | None,
    annotations: dict[str, str],
    *,
    foreign: list[str] | None = None,
    store_problem: str | None = None,
    pins: Mapping[str, int] | None = None,
) -> TrackPass:
    """Plan and act on one track's rollout: the deployment's model (``status`` is the
    resource's) or a tenant model (``status`` is its entry in ``.status.tenants``); the
    pods are seen, and annotated, through the track's keys only; ``pins`` go with each
    pod's new target."""
    views = [p.of_track(keys) for p in pods]
    stable = status.get("currentVersion")
    now = time.time()
    rollout = rollout_from_status(status.get("rollout"))
    analysis = AnalysisState.from_status(status.get("analysis"))
    sample = await _read_canary(spec, namespace, stable, rollout, analysis, views, now)
    plan = plan_rollout(
        spec,
        stable,
        status.get("previousVersion"),
        rollout,
        views,
        now,
        _rng,
        annotations.get(keys.promote),
        analysis,
        sample,
        aborted_version=annotations.get(keys.abort),
        retried_version=annotations.get(keys.retry),
    )
    await cluster.set_targets(api, namespace, plan.actions, keys, pins or {})
    # one promotion promotes one rollout; an abort or a retry is acted on (or ignored) once
    named = {PROMOTE: keys.promote, ABORT: keys.abort, RETRY: keys.retry}
    used = ((keys.promote,) if plan.promotion_used else ()) + tuple(
        named.get(key, key) for key in plan.cleared
    )
    new_status = build_status(
        plan,
        views,
        spec.replicas,
        generation,
        now,
        _conditions(status),
        signing_key=spec.signing_public_key_secret,
        foreign=foreign,
        store_problem=store_problem,
    )
    new_status["history"] = record(status.get("history"), plan, now, annotations.get(CHANGE_CAUSE))
    deadline = next_deadline(spec, plan.state, plan.analysis)
    wake_in = None if deadline is None else max(0.0, deadline - time.time())
    return TrackPass(new_status, list(plan.events), wake_in, used)


async def _tenant_pass(
    body: kopf.Body,
    spec: ModelDeploymentSpec,
    tenant: TenantModelSpec,
    status: dict[str, Any],
    pods: list[PodView],
    namespace: str,
    name: str,
    memo: kopf.Memo,
    generation: int | None,
    annotations: dict[str, str],
    logger: kopf.Logger,
) -> TrackPass:
    """A tenant model's own rollout, which never touches another track's annotations; its
    refusal (a version not in the store) is its own status, not the resource's. Its
    events name the tenant."""
    own = track_spec(spec, tenant)
    label = f"tenant {tenant.tenant}, model {tenant.model} ({tenant.track})"
    gate = await _store_gate(memo, _config(memo).check_store, namespace, own, status, logger)
    if gate.missing is not None:
        refused = _reject(body, status, [gate.missing], generation, logger)
        events = [replace(e, message=f"{label}: {e.message}") for e in refused.events]
        return TrackPass(refused.status, events, None)
    passed = await _track_pass(
        gate.spec, status, track_keys(tenant.track), pods, namespace, name, memo.api,
        generation, annotations, store_problem=gate.problem, pins=gate.pins,
    )  # fmt: skip
    passed.status["verifiedVersions"] = gate.verified
    passed.status[PINS_FIELD] = gate.pins
    passed.status["model"] = tenant.key
    events = [replace(e, message=f"{label}: {e.message}") for e in passed.events]
    wake_in = passed.wake_in
    if gate.problem is not None:
        wake_in = min(wake_in or STORE_RETRY_S, STORE_RETRY_S)
    return TrackPass(passed.status, events, wake_in, passed.cleared)


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


async def _check_store(api: KubeClient, namespace: str, spec: ModelDeploymentSpec) -> StoreAnswer:
    """Is ``spec.version`` in the store, asked with the resource's own credentials?"""
    secret_name = spec.store.credentials_secret
    if not secret_name or not spec.store.url:
        return await check_version(spec)
    secret = await cluster.get_secret(api, namespace, secret_name)
    if secret is None:
        return StoreAnswer(VersionCheck.UNREACHABLE, f"credentials Secret {secret_name} not found")
    return await check_version(spec, boto_credentials(dict(secret.get("data") or {})))


def _changed(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether ``new`` says more than ``old`` beyond the volatile fields, the resource's
    and each tenant model's (whose entries carry their own)."""

    def stable(status: dict[str, Any]) -> dict[str, Any]:
        kept = {k: v for k, v in status.items() if k not in _VOLATILE}
        tenants = kept.get("tenants")
        if isinstance(tenants, dict):
            kept["tenants"] = {
                track: stable(entry) if isinstance(entry, dict) else entry
                for track, entry in tenants.items()
            }
        return kept

    return stable(old) != stable(new)


async def _sleep(stopped: kopf.DaemonStopped, wake: asyncio.Event, seconds: float) -> None:
    waiters = [asyncio.ensure_future(stopped.wait()), asyncio.ensure_future(wake.wait())]
    try:
        await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


async def _report_refusal(
    body: kopf.Body,
    memo: kopf.Memo,
    namespace: str,
    name: str,
    status: dict[str, Any],
    refusal: ApiError,
    logger: kopf.Logger,
) -> dict[str, Any]:
    """A call the API server refused (a verb RBAC does not grant, an admission policy)
    is no reason to restart: it becomes the Ready condition, with the server's message,
    and a Warning event once. Returns the status now stored."""
    new = without_nulls(refused_status(status, refusal.status, refusal.reason, time.time()))
    if not _changed(status, new):
        return status
    logger.error("the API server refused a call: %s", refusal)
    _post(body, "ApiRefused", refusal.reason, warning=True)
    try:
        patch = merge_patch(status, new)
        return await cluster.patch_status(memo.api, namespace, name, patch) or new
    except ApiError as exc:
        logger.error("and the condition could not be written: %s", exc)
        return status


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
            new_status = without_nulls(result.status)
            if _changed(status, new_status):
                patch = merge_patch(status, new_status)
                status = await cluster.patch_status(memo.api, namespace, name, patch) or status
            if result.cleared:  # acted on, and the status that says so is written
                await cluster.clear_annotations(memo.api, namespace, name, result.cleared)
            for event in result.events:
                _post(body, event.reason, event.message, warning=event.warning)
                logger.info("%s: %s", event.reason, event.message)
            metrics: OperatorMetrics = memo.metrics
            metrics.pass_seconds.labels(namespace, name).observe(time.monotonic() - started)
            versions = result.status.get("versions") or {}
            metrics.observe(namespace, name, str(result.status.get("phase")), versions)
        except TransientApiError as exc:
            raise kopf.TemporaryError(f"Kubernetes API: {exc}", delay=API_RETRY_DELAY_S) from exc
        except ApiError as exc:  # refused: said on the resource, asked again at the resync
            status = await _report_refusal(body, memo, namespace, name, status, exc, logger)
            await _sleep(stopped, wake, interval)
            continue
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
