"""Issue 11, the server's side of canary analysis, against a real server (aiohttp's test
server over TCP), its real control socket and real ONNX models: the traffic op, the
per-request split, the pin header, shadow runs, the per-version series (parsed with
prometheus_client's parser) and golden sets."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from tritonclient.grpc.aio import InferenceServerClient

from model_rollout_contract import canary
from model_rollout_contract.canary import PIN_HEADER, TrafficPolicy
from model_rollout_contract.layout import CURRENT_FILE, TRAFFIC_FILE
from model_rollout_e2e.onnx_models import INPUT_NAME, OUTPUT_NAME
from model_server.app import ModelServer
from model_server.backends.base import Engine, ModelFile
from model_server.backends.onnxruntime_backend import OnnxRuntimeBackend
from model_server.config import ModelSpec, ServerConfig, parse_args
from model_server.frontends.http.codec import HttpInferBody
from model_server.observability.version_metrics import SHADOW_SKIPPED
from model_server.protocol.tensor_spec import TensorSpec
from model_server.protocol.v2_codec import InferenceRequest
from model_server.scheduling.traffic import Route, TrafficRouter
from tests.support.backends import RiggedBackend, serving
from tests.support.server import (
    ADMIN,
    ADMIN_TOKEN,
    Version,
    add_golden,
    add_version,
    ask,
    binomial_bounds,
    golden_npz,
    infer_body,
    output_of,
    sample,
    samples,
    which_version,
)

GRPC_ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}  # gRPC metadata keys: lower case


def load_request(v: Version) -> dict[str, str]:
    return {"op": "load", "model": "mlp", "version": v.name, "path": str(v.path),
            "sha256": v.sha256}  # fmt: skip


def traffic(candidate: str | None, stable: str | None = "v1", percent: int = 0,
            shadow: int = 0) -> dict[str, object]:  # fmt: skip
    return {"op": "traffic", "model": "mlp", "stable": stable, "candidate": candidate,
            "traffic_percent": percent, "shadow_percent": shadow}  # fmt: skip


def load_with_policy(
    v: Version, stable: str = "v1", percent: int = 0, shadow: int = 0
) -> dict[str, object]:
    """A canary's load: ``v`` and the policy with it as its candidate, in one op."""
    return {**traffic(v.name, stable, percent, shadow), **load_request(v)}


async def canary_of_v2(sock: Path, repo, percent: int = 0, shadow: int = 0) -> dict:  # type: ignore[no-untyped-def,type-arg]
    """v2 loaded beside v1 (now retained) and a policy splitting between them."""
    assert (await ask(sock, load_request(repo[1]["v2"])))["ok"]
    return await ask(sock, traffic("v2", percent=percent, shadow=shadow))


async def metrics(client: TestClient) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return samples(await (await client.get("/metrics")).text())


def batch(rng: np.random.Generator, rows: int = 3) -> np.ndarray:
    return rng.standard_normal((rows, 8)).astype(np.float32)


# --- the traffic op ---------------------------------------------------------------------


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


# --- the split, and the pin header ------------------------------------------------------


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


# --- shadow runs ------------------------------------------------------------------------


