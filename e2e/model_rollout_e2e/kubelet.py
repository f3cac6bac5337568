"""A stand-in for the Deployment controller and the kubelet, driven through the API.

For every Deployment it keeps ``spec.replicas`` active pods (from the pod template) and
asks a :class:`PodRuntime` to run them. As in a cluster: a pod deleted through the API has
its processes stopped and is replaced; an evicted pod (:meth:`Kubelet.evict`) stays, in
phase ``Failed``, and is replaced, since Failed and Succeeded pods do not count as
replicas; a pod named in :attr:`Kubelet.never_ready` runs but never turns Ready.

Its runtime is :class:`SimulatedPods` (the sidecar's report is faked, for the operator
tests on the emulated API); the end-to-end tests and the demo run real processes on a
real control plane (:mod:`.node_agent`). Each pod gets an IP of its own
(:mod:`.loopback`), which the stand-in writes to ``status.podIP`` as a kubelet does.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import time
from typing import Any

from model_rollout_contract.annotations import SIDECAR_STATUS, TARGET_VERSION
from model_rollout_contract.argv import CONFIGMAP_VERSION_KEY
from model_rollout_contract.canary import TRAFFIC_POLICY, InvalidPolicy, TrafficPolicy
from model_rollout_contract.defaults import SERVER_PORT
from model_rollout_contract.report import SidecarReport
from model_rollout_contract.states import SidecarState

from . import loopback
from .api_client import HarnessApi
from .pod_runtime import PodRuntime
from .simulated_servers import Behaviour, SimulatedServer

log = logging.getLogger(__name__)


def _labels_match(selector: dict[str, str], labels: dict[str, str] | None) -> bool:
    return all((labels or {}).get(k) == v for k, v in selector.items())


class Kubelet:
    def __init__(
        self, api: HarnessApi, namespace: str, runtime: PodRuntime, interval_s: float = 0.2
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.runtime = runtime
        self.interval_s = interval_s
        self._counter = itertools.count()
        self._ready: dict[str, bool] = {}
        self._running: set[str] = set()
        self._failed: set[str] = set()
        self.never_ready: set[str] = set()  # pods whose readiness probe never passes

    def _path(self, kind: str) -> str:
        prefix = "/apis/apps/v1" if kind == "deployments" else "/api/v1"
        return f"{prefix}/namespaces/{self.namespace}/{kind}"

    async def _list(self, kind: str) -> list[dict[str, Any]]:
        answer = await self.api.request("GET", self._path(kind))
        return list((answer or {}).get("items", []))

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.step()
            except Exception:
                log.exception("kubelet step failed")
            try:
                await asyncio.wait_for(stop.wait(), self.interval_s)
            except asyncio.TimeoutError:
                pass

    async def step(self) -> None:
        pods = await self._list("pods")
        listed = {p["metadata"]["name"] for p in pods}
        for gone in self._running - listed:  # deleted through the API: stop its containers
            await self.runtime.stop(gone)
            self._running.discard(gone)
            self._ready.pop(gone, None)
        pods = [p for p in pods if p["metadata"]["name"] not in self._failed]
        for deployment in await self._list("deployments"):
            spec = deployment.get("spec", {})
            selector = spec.get("selector", {}).get("matchLabels", {})
            owned = sorted(
                (p for p in pods if _labels_match(selector, p["metadata"].get("labels"))),
                key=lambda p: p["metadata"]["name"],
            )
            want = int(spec.get("replicas", 1))
            for _ in range(want - len(owned)):
                pods.append(await self._create_pod(deployment))
            for extra in owned[want:] if want < len(owned) else []:
                await self.delete_pod(extra["metadata"]["name"])
                pods.remove(extra)
        await asyncio.gather(*(self._sync(p) for p in pods))

    async def _create_pod(self, deployment: dict[str, Any]) -> dict[str, Any]:
        template = copy.deepcopy(deployment["spec"]["template"])
        name = f"{deployment['metadata']['name']}-{next(self._counter):03d}"
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {**template.get("metadata", {}), "name": name, "namespace": self.namespace},
            "spec": template.get("spec", {}),
            "status": {"phase": "Pending", "conditions": [{"type": "Ready", "status": "False"}]},
        }
        created = await self.api.request("POST", self._path("pods"), pod)
        await self.runtime.start(created)
        self._running.add(name)
        ip = self.runtime.address(name)
        if ip is not None:
            await self.api.merge_patch(
                f"{self._path('pods')}/{name}/status",
                {"status": {"podIP": ip, "podIPs": [{"ip": ip}]}},
            )
        log.info("started pod %s", name)
        return dict(created)

    async def delete_pod(self, name: str) -> None:
        await self.runtime.stop(name)
        self._running.discard(name)
        await self.api.request("DELETE", f"{self._path('pods')}/{name}")
        self._ready.pop(name, None)

    async def evict(self, name: str, reason: str = "Evicted") -> None:
        """What the kubelet does under node pressure: containers killed, the pod object
        kept in phase Failed (until garbage-collected), a replacement created."""
        await self.runtime.stop(name)
        self._running.discard(name)
        self._failed.add(name)
        self._ready[name] = False
        await self.api.merge_patch(
            f"{self._path('pods')}/{name}/status",
            {
                "status": {
                    "phase": "Failed",
                    "reason": reason,
                    "conditions": [{"type": "Ready", "status": "False"}],
                }
            },
        )

    async def _sync(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        ready = await self.runtime.sync(pod) and name not in self.never_ready
        if name in self._failed or name not in self._running:
            return  # evicted or deleted while this sync ran: a "Running" now would revive it
        if self._ready.get(name) != ready:
            self._ready[name] = ready
            await self.api.merge_patch(
                f"{self._path('pods')}/{name}/status",
                {
                    "status": {
                        "phase": "Running",
                        "conditions": [
                            {
                                "type": "Ready",
                                "status": "True" if ready else "False",
                                "lastTransitionTime": time.strftime(
                                    "%Y-%m-%dT%H:%M:%SZ", time.gmtime()
                                ),
                            }
                        ],
                    }
                },
            )

    async def shutdown(self) -> None:
        for pod in await self._list("pods"):
            await self.runtime.stop(pod["metadata"]["name"])


class SimulatedPods:
    """Pods whose "sidecar" reports serving its target ``delay_s`` after it changes,
    or refuses versions listed in ``refuse`` (for operator tests without processes).
    A new pod starts on the version its ConfigMap names (what the init container
    pre-pulls), or ``initial_version``.

    With ``model``, each pod also has a :class:`~.simulated_servers.SimulatedServer` on
    its IP, which answers ``requests_per_sync`` made-up requests per sync, each version
    as ``behaviours`` says, under the pod's traffic policy once it serves the policy's
    candidate (as its sidecar would relay it)."""

    def __init__(
        self,
        api: HarnessApi,
        namespace: str,
        delay_s: float = 0.3,
        refuse: set[str] | None = None,
        initial_version: str | None = None,
        model: str | None = None,
        behaviours: dict[str, Behaviour] | None = None,
        requests_per_sync: int = 0,
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.delay_s = delay_s
        self.refuse = refuse if refuse is not None else set()
        self.initial_version = initial_version
        self.model = model
        self.behaviours = behaviours if behaviours is not None else {}
        self.requests_per_sync = requests_per_sync
        self.servers: dict[str, SimulatedServer] = {}
        # pod -> (target, when first seen: monotonic, epoch)
        self._seen: dict[str, tuple[str, float, float]] = {}
        self.serving: dict[str, str | None] = {}
        self.retained: dict[str, tuple[str, ...]] = {}  # what each server holds besides

    async def start(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        self.serving[name] = await self._configured(pod) or self.initial_version
        if self.model is not None:
            server = SimulatedServer(self.model, loopback.allocate(SERVER_PORT))
            await server.start()
            self.servers[name] = server

    def address(self, name: str) -> str | None:
        server = self.servers.get(name)
        return server.address if server is not None else None

    def _serve(self, name: str, annotations: dict[str, str]) -> None:
        server, serving = self.servers.get(name), self.serving.get(name)
        if server is None or serving is None or not self.requests_per_sync:
            return
        try:
            raw = annotations.get(TRAFFIC_POLICY)
            policy = TrafficPolicy.from_annotation(raw) if raw else None
        except InvalidPolicy:
            policy = None
        server.serve(serving, policy, self.behaviours, self.requests_per_sync)

    async def _configured(self, pod: dict[str, Any]) -> str | None:
        for volume in pod.get("spec", {}).get("volumes", []):
            if "configMap" in volume:
                name = volume["configMap"]["name"]
                cm = await self.api.request(
                    "GET", f"/api/v1/namespaces/{self.namespace}/configmaps/{name}"
                )
                value = ((cm or {}).get("data") or {}).get(CONFIGMAP_VERSION_KEY)
                return str(value) if value else None
        return None

    async def sync(self, pod: dict[str, Any]) -> bool:
        name = pod["metadata"]["name"]
        if name not in self.serving:
            return False  # stopped (or never started): no sidecar reports any more
        annotations = pod["metadata"].get("annotations") or {}
        target = annotations.get(TARGET_VERSION) or self.initial_version
        serving = self.serving.get(name)
        if target is None:
            return serving is not None
        seen = self._seen.get(name)
        if seen is None or seen[0] != target:
            self._seen[name] = seen = (target, time.monotonic(), time.time())
        held = self.retained.get(name, ())
        if target == serving:
            state, reason = SidecarState.OK, None
        elif target in self.refuse:
            state, reason = (
                SidecarState.REFUSED,
                "bad_signature: manifest signature does not verify",
            )
        elif target in held or time.monotonic() - seen[1] >= self.delay_s:  # retained: at once
            self.retained[name] = held = tuple(v for v in (*held, serving) if v and v != target)[
                -1:
            ]
            self.serving[name] = serving = target
            state, reason = SidecarState.OK, None
        else:
            state, reason = SidecarState.LOADING, None
        self._serve(name, annotations)
        report = SidecarReport(
            "simulated", target, serving, state, reason, retained=held, target_seen_at=seen[2]
        )
        encoded = report.to_json()
        if annotations.get(SIDECAR_STATUS) != encoded:
            await self.api.merge_patch(
                f"/api/v1/namespaces/{self.namespace}/pods/{name}",
                {"metadata": {"annotations": {SIDECAR_STATUS: encoded}}},
            )
        return serving is not None

    async def stop(self, name: str) -> None:
        self.serving.pop(name, None)
        self.retained.pop(name, None)
        server = self.servers.pop(name, None)
        if server is not None:
            await server.stop()
            loopback.release(server.address)
