"""The sidecar's control socket: load with digest check, rollback, status, bad input."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from aiohttp.test_utils import TestClient

from helpers import add_version
from model_server.app import ModelServer


async def ask(path: Path, request: dict | bytes) -> dict:
    reader, writer = await asyncio.open_unix_connection(str(path))
    payload = request if isinstance(request, bytes) else json.dumps(request).encode()
    writer.write(payload + b"\n")
    await writer.drain()
    answer = json.loads(await reader.readline())
    writer.close()
    return answer


async def test_load_rollback_status(
    client: TestClient, model_server: ModelServer, repo, server_config
) -> None:
    sock = server_config.control_socket
    assert oct(sock.stat().st_mode & 0o777) == "0o600"
    v2 = repo[1]["v2"]
    answer = await ask(
        sock,
        {"op": "load", "model": "mlp", "version": "v2", "path": str(v2.path), "sha256": v2.sha256},
    )
    assert answer["ok"] and answer["from"] == "v1" and answer["to"] == "v2", answer
    status = await ask(sock, {"op": "status", "model": "mlp"})
    assert status["version"] == "v2" and status["loaded"] == ["v1", "v2"]
    answer = await ask(sock, {"op": "rollback", "model": "mlp"})
    assert answer["ok"] and answer["to"] == "v1" and answer["instant"]
    who = model_server.audit.events[-1]["who"]
    assert who.startswith("socket:uid=")


async def test_refusals(
    client: TestClient, model_server: ModelServer, repo, server_config, tmp_path: Path
) -> None:
    sock = server_config.control_socket
    v2, v3 = repo[1]["v2"], repo[1]["v3"]
    wrong_digest = await ask(
        sock,
        {"op": "load", "model": "mlp", "version": "v2", "path": str(v2.path), "sha256": v3.sha256},
    )
    assert not wrong_digest["ok"] and "sha256" in wrong_digest["error"]
    outside = add_version(tmp_path / "elsewhere", "mlp", "v5", seed=5)
    answer = await ask(
        sock,
        {
            "op": "load",
            "model": "mlp",
            "version": "v5",
            "path": str(outside.path),
            "sha256": outside.sha256,
        },
    )
    assert not answer["ok"] and answer["code"] == "forbidden"
    assert not (await ask(sock, b"not json"))["ok"]
    assert (await ask(sock, {"op": "explode", "model": "mlp"}))["code"] == "bad_request"
    assert (await ask(sock, {"op": "status", "model": "nope"}))["code"] == "model_not_found"
    assert model_server.manager.slot("mlp").current.version == "v1"  # type: ignore[union-attr]


async def test_http_and_socket_answer_swaps_with_the_same_fields(
    client: TestClient, server_config
) -> None:
    from conftest import ADMIN

    over_http = await (await client.post("/v1/reload?target_version=v2", headers=ADMIN)).json()
    over_socket = await ask(server_config.control_socket, {"op": "rollback", "model": "mlp"})
    assert over_http.pop("status") == "ok" and over_socket.pop("ok") is True
    assert set(over_http) == set(over_socket) == {"model", "from", "to", "duration_ms", "instant"}
    assert (over_http["to"], over_socket["to"]) == ("v2", "v1")
    health = await (await client.get("/v1/models/mlp/health")).json()
    assert health["versions"]["v1"] == {"state": "READY", "reason": "serving"}
    assert health["versions"]["v2"] == {"state": "READY", "reason": "retained for rollback"}
