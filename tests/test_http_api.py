"""The HTTP API as a client sees it: v2 inference, health, control endpoints, errors."""

from __future__ import annotations

import json

import numpy as np
from aiohttp.test_utils import TestClient

from conftest import ADMIN
from helpers import infer_body, which_version
from model_server.app import ModelServer

X = np.arange(16, dtype=np.float32).reshape(2, 8) / 10


async def test_infer_returns_v1_outputs(client: TestClient, repo) -> None:
    response = await client.post("/v2/models/mlp/infer", json=infer_body(X))
    assert response.status == 200
    answer = await response.json()
    assert answer["model_version"] == "v1"
    assert which_version(repo[1], X, answer) == "v1"
    assert answer["outputs"][0]["shape"] == [2, 4]


async def test_health_and_metadata(client: TestClient, repo) -> None:
    assert (await client.get("/v2/health/live")).status == 200
    assert (await (await client.get("/v2/health/ready")).json()) == {"ready": True}
    health = await (await client.get("/v1/models/mlp/health")).json()
    assert health["status"] == "ok" and health["version"] == "v1"
    assert health["loaded_at"].endswith("+00:00")
    assert health["sha256"] == repo[1]["v1"].sha256
    meta = await (await client.get("/v2/models/mlp")).json()
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 8]}]
    assert meta["platform"] == "onnxruntime_onnx"
    models = await (await client.get("/v1/models")).json()
    assert models["models"][0]["available"] == ["v1", "v2", "v3"]


async def test_reload_and_rollback(client: TestClient, repo) -> None:
    response = await client.post("/v1/reload?target_version=v2", headers=ADMIN)
    body = await response.json()
    assert response.status == 200, body
    assert (body["status"], body["from"], body["to"], body["instant"]) == ("ok", "v1", "v2", False)
    answer = await (await client.post("/v2/models/mlp/infer", json=infer_body(X))).json()
    assert which_version(repo[1], X, answer) == "v2"

    response = await client.post("/v1/rollback", headers=ADMIN)
    body = await response.json()
    assert (body["from"], body["to"], body["instant"]) == ("v2", "v1", True)
    assert body["duration_ms"] < 50  # a pointer swap, no load
    answer = await (await client.post("/v2/models/mlp/infer", json=infer_body(X))).json()
    assert which_version(repo[1], X, answer) == "v1"


async def test_admin_endpoints_need_the_token(client: TestClient) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = await client.post("/v1/reload?target_version=v2", headers=headers)
        assert response.status == 401
        assert (await response.json())["code"] == "unauthorized"
    assert (await client.get("/v1/audit")).status == 401


async def test_bad_requests_are_4xx_json(client: TestClient) -> None:
    cases = [
        (b"{not json", 400, "bad_request"),
        (json.dumps({"inputs": "x"}).encode(), 400, "bad_request"),
        (
            json.dumps(
                {"inputs": [{"name": "nope", "shape": [1, 8], "datatype": "FP32", "data": [0] * 8}]}
            ).encode(),
            400,
            "bad_request",
        ),
        (
            json.dumps(
                {
                    "inputs": [
                        {"name": "input", "shape": [1, 7], "datatype": "FP32", "data": [0] * 7}
                    ]
                }
            ).encode(),
            400,
            "bad_request",
        ),
        (
            json.dumps(
                {
                    "inputs": [
                        {"name": "input", "shape": [1, 8], "datatype": "INT64", "data": [0] * 8}
                    ]
                }
            ).encode(),
            400,
            "bad_request",
        ),
        (
            json.dumps(
                {
                    "inputs": [
                        {"name": "input", "shape": [2, 8], "datatype": "FP32", "data": [0] * 8}
                    ]
                }
            ).encode(),
            400,
            "bad_request",
        ),
        (
            json.dumps(
                {
                    "inputs": [
                        {"name": "input", "shape": [1, 8], "datatype": "FP32", "data": ["a"] * 8}
                    ]
                }
            ).encode(),
            400,
            "bad_request",
        ),
    ]
    for payload, status, code in cases:
        response = await client.post(
            "/v2/models/mlp/infer", data=payload, headers={"Content-Type": "application/json"}
        )
        assert response.status == status, payload
        body = await response.json()
        assert body["code"] == code and body["error"], body
    response = await client.post("/v2/models/missing/infer", json=infer_body(X))
    assert response.status == 404 and (await response.json())["code"] == "model_not_found"
    response = await client.get("/no/such/route")
    assert response.status == 404 and "error" in await response.json()
    response = await client.post("/v1/reload?target_version=v9", headers=ADMIN)
    assert response.status == 404 and (await response.json())["status"] == "failed"
    response = await client.post("/v1/reload?target_version=../etc", headers=ADMIN)
    assert response.status == 400
    response = await client.post("/v1/reload", headers=ADMIN)
    assert response.status == 400
    response = await client.post("/v1/rollback", headers=ADMIN)
    assert response.status == 409  # nothing retained yet


