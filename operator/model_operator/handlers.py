"""kopf handlers, event-driven.

One task per ModelDeployment runs every pass for that resource (observe, plan, act,
write status, post events), so observations, decisions and the status they produce never
race each other; all decisions are made by the pure functions in :mod:`planner`,
:mod:`manifests` and :mod:`status`. The task sleeps until something happens: the
operator's own watch on the pods it labels keeps an index (:mod:`.pod_index`: no LIST
per pass) and wakes the owning resource's task when a pod's view changed; a change of
the resource itself wakes it too; a timer remains only for deadlines and jitter (the
planner's :func:`~.planner.next_deadline`) and as a resync period.

The task is the operator's own (:class:`Follower`), started and stopped by the
resource's watch events, not a kopf daemon: kopf puts a finalizer on every resource that
has a daemon, which blocks deleting it whenever the operator is down, and nothing here
needs one (the children go with their owner, by their ownerReferences). kopf writes
nothing either (no finalizer, no posted events): every write goes through the operator's
own client, which the leader's fence guards (:mod:`.leader`).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import kopf

from model_rollout_contract.annotations import (
    ABORT,
    CHANGE_CAUSE,
    PROMOTE,
    RETRY,
)
from model_rollout_contract.backoff import Backoff
from model_rollout_contract.names import is_valid_name
from model_rollout_contract.pins import MAX_SEQUENCE
from model_rollout_contract.states import Phase
from model_rollout_contract.tracks import DEFAULT_TRACK, TrackKeys, track_keys

from . import cluster
from .analysis import AnalysisState, Sample
from .analysis_sources import read_canary
from .cluster import ApplyResult
from .config import OperatorConfig
from .constants import GROUP, KOPF_FINALIZER, PLURAL, VERSION
from .errors import ApiError, ResourceGone, SpecError, TransientApiError
from .history import record
from .kube_client import KubeClient, connection_info, load_configuration
from .leader import LeaseFence
from .manifests import children, configmap, digest, selector_text
from .metrics import OperatorMetrics
from .planner import Event, RolloutState, analysing, next_deadline, plan_rollout
from .pod_index import PodIndex, PodLookup
from .pods import PodView
from .signatures import Ed25519PublicKey, secret_keys
from .spec import ModelDeploymentSpec, TenantModelSpec, parse_spec, track_spec
from .status import (
    PODS_UNSEEN_REASON,
    UNSIGNED_MESSAGE,
    UNSIGNED_REASON,
    build_status,
    invalid_status,
    pods_unseen_status,
    refused_status,
    rollout_from_status,
    was_unsigned,
    without_nulls,
)
from .store_check import StoreAnswer, VersionCheck, boto_credentials, check_version
from .template_pass import (
    TemplatePass,
    held_version,
    plan_templates,
    template_actions,
    without_retries,
)
from .template_recovery import STABLE_TEMPLATE_FIELD, keep_stable

_rng = random.SystemRandom()
# after transient API errors in a row, a resource's passes start again this late
# (jittered, never sooner than a Retry-After)
TASK_BACKOFF = Backoff(base_s=1.0, max_s=60.0, floor=0.5)
STORE_RETRY_S = 5.0  # an unreachable store is asked again this late
CHILDREN_CHECK_S = 10.0  # children are compared with the live objects at least this often
_VOLATILE = ("lastUpdateTime",)  # status fields that alone are no reason to write


def _config(memo: Any) -> OperatorConfig:
    return getattr(memo, "config", None) or OperatorConfig()


async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    config = _config(memo)
    # kopf posts no Events (its log lines, on every pod event): the rollout's are posted
    # by the operator's own client (see _post), which the leader's fence guards
    settings.posting.enabled = False
    settings.scanning.disabled = config.disable_scanning
    memo.metrics = metrics = OperatorMetrics()
    configuration = await load_configuration(config.kube_api, config.kubeconfig)

    def count_error(status: int) -> None:
        metrics.api_errors.labels(str(status)).inc()

    fence: LeaseFence | None = getattr(memo, "fence", None)
    memo.api = KubeClient(configuration, on_error=count_error, fence=fence)
    memo.wakers = {}  # (namespace, name) -> asyncio.Event of that resource's task
    memo.followers = {}  # (namespace, name) -> its Follower

    def pods_changed(namespace: str, name: str) -> None:
        _waker(memo, namespace, name).set()

    def pods_seen_again(scope: str | None) -> None:
        wakers: dict[tuple[str, str], asyncio.Event] = memo.wakers
        for (namespace, _), wake in wakers.items():
            if scope in (None, namespace):
                wake.set()

    # listed before kopf starts the resources' watch: no pass runs on an empty index
    memo.pods = PodIndex(memo.api, config.namespaces, pods_changed, pods_seen_again)
    await memo.pods.start()


async def serve_metrics(memo: kopf.Memo, **_: Any) -> None:
    port = _config(memo).metrics_port
    memo.metrics_runner = await memo.metrics.serve(port) if port else None


async def close_api(memo: kopf.Memo, **_: Any) -> None:
    """The resources' tasks stopped first (a pass cut short is run again by whoever leads
    next: all state is in the status and the pods' annotations), then the client."""
    followers: dict[tuple[str, str], Follower] = getattr(memo, "followers", {})
    tasks = [f.task for f in followers.values() if f.task is not None]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    followers.clear()
    pods: PodIndex | None = getattr(memo, "pods", None)
    if pods is not None:
        await pods.stop()
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


