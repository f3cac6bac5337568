"""The whole system on one machine: model store, emulated API server, the operator
process, and a kubelet that runs each planned pod as real processes.

Used by the end-to-end test and by the demo; ``Scenario`` is an async context manager.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import tempfile
import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model_rollout_contract.annotations import TARGET_VERSION, parse_downward_annotations
from model_rollout_contract.argv import AUDIT_DIR, AUDIT_LOG
from model_rollout_contract.cli import SIDECAR_ENV_PREFIX, env_name
from model_rollout_e2e.onnx_models import write_mlp
from model_sidecar.publish import publish
from model_sidecar.signing import generate_keypair
from model_sidecar.store import LocalStore, ModelStore, S3Store

from .api_client import HarnessApi
from .kube_emulator import (
    create_model_deployment,
    get_model_deployment,
    kube_emulator,
    list_objects,
    patch_model_deployment,
    wait_for_status,
)
from .kubelet import Kubelet
from .pod_processes import ProcessPods
from .processes import ChildProcess, OperatorProcess, free_port, http_ok, wait_until

NAMESPACE = "ml"
KEYS_MOUNT = "/etc/model-rollout/keys"
STORE_MOUNT = "/store"


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


@dataclass
class Scenario:
    store: StoreSetup
    work: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="mr-", dir="/tmp")))
    model: str = "mlp"
    in_dim: int = 8
    env: dict[str, str] = field(default_factory=dict)
    operator_interval: float = 0.3
    volume_refresh_s: float = 60.0  # the kubelet's Downward API / ConfigMap refresh period
    api_process: bool = False  # the emulated API server in a process of its own (benchmarks)
    mounts: dict[str, Path] = field(default_factory=dict)  # more Secrets: container -> host

    def __post_init__(self) -> None:
        self.keys = self.work / "keys"
        self.keys.mkdir(parents=True, exist_ok=True)
        generate_keypair(self.keys / "signing.key", self.keys / "public.pem")
        self.api: Any = None
        self.pods: ProcessPods | None = None
        self.operator: ChildProcess | None = None

    def publish(self, version: str, seed: int, **dims: Any) -> None:
        """A version of the model (``dims``: :func:`~.onnx_models.write_mlp`'s sizes and
        ``nan_above``)."""
        path = self.work / "build" / version / "model.onnx"
        write_mlp(path, seed, in_dim=self.in_dim, **dims)
        publish(self.store.store, self.model, version, path, self.keys / "signing.key")

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Scenario]:
        async with self._api_server() as api:
            self.api = api
            mounts = {KEYS_MOUNT: self.keys, **self.mounts}
            if self.store.host_dir is not None:
                mounts[STORE_MOUNT] = self.store.host_dir
            self.pods = ProcessPods(
                api,
                NAMESPACE,
                self.work / "pods",
                mounts,
                {**self.env, env_name(SIDECAR_ENV_PREFIX, "--kube-api"): api.url},
                volume_refresh_s=self.volume_refresh_s,
            )
            kubelet = Kubelet(api, NAMESPACE, self.pods, interval_s=0.2)
            stop = asyncio.Event()
            kubelet_task = asyncio.create_task(kubelet.run(stop))
            self.start_operator()
            try:
                yield self
            finally:
                if self.operator is not None:
                    await asyncio.to_thread(self.operator.stop)
                stop.set()
                await kubelet_task
                await kubelet.shutdown()

    @contextlib.asynccontextmanager
    async def _api_server(self) -> AsyncIterator[HarnessApi]:
        if not self.api_process:
            async with kube_emulator() as api:
                yield api
            return
        port = free_port()
        server = ChildProcess(
            "model_rollout_e2e.kube_emulator", ["--port", str(port)], self.work / "api.log"
        ).start()
        try:
            url = f"http://127.0.0.1:{port}"
            await asyncio.to_thread(wait_until, lambda: http_ok(f"{url}/api/v1"), 30, 0.1, "API")
            yield HarnessApi(url)
        finally:
            await asyncio.to_thread(server.stop)

    def start_operator(self) -> None:
        self.operator = OperatorProcess(
            self.api.url, NAMESPACE, self.operator_interval, self.work / "operator.log", self.env
        ).start()

    def deployment_body(self, version: str, replicas: int, **spec: Any) -> dict[str, Any]:
        return {
            "metadata": {"name": self.model},
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
        await create_model_deployment(
            self.api, NAMESPACE, self.deployment_body(version, replicas, **spec)
        )

    async def set_version(self, version: str) -> None:
        await patch_model_deployment(
            self.api, NAMESPACE, self.model, {"spec": {"version": version}}
        )

    async def status(self) -> dict[str, Any]:
        md = await get_model_deployment(self.api, NAMESPACE, self.model)
        return dict((md or {}).get("status") or {})

    async def wait(
        self,
        predicate: Callable[[dict[str, Any]], bool],
        timeout_s: float,
        on_status: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        try:
            return await wait_for_status(
                self.api, NAMESPACE, self.model, predicate, timeout_s, on_status
            )
        except TimeoutError as exc:
            tail = self.operator.log_tail(20) if self.operator else ""
            raise TimeoutError(f"{exc}\noperator log:\n{tail}") from None

    def pod_urls(self) -> list[str]:
        assert self.pods is not None
        return [p.url for p in self.pods.pods.values() if p.containers]

    async def pod_objects(self) -> list[dict[str, Any]]:
        return await list_objects(self.api, f"/api/v1/namespaces/{NAMESPACE}/pods")

    def serving_versions(self) -> dict[str, str | None]:
        """Each pod's ``model_server_version_serving`` metric, read from its /metrics."""
        assert self.pods is not None
        result: dict[str, str | None] = {}
        for name, pod in self.pods.pods.items():
            result[name] = current_version_metric(pod.url, self.model)
        return result

    def projected_targets(self) -> dict[str, str | None]:
        """Each pod's target as its Downward API file shows it (the kubelet's last refresh)."""
        assert self.pods is not None
        targets: dict[str, str | None] = {}
        for name, pod in self.pods.pods.items():
            path = pod.root / "podinfo" / "annotations"
            text = path.read_text() if path.exists() else ""
            targets[name] = parse_downward_annotations(text).get(TARGET_VERSION)
        return targets

    def audit_events(self) -> dict[str, list[dict[str, Any]]]:
        assert self.pods is not None
        events = {}
        for name, pod in self.pods.pods.items():
            # the server's own volume
            log = Path(pod.sandbox.host_path(AUDIT_DIR)) / Path(AUDIT_LOG).name
            lines = log.read_text().splitlines() if log.exists() else []
            events[name] = [json.loads(line) for line in lines]
        return events


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
