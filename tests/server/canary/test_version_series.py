"""The per-version series the canary analysis reads (parsed with prometheus_client's
parser): output statistics, series that exist from the load, and the engine's own time
of every run, live or shadow (issue 11)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from model_rollout_contract import canary
from model_rollout_contract.canary import PIN_HEADER
from model_rollout_e2e.onnx_models import INPUT_NAME
from model_server.config import ServerConfig
from tests.support.backends import RiggedBackend, serving
from tests.support.canary import batch, load_request, load_with_policy, metrics, traffic
from tests.support.server import ask, infer_body, output_of, sample, which_version


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