async def _post(memo: kopf.Memo, body: kopf.Body, event: Event, logger: kopf.Logger) -> None:
    """A Kubernetes Event on the resource. Events are auxiliary: one the API server does
    not take is logged, and the pass goes on."""
    logger.info("%s: %s", event.reason, event.message)
    try:
        await cluster.post_event(
            memo.api, dict(body), event.reason, event.message, event.warning,
            instance=_config(memo).identity,
        )  # fmt: skip
    except ApiError as exc:
        logger.warning("event %s not posted: %s", event.reason, exc)


def _forget_metrics(memo: kopf.Memo, namespace: str, name: str) -> None:
    """A ModelDeployment that is gone leaves no series behind."""
    metrics: OperatorMetrics | None = getattr(memo, "metrics", None)
    if metrics is not None:
        metrics.forget(namespace, name)


def _waker(memo: kopf.Memo, namespace: str, name: str) -> asyncio.Event:
    wakers: dict[tuple[str, str], asyncio.Event] = memo.wakers
    return wakers.setdefault((namespace, name), asyncio.Event())


class Follower:
    """One ModelDeployment's task (:func:`follow`), the latest copy of the resource its
    watch delivered, which each pass reads, and the transient failures in a row (its
    backoff). It follows one object (``uid``): one deleted and created again under the
    same name is another, with a task and state of its own."""

    def __init__(self, body: kopf.Body) -> None:
        self.body = body
        self.uid = str(body.get("metadata", {}).get("uid") or "")
        self.task: asyncio.Task[None] | None = None
        self.failures = 0
        self.written: dict[str, Any] | None = None  # the status its last write stored
        self.runs = 0  # starts of its passes: a start after the first follows a failure
        # the annotations its passes removed (acted on), as they were: while the watch's
        # copy still shows one, the API server is asked whether it is still gone, or one
        # would be acted on twice (kept across a restart of the passes, which a transient
        # failure right after the removal causes)
        self.cleared: dict[str, str] = {}

    def echo(self, body: kopf.Body) -> bool:
        """Is ``body`` the watch's copy of this task's own status write, with nothing
        else changed? Then it is no news: a pass on it would find nothing to do."""
        if self.written is None or dict(body.get("status") or {}) != self.written:
            return False
        return body.get("spec") == self.body.get("spec") and _meta(body) == _meta(self.body)


def _meta(body: kopf.Body) -> tuple[Any, ...]:
    """What of a resource's metadata a pass reads."""
    meta = body.get("metadata") or {}
    return tuple(
        meta.get(k)
        for k in ("generation", "annotations", "labels", "deletionTimestamp", "finalizers")
    )


