"""Rollouts at scale on a real control plane (issue 28, item 8): ``deployments``
ModelDeployments of ``pods`` simulated pods in all (:mod:`.simulated_sidecar` on one
simulated node), rolled v1→v2 and back by the operator as the chart runs it, each figure
counted by the API server itself (its audit log: :meth:`.ControlPlane.audit_counts`) or
the kernel (the operator's CPU time: :func:`.api_counts.process_cpu_seconds`).

A rollout's window runs from the admin's patch of ``spec.version`` to every
ModelDeployment's status saying Available with all its pods on the new version, for
the generation patched (its wall time and the operator's CPU time); its writes are
counted until ``settle_s`` later, so that none it caused is left out. Idle windows
(after the first rollout to v1 and after the rollback) count the writes made while
nothing changes. Only writes to the run's namespace count (its ModelDeployments, their
pods and children, Events): the node's Lease renewals (a kubelet's heartbeat, in
``kube-node-lease``) are the cluster's, not the rollouts'.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import urllib.request
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .api_counts import WriteCounts, process_cpu_seconds
from .chart_install import Operator, install_chart
from .control_plane import ControlPlane
from .node_agent import AgentThread, NodeAgent
from .simulated_sidecar import SidecarBehaviour, SimulatedModelContainers, model_store_claim

log = logging.getLogger(__name__)
GROUP_PATH = "/apis/serving.model-rollout.io/v1alpha1"


@dataclass(frozen=True)
class ScaleSettings:
    pods: int = 1000
    deployments: int = 10
    idle_s: float = 60.0  # each idle window
    interval_s: float = 30.0  # the operator's resync period (its --interval)
    timeout_s: float = 900.0  # a hang guard for each step
    settle_s: float = 5.0  # after a rollout: its last writes (the sidecars' last reports)
    sidecars: SidecarBehaviour = field(
        default_factory=lambda: SidecarBehaviour(fetch_s=0.5, load_s=1.0)
    )
    # the rollout: a 10% canary held a few seconds, then batches of 25%
    canary: dict[str, Any] = field(default_factory=lambda: {"percent": 10, "pauseSeconds": 5})
    rollout: dict[str, Any] = field(
        default_factory=lambda: {"batchPercent": 25, "jitterSeconds": 1}
    )


@dataclass
class Window:
    """What one window of time cost: writes by user and resource, the operator's CPU."""

    name: str
    wall_s: float
    writes: int  # to the run's namespace
    pod_writes: int  # of the pods themselves (targets, reports), not their status
    md_status_writes: int
    operator_cpu_s: float
    by_writer: list[dict[str, Any]]
    pods: int
    load_1m: float  # the machine's 1-minute load average at the window's end

    @property
    def writes_per_pod(self) -> float:
        return self.writes / self.pods

    @property
    def writes_per_minute(self) -> float:
        return self.writes * 60.0 / self.wall_s if self.wall_s else 0.0

    @property
    def operator_cores(self) -> float:
        return self.operator_cpu_s / self.wall_s if self.wall_s else 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "writes_per_pod": round(self.writes_per_pod, 3),
            "writes_per_minute": round(self.writes_per_minute, 2),
            "operator_cores": round(self.operator_cores, 3),
        }


