"""Issue 11, the server's side of canary analysis, against a real server (aiohttp's test
server over TCP), its real control socket and real ONNX models: the traffic op, the
per-request split, the pin header, shadow runs, the per-version series (parsed with
prometheus_client's parser) and golden sets."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer

from conftest import ADMIN
from helpers import (
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
from model_rollout_contract import canary
from model_rollout_contract.canary import PIN_HEADER, TrafficPolicy
from model_rollout_e2e.onnx_models import INPUT_NAME, OUTPUT_NAME
from model_server.app import SERVER, ModelServer
from model_server.backends.base import Engine, ModelFile
from model_server.backends.onnxruntime_backend import OnnxRuntimeBackend
from model_server.config import ServerConfig, parse_args
from model_server.traffic import Route, TrafficRouter
from model_server.version_metrics import SHADOW_SKIPPED

Feeds = Mapping[str, np.ndarray]


class Rigged(OnnxRuntimeBackend):
    """ONNX Runtime whose engines of chosen versions misbehave on cue: wait at a gate,
    raise, or answer NaN for the inputs a predicate picks (warm-up's zeros pass)."""

    def __init__(self) -> None:
        super().__init__()
        self.gates: dict[str, threading.Event] = {}
        self.fails: dict[str, Callable[[Feeds], bool]] = {}
        self.nans: dict[str, Callable[[Feeds], bool]] = {}
        self.waiting: dict[str, int] = Counter()  # runs blocked at each gate now
        self.closed: list[str] = []

    def gate(self, version: str) -> threading.Event:
        return self.gates.setdefault(version, threading.Event())

    def load(self, model: ModelFile) -> Engine:
        engine = super().load(model)
        version, backend = model.path.parent.name, self
        inner_infer, inner_close = engine.infer, engine.close

        def infer(feeds: Feeds) -> dict[str, np.ndarray]:
            gate = backend.gates.get(version)
            if gate is not None and not gate.is_set():
                backend.waiting[version] += 1
                gate.wait()
                backend.waiting[version] -= 1
            if backend.fails.get(version, lambda _: False)(feeds):
                raise RuntimeError(f"{version} cannot run these inputs")
            out = inner_infer(feeds)
            if backend.nans.get(version, lambda _: False)(feeds):
                out = {k: v * np.nan for k, v in out.items()}
            return out

        def close() -> None:
            backend.closed.append(version)
            inner_close()

        engine.infer = infer  # type: ignore[method-assign]
        engine.close = close  # type: ignore[method-assign]
        return engine


@contextlib.asynccontextmanager
async def serving(
    config: ServerConfig, backend: OnnxRuntimeBackend | None = None, **changes: object
) -> AsyncIterator[tuple[TestClient, ModelServer]]:
    app = ModelServer(dataclasses.replace(config, **changes), backend).make_app()  # type: ignore[arg-type]
    async with TestClient(TestServer(app)) as client:
        yield client, client.app[SERVER]


def load_request(v: Version) -> dict[str, str]:
    return {"op": "load", "model": "mlp", "version": v.name, "path": str(v.path),
            "sha256": v.sha256}  # fmt: skip


def traffic(candidate: str | None, stable: str | None = "v1", percent: int = 0,
            shadow: int = 0) -> dict[str, object]:  # fmt: skip
    return {"op": "traffic", "model": "mlp", "stable": stable, "candidate": candidate,
            "traffic_percent": percent, "shadow_percent": shadow}  # fmt: skip


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
    assert answer == {"ok": True, "model": "mlp", "version": "v2",
                      "sha256": repo[1]["v2"].sha256, "loaded": ["v1", "v2"]}  # fmt: skip
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
    backend = Rigged()
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
    backend = Rigged()
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


async def test_a_candidate_failing_in_shadow_counts_as_its_error_and_never_the_clients(
    repo, server_config: ServerConfig
) -> None:
    backend = Rigged()
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
    assert sample(found, "inference_requests_total", model="mlp", code="500") == 0


# --- per-version output statistics ------------------------------------------------------


async def test_output_statistics_count_nan_and_go_with_the_version(
    repo, server_config: ServerConfig
) -> None:
    backend = Rigged()
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
    assert sample(await metrics(client), "model_reload_failure_total", model="mlp",
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
    backend = Rigged()  # v2 answers NaN on large inputs (so it passes its warm-up on zeros)
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
