"""kopf handlers. Everything runs in one timer per ModelDeployment, so observations,
decisions and the status they produce never race each other; all decisions are made by
the pure functions in :mod:`planner`, :mod:`manifests` and :mod:`status`."""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import kopf

from model_sidecar.kube import KubeApi

from . import cluster
from .config import OperatorConfig
from .constants import GROUP, PLURAL, PROMOTE_ANNOTATION, VERSION
from .manifests import children, configmap, digest
from .planner import RolloutState, plan_rollout
from .pods import pod_view
from .spec import SpecError, parse_spec
from .status import build_status, invalid_status, merge_patch
from .store_check import VersionCheck, check_version

log = logging.getLogger(__name__)
_rng = random.SystemRandom()


def _config(memo: Any) -> OperatorConfig:
    return getattr(memo, "config", None) or OperatorConfig()


def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    config = _config(memo)
    settings.posting.level = logging.INFO
    settings.scanning.disabled = config.disable_scanning
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    memo.api = KubeApi.from_url_or_cluster(config.kube_api)


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


def _reject(
    patch: kopf.Patch,
    body: kopf.Body,
    status: dict[str, Any],
    problems: list[str],
    generation: int | None,
) -> None:
    new = invalid_status(problems, generation, time.time(), _conditions(status))
    if status.get("message") != new["message"] or status.get("phase") != "Invalid":
        kopf.warn(body, reason="InvalidSpec", message=new["message"])
        log.warning("%s rejected: %s", body.get("metadata", {}).get("name"), new["message"])
    patch.status.update(merge_patch({k: status.get(k) for k in new}, new))


async def reconcile(
    *,
    body: kopf.Body,
    status: kopf.Status,
    meta: kopf.Meta,
    name: str,
    namespace: str | None,
    patch: kopf.Patch,
    memo: Any,
    **_: Any,
) -> None:
    assert namespace is not None  # ModelDeployment is a namespaced resource
    status_d = dict(status)
    generation = meta.get("generation")
    try:
        spec = parse_spec(dict(body.get("spec", {})))
    except SpecError as exc:
        _reject(patch, body, status_d, exc.problems, generation)
        return
    config = _config(memo)
    verified = list(status_d.get("verifiedVersions") or [])
    if config.check_store and spec.version not in verified:
        result, message = await check_version(spec)
        if result is VersionCheck.MISSING:
            _reject(patch, body, status_d, [message], generation)
            return
        if result is VersionCheck.UNREACHABLE:
            patch.status["message"] = message
            log.warning("%s: %s; will retry", name, message)
            return
        verified = ([*verified, spec.version])[-8:]
    api: KubeApi = memo.api

    stable = status_d.get("currentVersion")
    objects = [adopted(o, body) for o in children(name, namespace, spec, stable or spec.version)]
    applied = digest(objects)
    if status_d.get("appliedHash") != applied:
        for obj in objects:
            await cluster.apply(api, obj)
        kopf.info(body, reason="Reconciled", message=f"applied {len(objects)} child objects")

    pods = [pod_view(p) for p in await cluster.list_pods(api, namespace, name)]
    promoted = (meta.get("annotations") or {}).get(PROMOTE_ANNOTATION)
    plan = plan_rollout(
        spec,
        stable,
        status_d.get("previousVersion"),
        RolloutState.from_status(status_d.get("rollout")),
        pods,
        time.time(),
        _rng,
        promoted,
    )
    await cluster.set_targets(api, namespace, plan.actions)
    for event in plan.events:
        (kopf.warn if event.warning else kopf.info)(
            body, reason=event.reason, message=event.message
        )
        log.info("%s/%s %s: %s", namespace, name, event.reason, event.message)
    new_status = build_status(
        plan, pods, spec.replicas, generation, time.time(), _conditions(status_d)
    )
    new_status["appliedHash"] = applied
    new_status["verifiedVersions"] = verified
    if plan.stable_version != stable:  # publish the new default for pods created later
        await cluster.apply(
            api,
            adopted(configmap(name, namespace, spec, plan.stable_version or spec.version), body),
        )
    patch.status.update(merge_patch(status_d, new_status))


def register(config: OperatorConfig) -> kopf.OperatorRegistry:
    """A registry with the handlers; the timer interval comes from the configuration."""
    registry = kopf.OperatorRegistry()
    kopf.on.startup(registry=registry)(configure)
    kopf.on.login(registry=registry)(login)
    kopf.timer(
        GROUP,
        VERSION,
        PLURAL,
        id="reconcile",
        interval=config.interval_s,
        initial_delay=0.0,
        registry=registry,
    )(reconcile)
    return registry
