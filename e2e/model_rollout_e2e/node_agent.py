"""The kubelet stand-in on a real API server (:mod:`.control_plane`): one Node whose pods
run as processes on this machine (:class:`~.container_runtime.ProcessContainers`) or
nowhere (:class:`~.container_runtime.SimulatedContainers`, for scale tests).

It acts as a node does, with a node's credentials (``system:node:<name>``, so the Node
authorizer and NodeRestriction judge every call): registers its Node (capacity and
allocatable cpu, memory, pods, ``nvidia.com/gpu``; the Ready condition; the
``kubernetes.io/hostname``/``os``/``arch`` labels and any others; taints, as a
kubelet's ``--register-with-taints``), renews its Lease in
``kube-node-lease`` every ``lease_renew_s`` (10 s, as a kubelet) on a thread of its own
(:mod:`.node_heartbeat`) so the node-lifecycle controller keeps it Ready and untainted,
and sets its Ready condition back if that controller changed it, watches the pods the
scheduler binds to it (``spec.nodeName``) and gives each a
:class:`~.pod_worker.PodWorker`: containers, readiness probes, status, projected token
and Downward API files refreshed every ``volume_refresh_s`` (a real kubelet's sync
period is about a minute), graceful deletion. Every ``status_sync_s`` (10 s, a kubelet's
status sync) it writes a pod's status again where the API shows other conditions than
the node wrote (the node-lifecycle controller marks every pod not Ready when the node's
Lease ran out).

Not a kubelet: no images, cgroups, resource limits or namespaces (a container's command
runs on the host, see :mod:`.pod_sandbox`); volumes are only emptyDir, ConfigMap, Secret,
Downward API and the projected token (:mod:`.pod_volumes`); no liveness or startup
probes, native sidecars, ephemeral containers, events or node status beyond its
conditions; an eviction only when a test asks for one (:meth:`NodeAgent.evict`), as a
pod's failing readiness (:meth:`NodeAgent.fail_readiness`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.client.exceptions import ApiException

from .loop_thread import LoopThread
from .node_heartbeat import NodeHeartbeat, node_conditions
from .pod_runtime import ContainerRuntime
from .pod_worker import HOST_IP, PodWorker, WorkerSettings
from .raw_api import WatchGone, json_call, watch_events

log = logging.getLogger(__name__)
KUBELET_VERSION = "v1.37.2"
_TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


class NodeAgent:
    """``async with NodeAgent(kubeconfig, runtime) as agent:`` (or :class:`AgentThread`)."""

    def __init__(
        self,
        kubeconfig: Path,
        runtime: ContainerRuntime,
        name: str = "stand-in-node",
        *,
        cpu: str = "32",
        memory: str = "128Gi",
        pods: int = 1100,
        gpus: int = 8,
        labels: dict[str, str] | None = None,
        taints: list[dict[str, str]] | None = None,
        extended: dict[str, str] | None = None,
        volume_refresh_s: float = 60.0,
        token_max_age_s: float | None = None,
        restart_backoff_s: float = 10.0,
        lease_renew_s: float = 10.0,
        status_sync_s: float = 10.0,
    ) -> None:
        """``kubeconfig``: the node's (``ControlPlane.node_kubeconfig``); ``extended``:
        more extended resources it offers (``nvidia.com/mig-1g.10gb``). Downward API
        and ConfigMap files and tokens are refreshed every ``volume_refresh_s`` (a real
        kubelet: about 60 s); tokens are renewed at 80 % of their lifetime or after
        ``token_max_age_s``; a crashed container restarts after ``restart_backoff_s``,
        doubling up to 300 s (a kubelet: 10 s)."""
        self.kubeconfig = kubeconfig
        self.runtime = runtime
        self.name = name
        resources = {"cpu": cpu, "memory": memory, "pods": str(pods),
                     "nvidia.com/gpu": str(gpus), "ephemeral-storage": "100Gi",
                     **(extended or {})}  # fmt: skip
        self.resources = resources
        self.taints = list(taints or [])  # registered with them, as --register-with-taints
        self.labels = {
            "kubernetes.io/hostname": name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            **(labels or {}),
        }
        self.volume_refresh_s = volume_refresh_s
        self.token_max_age_s = token_max_age_s
        self.restart_backoff_s = restart_backoff_s
        self.lease_renew_s = lease_renew_s
        self.status_sync_s = status_sync_s
        self.heartbeat: NodeHeartbeat | None = None
        self.workers: dict[str, PodWorker] = {}  # by pod uid
        self._runs: dict[str, asyncio.Task[None]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._api: k8s.ApiClient | None = None
        self._core: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> NodeAgent:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Register the Node and its Lease, then run the pods bound to it."""
        self._loop = asyncio.get_running_loop()
        configuration = k8s.Configuration()
        await k8s_config.load_kube_config(
            config_file=str(self.kubeconfig), client_configuration=configuration
        )
        configuration.connection_pool_maxsize = 32
        self._api = k8s.ApiClient(configuration)
        self._core = k8s.CoreV1Api(self._api)
        uid = await self._register()
        self.heartbeat = NodeHeartbeat(self.kubeconfig, self.name, uid, self.lease_renew_s)
        await asyncio.to_thread(self.heartbeat.start)
        self._tasks = [
            asyncio.create_task(self._watch_pods()),
            asyncio.create_task(self._sync_statuses()),
        ]

    async def stop(self) -> None:
        """Cancel every task and kill every process; the Node stays (a node that went
        away: the node-lifecycle controller marks it NotReady)."""
        for task in [*self._tasks, *self._runs.values()]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._runs.values(), return_exceptions=True)
        self._tasks, self._runs = [], {}
        if self.heartbeat is not None:
            await asyncio.to_thread(self.heartbeat.stop)
        if self._api is not None:
            await self._api.close()
            self._api = None

    # -- the Node and its Lease ----------------------------------------------------------

    async def _register(self) -> str:
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.name, "labels": self.labels},
            "spec": {"taints": self.taints} if self.taints else {},
        }
        try:
            created = await json_call(self._core.create_node(node, _preload_content=False))
        except ApiException as exc:
            if exc.status != 409:
                raise
            created = await json_call(self._core.read_node(self.name, _preload_content=False))
        uid = str(created["metadata"]["uid"])
        status = {
            "capacity": self.resources,
            "allocatable": self.resources,
            "conditions": node_conditions(),
            "addresses": [
                {"type": "InternalIP", "address": HOST_IP},
                {"type": "Hostname", "address": self.name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
            "nodeInfo": {
                "machineID": uid, "systemUUID": uid, "bootID": uid,
                "kernelVersion": "", "osImage": "model-rollout node agent",
                "containerRuntimeVersion": "process://1", "kubeletVersion": KUBELET_VERSION,
                "kubeProxyVersion": "", "operatingSystem": "linux", "architecture": "amd64",
            },
        }  # fmt: skip
        await json_call(
            self._core.patch_node_status(
                self.name,
                {"status": status},
                _content_type="application/merge-patch+json",
                _preload_content=False,
            )
        )
        return uid

    # -- the pods bound to it ------------------------------------------------------------

    async def _watch_pods(self) -> None:
        """List, then watch from the list's resourceVersion; list again when the watch
        ends badly (a pod gone meanwhile has its worker stopped)."""
        selector = f"spec.nodeName={self.name}"
        resource_version: str | None = None
        while True:
            try:
                if resource_version is None:
                    listed = await json_call(
                        self._core.list_pod_for_all_namespaces(
                            field_selector=selector, _preload_content=False
                        )
                    )
                    pods = listed.get("items") or []
                    for gone in set(self.workers) - {p["metadata"]["uid"] for p in pods}:
                        self._forget(gone)
                    for pod in pods:
                        self._dispatch("ADDED", pod)
                    resource_version = str(listed["metadata"]["resourceVersion"])
                watch = await self._watch(selector, resource_version)
                async for kind, pod in watch_events(watch):
                    resource_version = str(pod["metadata"].get("resourceVersion"))
                    if kind != "BOOKMARK":
                        self._dispatch(kind, pod)
            except WatchGone:
                resource_version = None
            except (ApiException, *_TRANSPORT_ERRORS, json.JSONDecodeError) as exc:
                log.warning("node %s: pod watch failed: %r", self.name, exc)
                resource_version = None
                await asyncio.sleep(1)

    async def _watch(self, selector: str, resource_version: str) -> Any:
        """The watch's response, for :func:`~.raw_api.watch_events`."""
        return await self._core.list_pod_for_all_namespaces(
            field_selector=selector,
            watch="true",
            resource_version=resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=300,
            _preload_content=False,
            _request_timeout=330,
        )

    async def _sync_statuses(self) -> None:
        """A kubelet's periodic status sync: each pod whose status on the API (the
        watch's latest) differs from what its worker wrote has it written again."""
        while True:
            await asyncio.sleep(self.status_sync_s)
            for uid, worker in list(self.workers.items()):
                if uid in self._runs and worker.drifted():
                    worker.resync()

    def _dispatch(self, kind: str, pod: dict[str, Any]) -> None:
        uid = str(pod["metadata"]["uid"])
        if kind == "DELETED":
            self._forget(uid)
            return
        worker = self.workers.get(uid)
        if worker is not None:
            worker.update(pod)
            return
        phase = (pod.get("status") or {}).get("phase")
        if phase in ("Succeeded", "Failed") and not pod["metadata"].get("deletionTimestamp"):
            return  # ended before this agent started: nothing to run
        settings = WorkerSettings(
            self._core,
            self.runtime,
            self.volume_refresh_s,
            self.token_max_age_s,
            self.restart_backoff_s,
        )
        worker = self.workers[uid] = PodWorker(settings, pod)
        self._runs[uid] = asyncio.create_task(worker.run())

    def evict(
        self, namespace: str, name: str, message: str = "The node was low on resource: memory."
    ) -> None:
        """Evict the pod as a kubelet under node pressure does (:meth:`PodWorker.evict`);
        from any thread (the agent may run on an :class:`AgentThread`)."""
        self._on_loop(namespace, name, lambda worker: worker.evict(message))

    def fail_readiness(self, namespace: str, name: str) -> None:
        """The pod's readiness probes fail from now on (:meth:`PodWorker.fail_readiness`);
        from any thread."""
        self._on_loop(namespace, name, lambda worker: worker.fail_readiness())

    def _on_loop(self, namespace: str, name: str, action: Callable[[PodWorker], None]) -> None:
        if self._loop is None:
            raise RuntimeError(f"node agent {self.name} is not running")

        async def act() -> None:
            for worker in self.workers.values():
                if (worker.namespace, worker.name) == (namespace, name):
                    action(worker)
                    return
            raise LookupError(f"node {self.name} runs no pod {namespace}/{name}")

        asyncio.run_coroutine_threadsafe(act(), self._loop).result(30)

    def _forget(self, uid: str) -> None:
        """The pod is gone from the API: stop its worker (killing what still runs)."""
        self.workers.pop(uid, None)
        run = self._runs.pop(uid, None)
        if run is not None:
            run.cancel()


class AgentThread:
    """A :class:`NodeAgent` on a thread of its own with its own event loop, for tests
    that drive the cluster synchronously (kubectl). ``start()`` returns once the Node is
    registered; ``stop()`` kills every pod's processes."""

    def __init__(self, agent: NodeAgent) -> None:
        self.agent = agent
        self._thread = LoopThread(f"node-{agent.name}", self._serve)

    async def _serve(self, ready: Callable[[], None], stopping: asyncio.Event) -> None:
        try:
            await self.agent.start()
            ready()
            await stopping.wait()
        finally:
            await self.agent.stop()

    def start(self, timeout_s: float = 60.0) -> AgentThread:
        name = self.agent.name
        self._thread.start(
            timeout_s,
            late=f"node agent {name} did not register",
            failed=f"node agent {name} failed",
        )
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        if not self._thread.stop(timeout_s):
            raise TimeoutError(f"node agent {self.agent.name} still running")
        if self._thread.error is not None:
            raise RuntimeError(f"node agent {self.agent.name} failed") from self._thread.error

    def __enter__(self) -> AgentThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
