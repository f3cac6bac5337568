"""Hostile requests get a 4xx JSON answer, never a plain-text 500 (issue 13, server
robustness): shapes that overflow, element counts that wrap, unhashable output names,
unknown charsets, deeply nested JSON, non-ASCII credentials, loosely typed data."""

from __future__ import annotations

import json

import pytest
from aiohttp.test_utils import TestClient

from conftest import ADMIN

INFER = "/v2/models/mlp/infer"


def body(shape: list[int], data: object, datatype: str = "FP32", **extra: object) -> dict:
    return {
        "inputs": [{"name": "input", "shape": shape, "datatype": datatype, "data": data}],
        **extra,
    }


async def answer(response) -> dict:  # type: ignore[no-untyped-def]
    assert response.content_type == "application/json", await response.text()
    payload: dict = await response.json()
    assert set(payload) >= {"error", "code"}, payload
    return payload


@pytest.mark.parametrize(
    ("name", "request_body"),
    [
        ("shape entry of 2**63", body([2**63, 8], [0.0] * 8)),
        ("shape whose element count wraps to 0 in int64", body([2**32, 2**32, 8], [])),
        ("negative shape entry", body([-1, 8], [0.0] * 8)),
        ("unhashable output name", {**body([1, 8], [0.0] * 8), "outputs": [{"name": ["x"]}]}),
        ("null in FP32 data", body([1, 8], [None] + [0.0] * 7)),
        ("a string in FP32 data", body([1, 8], ["1.5"] + [0.0] * 7)),
        ("a boolean in FP32 data", body([1, 8], [True] + [0.0] * 7)),
        ("data nested past the shape", body([1, 8], [[[0.0]]] * 8)),
    ],
)
async def test_malformed_tensors_are_400(client: TestClient, name: str, request_body: dict) -> None:
    response = await client.post(INFER, json=request_body)
    assert response.status == 400, (name, await response.text())
    assert (await answer(response))["code"] == "bad_request"


async def test_json_nested_2000_deep_is_400(client: TestClient) -> None:
    text = "[" * 2000 + "]" * 2000
    response = await client.post(INFER, data=text, headers={"Content-Type": "application/json"})
    assert response.status == 400 and (await answer(response))["code"] == "bad_request"


async def test_an_unknown_charset_is_4xx(client: TestClient) -> None:
    response = await client.post(
        INFER,
        data=json.dumps(body([1, 8], [0.0] * 8)).encode(),
        headers={"Content-Type": "application/json; charset=no-such-charset"},
    )
    assert response.status in (400, 415), await response.text()
    await answer(response)


@pytest.mark.parametrize("header", ["Authorization", "X-API-Key"])
async def test_non_ascii_credentials_are_401(client: TestClient, header: str) -> None:
    raw = "Bearer t\xe9st\xff" if header == "Authorization" else "k\xe9y\xff"
    response = await client.post(
        "/v1/reload?target_version=v2", headers={header: raw.encode("latin-1").decode("latin-1")}
    )
    assert response.status == 401, await response.text()
    await answer(response)


async def test_a_too_large_body_is_413_and_counted_as_413(client: TestClient) -> None:
    response = await client.post(
        INFER,
        data=b"[" + b"0," * (40 * 2**20) + b"0]",
        headers={"Content-Type": "application/json"},
    )
    assert response.status == 413, await response.text()
    await answer(response)
    metrics = await (await client.get("/metrics")).text()
    assert 'inference_requests_total{code="413",model="mlp"} 1.0' in metrics


async def test_ints_are_accepted_as_fp32(client: TestClient) -> None:
    response = await client.post(INFER, json=body([1, 8], [0, 1, 2, 3, 4, 5, 6, 7]))
    assert response.status == 200, await response.text()
    nested = await client.post(INFER, json=body([1, 8], [[0.0] * 8]))
    assert nested.status == 200, await nested.text()
    assert ADMIN  # the fixture's token exists (admin paths are covered elsewhere)
