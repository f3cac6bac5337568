"""The whole system on one machine, on a real Kubernetes control plane: a model store,
etcd + kube-apiserver + controller-manager + scheduler (:mod:`.control_plane`), the
Helm chart's CRD, RBAC and sidecar admission policy, the operator as a process with its
ServiceAccount's kubeconfig, and a node agent (:mod:`.node_agent`, the kubelet stand-in)
that runs the pods the scheduler binds to it as processes: the operator's Deployment
becomes a ReplicaSet and pods through the real controller-manager, and each pod's init
container, server and sidecars run from its real pod spec, the sidecars with the pod's
projected token.

Used by the end-to-end tests, the rollback benchmark and the demo; ``Scenario`` is an
async context manager (:meth:`Scenario.running`). Tests share their session's control
plane (``cluster``), each scenario in a namespace and on a node of its own; the demo and
the benchmark start one in the scenario's directory.

Pods get loopback addresses (:mod:`.loopback`), which an EndpointSlice may not hold, so
traffic goes to the pods' own addresses (:meth:`Scenario.pod_urls`), not to the Service.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import tempfile
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.client.exceptions import ApiException

from model_rollout_contract.annotations import DOMAIN, TARGET_VERSION, parse_downward_annotations
from model_rollout_contract.argv import AUDIT_LOG, KEYS_DIR, STORE_DIR
from model_rollout_contract.defaults import SERVER_PORT
from model_rollout_e2e.onnx_models import write_mlp
from model_sidecar.publish import publish
from model_sidecar.signing import generate_keypair
from model_sidecar.store import LocalStore, ModelStore, S3Store

from .chart_install import Operator, install_chart
from .container_runtime import ProcessContainers
from .control_plane import ControlPlane
from .kubectl import Kubectl
from .node_agent import AgentThread, NodeAgent
from .pod_sandbox import Sandbox
from .raw_api import WatchEnded, json_call, watch_events

GROUP, API_VERSION, PLURAL = DOMAIN, "v1alpha1", "modeldeployments"
WATCH_S = 60  # each status watch request's length; a new one follows


@dataclass
class StoreSetup:
    """Where versions are published, and how a ModelDeployment names that place."""

    store: ModelStore
    spec: dict[str, Any]
    host_dir: Path | None = None  # for a volume ("pvc") store: what /store maps to

    @classmethod
    def local(cls, root: Path) -> StoreSetup:
        return cls(LocalStore(root), {"pvc": "model-store"}, root)

    @classmethod
    def s3(cls, store: S3Store) -> StoreSetup:
        return cls(
            store,
            {
                "url": f"s3://{store.bucket}/{store.prefix}".rstrip("/"),
                "endpoint": str(store.client.meta.endpoint_url),
            },
        )


def _namespace() -> str:
    return f"ml-{uuid.uuid4().hex[:8]}"


@dataclass
class Scenario:
    store: StoreSetup
    work: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="mr-", dir="/tmp")))
    model: str = "mlp"
    in_dim: int = 8
    env: dict[str, str] = field(default_factory=dict)  # more for the operator and the pods
    operator_interval: float = 1.0  # its resync; events (pods, the resource) wake it sooner
    volume_refresh_s: float = 60.0  # the node agent's Downward API / ConfigMap refresh period
    mounts: dict[str, Path] = field(default_factory=dict)  # more Secrets: container -> host
    cluster: ControlPlane | None = None  # a running one to share; None: start one in work/
    namespace: str = field(default_factory=_namespace)

    def __post_init__(self) -> None:
        self.keys = self.work / "keys"
        self.keys.mkdir(parents=True, exist_ok=True)
        generate_keypair(self.keys / "signing.key", self.keys / "public.pem")
        self.agent: NodeAgent | None = None
        self.operator: Operator | None = None
        self._api: k8s.ApiClient | None = None

    def publish(self, version: str, seed: int, **dims: Any) -> None:
        """A version of the model (``dims``: :func:`~.onnx_models.write_mlp`'s sizes and
        ``nan_above``)."""
        path = self.work / "build" / version / "model.onnx"
        write_mlp(path, seed, in_dim=self.in_dim, **dims)
        publish(self.store.store, self.model, version, path, self.keys / "signing.key")

    # -- the system ----------------------------------------------------------------------

    @property
    def kubectl(self) -> Kubectl:
        """kubectl as the cluster's admin."""
        assert self.cluster is not None, "not running"
        return self.cluster.kubectl

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Scenario]:
        """Control plane (unless shared), chart, namespace, node agent, operator; torn
        down in the order that leaves nothing behind on a shared control plane: the
        operator, the namespace (no pod of it is recreated), the node, its processes."""
        owned = self.cluster is None
        if self.cluster is None:
            self.cluster = ControlPlane(self.work / "control-plane")
        cluster = self.cluster
        thread: AgentThread | None = None
        try:
            if owned:
                await asyncio.to_thread(cluster.start)
            identity = await asyncio.to_thread(install_chart, cluster)
            await asyncio.to_thread(self._prepare_namespace)
            self._api = await self._admin_client()
            self.agent = self._node_agent()
            thread = await asyncio.to_thread(AgentThread(self.agent).start)
            self.operator = Operator(
                identity.kubeconfig, self.namespace, self.work / "operator.log",
                self.operator_interval, env=self.env,
            )  # fmt: skip
            self.operator.start()
            yield self
        finally:
            if self.operator is not None:
                await asyncio.to_thread(self.operator.stop)
            if cluster.components:
                await asyncio.to_thread(
                    cluster.kubectl.run, "delete", "namespace", self.namespace, "--wait=false"
                )
            if thread is not None:
                await asyncio.to_thread(thread.stop)
                await asyncio.to_thread(
                    cluster.kubectl.run, "delete", "node", thread.agent.name, "--wait=false"
                )
            if self._api is not None:
                await self._api.close()
                self._api = None
            if owned:
                await asyncio.to_thread(cluster.stop)

    def _prepare_namespace(self) -> None:
        """The namespace, and for a volume store a PersistentVolume of the store's
        directory bound to the claim the spec names (the scheduler places no pod whose
        claim is unbound)."""
        admin = self.kubectl
        admin("create", "namespace", self.namespace)
        claim = self.store.spec.get("pvc")
        if claim is None or self.store.host_dir is None:
            return
        volume = f"{self.namespace}-{claim}"
        size = {"storage": "1Gi"}
        admin.apply(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": volume},
                "spec": {
                    "capacity": size,
                    "accessModes": ["ReadOnlyMany"],
                    "persistentVolumeReclaimPolicy": "Retain",
                    "storageClassName": "",
                    "hostPath": {"path": str(self.store.host_dir)},
                    "claimRef": {"namespace": self.namespace, "name": claim},
                },
            },
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": claim, "namespace": self.namespace},
                "spec": {
                    "accessModes": ["ReadOnlyMany"],
                    "storageClassName": "",
                    "volumeName": volume,
                    "resources": {"requests": size},
                },
            },
        )
        admin(
            "wait", "--for=jsonpath={.status.phase}=Bound", "--timeout=60s",
            f"pvc/{claim}", "-n", self.namespace,
        )  # fmt: skip

    def _node_agent(self) -> NodeAgent:
        """A node of this scenario's own: its pods' containers are processes, with the
        Secrets and the store volume given as host directories (no Secret of the spec
        is created in the API: a Secret volume mounted at a given directory is that
        directory)."""
        assert self.cluster is not None
        mounts = {KEYS_DIR: self.keys, **self.mounts}
        if self.store.host_dir is not None:
            mounts[STORE_DIR] = self.store.host_dir
        runtime = ProcessContainers(
            self.work / "pods", env=self.env, mounts=mounts, api_server=self.cluster.server
        )
        name = f"node-{self.namespace}"
        return NodeAgent(
            self.cluster.node_kubeconfig(name), runtime, name,
            volume_refresh_s=self.volume_refresh_s,
        )  # fmt: skip

    async def _admin_client(self) -> k8s.ApiClient:
        assert self.cluster is not None
        configuration = k8s.Configuration()
        await k8s_config.load_kube_config(
            config_file=str(self.cluster.kubeconfig), client_configuration=configuration
        )
        return k8s.ApiClient(configuration)

    # -- the ModelDeployment -------------------------------------------------------------

    def deployment_body(self, version: str, replicas: int, **spec: Any) -> dict[str, Any]:
        return {
            "apiVersion": f"{GROUP}/{API_VERSION}",
            "kind": "ModelDeployment",
            "metadata": {"name": self.model, "namespace": self.namespace},
            "spec": {
                "model": self.model,
                "version": version,
                "replicas": replicas,
                "image": "registry.example.com/model-server:0.1.0",
                "backend": "onnxruntime",
                "precision": "fp32",
                "resources": {"gpu": 0},
                "store": self.store.spec,
                "signingPublicKeySecret": "model-signing-key",
                **spec,
            },
        }

    async def apply(self, version: str, replicas: int, **spec: Any) -> None:
        """``kubectl apply`` of the ModelDeployment."""
        await asyncio.to_thread(self.kubectl.apply, self.deployment_body(version, replicas, **spec))

    async def patch(self, patch: dict[str, Any]) -> None:
        """``kubectl patch --type=merge`` of the ModelDeployment, as a user edits it."""
        await asyncio.to_thread(
            self.kubectl, "patch", "modeldeployment", self.model, "-n", self.namespace,
            "--type=merge", "-p", json.dumps(patch),
        )  # fmt: skip

    async def set_version(self, version: str) -> None:
        await self.patch({"spec": {"version": version}})

    def _custom(self) -> Any:
        assert self._api is not None, "not running"
        return k8s.CustomObjectsApi(self._api)

    async def status(self) -> dict[str, Any]:
        try:
            md = await json_call(
                self._custom().get_namespaced_custom_object(
                    GROUP, API_VERSION, self.namespace, PLURAL, self.model,
                    _preload_content=False,
                )
            )  # fmt: skip
        except ApiException as exc:
            if exc.status == 404:
                return {}
            raise
        return dict(md.get("status") or {})

    async def wait(
        self,
        predicate: Callable[[dict[str, Any]], bool],
        timeout_s: float,
        on_status: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """The status once ``predicate`` holds, seen through a watch, so ``on_status``
        is given every status the resource had, not samples of them; TimeoutError with
        the last status and the operator's log otherwise."""
        last: list[dict[str, Any]] = [{}]

        def seen(status: dict[str, Any]) -> bool:
            last[0] = status
            if on_status is not None:
                on_status(status)
            return predicate(status)

        try:
            return await asyncio.wait_for(self._watch_status(seen), timeout_s)
        except asyncio.TimeoutError:
            tail = self.operator.log_tail(20) if self.operator else ""
            raise TimeoutError(
                f"status of {self.namespace}/{self.model} never matched in {timeout_s:.0f}s;"
                f" last: {last[0]}\noperator log:\n{tail}"
            ) from None

    async def _watch_status(self, seen: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        custom = self._custom()
        while True:
            try:
                md = await json_call(
                    custom.get_namespaced_custom_object(
                        GROUP, API_VERSION, self.namespace, PLURAL, self.model,
                        _preload_content=False,
                    )
                )  # fmt: skip
            except ApiException as exc:
                if exc.status != 404:
                    raise
                await asyncio.sleep(0.2)  # not created yet
                continue
            status = dict(md.get("status") or {})
            if seen(status):
                return status
            response = await custom.list_namespaced_custom_object(
                GROUP, API_VERSION, self.namespace, PLURAL,
                field_selector=f"metadata.name={self.model}", watch=True,
                resource_version=md["metadata"]["resourceVersion"], timeout_seconds=WATCH_S,
                _preload_content=False, _request_timeout=WATCH_S + 30,
            )  # fmt: skip
            try:
                async with contextlib.aclosing(watch_events(response)) as events:
                    async for kind, md in events:
                        if kind == "DELETED":
                            break  # gone: read it again
                        status = dict(md.get("status") or {})
                        if seen(status):
                            return status
            except WatchEnded:
                pass  # expired (410) or another error: read it again

    # -- the pods ------------------------------------------------------------------------

    async def _list(self, kind: str) -> list[dict[str, Any]]:
        assert self._api is not None, "not running"
        core: Any = k8s.CoreV1Api(self._api)
        lister = {"pods": core.list_namespaced_pod, "events": core.list_namespaced_event}[kind]
        listed = await json_call(lister(self.namespace, _preload_content=False))
        return list(listed.get("items") or [])

    async def pod_objects(self) -> list[dict[str, Any]]:
        """The namespace's pods, as the API server has them."""
        return await self._list("pods")

    async def events(self) -> list[dict[str, Any]]:
        """The namespace's Events (the operator's among them)."""
        return await self._list("events")

    async def pod_lives(self) -> dict[str, dict[str, tuple[str, str, int]]]:
        """Each pod (by uid) that is not being deleted: each container's (containerID,
        startedAt, restartCount). Equal before and after a rollout: no pod was replaced
        and no container restarted."""
        lives: dict[str, dict[str, tuple[str, str, int]]] = {}
        for pod in await self.pod_objects():
            if pod["metadata"].get("deletionTimestamp"):
                continue
            containers: dict[str, tuple[str, str, int]] = {}
            for c in (pod.get("status") or {}).get("containerStatuses") or []:
                started = ((c.get("state") or {}).get("running") or {}).get("startedAt", "")
                containers[c["name"]] = (c.get("containerID", ""), started, c["restartCount"])
            lives[pod["metadata"]["uid"]] = containers
        return lives

    def _sandboxes(self) -> dict[str, Sandbox]:
        """The node agent's running pods of this namespace (not being deleted) by name:
        what each has on this machine (its address, its volumes' directories). Another
        namespace's pod may land on this node too: the scheduler places any pod left
        Pending on a shared control plane."""
        assert self.agent is not None, "not running"
        workers = list(self.agent.workers.values())  # a copy: the agent's thread changes it
        return {
            w.name: w.sandbox
            for w in workers
            if w.namespace == self.namespace
            and w.sandbox is not None
            and w.phase == "Running"
            and not w.terminating
        }

    def pod_urls(self) -> list[str]:
        """Each running pod's server, at the pod's own address."""
        return [server_url(sandbox) for sandbox in self._sandboxes().values()]

    def serving_versions(self) -> dict[str, str | None]:
        """Each pod's ``model_server_version_serving`` metric, read from its /metrics."""
        return {
            name: current_version_metric(server_url(sandbox), self.model)
            for name, sandbox in self._sandboxes().items()
        }

    def projected_targets(self) -> dict[str, str | None]:
        """Each pod's target as its Downward API file shows it (the agent's last refresh)."""
        targets: dict[str, str | None] = {}
        for name, sandbox in self._sandboxes().items():
            path = sandbox.volume_dir("podinfo") / "annotations"
            text = path.read_text() if path.exists() else ""
            targets[name] = parse_downward_annotations(text).get(TARGET_VERSION)
        return targets

    def audit_events(self) -> dict[str, list[dict[str, Any]]]:
        """Each pod's server audit log (the server's own volume)."""
        events = {}
        for name, sandbox in self._sandboxes().items():
            log = Path(sandbox.host_path(AUDIT_LOG))
            lines = log.read_text().splitlines() if log.exists() else []
            events[name] = [json.loads(line) for line in lines]
        return events


def server_url(sandbox: Sandbox) -> str:
    return f"http://{sandbox.address}:{SERVER_PORT}"


def available(version: str, replicas: int) -> Callable[[dict[str, Any]], bool]:
    return lambda s: (
        s.get("phase") == "Available"
        and s.get("currentVersion") == version
        and s.get("versions") == {version: replicas}
    )


def current_version_metric(url: str, model: str) -> str | None:
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=2) as response:
            text = response.read().decode()
    except OSError:
        return None
    pattern = re.compile(
        r'^model_server_version_serving\{model="'
        + re.escape(model)
        + r'",version="([^"]+)"\} 1\.0$',
        re.M,
    )
    match = pattern.search(text)
    return match.group(1) if match else None