async def test_corrupt_engine_is_refused_and_old_version_keeps_serving(
    client: TestClient, model_server: ModelServer, repo
) -> None:
    root, versions = repo
    bad = root / "mlp" / "v4"
    bad.mkdir()
    (bad / "model.onnx").write_bytes(b"\x08\x07garbage that is not an onnx model")
    response = await client.post("/v1/reload?target_version=v4", headers=ADMIN)
    body = await response.json()
    assert response.status == 422 and body["status"] == "failed", body
    assert body["from"] == "v1" and "failed to load" in body["error"]
    answer = await (await client.post("/v2/models/mlp/infer", json=infer_body(X))).json()
    assert which_version(versions, X, answer) == "v1"

    # a file that does not match its manifest's digest is refused before loading
    versions["v3"].path.write_bytes(versions["v2"].path.read_bytes())
    response = await client.post("/v1/reload?target_version=v3", headers=ADMIN)
    body = await response.json()
    assert response.status == 422 and "sha256" in body["error"], body

    metrics = await (await client.get("/metrics")).text()
    assert 'model_reload_failure_total{model="mlp",reason="load_refused"} 2.0' in metrics
    assert 'current_model_version{model="mlp",version="v1"} 1.0' in metrics
    audit = await (await client.get("/v1/audit", headers=ADMIN)).json()
    failures = [e for e in audit["events"] if e["result"] == "failure"]
    assert [e["version"] for e in failures] == ["v4", "v3"]
    assert all(e["who"] == "admin" and e["error"] for e in failures)


async def test_metrics_after_a_swap(client: TestClient) -> None:
    await client.post("/v2/models/mlp/infer", json=infer_body(X))
    await client.post("/v1/reload?target_version=v2", headers=ADMIN)
    text = await (await client.get("/metrics")).text()
    assert 'model_reload_success_total{model="mlp"} 2.0' in text  # start-up load + reload
    assert 'current_model_version{model="mlp",version="v2"} 1.0' in text
    assert 'current_model_version{model="mlp",version="v1"} 0.0' in text
    assert 'model_load_duration_seconds_count{model="mlp"} 2.0' in text
    assert 'inference_request_duration_seconds_count{model="mlp"} 1.0' in text
    assert 'inference_requests_in_flight{model="mlp"} 0.0' in text


async def test_audit_log_file_has_every_load(client: TestClient, server_config) -> None:
    await client.post("/v1/reload?target_version=v2", headers=ADMIN)
    lines = [json.loads(line) for line in server_config.audit_log.read_text().splitlines()]
    assert [(e["version"], e["result"], e["source"]) for e in lines] == [
        ("v1", "success", "startup"),
        ("v2", "success", "http"),
    ]
    assert lines[1]["from_version"] == "v1" and len(lines[1]["digest"]) == 64
    assert lines[1]["duration_s"] > 0


async def test_every_inference_is_counted_and_timed_refused_ones_too(client: TestClient) -> None:
    await client.post("/v2/models/mlp/infer", json=infer_body(X))
    assert (await client.post("/v2/models/-bad/infer", json=infer_body(X))).status == 400
    bad_body = await client.post("/v2/models/mlp/infer", data=b"{not json")
    assert bad_body.status == 400
    metrics = await (await client.get("/metrics")).text()
    assert 'inference_requests_total{code="400",model="-bad"} 1.0' in metrics
    assert 'inference_requests_total{code="400",model="mlp"} 1.0' in metrics
    assert 'inference_requests_total{code="200",model="mlp"} 1.0' in metrics
    assert 'inference_request_duration_seconds_count{model="mlp"} 2.0' in metrics
    assert 'inference_request_duration_seconds_count{model="-bad"} 1.0' in metrics
