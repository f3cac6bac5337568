"""A load that carries its traffic policy: the candidate never answers outside it, a
request that arrived before the swap is not the candidate's, a policy that cannot hold
is refused before any work, and a later request to stay on stable wins (issue 11)."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer

from model_rollout_contract.canary import TrafficPolicy
from model_rollout_contract.layout import CURRENT_FILE
from model_rollout_e2e.onnx_models import INPUT_NAME, OUTPUT_NAME
from model_server.app import ModelServer
from model_server.backends.base import Engine, ModelFile
from model_server.backends.onnxruntime_backend import OnnxRuntimeBackend
from model_server.config import ModelSpec, ServerConfig
from model_server.protocol.tensor_spec import TensorSpec
from model_server.protocol.v2_codec import InferenceRequest
from tests.support.backends import serving
from tests.support.canary import batch, load_request, load_with_policy
from tests.support.server import ask, infer_body, which_version


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