async def test_shadow_runs_measure_the_drift_between_two_known_models(
    repo, server_config: ServerConfig
) -> None:
    n = 40
    # room for every run at once: none is skipped however the threads are scheduled
    async with serving(server_config, traffic_seed=3, shadow_max_in_flight=n) as (client, server):
        await canary_of_v2(server_config.control_socket, repo, percent=0, shadow=100)
        v1, v2 = repo[1]["v1"], repo[1]["v2"]
        rng = np.random.default_rng(9)
        drifts, agreed = [], 0
        for _ in range(n):
            x = batch(rng, rows=4)
            answer = await (await client.post("/v2/models/mlp/infer", json=infer_body(x))).json()
            assert which_version(repo[1], x, answer) == "v1"  # the client gets the stable one
            a, b = v1.expected(x), v2.expected(x)
            drifts.append(float(np.abs(a - b).max()))
            agreed += int(np.count_nonzero(a.argmax(axis=1) == b.argmax(axis=1)))
        await server.shadows.idle()
        found = await metrics(client)
    labels = {"model": "mlp", "version": "v2"}
    assert sample(found, canary.SHADOW_REQUESTS, **labels) == n
    assert sample(found, SHADOW_SKIPPED, **labels) == 0
    assert sample(found, canary.REQUESTS, code="200", **labels) == n  # counted for v2
    assert sample(found, f"{canary.LATENCY}_count", **labels) == 0  # it answered no client
    assert sample(found, f"{canary.SHADOW_LATENCY}_count", **labels) == n
    assert sample(found, f"{canary.SHADOW_DRIFT}_sum", **labels) == pytest.approx(sum(drifts))
    for bound in canary.DRIFT_BUCKETS:
        expected = sum(d <= bound for d in drifts)
        assert sample(found, f"{canary.SHADOW_DRIFT}_bucket", le=str(bound), **labels) == expected
    assert sample(found, canary.SHADOW_ARGMAX_COMPARED, **labels) == n * 4
    assert sample(found, canary.SHADOW_ARGMAX_AGREED, **labels) == agreed
    assert 0 < agreed < n * 4  # two different models: the check can tell
    assert sample(found, f"{canary.SHADOW_DRIFT}_count", model="mlp", version="v1") == 0


async def test_shadow_runs_wait_for_no_client_and_are_bounded(
    repo, server_config: ServerConfig
) -> None:
    """The candidate is stuck at a gate: the client's requests are all answered anyway,
    one shadow run is in flight (the bound) and the others are skipped and counted."""
    backend = RiggedBackend()
    async with serving(server_config, backend, shadow_max_in_flight=1) as (client, server):
        await canary_of_v2(server_config.control_socket, repo, shadow=100)
        backend.gate("v2").clear()
        x = np.ones((2, 8), dtype=np.float32)
        for _ in range(5):
            response = await client.post("/v2/models/mlp/infer", json=infer_body(x))
            assert which_version(repo[1], x, await response.json()) == "v1"
        while backend.waiting["v2"] == 0:
            await asyncio.sleep(0.01)
        assert server.shadows.in_flight == 1
        found = await metrics(client)
        labels = {"model": "mlp", "version": "v2"}
        assert sample(found, SHADOW_SKIPPED, **labels) == 4
        backend.gate("v2").set()
        await server.shadows.idle()
        found = await metrics(client)
        assert sample(found, canary.SHADOW_REQUESTS, **labels) == 1
        assert sample(found, f"{canary.SHADOW_DRIFT}_count", **labels) == 1


async def test_a_shadow_run_over_the_candidates_row_limit_is_not_run(
    repo, server_config: ServerConfig
) -> None:
    """The candidate's own bound on rows holds for shadow runs too: a wider candidate
    takes fewer rows than the stable version, and a request of more is refused for it as
    it would be live (the client's 400, not the candidate's 500), never run on it (before,
    the shadow ran the 40 rows on the candidate)."""
    wide = add_version(repo[0], "mlp", "v4", seed=4, hidden=16384, depth=2)
    async with serving(server_config, request_memory_mb=4, shadow_max_in_flight=4) as (
        client,
        server,
    ):
        sock = server_config.control_socket
        assert (await ask(sock, load_request(wide)))["ok"]
        assert (await ask(sock, traffic("v4", shadow=100)))["ok"]
        x = np.ones((40, 8), dtype=np.float32)  # the candidate takes 31 rows at most
        response = await client.post("/v2/models/mlp/infer", json=infer_body(x))
        assert which_version(repo[1], x, await response.json()) == "v1"
        await server.shadows.idle()
        found = await metrics(client)
    labels = {"model": "mlp", "version": "v4"}
    assert sample(found, canary.SHADOW_REQUESTS, **labels) == 1
    assert sample(found, canary.REQUESTS, code="400", **labels) == 1
    assert sample(found, canary.REQUESTS, code="200", **labels) == 0
    assert sample(found, canary.OUTPUT_VALUES, **labels) == 0  # it never ran


