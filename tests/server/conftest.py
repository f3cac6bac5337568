"""The server's fixtures: a model repository of three versions and a server on it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from model_server.app import SERVER, ModelServer
from model_server.config import ModelSpec, ServerConfig
from tests.support.server import ADMIN_TOKEN, Version, add_version


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
