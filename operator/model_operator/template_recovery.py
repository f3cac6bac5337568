"""The stable pod template when the status names none (its status subresource wiped, or
a backup restored without it): read from the cluster, not guessed, so that the
Deployment that holds the ready pods is not taken for an old one and drained.

A Deployment the operator renders carries :data:`~.manifests.TEMPLATE_DIGEST`, the
digest of the template it runs; one an older operator made has it not, but the name of
any after the first says its digest's head (:func:`~.manifests.deployment_name`).

While the spec renders another template than the stable one (a rollout waits, runs or
failed), the stable Deployment can no longer be rendered from it: a snapshot of it kept
in the status recreates it if it is deleted by hand (after a failure it is the one that
serves)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from model_rollout_contract.annotations import DOMAIN

from . import cluster
from .kube_client import KubeClient
from .manifests import (
    TEMPLATE_DIGEST,
    deployment,
    deployment_name,
    template_label,
    template_of,
)
from .pods import PodView
from .spec import ModelDeploymentSpec
from .template_rollout import TemplatePlan, TemplateRef, deployment_of


def inferred_stable(
    name: str, digest: str, owned: Mapping[str, str | None], pods: list[PodView]
) -> TemplateRef | None:
    """The stable template among the Deployments this resource owns (``owned``: each one's
    stamped digest, ``None`` where it has none): the one with the most ready pods, the
    one that runs the spec's template ``digest`` on a tie (or with none ready anywhere):
    a canary of the spec's template, or a failed one at zero pods, is never taken for it
    (every pod would move onto it unjudged, the serving one drained). ``None``: none
    (the first Deployment's, as on a first pass). One whose digest is unknown is the
    spec's if it is the first Deployment (as an upgrade from an operator without
    template rollouts takes it), else known by its digest's head only: the spec's
    template is rolled out to."""
    own = deployment_name(name, template_label(digest))
    ready = Counter(d for p in pods if p.ready and (d := deployment_of(name, p)) in owned)
    most = max(ready.values(), default=0)
    for known, stamped in sorted(owned.items()):
        runs_spec = stamped == digest or (stamped is None and known == own != name)
        if runs_spec and ready[known] == most:
            return TemplateRef(known, digest)
    if not ready:
        return None
    best = min(ready, key=lambda d: (-ready[d], d))  # a tie: by name, the same each pass
    stamped = owned[best]
    if stamped is not None:
        return TemplateRef(best, stamped)
    return TemplateRef(best, template_of(name, best) or digest)


async def stable_from_cluster(
    api: KubeClient, namespace: str, name: str, digest: str, pods: list[PodView], uid: str | None
) -> TemplateRef | None:
    """:func:`inferred_stable` of the Deployments that could be it: the spec's template's,
    the first one, and those of the pods (each read once; another tool's left out)."""
    names = {name, deployment_name(name, template_label(digest))}
    names |= {deployment_of(name, p) for p in pods}
    owned: dict[str, str | None] = {}
    for candidate in sorted(names):
        live = await cluster.owned_deployment(api, namespace, candidate, uid)
        if live is not None:
            stamped = ((live.get("metadata") or {}).get("annotations") or {}).get(TEMPLATE_DIGEST)
            owned[candidate] = stamped if isinstance(stamped, str) else None
    return inferred_stable(name, digest, owned, pods)


# .status: the stable Deployment as the cluster held it, while the spec renders another
# template (a rollout waits, runs or failed): the spec can no longer render it, so a
# stable Deployment deleted by hand is created again from this
STABLE_TEMPLATE_FIELD = "stableTemplate"


def snapshot(live: dict[str, Any]) -> dict[str, Any]:
    """What of a live Deployment recreates it: its pod template and the operator's
    annotations (its template's digest, the spec keys it was rendered with)."""
    meta = live.get("metadata") or {}
    own = {k: v for k, v in (meta.get("annotations") or {}).items() if k.startswith(f"{DOMAIN}/")}
    return {
        "deployment": meta.get("name"),
        "annotations": own,
        "template": (live.get("spec") or {}).get("template") or {},
    }


def _kept(saved: object, stable: str) -> dict[str, Any] | None:
    """The status's snapshot if it is of ``stable`` (and whole: the status can be edited)."""
    if not isinstance(saved, dict) or saved.get("deployment") != stable:
        return None
    whole = isinstance(saved.get("template"), dict) and isinstance(saved.get("annotations"), dict)
    return saved if whole else None


def restored(
    name: str,
    namespace: str,
    spec: ModelDeploymentSpec,
    stable: TemplateRef,
    replicas: int,
    saved: dict[str, Any],
) -> dict[str, Any]:
    """The stable Deployment again: the spec's Deployment (its name, labels, selector,
    strategy) with the saved pod template and annotations, and ``replicas`` pods."""
    body = deployment(name, namespace, spec, template_of(name, stable.deployment))
    body["metadata"]["annotations"] = {**saved["annotations"], TEMPLATE_DIGEST: stable.digest}
    body["spec"]["template"] = saved["template"]
    body["spec"]["replicas"] = replicas
    return body


async def keep_stable(
    api: KubeClient,
    namespace: str,
    name: str,
    spec: ModelDeploymentSpec,
    plan: TemplatePlan,
    rendered: str | None,
    saved: object,
    uid: str | None,
    adopt: Callable[[dict[str, Any]], dict[str, Any]],
    check: bool = True,
) -> tuple[dict[str, Any] | None, bool]:
    """While the stable Deployment is not the one rendered: its snapshot for the status
    (taken once from the live object), and whether it was gone and created again from
    it (``adopt``: its owner reference; ``check``: is it looked for this pass, as the
    other children are). ``(None, False)`` once it is rendered again."""
    stable = plan.stable
    if rendered == stable.deployment:
        return None, False
    kept = _kept(saved, stable.deployment)
    if kept is not None and not check:
        return kept, False
    live = await cluster.owned_deployment(api, namespace, stable.deployment, uid)
    if live is not None:
        return kept or snapshot(live), False
    if kept is None:  # gone before a snapshot was taken: nothing to create it from
        return None, False
    replicas = plan.replicas.get(stable.deployment, spec.replicas)
    body = adopt(restored(name, namespace, spec, stable, replicas, kept))
    return kept, await cluster.apply(api, body) is cluster.ApplyResult.CREATED