async def test_a_candidate_failing_in_shadow_counts_as_its_error_and_never_the_clients(
    repo, server_config: ServerConfig
) -> None:
    backend = RiggedBackend()
    backend.fails["v2"] = lambda feeds: bool(feeds[INPUT_NAME][0, 0] < 0)
    async with serving(server_config, backend, shadow_max_in_flight=30) as (client, server):
        await canary_of_v2(server_config.control_socket, repo, shadow=100)
        rng = np.random.default_rng(2)
        failing = 0
        for _ in range(30):
            x = batch(rng)
            failing += int(x[0, 0] < 0)
            response = await client.post("/v2/models/mlp/infer", json=infer_body(x))
            assert which_version(repo[1], x, await response.json()) == "v1"
        await server.shadows.idle()
        found = await metrics(client)
    labels = {"model": "mlp", "version": "v2"}
    assert 0 < failing < 30
    assert sample(found, canary.REQUESTS, code="500", **labels) == failing
    assert sample(found, canary.REQUESTS, code="200", **labels) == 30 - failing
    assert sample(found, canary.REQUESTS, code="200", model="mlp", version="v1") == 30
    assert sample(found, "model_server_inference_requests_total", model="mlp", code="500") == 0


# --- per-version output statistics ------------------------------------------------------


async def test_output_statistics_count_nan_and_go_with_the_version(
    repo, server_config: ServerConfig
) -> None:
    backend = RiggedBackend()
    backend.nans["v2"] = lambda feeds: bool(feeds[INPUT_NAME].max() > 100)
    async with serving(server_config, backend) as (client, _server):
        sock = server_config.control_socket
        assert (await ask(sock, load_request(repo[1]["v2"])))["ok"]
        rng = np.random.default_rng(4)
        finite: list[np.ndarray] = []
        for huge in (False, True, False, True, True):
            x = batch(rng) * (1000 if huge else 1)
            answer = await (await client.post("/v2/models/mlp/infer", json=infer_body(x))).json()
            assert answer["model_version"] == "v2"
            if not huge:
                finite.append(output_of(answer).astype(np.float64))
        found = await metrics(client)
        labels = {"model": "mlp", "version": "v2"}
        assert sample(found, canary.OUTPUT_VALUES, **labels) == 5 * 3 * 4
        assert sample(found, canary.OUTPUT_NONFINITE, **labels) == 3 * 3 * 4
        values = np.concatenate([f.ravel() for f in finite])
        assert sample(found, canary.OUTPUT_SUM, **labels) == pytest.approx(values.sum())
        assert sample(found, canary.OUTPUT_SQUARES, **labels) == pytest.approx(values @ values)
        x = batch(rng)
        await client.post("/v2/models/mlp/infer", json=infer_body(x), headers={PIN_HEADER: "v1"})
        found = await metrics(client)
        assert sample(found, canary.OUTPUT_VALUES, model="mlp", version="v1") == 12
        assert (await ask(sock, load_request(repo[1]["v3"])))["ok"]  # v1 leaves memory
        assert (await ask(sock, load_request(repo[1]["v1"])))["ok"]  # v2 leaves, v1 anew
        found = await metrics(client)
    assert not [key for key in found if ("version", "v2") in key[1]]
    v1_anew = (canary.OUTPUT_VALUES, frozenset({"model": "mlp", "version": "v1"}.items()))
    assert found[v1_anew] == 0  # the series exists again, counting from zero


# --- golden sets ------------------------------------------------------------------------

GOLDEN_X = np.random.default_rng(21).standard_normal((5, 8)).astype(np.float32)


def golden_of(v: Version, shift: float = 0.0, **tolerance: float) -> bytes:
    expected = v.expected(GOLDEN_X)
    expected[2, 1] += shift
    return golden_npz({INPUT_NAME: GOLDEN_X}, {OUTPUT_NAME: expected}, **tolerance)


async def test_a_version_that_answers_its_golden_set_is_swapped_in(
    client: TestClient, repo, server_config
) -> None:
    v2, v3 = repo[1]["v2"], repo[1]["v3"]
    add_golden(v2, golden_of(v2))
    add_golden(v3, golden_of(v3, shift=1e-4, atol=1e-3, rtol=0.0))  # within its own tolerance
    assert (await ask(server_config.control_socket, load_request(v2)))["ok"]
    reply = await client.post("/v1/reload?target_version=v3", headers=ADMIN)  # path: its dir
    assert reply.status == 200, await reply.text()


