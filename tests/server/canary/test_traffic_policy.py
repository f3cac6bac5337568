"""The traffic op, the per-request split between a stable version and its candidate, and
the pin header, against a real server (aiohttp's test server over TCP), its real control
socket and real ONNX models (issue 11, the server's side of canary analysis)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import numpy as np
import pytest
from aiohttp.test_utils import TestClient

from model_rollout_contract import canary
from model_rollout_contract.canary import PIN_HEADER, TrafficPolicy
from model_server.app import ModelServer
from model_server.config import ServerConfig, parse_args
from model_server.frontends.http.codec import HttpInferBody
from model_server.scheduling.traffic import Route, TrafficRouter
from tests.support.backends import RiggedBackend, serving
from tests.support.canary import batch, canary_of_v2, load_request, metrics, traffic
from tests.support.server import ask, binomial_bounds, infer_body, sample, which_version


async def test_the_traffic_op_sets_a_policy_and_answers_with_the_status(
    client: TestClient, model_server: ModelServer, repo, server_config
) -> None:
    sock = server_config.control_socket
    answer = await canary_of_v2(sock, repo, percent=10, shadow=20)
    held = {"stable": "v1", "candidate": "v2", "trafficPercent": 10, "shadowPercent": 20}
    assert answer == {"ok": True, "model": "mlp", "version": "v2",
                      "sha256": repo[1]["v2"].sha256, "loaded": ["v1", "v2"],
                      "policy": held}  # fmt: skip
    health = await (await client.get("/v1/models/mlp/health")).json()
    assert health["traffic"] == {"stable": "v1", "candidate": "v2", "trafficPercent": 10,
                                 "shadowPercent": 20}  # fmt: skip
    event = model_server.audit.events[-1]
    assert (event["action"], event["result"], event["version"], event["from_version"]) == (
        "traffic", "success", "v2", "v1")  # fmt: skip
    assert event["who"].startswith("socket:uid=") and '"trafficPercent":10' in event["detail"]
    events = len(model_server.audit.events)
    again = await ask(sock, traffic("v2", percent=10, shadow=20))  # a sidecar repeating it
    assert again == answer and len(model_server.audit.events) == events  # no-op, not audited
    cleared = await ask(sock, traffic(None, stable=None))
    assert cleared["ok"] and cleared["version"] == "v2"
    assert (await (await client.get("/v1/models/mlp/health")).json())["traffic"] is None
    assert model_server.audit.events[-1]["detail"] == "cleared"


async def test_a_policy_the_server_cannot_hold_is_refused_and_the_old_one_kept(
    client: TestClient, model_server: ModelServer, repo, server_config
) -> None:
    sock = server_config.control_socket
    not_loaded = await ask(sock, traffic("v2"))  # only v1 is loaded
    assert (not_loaded["ok"], not_loaded["code"]) == (False, "conflict"), not_loaded
    assert "'v2' is not serving" in not_loaded["error"]
    assert (await canary_of_v2(sock, repo, percent=30))["ok"]
    refusals = {
        "conflict": [traffic("v1", stable="v2"), traffic("v2", stable="v3")],
        "bad_request": [
            traffic("v2", stable="v2"),
            traffic("v2", percent=101),
            traffic("v2", shadow=-1),
            traffic("../v2"),
        ],
        "model_not_found": [{**traffic("v2"), "model": "nope"}],
    }
    for code, requests in refusals.items():
        for request in requests:
            answer = await ask(sock, request)
            assert (answer["ok"], answer["code"]) == (False, code), (request, answer)
    assert model_server.manager.slot("mlp").policy.traffic_percent == 30  # type: ignore[union-attr]
    failed = [e for e in model_server.audit.events if e["action"] == "traffic"]
    assert [e["result"] for e in failed].count("failure") == 4  # those that reached a model


async def test_requests_are_split_by_the_policy_per_request(
    repo, server_config: ServerConfig
) -> None:
    n, percent = 400, 30
    async with serving(server_config, traffic_seed=11) as (client, _server):
        await canary_of_v2(server_config.control_socket, repo, percent=percent)
        rng = np.random.default_rng(5)
        answered: Counter[str] = Counter()
        for _ in range(n):  # one kept-alive connection: the split is per request
            x = batch(rng)
            response = await client.post("/v2/models/mlp/infer", json=infer_body(x))
            assert response.status == 200
            answered[which_version(repo[1], x, await response.json())] += 1
        low, high = binomial_bounds(n, percent / 100)
        assert low <= answered["v2"] <= high, (answered, (low, high))
        assert answered["v1"] + answered["v2"] == n
        found = await metrics(client)
        for version in ("v1", "v2"):
            labels = {"model": "mlp", "version": version}
            assert sample(found, canary.REQUESTS, code="200", **labels) == answered[version]
            assert sample(found, f"{canary.LATENCY}_count", **labels) == answered[version]
            assert sample(found, canary.OUTPUT_VALUES, **labels) == answered[version] * 3 * 4


async def test_the_pin_header_picks_a_loaded_version_and_404s_another(
    client: TestClient, repo, server_config
) -> None:
    x = np.ones((2, 8), dtype=np.float32)
    assert (await ask(server_config.control_socket, load_request(repo[1]["v2"])))["ok"]
    for pinned in ("v1", "v2"):  # with no policy: v2 serves, v1 is retained
        response = await client.post(
            "/v2/models/mlp/infer", json=infer_body(x), headers={PIN_HEADER: pinned}
        )
        assert which_version(repo[1], x, await response.json()) == pinned
    await ask(server_config.control_socket, traffic("v2", percent=100))
    response = await client.post(
        "/v2/models/mlp/infer", json=infer_body(x), headers={PIN_HEADER: "v1"}
    )
    assert which_version(repo[1], x, await response.json()) == "v1"  # the pin beats the policy
    for pinned, status, code, says in (
        ("v3", 404, "version_not_found", "no version 'v3' loaded (loaded: ['v1', 'v2'])"),
        ("a/b", 400, "bad_request", PIN_HEADER),
    ):
        response = await client.post(
            "/v2/models/mlp/infer", json=infer_body(x), headers={PIN_HEADER: pinned}
        )
        body = await response.json()
        assert (response.status, body["code"]) == (status, code), body
        assert says in body["error"], body


async def test_a_swap_clears_the_policy_and_no_request_fails_meanwhile(
    client: TestClient, model_server: ModelServer, repo, server_config
) -> None:
    sock = server_config.control_socket
    slot = model_server.manager.slot("mlp")
    await canary_of_v2(sock, repo, percent=50)
    failures: list[int] = []
    done = asyncio.Event()

    async def load() -> Counter[str]:
        seen: Counter[str] = Counter()
        rng = np.random.default_rng(1)
        while not done.is_set():
            x = batch(rng)
            response = await client.post("/v2/models/mlp/infer", json=infer_body(x))
            if response.status != 200:
                failures.append(response.status)
                continue
            seen[which_version(repo[1], x, await response.json())] += 1
        return seen

    workers = [asyncio.create_task(load()) for _ in range(6)]
    await asyncio.sleep(0.05)  # let requests run under the policy
    assert (await ask(sock, {"op": "rollback", "model": "mlp", "version": "v1"}))["ok"]
    assert slot.policy is None  # a rollback to the stable version ends the canary
    await asyncio.sleep(0.05)
    done.set()
    seen = sum((await asyncio.gather(*workers)), Counter())
    assert failures == [] and seen["v1"] > 0

    assert (await ask(sock, load_request(repo[1]["v2"])))["instant"]  # v2 serves again
    assert (await ask(sock, traffic("v2", percent=50)))["ok"]
    slot.evict(slot.get("v1"), "evicted for the memory budget")  # type: ignore[arg-type]
    assert slot.policy is None  # its stable version left memory
    assert (await ask(sock, traffic("v2", percent=50)))["code"] == "conflict"
    assert (await ask(sock, load_request(repo[1]["v3"])))["ok"]
    x = np.ones((1, 8), dtype=np.float32)
    for _ in range(20):  # no request goes to a version the policy named
        answer = await (await client.post("/v2/models/mlp/infer", json=infer_body(x))).json()
        assert answer["model_version"] == "v3"


async def test_a_request_under_a_policy_holds_its_version_until_it_ends(
    repo, server_config: ServerConfig
) -> None:
    """The stable v1 answers a request held at a gate while v3's load evicts v1
    (retain 2): v1 is unloaded (its series gone), but its engine stays open until the
    request ends, and the request is answered by v1."""
    backend = RiggedBackend()
    async with serving(server_config, backend) as (client, server):
        sock = server_config.control_socket
        await canary_of_v2(sock, repo, percent=0)
        backend.gate("v1").clear()
        x = np.ones((1, 8), dtype=np.float32)
        held = asyncio.create_task(client.post("/v2/models/mlp/infer", json=infer_body(x)))
        while backend.waiting["v1"] == 0:
            await asyncio.sleep(0.01)
        assert (await ask(sock, load_request(repo[1]["v3"])))["ok"]
        slot = server.manager.slot("mlp")
        assert "v1" not in [v.version for v in slot.loaded()] and slot.policy is None
        assert "v1" not in backend.closed  # still running a request
        found = await metrics(client)
        assert not [key for key in found if ("version", "v1") in key[1]]
        backend.gate("v1").set()
        response = await held
        assert which_version(repo[1], x, await response.json()) == "v1"
        assert backend.closed == ["v1"]


async def test_a_request_its_client_gave_up_on_is_not_the_versions_error(
    repo, server_config: ServerConfig
) -> None:
    """A call cancelled while its version runs (a gRPC deadline, a client gone) is
    counted by the server as 499, and never as a 5xx in the series a canary is judged
    on: before, it counted as the version's 500."""
    backend = RiggedBackend()
    async with serving(server_config, backend) as (client, server):
        backend.gate("v1").clear()
        x = np.ones((1, 8), dtype=np.float32)
        body = HttpInferBody(server.codec, memoryview(json.dumps(infer_body(x)).encode()))
        call = asyncio.create_task(server.plane.infer("mlp", "mlp", body))
        while backend.waiting["v1"] == 0:
            await asyncio.sleep(0.01)
        call.cancel()
        backend.gate("v1").set()
        with pytest.raises(asyncio.CancelledError):
            await call
        found = await metrics(client)
        assert sample(found, "model_server_inference_requests_total", model="mlp", code="499") == 1
        failed = [k for k in found if k[0] == canary.REQUESTS and ("code", "500") in k[1]]
        assert all(found[k] == 0 for k in failed), failed