async def resource_changed(
    event: kopf.RawEvent,
    body: kopf.Body,
    namespace: str | None,
    name: str | None,
    memo: kopf.Memo,
    logger: kopf.Logger,
    **_: Any,
) -> None:
    """Start the resource's task when it is first seen, hand it each new copy and wake
    it (not for the copy that only echoes the task's own status write); stop it once
    the resource is deleted (or being deleted: nothing more to roll out). A finalizer
    that an earlier version's kopf daemon left is removed."""
    if namespace is None or name is None:
        return
    key = (namespace, name)
    uid = str(body.get("metadata", {}).get("uid") or "")
    followers: dict[tuple[str, str], Follower] = memo.followers
    follower = followers.get(key)
    if follower is not None and follower.uid != uid:  # deleted (its event missed), recreated
        logger.info("%s/%s is another object now (uid %s): a task of its own", *key, uid)
        if follower.task is not None:
            follower.task.cancel()
        followers.pop(key)  # nothing of the old one's is kept
        follower = None
    deleted = event.get("type") == "DELETED"
    if not deleted:
        await _drop_kopf_finalizer(memo, body, namespace, name, logger)
    if deleted or body.get("metadata", {}).get("deletionTimestamp"):
        if follower is not None and follower.task is not None:
            follower.task.cancel()
        followers.pop(key, None)
        if deleted:
            _forget_metrics(memo, namespace, name)
        return
    if follower is not None and follower.echo(body):
        follower.body = body
        return
    if follower is None:
        follower = followers[key] = Follower(body)
        follower.task = asyncio.create_task(
            follow(follower, name, namespace, memo, logger, memo.pods),
            name=f"rollouts of {namespace}/{name} ({uid})",
        )
    follower.body = body
    _waker(memo, namespace, name).set()