@pytest.mark.parametrize("over", ["socket", "http"])
async def test_a_golden_mismatch_is_refused_and_the_old_version_serves(
    client: TestClient, model_server: ModelServer, repo, server_config, over: str
) -> None:
    v2 = repo[1]["v2"]
    add_golden(v2, golden_of(v2, shift=0.5))
    if over == "socket":
        answer = await ask(server_config.control_socket, load_request(v2))
        assert not answer["ok"]
        code, error = answer["code"], answer["error"]
    else:
        response = await client.post("/v1/reload?target_version=v2", headers=ADMIN)
        assert response.status == 422
        body = await response.json()
        code, error = body["code"], body["error"]
    assert code == "golden_mismatch"
    assert "mlp:v2 fails its golden set: output 'output' differs by up to 0.5" in error
    assert "at [2, 1]" in error and "1 of 20 values outside" in error
    slot = model_server.manager.slot("mlp")
    assert slot.current.version == "v1" and [v.version for v in slot.loaded()] == ["v1"]  # type: ignore[union-attr]
    assert sample(await metrics(client), "model_server_reload_failure_total", model="mlp",
                  reason="golden_mismatch") == 1  # fmt: skip


async def test_a_golden_set_that_does_not_match_its_manifest_is_refused(
    client: TestClient, model_server: ModelServer, repo, server_config
) -> None:
    sock = server_config.control_socket
    v2 = repo[1]["v2"]
    good = golden_of(v2)
    add_golden(v2, good, named=golden_of(v2, shift=1.0))  # the manifest names other bytes
    answer = await ask(sock, load_request(v2))
    assert (answer["ok"], answer["code"]) == (False, "load_refused"), answer
    assert "golden.npz has" in answer["error"] and "its manifest says" in answer["error"]
    (v2.path.parent / canary.GOLDEN_FILE).unlink()
    answer = await ask(sock, load_request(v2))
    assert answer["code"] == "load_refused" and "does not exist" in answer["error"]
    wrong_input = golden_npz({"x": GOLDEN_X}, {OUTPUT_NAME: v2.expected(GOLDEN_X)})
    add_golden(v2, wrong_input)
    answer = await ask(sock, load_request(v2))
    assert answer["code"] == "load_refused" and "the model takes ['input']" in answer["error"]
    add_golden(v2, b"not an npz")
    answer = await ask(sock, load_request(v2))
    assert answer["code"] == "load_refused" and "not a readable .npz" in answer["error"]
    assert model_server.manager.slot("mlp").current.version == "v1"  # type: ignore[union-attr]
    add_golden(v2, good)  # and with the right file, it loads
    assert (await ask(sock, load_request(v2)))["ok"]


async def test_a_golden_set_of_a_manifest_for_other_bytes_is_refused(
    client: TestClient, repo, server_config, tmp_path: Path
) -> None:
    """An announced file whose directory's manifest describes another model file: its
    golden set is not this file's, so the load is refused rather than judged by it."""
    v2 = repo[1]["v2"]
    add_golden(v2, golden_of(v2))
    other = add_version(tmp_path / "other", "mlp", "v2", seed=7)
    v2.path.write_bytes(other.path.read_bytes())
    answer = await ask(server_config.control_socket, {**load_request(v2), "sha256": other.sha256})
    assert answer["code"] == "load_refused" and "describes another model file" in answer["error"]


def test_the_canary_flags_parse() -> None:
    config = parse_args(["--repository", "/m", "--traffic-seed", "7",
                         "--shadow-max-in-flight", "3"])  # fmt: skip
    assert (config.traffic_seed, config.shadow_max_in_flight) == (7, 3)
    assert parse_args(["--repository", "/m"]).traffic_seed is None
    with pytest.raises(SystemExit):
        parse_args(["--repository", "/m", "--shadow-max-in-flight", "0"])