class StaleRouter(TrafficRouter):
    """Routes every request as a policy would that named ``version``, as happens to a
    request routed just before that version left memory (a large body decodes in a
    worker process meanwhile)."""

    def __init__(self, version: str) -> None:
        super().__init__()
        self.version = version

    def route(self, policy: TrafficPolicy | None, pinned: str | None = None) -> Route:
        return super().route(policy, pinned) if pinned else Route(self.version)


async def test_a_request_routed_to_a_version_gone_since_is_answered_by_the_serving_one(
    client: TestClient, model_server: ModelServer, repo
) -> None:
    model_server.plane.router = StaleRouter("v2")  # v2 is not loaded
    x = np.ones((1, 8), dtype=np.float32)
    response = await client.post("/v2/models/mlp/infer", json=infer_body(x))
    assert response.status == 200
    assert which_version(repo[1], x, await response.json()) == "v1"


def test_the_canary_flags_parse() -> None:
    config = parse_args(["--repository", "/m", "--traffic-seed", "7",
                         "--shadow-max-in-flight", "3"])  # fmt: skip
    assert (config.traffic_seed, config.shadow_max_in_flight) == (7, 3)
    assert parse_args(["--repository", "/m"]).traffic_seed is None
    with pytest.raises(SystemExit):
        parse_args(["--repository", "/m", "--shadow-max-in-flight", "0"])
