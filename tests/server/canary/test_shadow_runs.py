"""Shadow runs: a share of the stable version's answers run again on the candidate, for the
analysis' drift, bounded and never the client's wait or error (issue 11)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from model_rollout_contract import canary
from model_rollout_e2e.onnx_models import INPUT_NAME
from model_server.config import ServerConfig
from model_server.observability.version_metrics import SHADOW_SKIPPED
from tests.support.backends import RiggedBackend, serving
from tests.support.canary import batch, canary_of_v2, load_request, metrics, traffic
from tests.support.server import add_version, ask, infer_body, sample, which_version


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
