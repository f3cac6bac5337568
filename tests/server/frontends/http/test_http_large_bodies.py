"""Large JSON bodies never hold the event loop, and JSON stays JSON (issue 13): a large
body is decoded (and a large answer encoded) in a worker process while the server keeps
answering, and non-finite numbers travel as "NaN"/"Infinity"/"-Infinity", never bare."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import replace

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer

from model_rollout_e2e.onnx_models import write_mlp
from model_server.app import SERVER, ModelServer
from model_server.config import ServerConfig
from model_server.protocol.v2_codec import encode_response
from tests.support.server import ADMIN, infer_body, output_of, worker_processes, write_manifest

INFER = "/v2/models/mlp/infer"
JSON = {"Content-Type": "application/json"}


def strict_json(text: str) -> object:
    """Parse as RFC 8259 JSON: a bare NaN or Infinity is an error."""

    def refuse(token: str) -> None:
        raise ValueError(f"bare {token} in the answer")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture
async def one_worker(server_config: ServerConfig) -> AsyncIterator[TestClient]:
    app = ModelServer(replace(server_config, json_workers=1)).make_app()
    async with TestClient(TestServer(app)) as client:
        yield client


async def in_flight(client: TestClient) -> float:
    text = await (await client.get("/metrics")).text()
    [line] = [
        x for x in text.splitlines() if x.startswith("model_server_inference_requests_in_flight{")
    ]
    return float(line.split()[-1])


async def test_a_large_body_is_decoded_while_the_server_keeps_answering(
    one_worker: TestClient, repo
) -> None:
    client, versions = one_worker, repo[1]
    x = np.random.default_rng(1).standard_normal((40_000, 8)).astype(np.float32)
    body = json.dumps(infer_body(x)).encode()  # about 7 MB: 320 000 numbers
    before = set(worker_processes(os.getpid()))
    warm = await client.post(INFER, data=body, headers=JSON)
    assert warm.status == 200, await warm.text()
    [worker] = set(worker_processes(os.getpid())) - before
    os.kill(worker, signal.SIGSTOP)  # the worker cannot finish any parse now
    try:
        big = asyncio.create_task(client.post(INFER, data=body, headers=JSON))
        while await in_flight(client) < 1:  # the body is read and handed to the worker
            await asyncio.sleep(0.01)
        for _ in range(20):
            assert (await client.get("/v2/health/live")).status == 200
            assert (await client.get("/v1/models/mlp/health")).status == 200
        assert not big.done()
    finally:
        os.kill(worker, signal.SIGCONT)
    response = await big
    assert response.status == 200, await response.text()
    answer = strict_json(await response.text())
    assert isinstance(answer, dict) and answer["model_version"] == "v1"
    got = output_of(answer)  # 160 000 values: encoded in the worker too
    np.testing.assert_allclose(got, versions["v1"].expected(x), atol=1e-4)


async def test_non_finite_outputs_are_strings_and_the_answer_is_json(client: TestClient) -> None:
    x = np.full((2, 8), 3e38, np.float32)  # overflows inside the model: NaN comes out
    response = await client.post(INFER, json=infer_body(x))
    assert response.status == 200, await response.text()
    answer = strict_json(await response.text())
    assert isinstance(answer, dict)
    assert answer["outputs"][0]["data"] == ["NaN"] * 8
    again = {
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 8],
                    "data": ["NaN", "Infinity", "-Infinity", 0, 1, 2, 3, 4]}]
    }  # fmt: skip
    assert (await client.post(INFER, json=again)).status == 200  # the strings are read back


def test_large_answers_with_infinities_are_encoded_as_strings() -> None:
    out = np.array([[np.inf, -np.inf, np.nan, 1.5]], np.float32)
    answer = strict_json(encode_response("m", "v1", "id", {"y": out}).decode())
    assert answer["outputs"][0]["data"] == ["Infinity", "-Infinity", "NaN", 1.5]  # type: ignore[index]


async def test_bare_nan_in_a_request_is_refused(client: TestClient) -> None:
    item = (
        '{"name": "input", "datatype": "FP32", "shape": [1, 8], "data": [NaN, 0, 0, 0, 0, 0, 0, 0]}'
    )
    text = f'{{"inputs": [{item}]}}'
    response = await client.post(INFER, data=text, headers=JSON)
    assert response.status == 400, await response.text()
    assert "NaN" in (await response.json())["error"]


# --- waiting for a worker (issue 13 follow-up) ---------------------------------------


@contextlib.asynccontextmanager
async def stopped_worker(client: TestClient, body: bytes) -> AsyncIterator[None]:
    """The server's one JSON worker, started by a first large body, then stopped: large
    bodies wait for it until the block ends."""
    before = set(worker_processes(os.getpid()))
    warm = await client.post(INFER, data=body, headers=JSON)
    assert warm.status == 200, await warm.text()
    [worker] = set(worker_processes(os.getpid())) - before
    os.kill(worker, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(worker, signal.SIGCONT)


async def until_in_flight(client: TestClient, count: int) -> None:
    while await in_flight(client) < count:  # bodies read, handed to the codec
        await asyncio.sleep(0.01)


async def test_a_body_waiting_for_a_worker_pins_no_version(
    server_config: ServerConfig, repo
) -> None:
    """With --retain 1, a swap drops v1: it must close at once, not stay open (with its
    memory) for a request whose body is still waiting to be decoded; the request is then
    answered by the version serving when its body is ready."""
    versions = repo[1]
    config = replace(server_config, json_workers=1, retain=1)
    x = np.random.default_rng(3).standard_normal((40_000, 8)).astype(np.float32)
    body = json.dumps(infer_body(x)).encode()
    async with TestClient(TestServer(ModelServer(config).make_app())) as client:
        slot = client.app[SERVER].manager.slot("mlp")
        async with stopped_worker(client, body):
            big = asyncio.create_task(client.post(INFER, data=body, headers=JSON))
            await until_in_flight(client, 1)
            swap = await client.post("/v1/reload?target_version=v2", headers=ADMIN)
            assert swap.status == 200, await swap.text()
            assert "v1" in slot.closed_versions  # nothing pinned it
            assert not big.done()
        response = await big
        assert response.status == 200, await response.text()
        answer = strict_json(await response.text())
        assert isinstance(answer, dict) and answer["model_version"] == "v2"
        np.testing.assert_allclose(output_of(answer), versions["v2"].expected(x), atol=1e-4)


async def test_a_full_queue_of_large_bodies_is_answered_503_with_retry_after(
    server_config: ServerConfig,
) -> None:
    config = replace(server_config, json_workers=1, json_max_pending=2)
    x = np.random.default_rng(4).standard_normal((40_000, 8)).astype(np.float32)
    body = json.dumps(infer_body(x)).encode()
    async with TestClient(TestServer(ModelServer(config).make_app())) as client:
        async with stopped_worker(client, body):
            waiting = [
                asyncio.create_task(client.post(INFER, data=body, headers=JSON)) for _ in range(2)
            ]
            await until_in_flight(client, 2)
            # a hang guard, not a timing: the answer comes at once or never
            refused = await asyncio.wait_for(client.post(INFER, data=body, headers=JSON), 60)
            assert refused.status == 503, await refused.text()
            assert refused.headers["Retry-After"] == "1"
            assert (await refused.json())["code"] == "unavailable"
            small = await client.post(INFER, json=infer_body(np.ones((1, 8), np.float32)))
            assert small.status == 200  # small bodies never wait for the worker
            assert not any(task.done() for task in waiting)
        for task in waiting:
            assert (await task).status == 200
        metrics = await (await client.get("/metrics")).text()
        assert 'model_server_inference_requests_total{code="503",model="mlp"} 1.0' in metrics


async def _chunks(body: bytes) -> AsyncIterator[bytes]:
    yield body  # a body without Content-Length: its size is known only once it is read


async def test_a_full_queue_is_the_servers_overload_and_not_the_versions_error(
    server_config: ServerConfig,
) -> None:
    """A chunked body (no announced length) is refused for a full queue once read: that
    503 is counted for the server, never in the per-version series canary analysis
    judges a version on."""
    config = replace(server_config, json_workers=1, json_max_pending=1)
    x = np.random.default_rng(4).standard_normal((40_000, 8)).astype(np.float32)
    body = json.dumps(infer_body(x)).encode()
    async with TestClient(TestServer(ModelServer(config).make_app())) as client:
        async with stopped_worker(client, body):
            waiting = asyncio.create_task(client.post(INFER, data=body, headers=JSON))
            await until_in_flight(client, 1)
            refused = await asyncio.wait_for(
                client.post(INFER, data=_chunks(body), headers=JSON), 60
            )
            assert refused.status == 503, await refused.text()
        assert (await waiting).status == 200
        metrics = await (await client.get("/metrics")).text()
        assert 'model_server_inference_requests_total{code="503",model="mlp"} 1.0' in metrics
        assert 'model_server_version_requests_total{code="503"' not in metrics


async def test_a_body_decoded_for_inputs_that_changed_meanwhile_is_checked_again(
    server_config: ServerConfig, repo
) -> None:
    """The body is decoded against the serving version's inputs before any pin; if a
    swap changed them meanwhile (here: 16 features instead of 8) and the version it was
    routed to is gone (--retain 1), it is checked against the version that will answer,
    never run on inputs it was not checked for."""
    root = repo[0]
    wide = root / "mlp" / "wide" / "model.onnx"
    write_mlp(wide, 7, in_dim=16)
    write_manifest(wide)
    x = np.random.default_rng(6).standard_normal((40_000, 8)).astype(np.float32)
    body = json.dumps(infer_body(x)).encode()
    config = replace(server_config, json_workers=1, retain=1)
    async with TestClient(TestServer(ModelServer(config).make_app())) as client:
        async with stopped_worker(client, body):
            big = asyncio.create_task(client.post(INFER, data=body, headers=JSON))
            await until_in_flight(client, 1)
            swap = await client.post("/v1/reload?target_version=wide", headers=ADMIN)
            assert swap.status == 200, await swap.text()
        response = await big
        assert response.status == 400, (await response.text())[:300]
        assert "shape" in (await response.json())["error"]