async def test_a_candidate_answering_nan_in_shadow_counts_its_non_finite_outputs(
    repo, server_config: ServerConfig
) -> None:
    """A shadow-only canary has no live answers from the candidate: its NaN must still
    show in the candidate's output statistics, not only as infinite drift."""
    backend = RiggedBackend()  # v2 answers NaN on large inputs (so it passes its warm-up on zeros)
    backend.nans["v2"] = lambda feeds: bool(feeds[INPUT_NAME].max() > 100)
    async with serving(server_config, backend, shadow_max_in_flight=10) as (client, server):
        await canary_of_v2(server_config.control_socket, repo, percent=0, shadow=100)
        rng = np.random.default_rng(5)
        for _ in range(4):
            x = batch(rng, rows=3) * 1000
            answer = await (await client.post("/v2/models/mlp/infer", json=infer_body(x))).json()
            assert answer["model_version"] == "v1"
        await server.shadows.idle()
        found = await metrics(client)
    labels = {"model": "mlp", "version": "v2"}
    assert sample(found, canary.SHADOW_REQUESTS, **labels) == 4
    assert sample(found, canary.OUTPUT_NONFINITE, **labels) == 4 * 3 * 4


async def test_the_series_analysis_reads_exist_at_zero_from_the_load(
    repo, server_config: ServerConfig
) -> None:
    """Prometheus' increase() cannot count a series' first sample: a 500 series born with
    the first error would hide it from the first check, so both exist from the load."""
    async with serving(server_config) as (client, _server):
        assert (await ask(server_config.control_socket, load_request(repo[1]["v2"])))["ok"]
        found = await metrics(client)
    for code in ("200", "500"):
        key = (canary.REQUESTS, frozenset({"model": "mlp", "version": "v2", "code": code}.items()))
        assert found.get(key) == 0.0, code
    v2 = frozenset({"model": "mlp", "version": "v2"}.items())
    assert found.get((f"{canary.ENGINE_LATENCY}_count", v2)) == 0.0


# --- a load that carries its policy -----------------------------------------------------


async def test_a_load_with_a_policy_never_lets_the_candidate_answer_outside_it(
    repo, server_config: ServerConfig
) -> None:
    """trafficPercent 0: the candidate answers nothing, not even between its swap and its
    policy. Six clients keep requests in flight across a full load of v2 with the policy,
    a rollback, and a pointer swap back to v2 with the policy: every answer is v1's."""
    async with serving(server_config) as (client, server):
        sock = server_config.control_socket
        done = asyncio.Event()
        answered: Counter[str] = Counter()

        async def keep_asking(seed: int) -> None:
            rng = np.random.default_rng(seed)
            while not done.is_set():
                x = batch(rng)
                response = await client.post("/v2/models/mlp/infer", json=infer_body(x))
                assert response.status == 200, await response.text()
                answered[which_version(repo[1], x, await response.json())] += 1

        async def more_answers(count: int) -> None:
            target = answered.total() + count
            async with asyncio.timeout(60):
                while answered.total() < target:
                    await asyncio.sleep(0.005)

        askers = [asyncio.create_task(keep_asking(seed)) for seed in range(6)]
        try:
            await more_answers(20)
            loaded = await ask(sock, load_with_policy(repo[1]["v2"]))
            assert loaded["ok"] and not loaded["instant"], loaded
            await more_answers(50)
            assert (await ask(sock, {"op": "rollback", "model": "mlp", "version": "v1"}))["ok"]
            swapped = await ask(sock, load_with_policy(repo[1]["v2"]))
            assert swapped["ok"] and swapped["instant"], swapped  # v2 was retained
            await more_answers(50)
        finally:
            done.set()
            await asyncio.gather(*askers)
        health = await (await client.get("/v1/models/mlp/health")).json()
        assert server.manager.slot("mlp").policy == TrafficPolicy("v1", "v2")
    assert (health["version"], health["traffic"]) == ("v2", TrafficPolicy("v1", "v2").to_json())
    assert answered["v2"] == 0 and answered["v1"] >= 120, answered
    set_by_loads = [e for e in server.audit.events if e["action"] == "traffic"]
    assert [(e["version"], e["from_version"], e["result"]) for e in set_by_loads] == [
        ("v2", "v1", "success"),
        ("v2", "v1", "success"),
    ]


