"""kopf handlers. Everything runs in one timer per ModelDeployment, so observations,
decisions and the status they produce never race each other; all decisions are made by
the pure functions in :mod:`planner`, :mod:`manifests` and :mod:`status`."""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import kopf

from model_rollout_contract.annotations import PROMOTE
from model_rollout_contract.states import Phase

from . import cluster
from .config import OperatorConfig
from .constants import GROUP, PLURAL, VERSION
from .errors import SpecError, TransientApiError
from .kube_client import ApiEndpoint, KubeClient
from .manifests import children, configmap, digest
from .planner import plan_rollout
from .pods import pod_view
from .spec import parse_spec
from .status import build_status, invalid_status, merge_patch, rollout_from_status
from .store_check import VersionCheck, check_version

_rng = random.SystemRandom()
API_RETRY_DELAY_S = 2.0  # after a transient API error, kopf retries the reconcile this late


def _config(memo: Any) -> OperatorConfig:
    return getattr(memo, "config", None) or OperatorConfig()


def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    config = _config(memo)
    settings.posting.level = logging.INFO
    settings.scanning.disabled = config.disable_scanning
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    endpoint = ApiEndpoint.from_url_or_cluster(config.kube_api)
    memo.api = KubeClient(endpoint) if endpoint is not None else None


async def close_api(memo: kopf.Memo, **_: Any) -> None:
    api: KubeClient | None = getattr(memo, "api", None)
    if api is not None:
        await api.close()


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
    logger: kopf.Logger,
) -> None:
    new = invalid_status(problems, generation, time.time(), _conditions(status))
    if status.get("message") != new["message"] or status.get("phase") != Phase.INVALID:
        kopf.warn(body, reason="InvalidSpec", message=new["message"])
        logger.warning("rejected: %s", new["message"])
    patch.status.update(merge_patch({k: status.get(k) for k in new}, new))


async def reconcile(
    *,
    body: kopf.Body,
    status: kopf.Status,
    meta: kopf.Meta,
    name: str | None,
    namespace: str | None,
    patch: kopf.Patch,
    memo: kopf.Memo,
    logger: kopf.Logger,
    **_: Any,
) -> None:
    """One pass: observe, plan, act, write status. A transient API failure becomes
    ``kopf.TemporaryError``: kopf retries the pass, and nothing half-applied is recorded
    because status is written only at the end of a pass."""
    assert namespace is not None and name is not None  # a namespaced resource
    try:
        await _reconcile(body, dict(status), meta, name, namespace, patch, memo, logger)
    except TransientApiError as exc:
        raise kopf.TemporaryError(f"Kubernetes API: {exc}", delay=API_RETRY_DELAY_S) from exc


async def _reconcile(
    body: kopf.Body,
    status_d: dict[str, Any],
    meta: kopf.Meta,
    name: str,
    namespace: str,
    patch: kopf.Patch,
    memo: kopf.Memo,
    logger: kopf.Logger,
) -> None:
    generation = meta.get("generation")
    try:
        spec = parse_spec(dict(body.get("spec", {})))
    except SpecError as exc:
        _reject(patch, body, status_d, exc.problems, generation, logger)
        return
    config = _config(memo)
    verified = list(status_d.get("verifiedVersions") or [])
    if config.check_store and spec.version not in verified:
        result, message = await check_version(spec)
        if result is VersionCheck.MISSING:
            _reject(patch, body, status_d, [message], generation, logger)
            return
        if result is VersionCheck.UNREACHABLE:
            patch.status["message"] = message
            logger.warning("%s; will retry", message)
            return
        verified = ([*verified, spec.version])[-8:]
    api: KubeClient = memo.api

    stable = status_d.get("currentVersion")
    objects = [adopted(o, body) for o in children(name, namespace, spec, stable or spec.version)]
    applied = digest(objects)
    if status_d.get("appliedHash") != applied:
        for obj in objects:
            await cluster.apply(api, obj)
        kopf.info(body, reason="Reconciled", message=f"applied {len(objects)} child objects")

    pods = [pod_view(p) for p in await cluster.list_pods(api, namespace, name)]
    promoted = (meta.get("annotations") or {}).get(PROMOTE)
    plan = plan_rollout(
        spec,
        stable,
        status_d.get("previousVersion"),
        rollout_from_status(status_d.get("rollout")),
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
        logger.info("%s: %s", event.reason, event.message)
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
    kopf.on.cleanup(registry=registry)(close_api)
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
