from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest_plugins = ["tests.support.skip_policy"]  # under CI=true only GPU/TensorRT tests may skip


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """One SeaweedFS (S3) per test session; each test uses its own bucket."""
    from model_rollout_e2e.binaries import BinaryNotFound, weed_binary
    from model_rollout_e2e.seaweed import SeaweedFS

    try:
        weed_binary()
    except BinaryNotFound as exc:
        pytest.skip(str(exc))
    server = SeaweedFS(tmp_path_factory.mktemp("seaweedfs")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """One real Kubernetes control plane per test session (etcd, kube-apiserver,
    kube-controller-manager, kube-scheduler; built by ``make install``); each test uses
    its own namespace. Stopped at the end of the session whatever the tests did."""
    from model_rollout_e2e.binaries import BinaryNotFound
    from model_rollout_e2e.control_plane import COMPONENTS, ControlPlane, control_plane_binary

    try:
        for name in COMPONENTS:
            control_plane_binary(name)
    except BinaryNotFound as exc:
        pytest.skip(str(exc))
    with ControlPlane(tmp_path_factory.mktemp("control-plane")) as cluster:
        yield cluster


@pytest.fixture
def node_agents(control_plane, tmp_path: Path):  # type: ignore[no-untyped-def]
    """Start kubelet stand-ins (``model_rollout_e2e.node_agent``) on the session's control
    plane: ``node_agents(processes=True, mounts=..., **NodeAgent options)``; simulated
    (no processes) unless ``processes``, the operator's pods with their sidecars' reports
    faked (``model_rollout_e2e.simulated_sidecar``) when given ``sidecars=
    SidecarBehaviour(...)``, or the runtime ``runtime(kubeconfig)`` makes from the node's
    kubeconfig (``model_rollout_e2e.simulated_traffic``). Each is stopped (its processes
    killed) and its Node deleted when the test ends, so the next test's pods go to the
    next test's node."""
    import uuid

    from model_rollout_e2e.container_runtime import ProcessContainers, SimulatedContainers
    from model_rollout_e2e.node_agent import AgentThread, NodeAgent
    from model_rollout_e2e.pod_runtime import ContainerRuntime
    from model_rollout_e2e.simulated_sidecar import SidecarBehaviour, SimulatedModelContainers

    threads: list[AgentThread] = []

    def start(
        processes: bool = False,
        mounts: dict[str, Path] | None = None,
        sidecars: SidecarBehaviour | None = None,
        runtime: Callable[[Path], ContainerRuntime] | None = None,
        **options: Any,
    ) -> NodeAgent:
        name = f"node-{uuid.uuid4().hex[:8]}"
        kubeconfig = control_plane.node_kubeconfig(name)
        containers: ContainerRuntime = (
            ProcessContainers(tmp_path / name, mounts=mounts)
            if processes
            else runtime(kubeconfig)
            if runtime is not None
            else SimulatedContainers()
            if sidecars is None
            else SimulatedModelContainers(kubeconfig, sidecars)
        )
        agent = NodeAgent(kubeconfig, containers, name, **options)
        threads.append(AgentThread(agent).start())
        return agent

    yield start
    for thread in reversed(threads):
        thread.stop()
        control_plane.kubectl.run("delete", "node", thread.agent.name, "--wait=false")


@pytest.fixture
def node_agent(node_agents):  # type: ignore[no-untyped-def]
    """One simulated node for this test (pods run nowhere, turn Ready at once)."""
    return node_agents()


@pytest.fixture
def s3_env(seaweed, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    from model_rollout_e2e.seaweed import CREDENTIALS_ENV

    for name, value in CREDENTIALS_ENV.items():
        monkeypatch.setenv(name, value)
    return seaweed
