"""A restarted server resumes the traffic policy of its volume (the traffic file) from its
first answer, logs one it cannot use and serves the current version (issue 11)."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
from tritonclient.grpc.aio import InferenceServerClient

from model_rollout_contract import canary
from model_rollout_contract.canary import TrafficPolicy
from model_rollout_contract.layout import CURRENT_FILE, TRAFFIC_FILE
from model_server.config import ModelSpec, ServerConfig
from tests.support.backends import serving
from tests.support.canary import GRPC_ADMIN, metrics
from tests.support.server import ADMIN, infer_body, sample, which_version


def on_disk(repo, current: str, policy: str | None) -> None:  # type: ignore[no-untyped-def]
    """The volume as a canary pod's sidecar leaves it: CURRENT and TRAFFIC."""
    model_dir = repo[0] / "mlp"
    (model_dir / CURRENT_FILE).write_text(f"{current}\n")
    if policy is not None:
        (model_dir / TRAFFIC_FILE).write_text(policy)


async def test_a_restarted_server_splits_by_its_traffic_file_from_its_first_answer(
    repo, server_config: ServerConfig
) -> None:
    """CURRENT names the candidate v2 and TRAFFIC a policy giving it no request: the
    server loads v1, then v2 under the policy, before it is ready; so its first
    answers, and every one after, are v1's, and the shadow runs go to v2."""
    policy = TrafficPolicy("v1", "v2", traffic_percent=0, shadow_percent=100)
    on_disk(repo, "v2", policy.to_annotation() + "\n")
    spec = [ModelSpec("mlp")]  # as the pod runs it: CURRENT says which version
    async with serving(server_config, models=spec, shadow_max_in_flight=20) as (client, server):
        assert (await client.get("/v2/health/ready")).status == 200
        x = np.ones((2, 8), dtype=np.float32)
        for _ in range(20):
            answer = await (await client.post("/v2/models/mlp/infer", json=infer_body(x))).json()
            assert which_version(repo[1], x, answer) == "v1"
        health = await (await client.get("/v1/models/mlp/health")).json()
        await server.shadows.idle()
        found = await metrics(client)
    assert (health["version"], health["retained"]) == ("v2", ["v1"])
    assert health["traffic"] == policy.to_json()
    assert sample(found, canary.SHADOW_REQUESTS, model="mlp", version="v2") == 20
    startup = [(e["action"], e["version"]) for e in server.audit.events if e["who"] == "startup"]
    assert startup == [("load", "v1"), ("traffic", "v2"), ("load", "v2")]


def _link_outside(repo) -> None:  # type: ignore[no-untyped-def]
    outside = repo[0].parent / "planted-policy"
    outside.write_text(TrafficPolicy("v1", "v2").to_annotation())
    os.symlink(outside, repo[0] / "mlp" / TRAFFIC_FILE)


def _a_directory(repo) -> None:  # type: ignore[no-untyped-def]
    (repo[0] / "mlp" / TRAFFIC_FILE).mkdir()


def _stable_corrupt(repo) -> None:  # type: ignore[no-untyped-def]
    (repo[0] / "mlp" / TRAFFIC_FILE).write_text(TrafficPolicy("v1", "v2").to_annotation())
    repo[1]["v1"].path.write_bytes(b"not an onnx model")  # its manifest's digest fails


@pytest.mark.parametrize(
    "policy, says",
    [
        ("{not json", "not JSON"),
        ("[" * 60_000, "not JSON"),  # nested deeper than the parser goes
        ('{"stable": "v1"}', "names its stable and candidate"),
        ('{"stable": "v9", "candidate": "v2"}', "stable version is not on disk"),
        ('{"stable": "v1", "candidate": "v3"}', "its candidate is not v2"),
        ('{"stable": "v2", "candidate": "v2"}', "between one version and itself"),
        (_link_outside, "symbolic link"),
        (_a_directory, "not a regular file"),
        (_stable_corrupt, "could not load mlp:v1, the stable version"),
        (" " * (1 << 20) + "{}", "more than 65536"),  # refused unread, not parsed
    ],
)
async def test_a_traffic_file_that_cannot_be_used_is_logged_and_the_server_serves_current(
    repo, server_config: ServerConfig, caplog: pytest.LogCaptureFixture, policy, says: str
) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO, logger="model_server")
    if callable(policy):
        on_disk(repo, "v2", None)
        policy(repo)
    else:
        on_disk(repo, "v2", policy)
    async with serving(server_config, models=[ModelSpec("mlp")]) as (client, _server):
        assert (await client.get("/v2/health/ready")).status == 200
        health = await (await client.get("/v1/models/mlp/health")).json()
        x = np.ones((1, 8), dtype=np.float32)
        answer = await (await client.post("/v2/models/mlp/infer", json=infer_body(x))).json()
    assert (health["version"], health["retained"], health["traffic"]) == ("v2", [], None)
    assert which_version(repo[1], x, answer) == "v2"
    logged = [r.getMessage() for r in caplog.records if TRAFFIC_FILE in r.getMessage()]
    assert any(says in message for message in logged), logged


