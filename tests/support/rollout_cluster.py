"""Rollouts on the session's real control plane (issue 28), for the operator tests that
follow a rollout through the pods: a namespace of the test's own; the operator as the
Helm chart runs it (``python -m model_operator`` as the chart's ServiceAccount, with a
kubeconfig: :class:`control_plane_operator.Operator`), started, killed and restarted by
the test, or one process a module's tests share (:func:`shared_operator`); the
Deployment's pods made by the real controller-manager and scheduler and run by a
simulated node (conftest's ``node_agents``) whose sidecars read their pod and
report on it through the API as the real ones do (``model_rollout_e2e.simulated_sidecar``)
; and the cluster's admin on the test's loop, following every status the operator writes
with a watch, so that a status held for a moment (one batch of a rollout) is not missed
as a poll could miss it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.client.exceptions import ApiException

from model_rollout_cli.kube import GROUP, PLURAL, VERSION
from model_rollout_contract.annotations import TARGET_VERSION
from model_rollout_e2e.control_plane import ControlPlane
from model_rollout_e2e.identities import Identity
from model_rollout_e2e.node_agent import NodeAgent
from model_rollout_e2e.raw_api import WatchGone, json_call, watch_events
from model_rollout_e2e.seaweed import CREDENTIALS_ENV
from model_rollout_e2e.simulated_sidecar import SidecarBehaviour, model_store_claim
from tests.support.control_plane_operator import Operator

log = logging.getLogger(__name__)
INTERVAL_S = 0.5  # the operator's resync: passes run on events, this is the longest wait
WAIT_S = 90.0  # a hang guard: each step of these rollouts takes seconds
SIDECARS = SidecarBehaviour(fetch_s=0.1, load_s=0.3)
_TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)
Status = dict[str, Any]


class RolloutCluster:
    """One test's namespace, its operator, its node and the admin's view of them."""

    def __init__(
        self,
        cluster: ControlPlane,
        namespace: str,
        identity: Identity,
        api: k8s.ApiClient,
        node_agents: Callable[..., NodeAgent],
        work: Path,
        shared: Operator | None = None,
    ) -> None:
        self.cluster, self.namespace, self.identity, self.work = cluster, namespace, identity, work
        self._node_agents = node_agents
        self._shared = shared
        self.core: Any = k8s.CoreV1Api(api)  # raw JSON calls (_preload_content=False)
        self.apps: Any = k8s.AppsV1Api(api)
        self.custom: Any = k8s.CustomObjectsApi(api)
        self.coordination: Any = k8s.CoordinationV1Api(api)
        self.operator: Operator | None = shared  # the one running for this namespace
        self.node: NodeAgent | None = None
        self.statuses: dict[str, list[Status]] = {}  # every status written, by resource
        self.history: list[Status] = []  # mlp's statuses (not empty), since last cleared
        self._news = asyncio.Event()

    # -- the operator and the node -------------------------------------------------------

    def start_operator(
        self,
        *extra: str,
        env: dict[str, str] | None = None,
        kubeconfig: Path | None = None,
        log_name: str = "operator.log",
    ) -> Operator:
        """``python -m model_operator`` for this namespace, as the chart's account."""
        if self._shared is not None:
            raise RuntimeError(f"{self.namespace} has the module's operator already")
        operator = Operator(
            kubeconfig or self.identity.kubeconfig, self.namespace, self.work / log_name,
            INTERVAL_S, extra=extra, env=env,
        ).start()  # fmt: skip
        assert isinstance(operator, Operator)
        self.operator = operator
        return operator

    async def stop_operator(self) -> None:
        """SIGTERM, as a pod's shutdown; the process's end awaited (kopf gives the
        resources' tasks 5 s)."""
        if self.operator is not None and self.operator is not self._shared:
            await asyncio.to_thread(self.operator.stop)
            self.operator = None

    async def kill_operator(self) -> None:
        """SIGKILL: the end of a test, which has no use for a graceful stop."""
        if self.operator is not None and self.operator is not self._shared:
            await asyncio.to_thread(self.operator.kill)
            self.operator = None

    def run_pods(self, sidecars: SidecarBehaviour = SIDECARS, **options: Any) -> NodeAgent:
        """The node that runs this test's pods (the scheduler's only choice), and the
        volume store a spec names (``store: {pvc: model-store}``)."""
        self.cluster.kubectl.apply(*model_store_claim(self.namespace, "model-store"))
        self.node = self._node_agents(sidecars=sidecars, **options)
        return self.node

    def log_tail(self) -> str:
        return self.operator.log_tail(40) if self.operator is not None else "(no operator)"

    # -- the ModelDeployment -------------------------------------------------------------

    async def create(self, body: dict[str, Any]) -> dict[str, Any]:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "ModelDeployment",
            **body,
            "metadata": {**body.get("metadata", {}), "namespace": self.namespace},
        }
        return await json_call(
            self.custom.create_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, body, _preload_content=False
            )
        )

    async def patch(self, patch: dict[str, Any], name: str = "mlp") -> dict[str, Any]:
        """A merge patch of the ModelDeployment (its spec or metadata), as ``kubectl
        patch --type=merge`` sends it."""
        return await json_call(
            self.custom.patch_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, name, patch,
                _content_type="application/merge-patch+json", _preload_content=False,
            )
        )  # fmt: skip

    async def md(self, name: str = "mlp") -> dict[str, Any]:
        return await json_call(
            self.custom.get_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, name, _preload_content=False
            )
        )

    async def wait(
        self, predicate: Callable[[Status], bool], timeout: float = WAIT_S, name: str = "mlp"
    ) -> Status:
        """The first status, from the one written last on, for which ``predicate`` holds
        (every status the operator writes is looked at, however briefly it held)."""
        start: int | None = None
        try:
            async with asyncio.timeout(timeout):
                while True:
                    news = self._news
                    statuses = self.statuses.get(name, [])
                    if start is None:
                        start = max(len(statuses) - 1, 0)
                    for status in statuses[start:]:
                        if predicate(status):
                            return status
                    start = len(statuses)
                    await news.wait()
        except TimeoutError:
            last = (self.statuses.get(name) or [{}])[-1]
            raise AssertionError(
                f"the status of {name} never matched; last: {last}\n"
                f"operator log:\n{self.log_tail()}"
            ) from None

    async def passes(self, count: int = 2, name: str = "mlp") -> None:
        """Until the operator has run ``count`` more reconcile passes of ``name``: what
        it would have done by now, it has done."""
        operator = self.operator
        assert operator is not None
        before = await asyncio.to_thread(operator.passes, self.namespace, name)
        async with asyncio.timeout(WAIT_S):
            while await asyncio.to_thread(operator.passes, self.namespace, name) < before + count:
                await asyncio.sleep(0.1)

    # -- what the operator made ----------------------------------------------------------

    async def items(self, kind: str) -> list[dict[str, Any]]:
        """The namespace's ``kind`` (pods, events, configmaps, services, secrets,
        deployments)."""
        if kind == "deployments":
            call = self.apps.list_namespaced_deployment(self.namespace, _preload_content=False)
        else:
            lister = getattr(self.core, f"list_namespaced_{kind.removesuffix('s')}")
            call = lister(self.namespace, _preload_content=False)
        return list((await json_call(call)).get("items") or [])

    async def get(self, kind: str, name: str) -> dict[str, Any] | None:
        """One object of the namespace (core kinds), or ``None``."""
        reader = getattr(self.core, f"read_namespaced_{kind}")
        try:
            return await json_call(reader(name, self.namespace, _preload_content=False))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def reasons(self) -> list[str]:
        """The reasons of the namespace's events, oldest first."""
        events = sorted(await self.items("events"), key=lambda e: e.get("eventTime") or
                        e.get("firstTimestamp") or e["metadata"]["creationTimestamp"])  # fmt: skip
        return [str(e.get("reason")) for e in events]

    async def events_of(self, reason: str, count: int) -> list[dict[str, Any]]:
        """At least ``count`` events of ``reason``: the operator posts an event on a task
        of its own, so one may land after the status write it goes with."""
        async with asyncio.timeout(WAIT_S):
            while True:
                found = [e for e in await self.items("events") if e.get("reason") == reason]
                if len(found) >= count:
                    return found
                await asyncio.sleep(0.1)

    async def pod_targets(self) -> dict[str, str | None]:
        return {
            p["metadata"]["name"]: (p["metadata"].get("annotations") or {}).get(TARGET_VERSION)
            for p in await self.items("pods")
        }

    # -- following the statuses ----------------------------------------------------------

    def _seen(self, md: dict[str, Any]) -> None:
        name, status = md["metadata"]["name"], dict(md.get("status") or {})
        statuses = self.statuses.setdefault(name, [])
        if not statuses or statuses[-1] != status:
            statuses.append(status)
        if name == "mlp" and status and (not self.history or self.history[-1] != status):
            self.history.append(status)
        self._news.set()
        self._news = asyncio.Event()

    async def follow(self) -> None:
        """List, then watch from the list; again from a list when a watch ends badly."""
        version: str | None = None
        while True:
            try:
                if version is None:
                    listed = await json_call(
                        self.custom.list_namespaced_custom_object(
                            GROUP, VERSION, self.namespace, PLURAL, _preload_content=False
                        )
                    )
                    for md in listed.get("items") or []:
                        self._seen(md)
                    version = str(listed["metadata"]["resourceVersion"])
                version = await self._watch(version)
            except (ApiException, *_TRANSPORT_ERRORS, json.JSONDecodeError) as exc:
                log.warning("following the ModelDeployments of %s: %r", self.namespace, exc)
                version = None
                await asyncio.sleep(0.5)

    async def _watch(self, version: str) -> str | None:
        """One watch; the resourceVersion to go on from (``None``: list again)."""
        response = await self.custom.list_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, watch=True, resource_version=version,
            allow_watch_bookmarks=True, timeout_seconds=60, _preload_content=False,
            _request_timeout=90,
        )  # fmt: skip
        try:
            async with contextlib.aclosing(watch_events(response)) as events:
                async for kind, md in events:
                    version = str(md["metadata"]["resourceVersion"])
                    if kind in ("ADDED", "MODIFIED"):
                        self._seen(md)
        except WatchGone:
            return None
        return version


