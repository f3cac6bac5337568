"""The HTTP API as a client sees it: v2 inference, health, control endpoints, errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import yaml
from aiohttp.test_utils import TestClient, TestServer

from model_server.app import SERVER, ModelServer
from model_server.config import ServerConfig
from tests.support.server import ADMIN, add_version, infer_body, which_version, write_manifest

X = np.arange(16, dtype=np.float32).reshape(2, 8) / 10


async def test_infer_returns_v1_outputs(client: TestClient, repo) -> None:
    response = await client.post("/v2/models/mlp/infer", json=infer_body(X))
    assert response.status == 200
    answer = await response.json()
    assert answer["model_version"] == "v1"
    assert which_version(repo[1], X, answer) == "v1"
    assert answer["outputs"][0]["shape"] == [2, 4]


async def test_answers_to_requests_without_an_id_get_distinct_ids(client: TestClient) -> None:
    ids = []
    for _ in range(3):
        response = await client.post("/v2/models/mlp/infer", json=infer_body(X))
        assert response.status == 200
        ids.append((await response.json())["id"])
    assert len(set(ids)) == 3 and all(ids)


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
    write_manifest(bad / "model.onnx")  # its bytes as described: they fail to load
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
    assert 'model_server_reload_failure_total{model="mlp",reason="load_refused"} 2.0' in metrics
    assert 'model_server_version_serving{model="mlp",version="v1"} 1.0' in metrics
    audit = await (await client.get("/v1/audit", headers=ADMIN)).json()
    failures = [e for e in audit["events"] if e["result"] == "failure"]
    assert [e["version"] for e in failures] == ["v4", "v3"]
    assert all(e["who"] == "admin" and e["error"] for e in failures)


async def test_metrics_after_a_swap(client: TestClient) -> None:
    await client.post("/v2/models/mlp/infer", json=infer_body(X))
    await client.post("/v1/reload?target_version=v2", headers=ADMIN)
    text = await (await client.get("/metrics")).text()
    assert 'model_server_reload_success_total{model="mlp"} 2.0' in text  # start-up load + reload
    assert 'model_server_version_serving{model="mlp",version="v2"} 1.0' in text
    assert 'model_server_version_serving{model="mlp",version="v1"} 0.0' in text
    assert 'model_server_load_duration_seconds_count{model="mlp"} 2.0' in text
    assert 'model_server_inference_request_duration_seconds_count{model="mlp"} 1.0' in text
    assert 'model_server_inference_requests_in_flight{model="mlp"} 0.0' in text


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
    assert 'model_server_inference_requests_total{code="400",model="(unknown)"} 1.0' in metrics
    assert 'model_server_inference_requests_total{code="400",model="mlp"} 1.0' in metrics
    assert 'model_server_inference_requests_total{code="200",model="mlp"} 1.0' in metrics
    assert 'model_server_inference_request_duration_seconds_count{model="mlp"} 2.0' in metrics
    assert 'model_server_inference_request_duration_seconds_count{model="(unknown)"} 1.0' in metrics


# --- the whole KServe v2 protocol over HTTP (issue 12) -------------------------------


async def test_server_metadata(client: TestClient) -> None:
    response = await client.get("/v2")
    assert response.status == 200
    assert (await response.json())["extensions"] == [
        "binary_tensor_data",
        "model_configuration",
        "model_repository",
        "statistics",
    ]


async def test_every_model_route_has_a_versioned_form(client: TestClient, repo) -> None:
    assert (await client.post("/v1/reload?target_version=v2", headers=ADMIN)).status == 200
    for version in ("v1", "v2"):  # v1 retained, v2 serving
        base = f"/v2/models/mlp/versions/{version}"
        assert (await (await client.get(f"{base}/ready")).json())["ready"] is True
        meta = await (await client.get(base)).json()
        assert meta["versions"] == ["v1", "v2"]
        config = await (await client.get(f"{base}/config")).json()
        assert config["input"][0]["dims"] == [-1, 8]
        answer = await (await client.post(f"{base}/infer", json=infer_body(X))).json()
        assert which_version(repo[1], X, answer) == version
        stats = await (await client.get(f"{base}/stats")).json()
        assert [s["version"] for s in stats["model_stats"]] == [version]
    for path, method in (
        ("", "GET"),
        ("/ready", "GET"),
        ("/config", "GET"),
        ("/stats", "GET"),
        ("/infer", "POST"),
    ):
        response = await client.request(
            method, f"/v2/models/mlp/versions/v3{path}", json=infer_body(X)
        )
        assert response.status == 404, path  # on disk, not loaded
        assert (await response.json())["code"] == "version_not_found", path
    response = await client.get("/v2/models/mlp/versions/..%2Fetc/ready")
    assert response.status == 400


async def test_a_route_and_a_pin_naming_two_versions_are_refused(client: TestClient) -> None:
    await client.post("/v1/reload?target_version=v2", headers=ADMIN)
    response = await client.post(
        "/v2/models/mlp/versions/v1/infer", json=infer_body(X), headers={"X-Model-Version": "v2"}
    )
    assert response.status == 400 and "X-Model-Version" in (await response.json())["error"]


async def test_unload_and_load_again(client: TestClient, model_server: ModelServer, repo) -> None:
    slot = model_server.manager.slot("mlp")
    await client.post("/v1/reload?target_version=v2", headers=ADMIN)
    response = await client.post("/v2/repository/models/mlp/unload", headers=ADMIN)
    body = await response.json()
    assert response.status == 200 and body["unloaded"] == ["v1", "v2"], body
    assert slot.loaded() == [] and {"v1", "v2"} <= set(slot.closed_versions)
    assert (await client.get("/v2/models/mlp/ready")).status == 503
    assert (await client.get("/v2/health/ready")).status == 200  # unloaded on request
    response = await client.post("/v2/models/mlp/infer", json=infer_body(X))
    assert response.status == 503 and (await response.json())["code"] == "not_ready"
    again = await client.post("/v2/repository/models/mlp/unload", headers=ADMIN)
    assert again.status == 200 and (await again.json())["unloaded"] == []

    response = await client.post("/v2/repository/models/mlp/load", headers=ADMIN)
    body = await response.json()
    assert response.status == 200 and body["to"] == "v3", body  # no CURRENT: the newest
    answer = await (await client.post("/v2/models/mlp/infer", json=infer_body(X))).json()
    assert which_version(repo[1], X, answer) == "v3"
    audit = await (await client.get("/v1/audit", headers=ADMIN)).json()
    assert [(e["action"], e["result"]) for e in audit["events"][-3:]] == [
        ("unload", "success"),
        ("unload", "noop"),
        ("load", "success"),
    ]


async def test_a_model_that_failed_to_load_at_start_holds_readiness_back(
    server_config, repo
) -> None:
    """Readiness still waits for a model that never loaded: only an unload on request
    lets it go."""
    (repo[0] / "mlp" / "v1" / "model.onnx").write_bytes(b"not onnx")
    async with TestClient(TestServer(ModelServer(server_config).make_app())) as client:
        assert (await client.get("/v2/health/ready")).status == 503


async def test_repository_requests_are_checked(client: TestClient, repo) -> None:
    assert (await client.post("/v2/repository/index")).status == 401
    assert (await client.post("/v2/repository/models/mlp/unload")).status == 401
    for path, body in (
        ("/v2/repository/index", b"[1]"),
        ("/v2/repository/index", b'{"ready": "yes"}'),
        ("/v2/repository/models/mlp/load", b"{not json"),
        ("/v2/repository/models/mlp/load", b'{"parameters": {"file:1/model.onnx": "AAAA"}}'),
        ("/v2/repository/models/mlp/unload", b'{"parameters": {"unload_dependents": 1}}'),
        ("/v2/repository/models/mlp/unload", b'{"parameters": {"force": true}}'),
    ):
        response = await client.post(path, data=body, headers=ADMIN)
        assert response.status == 400, (path, body)
        assert (await response.json())["code"] == "bad_request"
    assert (await client.get("/v2/models/mlp/ready")).status == 200  # none of that unloaded it
    response = await client.post(
        "/v2/repository/models/mlp/unload",
        json={"parameters": {"unload_dependents": False}},
        headers=ADMIN,
    )
    assert response.status == 200
    current = repo[0] / "mlp" / "CURRENT"
    current.write_text("../v1")
    response = await client.post("/v2/repository/models/mlp/load", headers=ADMIN)
    assert response.status == 400, await response.text()
    current.unlink()
    current.symlink_to(repo[0] / "elsewhere")  # a link in CURRENT's place is never followed
    (repo[0] / "elsewhere").write_text("v2")
    response = await client.post("/v2/repository/models/mlp/load", headers=ADMIN)
    assert response.status == 403, await response.text()
    index = await (
        await client.post("/v2/repository/index", json={"ready": True}, headers=ADMIN)
    ).json()
    assert index == []


async def test_statistics_start_from_zero_for_a_version_loaded_again(client: TestClient) -> None:
    await client.post("/v2/models/mlp/infer", json=infer_body(X))
    stats = await (await client.get("/v2/models/mlp/stats")).json()
    assert stats["model_stats"][0]["inference_count"] == 1
    await client.post("/v2/repository/models/mlp/unload", headers=ADMIN)
    assert (await (await client.get("/v2/models/mlp/stats")).json()) == {"model_stats": []}
    (Path(client.app[SERVER].repository.root) / "mlp" / "CURRENT").write_text("v1")
    await client.post("/v2/repository/models/mlp/load", headers=ADMIN)
    [stat] = (await (await client.get("/v2/models/stats")).json())["model_stats"]
    assert (stat["version"], stat["inference_count"]) == ("v1", 0)


async def test_tenants_see_their_own_statistics_and_the_admin_names_them(tmp_path) -> None:
    root = tmp_path / "models"
    add_version(root, "acme/mlp", "v1", seed=11)
    add_version(root, "globex/mlp", "v1", seed=22)
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(
        yaml.safe_dump(
            {
                "tenants": {
                    "acme": {"api_key": "key-acme", "models": ["mlp"]},
                    "globex": {"api_key": "key-globex", "models": ["mlp"]},
                }
            }
        )
    )
    token = tmp_path / "token"
    token.write_text(ADMIN["Authorization"].removeprefix("Bearer "))
    config = ServerConfig(repository=root, tenants_file=tenants, admin_token_file=token)
    acme = {"X-API-Key": "key-acme"}
    async with TestClient(TestServer(ModelServer(config).make_app())) as client:
        await client.post("/v2/models/mlp/infer", json=infer_body(X), headers=acme)
        stats = await (await client.get("/v2/models/stats", headers=acme)).json()
        assert [(s["name"], s["inference_count"]) for s in stats["model_stats"]] == [("mlp", 1)]
        other = await (
            await client.get("/v2/models/stats", headers={"X-API-Key": "key-globex"})
        ).json()
        assert [s["inference_count"] for s in other["model_stats"]] == [0]
        assert (await client.get("/v2/models/stats")).status == 401
        index = await (await client.post("/v2/repository/index", headers=ADMIN)).json()
        assert [e["name"] for e in index] == ["acme/mlp", "globex/mlp"]
        # a tenant's model, as tritonclient sends "acme/mlp" (unescaped) or escaped
        for path in ("acme/mlp", "acme%2Fmlp"):
            response = await client.post(f"/v2/repository/models/{path}/unload", headers=ADMIN)
            assert response.status == 200, await response.text()
        assert (await client.get("/v2/models/mlp/ready", headers=acme)).status == 503
        ready = await client.get("/v2/models/mlp/ready", headers={"X-API-Key": "key-globex"})
        assert ready.status == 200


async def test_a_load_says_where_its_time_went(client: TestClient) -> None:
    response = await client.post("/v1/reload?target_version=v2", headers=ADMIN)
    body = await response.json()
    stages = body["stages_ms"]
    # the server's own timing of each stage, and what lay between them, add up to the load
    assert {"read_hash", "hash_wait", "warm_up", "swap", "other"} <= set(stages)
    assert {"session", "row_estimate"} & set(stages)  # the ONNX Runtime backend's own
    assert all(ms >= 0 for ms in stages.values())
    assert abs(sum(stages.values()) - body["duration_ms"]) < 0.05
    text = await (await client.get("/metrics")).text()
    for stage in stages:
        assert (
            f'model_server_load_stage_duration_seconds_count{{model="mlp",stage="{stage}"}}' in text
        )
    rollback = await (await client.post("/v1/rollback", headers=ADMIN)).json()
    assert "stages_ms" not in rollback  # a pointer swap: no load, no stages