class HeldRequest:
    """A transport's request whose body is decoded only when the test lets it go, as a
    large body waits for a JSON worker: routed before a swap, pinned after it. Its
    answer is the version that ran it and the outputs."""

    def __init__(self, x: np.ndarray) -> None:
        self.x = x
        self.decoding, self.release = asyncio.Event(), asyncio.Event()

    async def decode(self, specs: tuple[TensorSpec, ...]) -> InferenceRequest:
        self.decoding.set()
        await self.release.wait()
        return InferenceRequest({INPUT_NAME: self.x}, None, None)

    async def encode(
        self,
        name: str,
        version: str,
        request_id: str,
        outputs: dict[str, np.ndarray],
        request: InferenceRequest,
    ) -> tuple[str, dict[str, np.ndarray]]:
        return version, outputs


async def test_a_request_that_arrived_before_a_canary_swap_is_not_answered_by_the_candidate(
    client: TestClient, model_server: ModelServer, repo, server_config
) -> None:
    """Routed while v1 served alone, decoded while v2 was swapped in under a policy that
    gives v2 no request: the request is answered by v1, the version it was routed to."""
    x = np.random.default_rng(3).standard_normal((2, 8)).astype(np.float32)
    held = HeldRequest(x)
    answering = asyncio.create_task(model_server.plane.infer("mlp", "mlp", held))
    async with asyncio.timeout(30):
        await held.decoding.wait()
    assert (await ask(server_config.control_socket, load_with_policy(repo[1]["v2"])))["ok"]
    held.release.set()
    version, outputs = (await answering).body
    assert version == "v1"
    assert np.allclose(outputs[OUTPUT_NAME], repo[1]["v1"].expected(x), atol=1e-4)


async def test_a_load_whose_policy_cannot_hold_is_refused_before_any_work(
    repo, server_config: ServerConfig
) -> None:
    v2 = repo[1]["v2"]
    async with serving(server_config, retain=1) as (_client, server):
        answer = await ask(server_config.control_socket, load_with_policy(v2))
        slot = server.manager.slot("mlp")
        assert (answer["ok"], answer["code"]) == (False, "conflict"), answer
        assert "keeps 1 version" in answer["error"] and "held beside" in answer["error"]
        assert [v.version for v in slot.loaded()] == ["v1"] and "v2" not in slot.states()
    async with serving(server_config) as (_client, server):
        sock, slot = server_config.control_socket, server.manager.slot("mlp")
        for request, code, says in (
            (load_with_policy(v2, stable="v3"), "conflict", "stable version 'v3' is not loaded"),
            (load_with_policy(v2, stable="v2"), "bad_request", "not 'v2' and itself"),
            ({**load_with_policy(v2), "candidate": "v3"}, "bad_request", "as its candidate"),
        ):
            answer = await ask(sock, request)
            assert (answer["ok"], answer["code"]) == (False, code), (request, answer)
            assert says in answer["error"], answer
        assert [v.version for v in slot.loaded()] == ["v1"] and slot.policy is None
        assert "v2" not in slot.states()
        # the serving version loaded again with a policy: no swap, the policy is set
        assert (await ask(sock, load_request(v2)))["ok"]
        answer = await ask(sock, load_with_policy(v2, percent=30))
        assert answer["ok"] and answer["instant"] and answer["from"] == "v2", answer
        assert slot.policy == TrafficPolicy("v1", "v2", traffic_percent=30)


async def test_a_load_with_a_policy_evicts_another_version_never_its_stable_one(
    client: TestClient, model_server: ModelServer, repo, server_config
) -> None:
    """retain 2, v3 serving and v1 (the oldest) retained: v2 loaded under a policy whose
    stable version is v1 evicts v3, not v1, and the split holds."""
    sock = server_config.control_socket
    assert (await ask(sock, load_request(repo[1]["v3"])))["ok"]
    assert (await ask(sock, load_with_policy(repo[1]["v2"])))["ok"]
    slot = model_server.manager.slot("mlp")
    assert [v.version for v in slot.loaded()] == ["v1", "v2"]
    assert slot.policy == TrafficPolicy("v1", "v2")
    x = np.ones((1, 8), dtype=np.float32)
    for _ in range(10):
        answer = await (await client.post("/v2/models/mlp/infer", json=infer_body(x))).json()
        assert which_version(repo[1], x, answer) == "v1"


# --- the engine's own time --------------------------------------------------------------


