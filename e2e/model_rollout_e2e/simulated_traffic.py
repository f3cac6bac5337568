"""The operator's simulated pods (:mod:`.simulated_sidecar`) with traffic, for the canary
analysis on a real API server: each pod gets an address of its own on the loopback range
(:mod:`.loopback`; the node agent writes it to ``status.podIP``), and its server
container is a :class:`~.simulated_servers.SimulatedServer` listening there on port 8000,
which answers made-up requests as the test says each version answers
(:class:`~.simulated_servers.Behaviour`): ``requests_per_tick`` every ``tick_s``, by the
version the pod's (simulated) sidecar made it serve, split between the versions by the
pod's traffic policy once it serves the policy's candidate, as a real server splits
them. The operator reads each canary pod's ``/metrics`` at ``podIP:8000``, as in a
cluster, or a Prometheus scrapes them.

``behaviours`` and ``requests_per_tick`` may be changed while the pods run (a test stops
the traffic); the node agent runs the pods on a thread of its own, the test on another.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from model_rollout_contract.canary import TRAFFIC_POLICY, InvalidPolicy, TrafficPolicy
from model_rollout_contract.defaults import SERVER_PORT

from . import loopback
from .pod_runtime import Container
from .pod_sandbox import Sandbox
from .simulated_servers import Behaviour, SimulatedServer
from .simulated_sidecar import SidecarBehaviour, SimulatedModelContainers, TaskContainer

SERVER_PROGRAM = "model-server"


def _policy(annotations: Mapping[str, str]) -> TrafficPolicy | None:
    """The pod's traffic policy (default track); a malformed one is none, as the sidecar
    ignores it."""
    text = annotations.get(TRAFFIC_POLICY)
    if text is None:
        return None
    try:
        return TrafficPolicy.from_annotation(text)
    except InvalidPolicy:
        return None


class TrafficModelContainers(SimulatedModelContainers):
    """:class:`SimulatedModelContainers` whose server containers answer made-up traffic
    and serve ``/metrics`` at the pod's own address (see the module's docstring)."""

    def __init__(
        self,
        kubeconfig: Path,
        behaviour: SidecarBehaviour | None = None,
        model: str = "mlp",
        behaviours: Mapping[str, Behaviour] | None = None,
        requests_per_tick: int = 4,
        tick_s: float = 0.1,
    ) -> None:
        super().__init__(kubeconfig, behaviour)
        self.model = model
        self.behaviours: dict[str, Behaviour] = dict(behaviours or {})
        self.requests_per_tick = requests_per_tick
        self.tick_s = tick_s
        self.web: dict[str, SimulatedServer] = {}  # by pod uid

    def sandbox(self, pod: dict[str, Any]) -> Sandbox:
        """A loopback address of the pod's own, with port 8000 free on it."""
        sandbox = Sandbox(Path(os.devnull), loopback.allocate(SERVER_PORT))
        self._uids[sandbox.address] = str(pod["metadata"]["uid"])
        return sandbox

    def release(self, sandbox: Sandbox) -> None:
        super().release(sandbox)
        loopback.release(sandbox.address)

    async def start(
        self, pod: dict[str, Any], sandbox: Sandbox, container: dict[str, Any]
    ) -> Container:
        command = [*(container.get("command") or []), *(container.get("args") or [])]
        if command[:1] != [SERVER_PROGRAM]:
            return await super().start(pod, sandbox, container)
        uid = str(pod["metadata"]["uid"])
        server = SimulatedServer(self.model, sandbox.address)
        await server.start()
        self.web[uid] = server
        return TaskContainer(next(self._numbers), self._answer(uid, server))

    async def _answer(self, uid: str, server: SimulatedServer) -> int:
        """The server's life: made-up requests every tick, until it is signalled."""
        try:
            while True:
                await asyncio.sleep(self.tick_s)
                held = self.servers.get(uid)
                serving = held.serving.get(None) if held is not None else None
                requests = self.requests_per_tick
                if serving is None or requests <= 0:
                    continue
                sidecar = self.sidecars.get((uid, None))
                policy = _policy(sidecar.annotations) if sidecar is not None else None
                server.serve(serving, policy, self.behaviours, requests)
        finally:
            self.web.pop(uid, None)
            await server.stop()