@contextlib.contextmanager
def shared_operator(
    cluster: ControlPlane, identity: Identity, work: Path, prefix: str
) -> Iterator[Operator]:
    """One operator process for every namespace named ``<prefix>-*`` (a kopf glob), as
    the chart runs it, with the model store's credentials (SeaweedFS'), for the tests of
    a module that need no operator of their own: each test then starts none, which costs
    a loaded machine a few seconds of CPU. Killed at the end."""
    operator = Operator(
        identity.kubeconfig, f"{prefix}-*", work / "operator.log", INTERVAL_S,
        env=CREDENTIALS_ENV,
    ).start()  # fmt: skip
    assert isinstance(operator, Operator)
    try:
        yield operator
    finally:
        operator.kill()


@contextlib.asynccontextmanager
async def rollout_cluster(
    cluster: ControlPlane,
    identity: Identity,
    node_agents: Callable[..., NodeAgent],
    work: Path,
    prefix: str = "rollout",
    shared: Operator | None = None,
) -> AsyncIterator[RolloutCluster]:
    """A :class:`RolloutCluster` in a new namespace ``<prefix>-...``, which ``shared``
    (if any) runs for; an operator the test started is killed and the namespace deleted
    afterwards."""
    namespace = f"{prefix}-{uuid.uuid4().hex[:8]}"
    await asyncio.to_thread(cluster.kubectl, "create", "namespace", namespace)
    configuration = k8s.Configuration()
    await k8s_config.load_kube_config(
        config_file=str(cluster.kubeconfig), client_configuration=configuration
    )
    async with k8s.ApiClient(configuration) as api:
        rollouts = RolloutCluster(cluster, namespace, identity, api, node_agents, work, shared)
        following = asyncio.create_task(rollouts.follow())
        try:
            yield rollouts
        finally:
            following.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await following
            await rollouts.kill_operator()
            await asyncio.to_thread(
                cluster.kubectl.run, "delete", "namespace", namespace, "--wait=false"
            )


def condition(status: Status, kind: str) -> dict[str, Any]:
    """The status's condition of ``kind`` (empty when it has none)."""
    return next((c for c in status.get("conditions", []) if c["type"] == kind), {})