async def _drop_kopf_finalizer(
    memo: kopf.Memo, body: kopf.Body, namespace: str, name: str, logger: kopf.Logger
) -> None:
    """Remove the finalizer that kopf's daemon put on resources (the operator's earlier
    versions): left there, it blocks their deletion for good."""
    finalizers = list(body.get("metadata", {}).get("finalizers") or [])
    if KOPF_FINALIZER not in finalizers:
        return
    try:
        await cluster.remove_finalizer(memo.api, namespace, name, finalizers, KOPF_FINALIZER)
        logger.info("removed the finalizer %s (nothing needs it)", KOPF_FINALIZER)
    except ApiError as exc:  # changed meanwhile, or refused: the next event tries again
        logger.warning("finalizer %s not removed: %s", KOPF_FINALIZER, exc)


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
    removed: frozenset[str] = frozenset(),
) -> Pass:
    """Observe, plan, act. ``status`` is the resource's status as this operator last left
    it; the new one is returned, for the caller to write. ``check_children``: compare
    every child with the live object (recreate what was deleted, restore what drifted);
    otherwise they are applied only when what the resource asks of them changed.
    ``removed``: annotations the body still shows that the API server no longer has."""
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
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if k not in removed}
    annotations, aborted, retried = template_actions(annotations)  # of a template rollout
    templates = await plan_templates(
        api, name, namespace, spec, status, pods, annotations.get(PROMOTE), meta.get("uid"),
        aborted=aborted, retried=retried,
    )  # fmt: skip
    rendered = templates.rendered()
    if templates.holds_versions():  # one kind of rollout at a time: versions wait, a retry too
        spec = replace(spec, version=held_version(status) or spec.version)
        annotations = without_retries(annotations)
    objects = []  # in their order; the Deployment: the one that runs the spec's template
    for child in children(name, namespace, spec, stable or spec.version, tenant_versions, pins):
        if child["kind"] == "Deployment":
            if rendered is None:
                continue
            child = templates.deployment(rendered, namespace, spec)
        objects.append(adopted(child, body))
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

    kept, recreated = await keep_stable(
        api, namespace, name, spec, templates.plan, rendered, status.get(STABLE_TEMPLATE_FIELD),
        meta.get("uid"), lambda child: adopted(child, body), check_children,
    )  # fmt: skip
    if recreated:
        again = templates.plan.stable.deployment
        events.append(Event("Reconciled", f"created {again} again, the stable pod template's"))
    await _scale_templates(api, namespace, str(meta.get("uid") or ""), templates, rendered,
                           check_children)  # fmt: skip
    # fewer pods than asked: maybe the API server refuses them (the Deployment says why)
    refused = (
        await cluster.pods_refused(
            api, namespace, rendered or templates.plan.stable.deployment, meta.get("uid")
        )
        if len(pods) < spec.replicas
        else None
    )
    own = await _track_pass(
        spec, status, DEFAULT_TRACK, pods, namespace, name, api, generation, annotations,
        foreign=foreign, store_problem=gate.problem, store_checked=gate.checked, pins=gate.pins,
        pods_refused=refused,
    )  # fmt: skip
    events += own.events
    if spec.allow_unsigned and not was_unsigned(_conditions(status)):
        events.append(Event(UNSIGNED_REASON, UNSIGNED_MESSAGE, warning=True))
    new_status = own.status
    events += templates.plan.events
    templates.write(new_status, _conditions(status), time.time())
    new_status["appliedHash"] = applied
    if kept is not None:
        new_status[STABLE_TEMPLATE_FIELD] = kept
    new_status["selector"] = selector_text(name)  # the scale subresource's labelSelectorPath
    new_status["foreignChildren"] = foreign
    new_status["verifiedVersions"] = gate.verified
    new_status[PINS_FIELD] = gate.pins
    wakes = [own.wake_in, templates.plan.wake_in]
    if new_status.get("currentVersion") != stable:  # children follow the new stable: now,
        wakes.append(0.0)  # in the rollout's own time, not at the next (idle) resync
    cleared = list(own.cleared) + ([PROMOTE] if templates.plan.promotion_used else [])
    cleared += templates.plan.cleared

    tenants_after: dict[str, Any] = {}
    for tenant in spec.tenant_models:
        passed = await _tenant_pass(
            body, spec, tenant, tenants_before.get(tenant.track) or {}, pods, namespace, name,
            memo, generation, annotations, logger, hold=templates.holds_versions(),
            pods_refused=refused,
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


async def _scale_templates(
    api: KubeClient,
    namespace: str,
    uid: str,
    templates: TemplatePass,
    rendered: str | None,
    check_children: bool,
) -> None:
    """The pod templates' Deployments other than the one rendered (applied whole with the
    other children): scaled as the template plan says, and those it retires deleted."""
    plan = templates.plan
    if templates.scales(check_children):
        for deployment, replicas in plan.replicas.items():
            if deployment != rendered:
                await cluster.scale_deployment(api, namespace, deployment, uid, replicas)
    for deployment in plan.retired:
        await cluster.delete_deployment(api, namespace, deployment, uid)


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
    checked: bool = True  # found in the store (now or before), or served: False, not asked


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
    if spec.version in verified or spec.version in known:
        return StoreGate(spec, verified, pins=_kept(pins, verified, status))
    if not check_store:
        return StoreGate(spec, verified, pins=_kept(pins, verified, status), checked=False)
    answer: StoreAnswer = await _check_store(memo.api, namespace, spec)
    if answer.result is VersionCheck.SKIPPED:  # a volume store: nothing was verified
        return StoreGate(spec, verified, pins=_kept(pins, verified, status), checked=False)
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
    store_checked: bool = True,
    pins: Mapping[str, int] | None = None,
    pods_refused: str | None = None,
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
    sample = await _read_canary(spec, namespace, name, stable, rollout, analysis, views, now)
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
        store_checked=store_checked,
        paused=spec.paused,
        pods_refused=pods_refused,
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
    hold: bool = False,
    pods_refused: str | None = None,
) -> TrackPass:
    """A tenant model's own rollout, which never touches another track's annotations; its
    refusal (a version not in the store) is its own status, not the resource's. Its
    events name the tenant. ``hold``: a template rollout runs; its version waits.
    ``pods_refused``: why the API server refuses the pods, which every track shares (its
    entry's ``PodsSchedulable`` says so, as the resource's does)."""
    own = track_spec(spec, tenant)
    if hold:
        own = replace(own, version=held_version(status) or own.version)
    label = f"tenant {tenant.tenant}, model {tenant.model} ({tenant.track})"
    gate = await _store_gate(memo, _config(memo).check_store, namespace, own, status, logger)
    if gate.missing is not None:
        refused = _reject(body, status, [gate.missing], generation, logger)
        events = [replace(e, message=f"{label}: {e.message}") for e in refused.events]
        return TrackPass(refused.status, events, None)
    passed = await _track_pass(
        gate.spec, status, track_keys(tenant.track), pods, namespace, name, memo.api,
        generation, annotations, store_problem=gate.problem, store_checked=gate.checked,
        pins=gate.pins, pods_refused=pods_refused,
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
    name: str,
    stable: str | None,
    rollout: RolloutState | None,
    analysis: AnalysisState | None,
    pods: list[PodView],
    now: float,
) -> Sample | None:
    """The canary's figures, when its analysis has a check due (else ``None``)."""
    held = analysing(spec, rollout, analysis)
    if held is None or rollout is None or stable is None or not held.due(now):
        return None
    return await read_canary(
        spec, namespace, name, stable, pods, held.window_start, now, rollout.canary_step
    )


