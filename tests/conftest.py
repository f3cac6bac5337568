from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

sys.path.insert(0, str(Path(__file__).parent))

from helpers import Version, add_version
from model_server.app import SERVER, ModelServer
from model_server.config import ModelSpec, ServerConfig

pytest_plugins = ["skip_policy"]  # under CI=true only GPU/TensorRT tests may skip

ADMIN_TOKEN = "test-admin-token"


@pytest.fixture
def repo(tmp_path: Path) -> tuple[Path, dict[str, Version]]:
    root = tmp_path / "models"
    versions = {
        "v1": add_version(root, "mlp", "v1", seed=1),
        "v2": add_version(root, "mlp", "v2", seed=2),
        "v3": add_version(root, "mlp", "v3", seed=3),
    }
    return root, versions


@pytest.fixture
def server_config(tmp_path: Path, repo: tuple[Path, dict[str, Version]]) -> ServerConfig:
    token = tmp_path / "admin-token"
    token.write_text(ADMIN_TOKEN)
    return ServerConfig(
        repository=repo[0],
        models=[ModelSpec("mlp", "v1")],
        admin_token_file=token,
        control_socket=tmp_path / "control.sock",
        audit_log=tmp_path / "audit.jsonl",
        cache_dir=tmp_path / "cache",
    )


@pytest.fixture
async def client(server_config: ServerConfig) -> AsyncIterator[TestClient]:
    app = ModelServer(server_config).make_app()
    async with TestClient(TestServer(app)) as test_client:
        yield test_client


@pytest.fixture
def model_server(client: TestClient) -> ModelServer:
    return client.app[SERVER]


ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


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
