"""KServe v2 / Open Inference Protocol conformance over HTTP, driven by a real
third-party client: NVIDIA's ``tritonclient.http`` (not a client written here) against
the server on a real TCP port. Its defaults are what real users send: binary tensor
data for inputs, all outputs as binary, versioned routes, the repository and statistics
extensions.

``tritonclient.http`` runs on gevent (geventhttpclient): each client lives on one
thread of its own, where gevent has its own hub, away from the test's event loop, which
serves the requests meanwhile. Nothing is monkey-patched."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np
import pytest
import tritonclient.http as triton
from aiohttp.test_utils import TestServer
from tritonclient.utils import InferenceServerException

from model_rollout_e2e.onnx_models import INPUT_NAME, OUTPUT_NAME
from model_server.app import ModelServer
from model_server.config import ServerConfig
from model_server.dataplane.metadata import EXTENSIONS
from tests.support.server import ADMIN

T = TypeVar("T")
X = np.random.default_rng(5).standard_normal((3, 8)).astype(np.float32)
WRONG_ADMIN = {"Authorization": "Bearer not-the-token"}


class Triton:
    """One ``tritonclient.http`` client, called on its own thread."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tritonclient")
        self._client: triton.InferenceServerClient | None = None

    def _run(self, call: Callable[[triton.InferenceServerClient], T]) -> T:
        if self._client is None:
            self._client = triton.InferenceServerClient(self.url, network_timeout=120)
        return call(self._client)

    async def __call__(self, call: Callable[[triton.InferenceServerClient], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._run, call)

    async def refused(self, call: Callable[[triton.InferenceServerClient], Any]) -> str:
        """The HTTP status of a call the server refuses (the client raises)."""
        with pytest.raises(InferenceServerException) as refused:
            await self(call)
        status = refused.value.status()
        assert status is not None, refused.value
        return str(status)

    async def close(self) -> None:
        def close() -> None:
            if self._client is not None:
                self._client.close()

        await asyncio.get_running_loop().run_in_executor(self._thread, close)
        self._thread.shutdown()


@contextlib.asynccontextmanager
async def serving(config: ServerConfig) -> AsyncIterator[Triton]:
    """The server on a real port of 127.0.0.1, and a client of it."""
    server = ModelServer(config)
    async with TestServer(server.make_app(), host="127.0.0.1") as http:
        client = Triton(f"127.0.0.1:{http.port}")
        try:
            yield client
        finally:
            await client.close()


@pytest.fixture
async def client(server_config: ServerConfig) -> AsyncIterator[Triton]:
    async with serving(server_config) as triton_client:
        yield triton_client


def infer_input(x: np.ndarray, binary: bool = True) -> triton.InferInput:
    item = triton.InferInput(INPUT_NAME, list(x.shape), "FP32")
    item.set_data_from_numpy(x, binary_data=binary)
    return item


def output(binary: bool) -> triton.InferRequestedOutput:
    return triton.InferRequestedOutput(OUTPUT_NAME, binary_data=binary)


async def test_health_and_server_metadata(client: Triton) -> None:
    assert await client(lambda c: c.is_server_live())
    assert await client(lambda c: c.is_server_ready())
    metadata = await client(lambda c: c.get_server_metadata())
    assert metadata["name"] == "model-rollout" and metadata["version"]
    # what is claimed is what this file drives the server through
    assert metadata["extensions"] == list(EXTENSIONS)
    assert set(EXTENSIONS) == {
        "binary_tensor_data",
        "model_configuration",
        "model_repository",
        "statistics",
    }


async def test_model_metadata_and_readiness_by_version(client: Triton) -> None:
    assert await client(lambda c: c.is_model_ready("mlp"))
    assert await client(lambda c: c.is_model_ready("mlp", "v1"))
    assert not await client(lambda c: c.is_model_ready("mlp", "v2"))  # on disk, not loaded
    assert not await client(lambda c: c.is_model_ready("missing"))
    metadata = await client(lambda c: c.get_model_metadata("mlp"))
    assert metadata == {
        "name": "mlp",
        "versions": ["v1"],
        "platform": "onnxruntime_onnx",
        "inputs": [{"name": INPUT_NAME, "datatype": "FP32", "shape": [-1, 8]}],
        "outputs": [{"name": OUTPUT_NAME, "datatype": "FP32", "shape": [-1, 4]}],
    }
    assert await client(lambda c: c.get_model_metadata("mlp", "v1")) == metadata
    assert await client.refused(lambda c: c.get_model_metadata("mlp", "v2")) == "404"
    assert await client.refused(lambda c: c.get_model_metadata("missing")) == "404"


async def test_model_configuration(client: Triton) -> None:
    config = await client(lambda c: c.get_model_config("mlp"))
    assert config["name"] == "mlp"
    assert (config["platform"], config["backend"]) == ("onnxruntime_onnx", "onnxruntime")
    assert config["max_batch_size"] == 0  # no dynamic batching: dims are the whole shape
    assert config["input"] == [{"name": INPUT_NAME, "data_type": "TYPE_FP32", "dims": [-1, 8]}]
    assert config["output"] == [{"name": OUTPUT_NAME, "data_type": "TYPE_FP32", "dims": [-1, 4]}]
    assert await client(lambda c: c.get_model_config("mlp", "v1")) == config
    assert await client.refused(lambda c: c.get_model_config("mlp", "v3")) == "404"


async def test_model_configuration_with_dynamic_batching(server_config: ServerConfig) -> None:
    config = replace(
        server_config, max_batch_size=16, max_queue_delay_us=500, batch_models=("mlp",)
    )
    async with serving(config) as client:
        answer = await client(lambda c: c.get_model_config("mlp"))
        assert answer["max_batch_size"] == 16
        assert answer["dynamic_batching"] == {"max_queue_delay_microseconds": 500}
        # Triton's convention: with batching, dims leave out the batch axis
        assert answer["input"][0]["dims"] == [8] and answer["output"][0]["dims"] == [4]
        result = await client(lambda c: c.infer("mlp", [infer_input(X)]))
        assert result.as_numpy(OUTPUT_NAME).shape == (3, 4)
        stats = await client(lambda c: c.get_inference_statistics("mlp"))
        assert stats["model_stats"][0]["inference_count"] == 3  # a batched model counts rows


async def test_infer_with_the_clients_defaults_is_binary_both_ways(client: Triton, repo) -> None:
    versions = repo[1]
    result = await client(lambda c: c.infer("mlp", [infer_input(X)]))
    response = result.get_response()
    assert response["model_name"] == "mlp" and response["model_version"] == "v1"
    [described] = response["outputs"]
    assert described["parameters"] == {"binary_data_size": 3 * 4 * 4}
    assert "data" not in described
    np.testing.assert_allclose(result.as_numpy(OUTPUT_NAME), versions["v1"].expected(X), atol=1e-5)


async def test_infer_json_both_ways(client: Triton, repo) -> None:
    versions = repo[1]
    result = await client(
        lambda c: c.infer("mlp", [infer_input(X, binary=False)], outputs=[output(False)])
    )
    [described] = result.get_response()["outputs"]
    assert "parameters" not in described and len(described["data"]) == 12
    np.testing.assert_allclose(result.as_numpy(OUTPUT_NAME), versions["v1"].expected(X), atol=1e-5)


@pytest.mark.parametrize(("binary_in", "binary_out"), [(True, False), (False, True)])
async def test_infer_mixed_json_and_binary(
    client: Triton, repo, binary_in: bool, binary_out: bool
) -> None:
    versions = repo[1]
    result = await client(
        lambda c: c.infer(
            "mlp", [infer_input(X, binary_in)], outputs=[output(binary_out)], request_id="r-7"
        )
    )
    response = result.get_response()
    assert response["id"] == "r-7"
    assert ("parameters" in response["outputs"][0]) is binary_out
    np.testing.assert_allclose(result.as_numpy(OUTPUT_NAME), versions["v1"].expected(X), atol=1e-5)


async def test_a_large_binary_request(client: Triton, repo) -> None:
    """A 12.8 MB input tensor (400 000 rows): the binary part is read as a view of the
    body, and the 6.4 MB output comes back binary."""
    versions = repo[1]
    x = np.random.default_rng(9).standard_normal((400_000, 8)).astype(np.float32)
    result = await client(lambda c: c.infer("mlp", [infer_input(x)]))
    np.testing.assert_allclose(result.as_numpy(OUTPUT_NAME), versions["v1"].expected(x), atol=1e-4)


async def test_a_retained_version_answers_by_version(client: Triton, repo) -> None:
    versions = repo[1]
    await client(lambda c: c.load_model("mlp", headers=ADMIN))  # the newest: v3 (no CURRENT)
    assert await client(lambda c: c.is_model_ready("mlp", "v1"))  # retained for rollback
    metadata = await client(lambda c: c.get_model_metadata("mlp"))
    assert metadata["versions"] == ["v1", "v3"]
    for version, named in (("v3", ""), ("v1", "v1"), ("v3", "v3")):
        result = await client(lambda c, n=named: c.infer("mlp", [infer_input(X)], model_version=n))
        assert result.get_response()["model_version"] == version
        np.testing.assert_allclose(
            result.as_numpy(OUTPUT_NAME), versions[version].expected(X), atol=1e-5
        )
    status = await client.refused(
        lambda c: c.infer("mlp", [infer_input(X)], model_version="v2")  # not loaded
    )
    assert status == "404"


async def test_repository_index_load_and_unload(client: Triton, repo, server_config) -> None:
    root, versions = repo
    index = await client(lambda c: c.get_model_repository_index(headers=ADMIN))
    assert index == [
        {"name": "mlp", "version": "v1", "state": "READY", "reason": "serving"},
        {"name": "mlp", "version": "v2", "state": "UNAVAILABLE", "reason": "not loaded"},
        {"name": "mlp", "version": "v3", "state": "UNAVAILABLE", "reason": "not loaded"},
    ]

    await client(lambda c: c.unload_model("mlp", headers=ADMIN))
    assert not await client(lambda c: c.is_model_ready("mlp"))
    assert await client(lambda c: c.is_server_ready())  # unloaded on request: not held back
    assert await client.refused(lambda c: c.infer("mlp", [infer_input(X)])) == "503"
    states = {
        e["version"]: e["state"]
        for e in await client(lambda c: c.get_model_repository_index(headers=ADMIN))
    }
    assert states["v1"] in ("UNLOADING", "UNAVAILABLE")

    (root / "mlp" / "CURRENT").write_text("v2\n")  # what the sidecar last swapped to
    await client(lambda c: c.load_model("mlp", headers=ADMIN))
    result = await client(lambda c: c.infer("mlp", [infer_input(X)]))
    assert result.get_response()["model_version"] == "v2"
    np.testing.assert_allclose(result.as_numpy(OUTPUT_NAME), versions["v2"].expected(X), atol=1e-5)

    audit = [json.loads(line) for line in server_config.audit_log.read_text().splitlines()]
    assert [(e["action"], e["version"], e["result"], e["who"]) for e in audit[1:]] == [
        ("unload", "v1", "success", "admin"),
        ("load", "v2", "success", "admin"),
    ]


async def test_repository_calls_need_the_admin_token(client: Triton) -> None:
    for headers in ({}, WRONG_ADMIN):
        for call in (
            lambda c, h=headers: c.get_model_repository_index(headers=h),
            lambda c, h=headers: c.load_model("mlp", headers=h),
            lambda c, h=headers: c.unload_model("mlp", headers=h),
        ):
            assert await client.refused(call) == "401"
    assert await client(lambda c: c.is_model_ready("mlp"))  # nothing was unloaded
    status = await client.refused(lambda c: c.load_model("missing", headers=ADMIN))
    assert status == "404"
    status = await client.refused(
        lambda c: c.load_model("mlp", headers=ADMIN, config=json.dumps({"max_batch_size": 4}))
    )
    assert status == "400"  # a configuration override is refused, not silently ignored


async def test_statistics(client: Triton) -> None:
    for _ in range(3):
        await client(lambda c: c.infer("mlp", [infer_input(X)]))
    # refused after the model ran (an output it does not have): a failure of v1
    bad_output = triton.InferRequestedOutput("no-such-output")
    assert (
        await client.refused(lambda c: c.infer("mlp", [infer_input(X)], outputs=[bad_output]))
        == "400"
    )
    # refused before any version was pinned (a malformed shape): no version's
    wrong = infer_input(X)
    wrong.set_shape([2, 8])
    assert await client.refused(lambda c: c.infer("mlp", [wrong])) == "400"

    [stat] = (await client(lambda c: c.get_inference_statistics("mlp")))["model_stats"]
    assert (stat["name"], stat["version"]) == ("mlp", "v1")
    assert stat["inference_count"] == 3 and stat["execution_count"] == 3
    inference = stat["inference_stats"]
    assert inference["success"]["count"] == 3 and inference["fail"]["count"] == 1
    for part in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert inference[part]["count"] == 3, part
    assert inference["compute_infer"]["ns"] > 0
    assert inference["success"]["ns"] >= inference["compute_infer"]["ns"]
    assert stat["last_inference"] > 0
    assert await client(lambda c: c.get_inference_statistics("mlp", "v1")) == {
        "model_stats": [stat]
    }
    everything = await client(lambda c: c.get_inference_statistics())
    assert [s["name"] for s in everything["model_stats"]] == ["mlp"]
    assert await client.refused(lambda c: c.get_inference_statistics("mlp", "v2")) == "404"
    assert await client.refused(lambda c: c.get_inference_statistics("missing")) == "404"


async def test_errors_are_the_clients_exceptions(client: Triton) -> None:
    assert await client.refused(lambda c: c.infer("missing", [infer_input(X)])) == "404"
    # a shape that does not match the binary data sent: binary_data_size is 96 bytes,
    # the shape now says 64
    short = infer_input(X)
    short.set_shape([2, 8])
    with pytest.raises(InferenceServerException, match="binary_data_size 96") as refused:
        await client(lambda c: c.infer("mlp", [short]))
    assert refused.value.status() == "400"
    wrong_type = triton.InferInput(INPUT_NAME, [3, 8], "FP64")
    wrong_type.set_data_from_numpy(X.astype(np.float64))
    assert await client.refused(lambda c: c.infer("mlp", [wrong_type])) == "400"
    assert await client(lambda c: c.is_server_live())  # and it goes on serving


async def test_compressed_requests(client: Triton, repo) -> None:
    for algorithm in ("gzip", "deflate"):
        result = await client(
            lambda c, a=algorithm: c.infer("mlp", [infer_input(X)], request_compression_algorithm=a)
        )
        np.testing.assert_allclose(
            result.as_numpy(OUTPUT_NAME), repo[1]["v1"].expected(X), atol=1e-5
        )
