"""Large JSON bodies never hold the event loop, and JSON stays JSON (issue 13): a large
body is decoded (and a large answer encoded) in a worker process while the server keeps
answering, and non-finite numbers travel as "NaN"/"Infinity"/"-Infinity", never bare."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import replace

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer

from helpers import infer_body, output_of, worker_processes
from model_server.app import ModelServer
from model_server.config import ServerConfig
from model_server.v2_codec import encode_response

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
    [line] = [x for x in text.splitlines() if x.startswith("inference_requests_in_flight{")]
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