async def test_a_traffic_file_is_not_applied_to_a_version_named_by_the_flags(
    repo, server_config: ServerConfig
) -> None:
    """``--model mlp=v2`` is not CURRENT: the TRAFFIC beside CURRENT is not its policy."""
    on_disk(repo, "v1", TrafficPolicy("v1", "v2").to_annotation())
    async with serving(server_config, models=[ModelSpec("mlp", "v2")]) as (client, _server):
        health = await (await client.get("/v1/models/mlp/health")).json()
    assert (health["version"], health["retained"], health["traffic"]) == ("v2", [], None)


async def test_an_unloaded_canary_loaded_again_resumes_its_traffic_file(
    repo, server_config: ServerConfig
) -> None:
    """The repository extension's unload, then load, comes back as a restart does: v1,
    then v2 under TRAFFIC's policy (which gives v2 no request), not v2 alone; over HTTP
    and over gRPC (tritonclient's unload_model/load_model), the same DataPlane call."""
    policy = TrafficPolicy("v1", "v2", traffic_percent=0)
    on_disk(repo, "v2", policy.to_annotation() + "\n")
    x = np.ones((2, 8), dtype=np.float32)
    changes = {"models": [ModelSpec("mlp")], "grpc_port": 0}
    async with serving(server_config, **changes) as (client, server):
        assert server.grpc is not None and server.grpc.port
        grpc_client = InferenceServerClient(f"127.0.0.1:{server.grpc.port}")

        async def over_http(op: str) -> None:
            response = await client.post(f"/v2/repository/models/mlp/{op}", headers=ADMIN)
            assert response.status == 200, await response.text()

        async def over_grpc(op: str) -> None:  # tritonclient raises for a refusal
            call = grpc_client.load_model if op == "load" else grpc_client.unload_model
            await call("mlp", headers=GRPC_ADMIN)

        try:
            for transport, repository_call in (("http", over_http), ("grpc", over_grpc)):
                await repository_call("unload")
                health = await (await client.get("/v1/models/mlp/health")).json()
                assert health["version"] is None, transport
                await repository_call("load")
                health = await (await client.get("/v1/models/mlp/health")).json()
                assert (health["version"], health["retained"]) == ("v2", ["v1"]), transport
                assert health["traffic"] == policy.to_json(), transport
                for _ in range(10):
                    response = await client.post("/v2/models/mlp/infer", json=infer_body(x))
                    assert which_version(repo[1], x, await response.json()) == "v1", transport
        finally:
            await grpc_client.close()
    admin = [(e["action"], e["version"], e["source"]) for e in server.audit.events
             if e["who"] == "admin"]  # fmt: skip
    assert admin == [
        (action, version, source)
        for source in ("http", "grpc")
        for action, version in (("unload", "v2"), ("load", "v1"), ("traffic", "v2"),
                                ("load", "v2"))
    ]  # fmt: skip


async def test_loading_a_canary_that_serves_under_its_traffic_file_changes_nothing(
    repo, server_config: ServerConfig
) -> None:
    """A repository load of a model already serving CURRENT under TRAFFIC's policy swaps
    nothing: its stable version, loaded already, is not swapped in on the way."""
    policy = TrafficPolicy("v1", "v2", traffic_percent=0)
    on_disk(repo, "v2", policy.to_annotation() + "\n")
    async with serving(server_config, models=[ModelSpec("mlp")]) as (client, server):
        response = await client.post("/v2/repository/models/mlp/load", headers=ADMIN)
        assert response.status == 200, await response.text()
        assert (await response.json())["from"] == "v2"
        health = await (await client.get("/v1/models/mlp/health")).json()
    assert (health["version"], health["retained"]) == ("v2", ["v1"])
    assert health["traffic"] == policy.to_json()
    admin = [(e["action"], e["version"], e["result"]) for e in server.audit.events
             if e["who"] == "admin"]  # fmt: skip
    assert admin == [("load", "v2", "noop")]
