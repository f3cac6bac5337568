"""The live pods of each ModelDeployment, kept by the operator's own pod watch.

One LIST, then a WATCH from it (again from a LIST after 410 Gone or a failure, with
backoff), of the
pods this operator labels (``DEPLOYMENT_LABEL``), per namespace or, for namespace
patterns, cluster-wide and filtered here. Each event is reduced to the pod's
:class:`~.pods.PodView` at once; the resource's task is woken only when a pod's view
changed, came or went, so a pod event that changes nothing the planner reads (a
resourceVersion, the kubelet's timestamps) costs no pass.

Why not kopf's index and pod events: kopf runs its whole handler machinery on every
event of every pod (a Body, the handlers' selection, logging), which at a thousand pods
in a rollout was most of the operator's CPU time; this watch decodes the line and
compares a view. Pods being deleted, Failed or Succeeded serve nothing and are dropped
(:func:`is_live`).

While a scope's LIST keeps failing the index holds the views of its last LIST: after
``UNSEEN_AFTER_S`` :meth:`PodIndex.unseen` says why, and the rollouts hold (a pass that
planned on a frozen view could start loads the pods already finished, or miss new pods)
until the pods are listed again, which wakes them.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import logging
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any, Protocol

from model_rollout_contract.annotations import DEPLOYMENT_LABEL
from model_rollout_contract.backoff import Backoff

from .errors import ApiError, TransientApiError
from .kube_client import KubeClient
from .pods import PodView, pod_view

log = logging.getLogger(__name__)
WATCH_TIMEOUT_S = 300  # the server ends each watch this late; it is resumed at once
# after a failed LIST or WATCH: from 1 s, doubling to 30 s, each at least half its cap
# (the API server that failed is shared: a thousand operators' retries must not storm it)
RELIST_BACKOFF = Backoff(base_s=1.0, max_s=30.0, floor=0.5)
UNSEEN_AFTER_S = 10.0  # failing this long, a scope's pods count as unseen
Key = tuple[str, str]  # (namespace, ModelDeployment)


class PodLookup(Protocol):
    """What a rollout's task reads of the index."""

    def get(self, key: Key, default: list[PodView], /) -> Iterable[PodView]: ...

    def unseen(self, namespace: str, /) -> str | None:
        """Why the namespace's pods are not seen now (``None``: they are)."""
        ...


def is_live(pod: Mapping[str, Any]) -> bool:
    """Pods being deleted, and Failed or Succeeded ones (evicted, say), serve nothing and
    count as no replica."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    return (pod.get("status") or {}).get("phase") not in ("Failed", "Succeeded")


def _has_glob(pattern: str) -> bool:
    return pattern.startswith("!") or any(c in pattern for c in "*?[")


def namespace_matcher(patterns: Iterable[str]) -> Callable[[str], bool]:
    """kopf's namespace patterns: globs, ``!glob`` excludes; none: every namespace."""
    included = [p for p in patterns if not p.startswith("!")]
    excluded = [p[1:] for p in patterns if p.startswith("!")]

    def matches(namespace: str) -> bool:
        if any(fnmatch.fnmatchcase(namespace, p) for p in excluded):
            return False
        return not included or any(fnmatch.fnmatchcase(namespace, p) for p in included)

    return matches