async def _check_store(api: KubeClient, namespace: str, spec: ModelDeploymentSpec) -> StoreAnswer:
    """Is ``spec.version`` in the store, asked with the resource's own credentials? Its
    sequence is read only from a manifest signed by a key the pods trust. A volume store
    is not read (the operator has no volume): its keys are not asked for either."""
    if not spec.store.url:
        return await check_version(spec)
    keys = await _trusted_keys(api, namespace, spec)
    secret_name = spec.store.credentials_secret
    if not secret_name or not spec.store.url:
        return await check_version(spec, keys=keys)
    secret = await cluster.get_secret(api, namespace, secret_name)
    if secret is None:
        return StoreAnswer(VersionCheck.UNREACHABLE, f"credentials Secret {secret_name} not found")
    return await check_version(spec, boto_credentials(dict(secret.get("data") or {})), keys)


async def _trusted_keys(
    api: KubeClient, namespace: str, spec: ModelDeploymentSpec
) -> tuple[Ed25519PublicKey, ...]:
    """The keys of the track's public key Secret; none (so nothing is pinned) without
    one, or when it holds no valid key (the sidecars refuse every version then)."""
    name = spec.signing_public_key_secret
    secret = await cluster.get_secret(api, namespace, name) if name else None
    try:
        return secret_keys(dict((secret or {}).get("data") or {}))
    except ValueError:
        return ()


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