async def test_every_engine_run_live_or_shadow_is_timed_in_its_versions_series(
    repo, server_config: ServerConfig
) -> None:
    """What the operator compares a shadowed candidate's SHADOW_LATENCY with: the
    stable version's ENGINE_LATENCY, counted for its live runs; the candidate's counts
    its shadow runs. Both exist at zero from the load (warm-up and golden runs are not
    counted)."""
    n = 12
    async with serving(server_config, shadow_max_in_flight=n) as (client, server):
        sock = server_config.control_socket
        assert (await ask(sock, load_request(repo[1]["v2"])))["ok"]
        found = await metrics(client)
        for version in ("v1", "v2"):
            labels = {"model": "mlp", "version": version}
            key = (f"{canary.ENGINE_LATENCY}_count", frozenset(labels.items()))
            assert found.get(key) == 0.0, version
        assert (await ask(sock, traffic("v2", percent=0, shadow=100)))["ok"]
        rng = np.random.default_rng(8)
        for _ in range(n):
            x = batch(rng)
            answer = await (await client.post("/v2/models/mlp/infer", json=infer_body(x))).json()
            assert which_version(repo[1], x, answer) == "v1"
        await server.shadows.idle()
        found = await metrics(client)
    stable, candidate = {"model": "mlp", "version": "v1"}, {"model": "mlp", "version": "v2"}
    assert sample(found, f"{canary.ENGINE_LATENCY}_count", **stable) == n
    assert sample(found, f"{canary.ENGINE_LATENCY}_count", **candidate) == n
    assert sample(found, f"{canary.SHADOW_LATENCY}_count", **candidate) == n
    engine_s = sample(found, f"{canary.ENGINE_LATENCY}_sum", **stable)
    assert 0 < engine_s <= sample(found, f"{canary.LATENCY}_sum", **stable)  # a part of it
    top = sample(found, f"{canary.ENGINE_LATENCY}_bucket", le="+Inf", **candidate)
    assert top == n


async def test_a_shadow_run_in_flight_counts_in_neither_requests_nor_shadow_requests(
    repo, server_config: ServerConfig
) -> None:
    """Analysis takes the candidate's live answers as REQUESTS less SHADOW_REQUESTS: a
    scrape while a shadow run is in flight must not see one counted and not the other
    (a phantom live answer would switch latency to request time and skip the check)."""
    backend = RiggedBackend()
    async with serving(server_config, backend, shadow_max_in_flight=4) as (client, server):
        sock = server_config.control_socket
        assert (await ask(sock, load_with_policy(repo[1]["v2"], percent=0, shadow=100)))["ok"]
        gate = backend.gate("v2")  # the candidate's shadow run waits here
        x = np.random.default_rng(1).standard_normal((1, 8)).astype(np.float32)
        assert (await client.post("/v2/models/mlp/infer", json=infer_body(x))).status == 200
        deadline = asyncio.get_running_loop().time() + 30
        while backend.waiting["v2"] < 1:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)
        during = await metrics(client)
        gate.set()
        await server.shadows.idle()
        after = await metrics(client)
    v2 = {"model": "mlp", "version": "v2"}
    for found, counted in ((during, 0), (after, 1)):
        assert sample(found, canary.SHADOW_REQUESTS, **v2) == counted
        assert sample(found, canary.REQUESTS, code="200", **v2) == counted


async def test_a_run_of_several_batched_requests_is_not_timed_as_engine_time(
    repo, server_config: ServerConfig
) -> None:
    """A shadow run is one request's: the stable version's ENGINE_LATENCY, what it is
    compared with, must be too. A batched run's time is that of all its rows, so only
    the runs of one request are observed (here every request is one row: the runs of
    one row in the batch-size histogram)."""
    backend = RiggedBackend()
    async with serving(
        server_config,
        backend,
        max_batch_size=16,
        max_queue_delay_us=200_000,
        batch_models=("mlp",),
    ) as (
        client,
        _,
    ):
        gate = backend.gate("v1")  # the first run waits, so the next requests queue up
        x = np.random.default_rng(3).standard_normal((1, 8)).astype(np.float32)

        async def one() -> None:
            r = await client.post("/v2/models/mlp/infer", json=infer_body(x))
            assert r.status == 200

        first = asyncio.ensure_future(one())
        deadline = asyncio.get_running_loop().time() + 30
        while backend.waiting["v1"] < 1:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)
        rest = asyncio.gather(*(one() for _ in range(8)))
        await asyncio.sleep(0.05)  # let them reach the queue (not a timed assertion)
        gate.set()
        await asyncio.gather(first, rest)
        for _ in range(4):
            await one()  # alone: a run of one request
        found = await metrics(client)
    runs = sample(found, "model_server_inference_batch_rows_count", model="mlp")
    alone = sample(found, "model_server_inference_batch_rows_bucket", model="mlp", le="1.0")
    assert runs > alone >= 5, (runs, alone)  # some batched runs, and the runs alone
    timed = sample(found, f"{canary.ENGINE_LATENCY}_count", model="mlp", version="v1")
    assert timed == alone