class PodIndex:
    """``index.get((namespace, name), [])``: the views of that ModelDeployment's live
    pods. :meth:`start` lists before it returns (no pass runs on an empty index)."""

    def __init__(
        self,
        api: KubeClient,
        namespaces: Iterable[str],
        on_change: Callable[[str, str], None],
        on_seen_again: Callable[[str | None], None] = lambda scope: None,
    ) -> None:
        """``on_change(namespace, name)``: a ModelDeployment's pods changed;
        ``on_seen_again(namespace)`` (``None``: every namespace): listed again after
        failures, whatever changed."""
        patterns = list(namespaces)
        self.api, self.on_change, self.on_seen_again = api, on_change, on_seen_again
        self.matches = namespace_matcher(patterns)
        # plain names: a watch each (a namespaced Role suffices); patterns: one cluster-wide
        self.scopes: list[str | None] = (
            list(patterns) if patterns and not any(map(_has_glob, patterns)) else [None]
        )
        self._pods: dict[tuple[str, str], tuple[str, PodView]] = {}  # pod -> (owner, view)
        self._owned: dict[Key, dict[str, PodView]] = {}  # owner -> its pods' views
        self._tasks: list[asyncio.Task[None]] = []
        self._failing: dict[str | None, tuple[float, str]] = {}  # scope -> (since, why)
        self._failures: dict[str | None, int] = {}  # scope -> failed tries in a row

    def get(self, key: Key, default: list[PodView] | None = None) -> list[PodView]:
        views = self._owned.get(key)
        return list(views.values()) if views else (default if default is not None else [])

    def unseen(self, namespace: str) -> str | None:
        """Why ``namespace``'s pods are not seen now: its scope's LIST or WATCH has failed
        for ``UNSEEN_AFTER_S`` or more (``None``: they are seen)."""
        for scope, (since, why) in self._failing.items():
            if scope in (None, namespace) and time.monotonic() - since >= UNSEEN_AFTER_S:
                return why
        return None

    async def start(self) -> None:
        """The first LIST of each scope (asked again until the API answers it: a refusal,
        RBAC's say, is logged), then its WATCH on a task of its own."""
        versions = [await self._first_list(scope) for scope in self.scopes]
        self._tasks = [
            asyncio.create_task(self._follow(scope, version), name=f"pod watch {scope or '*'}")
            for scope, version in zip(self.scopes, versions, strict=True)
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    # -- the index -----------------------------------------------------------------------

    def _path(self, scope: str | None, **params: str) -> str:
        base = f"/api/v1/namespaces/{scope}/pods" if scope else "/api/v1/pods"
        query = urllib.parse.urlencode({"labelSelector": DEPLOYMENT_LABEL, **params})
        return f"{base}?{query}"

    def _set(self, namespace: str, name: str, now: tuple[str, PodView] | None) -> None:
        """Pod ``namespace/name`` is ``now`` (``None``: gone); its owners are woken
        when that is news."""
        before = self._pods.get((namespace, name))
        if now == before:
            return
        if before is not None:
            self._pods.pop((namespace, name))
            self._owned.get((namespace, before[0]), {}).pop(name, None)
        if now is not None:
            self._pods[(namespace, name)] = now
            self._owned.setdefault((namespace, now[0]), {})[name] = now[1]
        for owner in {entry[0] for entry in (before, now) if entry is not None}:
            self.on_change(namespace, owner)

    def _put(self, pod: Mapping[str, Any]) -> None:
        meta = pod.get("metadata") or {}
        namespace, name = str(meta.get("namespace")), str(meta.get("name"))
        if not self.matches(namespace):
            return
        owner = str((meta.get("labels") or {}).get(DEPLOYMENT_LABEL) or "")
        self._set(namespace, name, (owner, pod_view(pod)) if owner and is_live(pod) else None)

    def _drop(self, pod: Mapping[str, Any]) -> None:
        meta = pod.get("metadata") or {}
        self._set(str(meta.get("namespace")), str(meta.get("name")), None)

    async def _list(self, scope: str | None) -> str:
        """The scope's pods as a LIST shows them (those it lacks are gone); its
        resourceVersion, to watch from."""
        answer = await self.api.request("GET", self._path(scope)) or {}
        items = list(answer.get("items") or [])
        listed = {(str(p["metadata"]["namespace"]), str(p["metadata"]["name"])) for p in items}
        for namespace, name in [k for k in self._pods if scope in (None, k[0])]:
            if (namespace, name) not in listed:
                self._set(namespace, name, None)
        for pod in items:
            self._put(pod)
        failing = self._failing.pop(scope, None)
        if failing is not None and time.monotonic() - failing[0] >= UNSEEN_AFTER_S:
            self.on_seen_again(scope)  # its rollouts were holding
        return str((answer.get("metadata") or {}).get("resourceVersion") or "")

    def _failed(self, scope: str | None, why: str) -> float:
        """Note the scope's failure (from its first in a row); the pause before the next
        try, growing with the failures in a row."""
        since, _ = self._failing.get(scope, (time.monotonic(), ""))
        failures = self._failures.get(scope, 0)
        self._failing[scope] = (since, f"the operator cannot list or watch the pods: {why}")
        self._failures[scope] = failures + 1
        return RELIST_BACKOFF.delay(failures)

    async def _first_list(self, scope: str | None) -> str:
        while True:
            try:
                version = await self._list(scope)
                self._failures.pop(scope, None)
                return version
            except ApiError as exc:
                pause = self._failed(scope, str(exc))
                log.warning("listing pods (%s): %s; again in %.1fs", scope or "all", exc, pause)
                await asyncio.sleep(pause)

    async def _follow(self, scope: str | None, version: str | None) -> None:
        while True:
            try:
                if version is None:
                    version = await self._list(scope)
                async for kind, pod in self._events(scope, version):
                    self._failures.pop(scope, None)  # a watch that delivers is healthy
                    version = str((pod.get("metadata") or {}).get("resourceVersion") or version)
                    if kind == "DELETED":
                        self._drop(pod)
                    elif kind in ("ADDED", "MODIFIED"):
                        self._put(pod)
            except _Gone:
                version = None
            except (ApiError, TransientApiError, ValueError) as exc:
                pause = self._failed(scope, str(exc))
                log.warning("pod watch (%s): %s; again in %.1fs", scope or "all", exc, pause)
                version = None
                await asyncio.sleep(pause)
            except Exception as exc:  # anything else (a connection cut mid-answer, a bug):
                # the watch must not end for good, or every pass plans on a frozen index
                pause = self._failed(scope, f"{type(exc).__name__}: {exc}")
                log.exception("pod watch (%s) failed; listing again in %.1fs", scope, pause)
                version = None
                await asyncio.sleep(pause)

    async def _events(
        self, scope: str | None, version: str
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        path = self._path(
            scope, watch="true", resourceVersion=version, allowWatchBookmarks="true",
            timeoutSeconds=str(WATCH_TIMEOUT_S),
        )  # fmt: skip
        async with self.api.stream(path, WATCH_TIMEOUT_S + 30) as lines:
            async for line in lines:
                event = json.loads(line)
                kind, obj = str(event.get("type")), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise _Gone()
                    raise ApiError(int(obj.get("code") or 0), str(obj.get("message")))
                yield kind, obj


class _Gone(Exception):
    """The watch's resourceVersion is gone (410): list again."""


__all__ = ["PodIndex", "PodLookup", "is_live", "namespace_matcher"]