async def _sleep(wake: asyncio.Event, seconds: float) -> None:
    """Until ``wake`` is set, or ``seconds`` have passed."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(wake.wait(), seconds)


def _fence(memo: kopf.Memo) -> None:
    """Return only while this replica may act (always without leader election)."""
    fence: LeaseFence | None = getattr(memo, "fence", None)
    if fence is not None:
        fence.check()


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
    await _post(memo, body, Event("ApiRefused", refusal.reason, warning=True), logger)
    try:
        uid = str(body.get("metadata", {}).get("uid") or "")
        return await cluster.replace_status(memo.api, namespace, name, uid, new) or new
    except ApiError as exc:
        logger.error("and the condition could not be written: %s", exc)
        return status


async def _hold_unseen(
    body: kopf.Body,
    memo: kopf.Memo,
    follower: Follower,
    status: dict[str, Any],
    why: str,
    logger: kopf.Logger,
) -> dict[str, Any]:
    """The resource's pods cannot be seen (the pod watch keeps failing): nothing is
    planned; ``Ready`` is False saying why, and a Warning event once. Returns the status
    now stored (a refused or failed write is left to the next pass)."""
    new = without_nulls(pods_unseen_status(status, why, time.time()))
    if not _changed(status, new):
        return status
    logger.error("rollout held: %s", why)
    await _post(memo, body, Event(PODS_UNSEEN_REASON, why, warning=True), logger)
    meta = body.get("metadata") or {}
    written = await cluster.replace_status(
        memo.api, str(meta.get("namespace")), str(meta.get("name")), follower.uid, new
    )
    follower.written = written or new
    return follower.written


async def follow(
    follower: Follower,
    name: str,
    namespace: str,
    memo: kopf.Memo,
    logger: kopf.Logger,
    pods_by_deployment: PodLookup,
) -> None:
    """The resource's task, until cancelled or the resource is gone: its passes
    (:func:`follow_rollouts`), run again from the latest copy of the resource after a
    failure: a transient API failure after the task's backoff (``TASK_BACKOFF``, which
    grows with each failure in a row), anything else at the next resync."""
    while True:
        try:
            await follow_rollouts(follower, name, namespace, memo, logger, pods_by_deployment)
        except ResourceGone as exc:
            logger.info("%s: its task ends", exc)
            if getattr(memo, "followers", {}).get((namespace, name)) in (
                None,
                follower,
            ):  # not a new one's
                _forget_metrics(memo, namespace, name)
            return
        except TransientApiError as exc:
            delay = TASK_BACKOFF.delay(follower.failures, _rng, exc.retry_after_s)
            follower.failures += 1
            logger.warning("Kubernetes API: %s; again in %.1fs", exc, delay)
            await asyncio.sleep(delay)
        except Exception:
            interval = _config(memo).interval_s
            logger.exception("the rollout's pass failed; again in %gs", interval)
            await asyncio.sleep(interval)


async def follow_rollouts(
    follower: Follower,
    name: str,
    namespace: str,
    memo: kopf.Memo,
    logger: kopf.Logger,
    pods_by_deployment: PodLookup,
) -> None:
    """The resource's passes: one whenever it or one of its pods changes, or a deadline
    comes. Status is written only when it changed; the status this task wrote is what
    the next pass starts from (the watch's copy can lag behind a write). A transient API
    failure ends it (:class:`TransientApiError`: :func:`follow` starts it again); a
    refusal becomes a condition. With leader election each pass first asks the fence."""
    wake = _waker(memo, namespace, name)
    interval = _config(memo).interval_s
    follower.runs += 1
    if follower.runs == 1:
        status = dict(follower.body.get("status") or {})
    else:  # again after a failure: the watch's copy can lag behind the last write
        status = await cluster.read_status(memo.api, namespace, name, follower.uid)
    children_checked = 0.0
    cleared = follower.cleared
    while True:
        wake.clear()
        _fence(memo)
        body = follower.body
        pods: Iterable[PodView] = pods_by_deployment.get((namespace, name), [])
        check = time.monotonic() - children_checked >= min(interval, CHILDREN_CHECK_S)
        started = time.monotonic()
        unseen = pods_by_deployment.unseen(namespace)
        if unseen is not None:  # planned on a frozen view, a pass could do harm: held
            status = await _hold_unseen(body, memo, follower, status, unseen, logger)
            await _sleep(wake, interval)  # woken when the pods are listed again
            continue
        shown = dict((body.get("metadata") or {}).get("annotations") or {})
        for key in [k for k, v in cleared.items() if shown.get(k) != v]:
            del cleared[key]  # the watch's copy shows it gone (or changed): forgotten
        try:
            removed: frozenset[str] = frozenset()
            if cleared:
                now = await cluster.read_annotations(memo.api, namespace, name)
                removed = frozenset(k for k, v in cleared.items() if now.get(k) != v)
            result = await reconcile_pass(
                body, status, name, namespace, sorted(pods, key=lambda p: p.name), memo, logger,
                check_children=check, removed=removed,
            )  # fmt: skip
            if check:
                children_checked = time.monotonic()
            new_status = without_nulls(result.status)
            if _changed(status, new_status):
                status = await cluster.replace_status(
                    memo.api, namespace, name, follower.uid, new_status
                ) or status  # fmt: skip
                follower.written = status
            if result.cleared:  # acted on, and the status that says so is written
                # noted first: a removal that fails midway (it may have landed) is then
                # checked with the API server before the annotation could act again
                cleared.update({k: shown[k] for k in result.cleared if k in shown})
                await cluster.clear_annotations(
                    memo.api, namespace, name, follower.uid, result.cleared
                )
            for event in result.events:
                await _post(memo, body, event, logger)
            follower.failures = 0  # a pass went through: the backoff starts again
            metrics: OperatorMetrics = memo.metrics
            metrics.pass_seconds.labels(namespace, name).observe(time.monotonic() - started)
            metrics.observe(namespace, name, result.status)
        except TransientApiError:
            raise
        except ApiError as exc:  # refused: said on the resource, asked again at the resync
            status = await _report_refusal(body, memo, namespace, name, status, exc, logger)
            await _sleep(wake, interval)
            continue
        wait = interval if result.wake_in is None else min(result.wake_in, interval)
        await _sleep(wake, wait)


def register(config: OperatorConfig) -> kopf.OperatorRegistry:
    """A registry with the handlers; ``config.interval_s`` is the resync period."""
    registry = kopf.OperatorRegistry()
    kopf.on.startup(registry=registry)(configure)
    kopf.on.startup(registry=registry)(serve_metrics)
    kopf.on.login(registry=registry)(login)
    kopf.on.cleanup(registry=registry)(close_api)
    kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)(resource_changed)
    return registry