class ScaleRun:
    """One control plane, operator and node for a run of :func:`run_scale`."""

    def __init__(self, cluster: ControlPlane, work: Path, settings: ScaleSettings) -> None:
        self.cluster, self.work, self.settings = cluster, work, settings
        self.namespace = f"scale-{uuid.uuid4().hex[:6]}"
        self.names = [f"model-{i:02d}" for i in range(settings.deployments)]
        self.operator: Operator | None = None
        self.node: AgentThread | None = None

    # -- the cluster's admin, as plain HTTPS calls ---------------------------------------

    def _call(self, method: str, path: str, body: Any = None, content: str = "") -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": content or "application/json"}
        request = urllib.request.Request(
            f"{self.cluster.server}{path}", data=data, method=method, headers=headers
        )
        context = self.cluster.ssl_context()
        with urllib.request.urlopen(request, timeout=30, context=context) as response:
            return json.loads(response.read())

    def _mds_path(self) -> str:
        return f"{GROUP_PATH}/namespaces/{self.namespace}/modeldeployments"

    def replicas(self, index: int) -> int:
        """The pods are shared out evenly, the first ones taking the remainder."""
        per, extra = divmod(self.settings.pods, self.settings.deployments)
        return per + (1 if index < extra else 0)

    # -- the run -------------------------------------------------------------------------

    def start(self) -> None:
        identity = install_chart(self.cluster)
        admin = self.cluster.kubectl
        admin("create", "namespace", self.namespace)
        admin.apply(*model_store_claim(self.namespace, "model-store"))
        name = f"node-{uuid.uuid4().hex[:6]}"
        kubeconfig = self.cluster.node_kubeconfig(name)
        containers = SimulatedModelContainers(kubeconfig, self.settings.sidecars)
        # room for every pod (no GPU asked: a simulated server needs none)
        agent = NodeAgent(
            kubeconfig, containers, name, cpu="4000", memory="16Ti", pods=self.settings.pods + 110
        )
        self.node = AgentThread(agent).start()
        self.operator = Operator(
            identity.kubeconfig, self.namespace, self.work / "operator.log",
            self.settings.interval_s,
        )  # fmt: skip
        self.operator.start()

    def stop(self) -> None:
        """The operator killed, the node stopped, the namespace deleted (a shared
        cluster's next run gets a clean one)."""
        if self.operator is not None:
            self.operator.kill()
        if self.node is not None:
            self.node.stop()
            self.cluster.kubectl.run("delete", "node", self.node.agent.name, "--wait=false")
        self.cluster.kubectl.run("delete", "namespace", self.namespace, "--wait=false")

    def operator_cpu_s(self) -> float:
        assert self.operator is not None and self.operator.proc is not None
        return process_cpu_seconds(self.operator.proc.pid)

    def create(self, version: str) -> None:
        for index, name in enumerate(self.names):
            body = {
                "apiVersion": "serving.model-rollout.io/v1alpha1",
                "kind": "ModelDeployment",
                "metadata": {"name": name, "namespace": self.namespace},
                "spec": {
                    "model": name,
                    "version": version,
                    "image": "registry.example/model-server:0.1",
                    "replicas": self.replicas(index),
                    "backend": "onnxruntime",
                    "store": {"pvc": "model-store"},
                    "resources": {"memory": "1Gi", "gpu": 0},
                    "canary": self.settings.canary,
                    "rollout": self.settings.rollout,
                    "signingPublicKeySecret": "model-signing-key",
                },
            }
            self._call("POST", self._mds_path(), body)

    def set_version(self, version: str) -> dict[str, int]:
        """Patch every ModelDeployment's version; the generation each patch made."""
        generations = {}
        for name in self.names:
            patched = self._call(
                "PATCH", f"{self._mds_path()}/{name}", {"spec": {"version": version}},
                "application/merge-patch+json",
            )  # fmt: skip
            generations[name] = int(patched["metadata"]["generation"])
        return generations

    def all_on(self, version: str, generations: dict[str, int] | None = None) -> bool:
        """Every ModelDeployment Available, every pod on ``version`` (and its status
        about the generation given, when given)."""
        items = {i["metadata"]["name"]: i for i in self._call("GET", self._mds_path())["items"]}
        for index, name in enumerate(self.names):
            status = (items.get(name) or {}).get("status") or {}
            if status.get("phase") != "Available":
                return False
            if status.get("versions") != {version: self.replicas(index)}:
                return False
            wanted = (generations or {}).get(name)
            if wanted is not None and status.get("observedGeneration", 0) < wanted:
                return False
        return True

    def wait_all_on(self, version: str, generations: dict[str, int] | None = None) -> None:
        deadline = time.monotonic() + self.settings.timeout_s
        while not self.all_on(version, generations):
            if time.monotonic() > deadline:
                tail = self.operator.log_tail(40) if self.operator else ""
                raise TimeoutError(f"the pods never all reached {version}:\n{tail}")
            if self.operator is not None and not self.operator.running():
                raise RuntimeError(f"the operator exited:\n{self.operator.log_tail(40)}")
            time.sleep(0.5)

    def window(self, name: str, action: Any, settle_s: float = 0.0) -> Window:
        """Run ``action``: its wall and the operator's CPU time, and the writes from its
        start to ``settle_s`` after its end."""
        since, cpu, started = self.cluster.audit_mark(), self.operator_cpu_s(), time.monotonic()
        action()
        wall = time.monotonic() - started
        cpu = self.operator_cpu_s() - cpu
        time.sleep(settle_s)
        counts = self.cluster.audit_counts(since, self.cluster.audit_mark(), self.namespace)
        return _window(name, wall, cpu, counts, self.settings.pods)

    def lease_max_gap_s(self) -> float:
        """The node's longest time between two Lease renewals (40 s: NotReady)."""
        heartbeat = self.node.agent.heartbeat if self.node is not None else None
        return round(heartbeat.max_gap_s, 2) if heartbeat is not None else 0.0

    def rollout(self, version: str) -> Window:
        def roll() -> None:
            self.wait_all_on(version, self.set_version(version))

        return self.window(f"rollout to {version}", roll, self.settings.settle_s)

    def idle(self, name: str) -> Window:
        return self.window(name, lambda: time.sleep(self.settings.idle_s))


def _window(name: str, wall: float, cpu: float, counts: WriteCounts, pods: int) -> Window:
    return Window(
        name=name,
        wall_s=round(wall, 2),
        writes=counts.total(),
        pod_writes=sum(n for (_, resource), n in counts.by_writer.items() if resource == "pods"),
        md_status_writes=counts.status_writes("modeldeployments"),
        operator_cpu_s=round(cpu, 2),
        by_writer=counts.table(),
        pods=pods,
        load_1m=round(os.getloadavg()[0], 2),
    )


def run_scale(
    work: Path, settings: ScaleSettings, cluster: ControlPlane | None = None
) -> dict[str, Any]:
    """On ``cluster`` (else a control plane of its own in ``work``) in a namespace of its
    own: create the ModelDeployments on v1, then an idle window, v1→v2, v2→v1, another
    idle window. Returns the report (JSON-ready)."""
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        if cluster is None:
            cluster = stack.enter_context(ControlPlane(work / "control-plane"))
        run = ScaleRun(cluster, work, settings)
        stack.callback(run.stop)
        run.start()
        run.create("v1")
        run.wait_all_on("v1")
        time.sleep(settings.settle_s)
        windows = [
            run.idle("idle after creation"),
            run.rollout("v2"),
            run.rollout("v1"),
            run.idle("idle after the rollback"),
        ]
        lease_gap = run.lease_max_gap_s()
    return {
        "settings": {
            **{k: v for k, v in asdict(settings).items() if k != "sidecars"},
            "sidecars": asdict(settings.sidecars),
        },
        "windows": [w.as_json() for w in windows],
        "node_lease_max_gap_s": lease_gap,
        "total_s": round(time.monotonic() - started, 1),
    }
