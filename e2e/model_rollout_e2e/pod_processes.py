"""Run a pod from its real pod spec as local processes (through the node agent's
:class:`~.container_runtime.ProcessContainers`), for the emulated API's stand-in
(:mod:`.kubelet`): its init containers one after the other, then the server and the
sidecars (the deployment's, and one per tenant model), sharing a directory as their
volumes and a Unix socket.

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
import contextlib
import logging
import random
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model_rollout_contract.annotations import format_downward_annotations
from model_rollout_contract.defaults import SERVER_PORT

from . import loopback
from .api_client import HarnessApi
from .container_runtime import ProcessContainer, ProcessContainers, log_name
from .pod_sandbox import Sandbox, atomic_write
from .processes import http_ok

log = logging.getLogger(__name__)


@dataclass
class RunningPod:
    name: str
    sandbox: Sandbox
    port: int = SERVER_PORT
    task: asyncio.Task[None] | None = None  # its init containers, then its containers
    init: ProcessContainer | None = None  # the init container running now
    containers: dict[str, ProcessContainer] = field(default_factory=dict)
    annotations_text: str = ""
    next_volume_sync: float = 0.0  # monotonic time of this pod's next volume refresh

    @property
    def root(self) -> Path:
        return self.sandbox.root

    @property
    def address(self) -> str:
        return self.sandbox.address

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
        self.runtime = ProcessContainers(work, self.env)  # how each container is run
        self.pods: dict[str, RunningPod] = {}

    async def start(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        root = self.work / name
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        spec = pod["spec"]
        sandbox = Sandbox.create(root, loopback.allocate(SERVER_PORT), spec, self.extra_mounts)
        running = self.pods[name] = RunningPod(name, sandbox)
        await self._project(running, pod)  # at start, before any container runs
        running.next_volume_sync = time.monotonic() + self.rng.uniform(0, self.volume_refresh_s)
        running.task = asyncio.create_task(self._run(running, pod))

    async def _run(self, pod: RunningPod, obj: dict[str, Any]) -> None:
        """Every init container to its end, in order, as a kubelet runs them (the first
        that fails stops the pod), then the containers."""
        for init in obj["spec"].get("initContainers") or []:
            pod.init = await self.runtime.start(obj, pod.sandbox, init)
            try:
                code = await asyncio.wait_for(pod.init.wait(), 300)
            except asyncio.TimeoutError:
                code = -1
            if code != 0:
                text = (pod.root / log_name(init)).read_text(errors="replace")
                tail = "\n".join(text.splitlines()[-30:])
                log.error("pod %s: init container %s failed:\n%s", pod.name, init["name"], tail)
                return
        pod.init = None
        for container in obj["spec"]["containers"]:
            pod.containers[container["name"]] = await self.runtime.start(
                obj, pod.sandbox, container
            )

    async def _project(self, pod: RunningPod, obj: dict[str, Any]) -> None:
        """Write the Downward API annotations and the ConfigMap files, atomically."""
        text = format_downward_annotations(obj["metadata"].get("annotations") or {})
        if text != pod.annotations_text:
            atomic_write(pod.root / "podinfo" / "annotations", text)
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
                        atomic_write(target, value)

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
        if running.task is not None:
            running.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running.task
        processes = [running.init, *running.containers.values()]
        await asyncio.gather(*(_stop(p) for p in processes if p is not None))
        loopback.release(running.address)


async def _stop(process: ProcessContainer, grace_s: float = 10.0) -> None:
    """SIGTERM, SIGKILL after ``grace_s``."""
    process.signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), grace_s)
    except asyncio.TimeoutError:
        process.signal(signal.SIGKILL)
        await process.wait()