# --- a restarted server resumes the policy of its volume --------------------------------


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


class GatedLoads(OnnxRuntimeBackend):
    """ONNX Runtime, whose loads of ``v2`` wait until the test opens the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()

    def load(self, model: ModelFile) -> Engine:
        if model.path.parent.name == "v2":
            assert self.gate.wait(60), "the test never let the load of v2 end"
        return super().load(model)


@pytest.mark.parametrize("overtaker", ["sidecar rollback", "load of the serving version"])
async def test_a_load_with_a_policy_is_not_installed_after_a_request_to_stay_on_stable(
    tmp_path: Path, overtaker: str
) -> None:
    """Review 11 #4: the canary's load (with its policy) outlives the sidecar's load
    timeout, then the pod goes back to the stable version, which serves already: nothing
    is swapped, but the clear of the policy (the sidecar's rollback) or a load of the
    serving version says the load in progress is no longer wanted: when it ends it is
    not installed (overtaken, its engine closed) and the stable version keeps serving."""
    from model_sidecar.store import LocalStore
    from tests.support.sidecar import (
        make_fetcher,
        make_keys,
        make_watcher,
        publish_versions,
        set_target,
    )

    policy = TrafficPolicy("v1", "v2", traffic_percent=50)
    keys = make_keys(tmp_path / "keys")
    store = LocalStore(tmp_path / "store")
    publish_versions(store, keys, tmp_path, {"v1": 1, "v2": 2})
    volume, podinfo, sock = tmp_path / "volume", tmp_path / "annotations", tmp_path / "c.sock"
    fetcher = make_fetcher(store, keys, volume)
    await fetcher.fetch("mlp", "v1")
    (volume / "mlp" / CURRENT_FILE).write_text("v1\n")
    backend = GatedLoads()
    config = ServerConfig(repository=volume, models=[ModelSpec("mlp")], control_socket=sock)
    server = ModelServer(config, backend)
    async with TestClient(TestServer(server.make_app())) as client:
        watcher = make_watcher(fetcher, sock, podinfo, tmp_path / "s.json", load_timeout_s=0.5)
        set_target(podinfo, "v1")
        assert await watcher.step() == "ok"
        slot = server.manager.slot("mlp")
        backend.gate.clear()
        set_target(podinfo, "v2", policy)  # the canary stage
        assert await watcher.step() == "error"  # load timeout: the server still loads v2
        assert slot.states()["v2"].state.value == "LOADING"
        if overtaker == "sidecar rollback":
            set_target(podinfo, "v1")
            assert await watcher.step() == "ok"  # serving v1 already: the policy cleared
        else:
            noop = await server.manager.load("mlp", "v1")  # serving: nothing to swap
            assert (noop.from_version, noop.to_version) == ("v1", "v1")
        backend.gate.set()
        while slot.states()["v2"].state.value == "LOADING":
            await asyncio.sleep(0.02)
        health = await (await client.get("/v1/models/mlp/health")).json()
        assert (health["version"], health["traffic"]) == ("v1", None)
        assert slot.states()["v2"].state.value == "UNAVAILABLE"
        assert "overtook it" in slot.states()["v2"].reason
        assert [v.version for v in slot.loaded()] == ["v1"]
        loads = [(e["version"], e["result"]) for e in server.audit.events if e["action"] == "load"]
        assert loads[-1] == ("v2", "failure")
