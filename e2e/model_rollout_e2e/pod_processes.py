"""Run a pod from its real pod spec as local processes: its init containers one after
the other, then the server and the sidecars (the deployment's, and one per tenant model),
sharing a directory as their volumes and a Unix socket.

Container paths are mapped to per-pod directories; each pod gets an IP of its own (a
loopback address, :mod:`.loopback`) on which its server listens at the pod spec's port,
as in a cluster (the operator reads ``podIP:8000/metrics``), while each sidecar's
``--metrics-port``, which binds every address, gets a free port of its own; the Downward API
annotations file and the ConfigMap file are written from the API objects as the kubelet
would, and readiness is the server's ``/v2/health/ready``.

Like a real kubelet, it writes those files when the pod starts and afterwards only on its
periodic sync of the pod: every ``volume_refresh_s`` (a real kubelet: about a minute),
at a random phase per pod. A new annotation reaches the file that late, never at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model_rollout_contract.annotations import format_downward_annotations
from model_rollout_contract.defaults import SERVER_PORT

from . import loopback
from .api_client import HarnessApi
from .processes import ChildProcess, free_port, http_ok

log = logging.getLogger(__name__)
PROGRAMS = {"model-server": "model_server", "model-sidecar": "model_sidecar"}


@dataclass
class RunningPod:
    name: str
    root: Path
    address: str = "127.0.0.1"  # the pod's IP
    port: int = SERVER_PORT
    init: ChildProcess | None = None
    init_task: asyncio.Task[int] | None = None
    containers: dict[str, ChildProcess] = field(default_factory=dict)
    annotations_text: str = ""
    next_volume_sync: float = 0.0  # monotonic time of this pod's next volume refresh
    mounts: dict[str, str] = field(default_factory=dict)  # container path -> host path

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"

    @property
    def volume(self) -> Path:
        return self.root / "models"


class ProcessPods:
    def __init__(
        self,
        api: HarnessApi,
        namespace: str,
        work: Path,
        mounts: dict[str, Path] | None = None,
        env: dict[str, str] | None = None,
        volume_refresh_s: float = 60.0,
        rng: random.Random | None = None,
    ) -> None:
        """``mounts`` maps extra container paths (secrets, PVCs) to host directories;
        ``volume_refresh_s`` is the kubelet's sync period for Downward API and ConfigMap
        files (0: at once, as no real kubelet does)."""
        self.api = api
        self.namespace = namespace
        self.work = work
        self.extra_mounts = mounts or {}
        self.env = env or {}
        self.volume_refresh_s = volume_refresh_s
        self.rng = rng or random.Random()
        self.pods: dict[str, RunningPod] = {}

    def _mount_map(self, pod: RunningPod, spec: dict[str, Any]) -> dict[str, str]:
        """Container path -> host path for every volume mount in the pod spec."""
        mapping: dict[str, str] = {}
        for container in spec.get("initContainers", []) + spec.get("containers", []):
            for mount in container.get("volumeMounts", []):
                path = mount["mountPath"]
                host = self.extra_mounts.get(path) or pod.root / mount["name"]
                mapping[path] = str(host)
        return mapping

    def _args(
        self,
        pod: RunningPod,
        container: dict[str, Any],
        mapping: dict[str, str],
        ports: dict[str, int],
    ) -> tuple[str, list[str]]:
        program, *args = container["args"]
        out: list[str] = []
        for i, arg in enumerate(args):
            flag = args[i - 1] if i else ""
            if flag == "--metrics-port":
                arg = str(ports.setdefault(container["name"], free_port()))
            elif flag == "--host":
                arg = pod.address
            for container_path in sorted(mapping, key=len, reverse=True):
                if (
                    arg == container_path
                    or arg.startswith(container_path + "/")
                    or arg.startswith(f"file://{container_path}")
                ):
                    arg = arg.replace(container_path, mapping[container_path], 1)
                    break
            out.append(arg)
        return PROGRAMS[program], out

    def _environment(self, pod_name: str, container: dict[str, Any]) -> dict[str, str]:
        env = dict(self.env)
        for item in container.get("env", []):
            if "value" in item:
                env[item["name"]] = item["value"]
            elif item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
                env[item["name"]] = pod_name
            elif (
                item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
                == "metadata.namespace"
            ):
                env[item["name"]] = self.namespace
        return env

    async def start(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        running = RunningPod(name, self.work / name)
        shutil.rmtree(running.root, ignore_errors=True)
        running.root.mkdir(parents=True)
        self.pods[name] = running
        spec = pod["spec"]
        mapping = running.mounts = self._mount_map(running, spec)
        for host in mapping.values():
            Path(host).mkdir(parents=True, exist_ok=True)
        await self._project(running, pod)  # at start, before any container runs
        running.next_volume_sync = time.monotonic() + self.rng.uniform(0, self.volume_refresh_s)
        running.address = loopback.allocate(SERVER_PORT)
        ports: dict[str, int] = {}  # container -> its metrics port
        running.init_task = asyncio.create_task(self._run_inits(running, spec, mapping, ports))
        running.init_task.add_done_callback(
            lambda task: self._start_containers(running, spec, mapping, ports, task)
        )

    async def _run_inits(
        self, pod: RunningPod, spec: dict[str, Any], mapping: dict[str, str], ports: dict[str, int]
    ) -> int:
        """Every init container to its end, in order, as a kubelet runs them; the first
        that fails stops the pod (its exit status)."""
        for i, init_spec in enumerate(spec["initContainers"]):
            module, args = self._args(pod, init_spec, mapping, ports)
            log_name = "init.log" if i == 0 else f"init-{init_spec['name']}.log"
            pod.init = ChildProcess(
                module, args, pod.root / log_name, self._environment(pod.name, init_spec)
            ).start()
            code = await asyncio.to_thread(pod.init.run_to_end, 300)
            if code != 0:
                return code
        return 0

    def _start_containers(
        self,
        pod: RunningPod,
        spec: dict[str, Any],
        mapping: dict[str, str],
        ports: dict[str, int],
        init: asyncio.Task[int],
    ) -> None:
        if init.cancelled() or init.exception() is not None or init.result() != 0:
            log.error(
                "pod %s: init container failed:\n%s",
                pod.name,
                pod.init.log_tail() if pod.init else "",
            )
            return
        for container in spec["containers"]:
            module, args = self._args(pod, container, mapping, ports)
            pod.containers[container["name"]] = ChildProcess(
                module,
                args,
                pod.root / f"{container['name']}.log",
                self._environment(pod.name, container),
            ).start()

    async def _project(self, pod: RunningPod, obj: dict[str, Any]) -> None:
        """Write the Downward API annotations and the ConfigMap files, atomically."""
        text = format_downward_annotations(obj["metadata"].get("annotations") or {})
        if text != pod.annotations_text:
            _atomic_write(pod.root / "podinfo" / "annotations", text)
            pod.annotations_text = text
        for volume in obj["spec"].get("volumes", []):
            if "configMap" in volume:
                cm = await self.api.request(
                    "GET",
                    f"/api/v1/namespaces/{self.namespace}/configmaps/{volume['configMap']['name']}",
                )
                for key, value in ((cm or {}).get("data") or {}).items():
                    target = pod.root / volume["name"] / key
                    if not target.exists() or target.read_text() != value:
                        _atomic_write(target, value)

    async def sync(self, pod: dict[str, Any]) -> bool:
        running = self.pods.get(pod["metadata"]["name"])
        if running is None:
            return False
        now = time.monotonic()
        if now >= running.next_volume_sync:  # the kubelet's periodic sync of this pod
            await self._project(running, pod)
            running.next_volume_sync = now + self.volume_refresh_s
        if not running.containers:
            return False
        return await asyncio.to_thread(http_ok, f"{running.url}/v2/health/ready", 0.5)

    def address(self, name: str) -> str | None:
        running = self.pods.get(name)
        return running.address if running is not None else None

    async def stop(self, name: str) -> None:
        running = self.pods.pop(name, None)
        if running is None:
            return
        if running.init is not None:
            running.init.stop()
        for process in running.containers.values():
            await asyncio.to_thread(process.stop)
        loopback.release(running.address)


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
