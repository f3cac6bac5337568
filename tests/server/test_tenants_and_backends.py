"""Per-tenant API keys route to per-tenant models; optional backends fail clearly."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer

from model_server.app import ModelServer
from model_server.backends import BackendUnavailable, ModelFile, make_backend
from model_server.config import ModelSpec, ServerConfig
from tests.support.server import add_version, infer_body, which_version, write_tenants

X = np.ones((1, 8), np.float32)


async def test_api_keys_route_to_tenant_models(tmp_path: Path) -> None:
    root = tmp_path / "models"
    acme = {"v1": add_version(root, "acme/mlp", "v1", seed=11)}
    globex = {"v1": add_version(root, "globex/mlp", "v1", seed=22)}
    tenants = write_tenants(tmp_path / "tenants.yaml")
    app = ModelServer(ServerConfig(repository=root, tenants_file=tenants)).make_app()
    async with TestClient(TestServer(app)) as client:
        for key, versions in (("key-acme", acme), ("key-globex", globex)):
            response = await client.post(
                "/v2/models/mlp/infer",
                json=infer_body(X),
                headers={"Authorization": f"Bearer {key}"},
            )
            assert response.status == 200
            which_version(versions, X, await response.json())
        assert (await client.post("/v2/models/mlp/infer", json=infer_body(X))).status == 401
        response = await client.post(
            "/v2/models/mlp/infer", json=infer_body(X), headers={"X-API-Key": "stolen"}
        )
        assert response.status == 401
        listing = await (await client.get("/v1/models", headers={"X-API-Key": "key-acme"})).json()
        assert [m["name"] for m in listing["models"]] == ["mlp"]
        # no admin token configured: the admin API is off, not open
        response = await client.post("/v1/reload?model=acme/mlp&target_version=v1")
        assert response.status == 403


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="TensorRT present")
def test_missing_tensorrt_is_a_clear_message() -> None:
    import model_server.backends.tensorrt_backend  # noqa: F401  importing never needs TensorRT

    with pytest.raises(BackendUnavailable, match=r"TensorRT .*pip install"):
        make_backend("tensorrt")


def test_cli_reports_missing_backend(tmp_path: Path) -> None:
    import subprocess

    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("TensorRT present")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "model_server",
            "--repository",
            str(tmp_path),
            "--backend",
            "tensorrt",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "TensorRT" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.gpu  # torch is installed where there is a GPU only (its PyPI build is CUDA's)
def test_torch_backend_matches_reference(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch", reason="torch not installed (GPU tier)")
    version = add_version(tmp_path, "mlp", "v1", seed=4)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # weights in GPU memory there
    engine = make_backend("torch", device=device).load(ModelFile.read(version.path))
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    np.testing.assert_allclose(engine.infer({"input": x})["output"], version.expected(x), atol=1e-5)
    assert engine.inputs[0].shape == (-1, 8)
    assert engine.device_memory_bytes > 0
    engine.close()


# TensorRT on a GPU: tests/server/backends/test_tensorrt_gpu.py; its API against the real bindings:
# tests/server/backends/test_tensorrt_api.py


async def test_a_tenant_model_with_no_version_does_not_take_the_pod_from_everybody(
    tmp_path: Path,
) -> None:
    """The pod's readiness is the server's own models': globex's model, which has no
    version yet (or whose load failed), leaves acme's and the deployment's serving."""
    root = tmp_path / "models"
    add_version(root, "resnet", "v1", seed=1)
    add_version(root, "acme/mlp", "a1", seed=2)
    tenants = write_tenants(tmp_path / "tenants.yaml", {"acme": "ka", "globex": "kg"})
    config = ServerConfig(repository=root, models=[ModelSpec("resnet")], tenants_file=tenants)
    async with TestClient(TestServer(ModelServer(config).make_app())) as client:
        assert (await client.get("/v2/health/ready")).status == 200
        ready = await client.get("/v2/models/mlp/ready", headers={"X-API-Key": "ka"})
        assert ready.status == 200
        unready = await client.get("/v2/models/mlp/ready", headers={"X-API-Key": "kg"})
        assert unready.status != 200
    # the server's own model still holds readiness back until it serves
    empty = tmp_path / "empty"
    add_version(empty, "acme/mlp", "a1", seed=2)
    config = ServerConfig(repository=empty, models=[ModelSpec("resnet")], tenants_file=tenants)
    async with TestClient(TestServer(ModelServer(config).make_app())) as client:
        assert (await client.get("/v2/health/ready")).status == 503
