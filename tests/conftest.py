from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

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
def s3_env(seaweed, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    from model_rollout_e2e.seaweed import CREDENTIALS_ENV

    for name, value in CREDENTIALS_ENV.items():
        monkeypatch.setenv(name, value)
    return seaweed
