"""The stable pod template when the status names none (its status subresource wiped, or
a backup restored without it): read from the cluster, not guessed, so that the
Deployment that holds the ready pods is not taken for an old one and drained.

A Deployment the operator renders carries :data:`~.manifests.TEMPLATE_DIGEST`, the
digest of the template it runs; one an older operator made has it not, but the name of
any after the first says its digest's head (:func:`~.manifests.deployment_name`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from . import cluster
from .kube_client import KubeClient
from .manifests import TEMPLATE_DIGEST, deployment_name, template_label, template_of
from .pods import PodView
from .template_rollout import TemplateRef, deployment_of


def inferred_stable(
    name: str, digest: str, owned: Mapping[str, str | None], pods: list[PodView]
) -> TemplateRef | None:
    """The stable template among the Deployments this resource owns (``owned``: each one's
    stamped digest, ``None`` where it has none): the one that runs the spec's template
    ``digest``, else the one with the most ready pods. ``None``: neither (the first
    Deployment's, as on a first pass). One whose digest is unknown is the spec's if it is
    the first Deployment (as an upgrade from an operator without template rollouts takes
    it), else known by its digest's head only: the spec's template is rolled out to."""
    own = deployment_name(name, template_label(digest))
    for deployment, stamped in sorted(owned.items()):
        if stamped == digest or (stamped is None and deployment == own != name):
            return TemplateRef(deployment, digest)
    ready = Counter(d for p in pods if p.ready and (d := deployment_of(name, p)) in owned)
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
    for deployment in sorted(names):
        live = await cluster.owned_deployment(api, namespace, deployment, uid)
        if live is not None:
            stamped = ((live.get("metadata") or {}).get("annotations") or {}).get(TEMPLATE_DIGEST)
            owned[deployment] = stamped if isinstance(stamped, str) else None
    return inferred_stable(name, digest, owned, pods)
