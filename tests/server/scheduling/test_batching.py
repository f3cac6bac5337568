"""Dynamic batching (issue 12), against a real server (aiohttp's test server), real ONNX
Runtime engines and real ONNX models built in code: queued requests run as one engine
run and each gets exactly its own rows; a batch never mixes versions across swaps; the
old version of a retain-1 swap is closed only after its last batch; a request that fails
in a batch fails alone; a lone request is answered once its delay is over; closing fails
what is queued with 503; the flags, the CRD field and the pod's server arguments."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import yaml
from aiohttp.test_utils import TestClient
from onnx import TensorProto, helper

from model_operator.manifests import deployment
from model_operator.spec import SpecError, parse_spec
from model_rollout_contract import argv, defaults
from model_rollout_contract.manifest import Manifest, sha256_file
from model_rollout_e2e.onnx_models import INPUT_NAME, OUTPUT_NAME
from model_server.app import ModelServer
from model_server.config import ConfigError, ModelSpec, ServerConfig, parse_args
from model_server.errors import Unavailable
from model_server.lifecycle.engine_manager import EngineManager
from model_server.lifecycle.repository import ModelRepository
from model_server.observability.audit import AuditLog
from model_server.observability.metrics import ServerMetrics
from model_server.protocol.tensor_spec import TensorSpec
from model_server.scheduling.batching import BatchPolicy, engine_max_rows, unbatchable_reason
from model_server.scheduling.runner import Runner
from tests.support.backends import RiggedBackend, serving
from tests.support.crd_validation import ResourceSchema
from tests.support.server import ADMIN, infer_body, output_of, sample, samples, which_version

ROOT = Path(__file__).resolve().parents[3]
Feeds = Mapping[str, np.ndarray]
GUARD_S = 60.0  # hang guard: far beyond any wait here, never a measured bound
LONG_DELAY_US = 30_000_000  # a batch that must fill up before it runs


def batched(
    config: ServerConfig, backend: RiggedBackend, **changes: Any
) -> contextlib.AbstractAsyncContextManager[tuple[TestClient, ModelServer]]:
    """A server of ``config`` with ``changes``, its models opted in to batching unless
    the changes say which are."""
    models = changes.get("models", config.models)
    changes.setdefault("batch_models", tuple(m.key for m in models))
    return serving(config, backend, **changes)


async def until(predicate: Callable[[], bool]) -> None:
    async with asyncio.timeout(GUARD_S):
        while not predicate():
            await asyncio.sleep(0.005)


def rows_of(rng: np.random.Generator, rows: int) -> np.ndarray:
    return rng.standard_normal((rows, 8)).astype(np.float32)


async def infer(client: TestClient, x: np.ndarray, model: str = "mlp") -> tuple[int, Any]:
    async with asyncio.timeout(GUARD_S):
        response = await client.post(f"/v2/models/{model}/infer", json=infer_body(x))
        assert response.content_type == "application/json", await response.text()
        return response.status, await response.json()  # an error too: its code and message


async def batch_sizes(client: TestClient) -> tuple[float, float]:
    """(engine runs, rows) of the model's model_server_inference_batch_rows histogram."""
    found = samples(await (await client.get("/metrics")).text())
    return (
        sample(found, "model_server_inference_batch_rows_count", model="mlp"),
        sample(found, "model_server_inference_batch_rows_sum", model="mlp"),
    )


def alone(server: ModelServer, x: np.ndarray, model: str = "mlp") -> np.ndarray:
    """What the serving version's engine answers for ``x`` run by itself."""
    current = server.manager.slot(model).current
    assert current is not None
    return current.engine.infer({INPUT_NAME: x})[OUTPUT_NAME]


def add_graph(root: Path, model: str, version: str, graph: onnx.GraphProto) -> None:
    path = root / model / version / "model.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 8
    onnx.checker.check_model(proto)
    onnx.save(proto, str(path))
    manifest = Manifest(model, version, "model.onnx", sha256_file(path), path.stat().st_size)
    (path.parent / "manifest.json").write_bytes(manifest.to_bytes())


def doubling(first_dim: int | str) -> onnx.GraphProto:
    """output = 2 * input, of shape [first_dim, 8]."""
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    return helper.make_graph(
        [helper.make_node("Mul", [INPUT_NAME, "two"], [OUTPUT_NAME])],
        "doubling",
        [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, [first_dim, 8])],
        [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, [first_dim, 8])],
        [two],
    )


def with_column_sums() -> onnx.GraphProto:
    """output = the input's rows, then one row of their sums: rows + 1 rows, a first axis
    that is dynamic but not the batch axis (row independence broken, as its output shape
    gives away)."""
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [0])
    return helper.make_graph(
        [
            helper.make_node("ReduceSum", [INPUT_NAME, "axes"], ["sums"], keepdims=1),
            helper.make_node("Concat", [INPUT_NAME, "sums"], [OUTPUT_NAME], axis=0),
        ],
        "with_column_sums",
        [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, ["rows", 8])],
        [axes],
    )


# --- batches ----------------------------------------------------------------------------


async def test_requests_queued_together_run_as_one_engine_run_each_getting_its_own_rows(
    repo, server_config: ServerConfig
) -> None:
    """Four requests of 1, 2, 3 and 2 rows fill a batch of 8: one engine run, and each
    answer is exactly what the model gives its rows alone."""
    rng = np.random.default_rng(1)
    xs = [rows_of(rng, n) for n in (1, 2, 3, 2)]
    backend = RiggedBackend(gate_timeout_s=GUARD_S)
    async with batched(
        server_config, backend, max_batch_size=8, max_queue_delay_us=LONG_DELAY_US
    ) as (client, server):
        answers = await asyncio.gather(*(infer(client, x) for x in xs))
        assert backend.rows() == [8]  # one engine run for the four requests
        for x, (status, answer) in zip(xs, answers, strict=True):
            assert status == 200 and answer["model_version"] == "v1"
            got = output_of(answer)
            assert got.shape == (x.shape[0], 4)
            np.testing.assert_allclose(got, alone(server, x), rtol=1e-5, atol=1e-6)
            assert which_version(repo[1], x, answer) == "v1"
        assert await batch_sizes(client) == (1, 8)
        found = samples(await (await client.get("/metrics")).text())
        assert sample(found, "model_server_version_requests_total", model="mlp", version="v1",
                      code="200") == 4  # fmt: skip


async def test_a_batch_keeps_to_the_models_rows_per_request(
    server_config: ServerConfig,
) -> None:
    """A batch is one engine run, so it takes no more rows than one request of the model
    may (--max-rows, or the memory bound): four requests of 2 rows, for a model of at
    most 4 rows per request, run as two batches of 4, not one of 8 (before: [8])."""
    rng = np.random.default_rng(11)
    xs = [rows_of(rng, 2) for _ in range(4)]
    backend = RiggedBackend(gate_timeout_s=GUARD_S)
    async with batched(
        server_config, backend, max_batch_size=8, max_queue_delay_us=LONG_DELAY_US,
        max_rows={"mlp": 4},
    ) as (client, server):  # fmt: skip
        answers = await asyncio.gather(*(infer(client, x) for x in xs))
        assert backend.rows() == [4, 4]
        for x, (status, answer) in zip(xs, answers, strict=True):
            assert status == 200
            np.testing.assert_allclose(output_of(answer), alone(server, x), rtol=1e-5, atol=1e-6)


async def test_a_batch_takes_the_oldest_requests_that_fit_and_the_rest_wait(
    server_config: ServerConfig,
) -> None:
    """One inference thread, busy; requests of 3, 3, 1 and 6 rows queue meanwhile, in that
    order, for batches of at most 4 rows. Then: 3 (the next 3 does not fit, and the queue
    is served in order), 3 + 1, and the 6 rows (more than a batch) alone."""
    rng = np.random.default_rng(2)
    backend = RiggedBackend(gate_timeout_s=GUARD_S)
    async with batched(
        server_config, backend, max_batch_size=4, max_queue_delay_us=0, workers=1
    ) as (client, server):
        backend.gate("v1").clear()
        first = asyncio.create_task(infer(client, rows_of(rng, 1)))
        await until(lambda: backend.waiting["v1"] == 1)
        xs = [rows_of(rng, n) for n in (3, 3, 1, 6)]
        rest = []
        for queued, x in enumerate(xs, 1):
            rest.append(asyncio.create_task(infer(client, x)))
            await until(lambda queued=queued: server.runner.batchers.queued() == queued)
        backend.gate("v1").set()
        answers = await asyncio.gather(first, *rest)
        assert backend.rows() == [1, 3, 4, 6]
        for x, (status, answer) in zip(xs, answers[1:], strict=True):
            assert status == 200
            np.testing.assert_allclose(output_of(answer), alone(server, x), rtol=1e-5, atol=1e-6)


async def test_a_lone_request_is_answered_once_its_queue_delay_is_over(
    server_config: ServerConfig,
) -> None:
    """Nothing else arrives to fill its batch of 64: the delay (50 ms) runs it alone."""
    backend = RiggedBackend(gate_timeout_s=GUARD_S)
    x = rows_of(np.random.default_rng(3), 1)
    async with batched(server_config, backend, max_batch_size=64, max_queue_delay_us=50_000) as (
        client,
        server,
    ):
        status, answer = await infer(client, x)  # the hang guard fails it if never run
        assert status == 200 and backend.rows() == [1]
        np.testing.assert_allclose(output_of(answer), alone(server, x), rtol=1e-5, atol=1e-6)
        assert await batch_sizes(client) == (1, 1)


async def test_with_no_delay_requests_batch_only_while_the_threads_are_busy(
    server_config: ServerConfig,
) -> None:
    """Delay 0 and one inference thread: a request runs at once while the thread is free;
    those that arrive while it is busy run together when it is free again."""
    rng = np.random.default_rng(4)
    backend = RiggedBackend(gate_timeout_s=GUARD_S)
    async with batched(
        server_config, backend, max_batch_size=16, max_queue_delay_us=0, workers=1
    ) as (client, server):
        backend.gate("v1").clear()
        first = asyncio.create_task(infer(client, rows_of(rng, 1)))
        await until(lambda: backend.waiting["v1"] == 1)
        xs = [rows_of(rng, 1) for _ in range(5)]
        rest = [asyncio.create_task(infer(client, x)) for x in xs]
        await until(lambda: server.runner.batchers.queued() == 5)
        backend.gate("v1").set()
        answers = await asyncio.gather(first, *rest)
        assert backend.rows() == [1, 5]
        for x, (status, answer) in zip(xs, answers[1:], strict=True):
            assert status == 200
            np.testing.assert_allclose(output_of(answer), alone(server, x), rtol=1e-5, atol=1e-6)


async def test_a_failing_request_in_a_batch_fails_alone(server_config: ServerConfig) -> None:
    """v1 fails on any input holding 1000: the batch that holds one such request fails,
    and is run again request by request, so only that request gets the error."""
    rng = np.random.default_rng(5)
    xs = [rows_of(rng, n) for n in (2, 1, 3, 2)]
    xs[2][1, 0] = 1000.0
    backend = RiggedBackend(gate_timeout_s=GUARD_S)
    backend.fails["v1"] = lambda feeds: bool(np.any(feeds[INPUT_NAME] == 1000.0))
    async with batched(
        server_config, backend, max_batch_size=8, max_queue_delay_us=LONG_DELAY_US
    ) as (client, server):
        answers = await asyncio.gather(*(infer(client, x) for x in xs))
        assert [status for status, _ in answers] == [200, 200, 500, 200]
        assert answers[2][1] == {
            "error": "internal error: v1 cannot run these inputs",
            "code": "internal_error",
        }
        for i in (0, 1, 3):
            got = output_of(answers[i][1])
            np.testing.assert_allclose(got, alone(server, xs[i]), rtol=1e-5, atol=1e-6)
        assert sorted(backend.rows()) == sorted([8, 2, 1, 3, 2])  # the batch, then each
        found = samples(await (await client.get("/metrics")).text())
        codes = {
            code: sample(found, "model_server_version_requests_total", model="mlp", version="v1",
                         code=code)
            for code in ("200", "500")
        }  # fmt: skip
        assert codes == {"200": 3, "500": 1}
        assert await batch_sizes(client) == (5, 16)  # the failed run and the four alone


# --- versions ---------------------------------------------------------------------------


async def test_a_batch_never_mixes_versions_across_swaps_under_load(
    repo, server_config: ServerConfig
) -> None:
    """24 clients send 1 to 3 rows at a time while v1 and v2 swap back and forth: every
    answer is its named version's output for its own rows, and batches did form."""
    backend = RiggedBackend(gate_timeout_s=GUARD_S)
    answered: Counter[str] = Counter()
    stop = asyncio.Event()

    async def client_loop(client: TestClient, seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            x = rows_of(rng, int(rng.integers(1, 4)))
            status, answer = await infer(client, x)
            assert status == 200, answer
            answered[which_version(repo[1], x, answer)] += 1

    async with batched(server_config, backend, max_batch_size=16, max_queue_delay_us=20_000) as (
        client,
        server,
    ):
        clients = [asyncio.create_task(client_loop(client, seed)) for seed in range(24)]
        for target in ["v2", "v1"] * 5:
            swaps = len(server.audit.events)
            await until(
                lambda swaps=swaps: (
                    sum(answered.values()) >= 20 * swaps or any(c.done() for c in clients)
                )  # a client failed: gather raises it
            )
            if any(c.done() for c in clients):
                break
            response = await client.post(f"/v1/reload?target_version={target}", headers=ADMIN)
            assert response.status == 200, await response.text()
        stop.set()
        await asyncio.gather(*clients)
    assert answered["v1"] > 0 and answered["v2"] > 0
    assert max(backend.rows()) > 3  # requests of several clients ran together
    assert {version for version, _ in backend.runs} == {"v1", "v2"}


async def test_retain_1_frees_the_old_version_only_after_its_last_batch(
    repo, server_config: ServerConfig
) -> None:
    """A batch of four requests holds v1 at a gate while v2 is swapped in with retain 1:
    v1 is dropped but stays open, v2 answers new requests meanwhile (its own batches), and
    v1 is closed once its batch has answered, with v1's outputs."""
    rng = np.random.default_rng(6)
    backend = RiggedBackend(gate_timeout_s=GUARD_S)
    async with batched(
        server_config, backend, retain=1, max_batch_size=4, max_queue_delay_us=LONG_DELAY_US
    ) as (client, server):
        backend.gate("v1").clear()
        xs = [rows_of(rng, 1) for _ in range(4)]
        held = [asyncio.create_task(infer(client, x)) for x in xs]
        await until(lambda: backend.waiting["v1"] == 1)
        response = await client.post("/v1/reload?target_version=v2", headers=ADMIN)
        assert response.status == 200
        slot = server.manager.slot("mlp")
        assert [v.version for v in slot.loaded()] == ["v2"]
        assert [v.version for v in slot.draining()] == ["v1"] and "v1" not in backend.closed
        new = [rows_of(rng, 2), rows_of(rng, 2)]  # v2's batch of 4 rows, beside v1's
        for x, (status, answer) in zip(
            new, await asyncio.gather(*(infer(client, x) for x in new)), strict=True
        ):
            assert status == 200 and which_version(repo[1], x, answer) == "v2"
        assert "v1" not in backend.closed  # its batch still runs
        backend.gate("v1").set()
        for x, (status, answer) in zip(xs, await asyncio.gather(*held), strict=True):
            assert status == 200 and which_version(repo[1], x, answer) == "v1"
        assert backend.closed == ["v1"] and slot.draining() == []
        assert backend.runs == [("v1", 4), ("v2", 4)]


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "unbatched"])
async def test_a_cancelled_request_keeps_its_version_open_until_its_run_ends(
    repo, batching: bool
) -> None:
    """A request cancelled (its client gone, a shutdown) while the engine runs its inputs
    keeps its pin until that run ends: a version dropped meanwhile is not closed under
    the run. (Unbatched, the pin used to go with the cancellation.)"""
    backend = RiggedBackend(gate_timeout_s=GUARD_S)
    policy = BatchPolicy(2 if batching else 0, 30.0, 4, frozenset({"mlp"}))
    manager = EngineManager(
        backend, ModelRepository(repo[0]), ServerMetrics(), AuditLog(), retain=1
    )
    runner = Runner(manager.metrics, manager.row_limits, batching=policy)
    manager.register("mlp")
    await manager.load("mlp", "v1")
    backend.gate("v1").clear()
    x = {INPUT_NAME: np.ones((1, 8), np.float32)}
    tasks = [asyncio.create_task(runner.infer(manager.slot("mlp"), x)) for _ in range(2)]
    await until(lambda: backend.waiting["v1"] == (1 if batching else 2))
    await manager.load("mlp", "v2")  # v1 dropped: its requests keep it open
    for task in tasks:
        task.cancel()
    for _ in range(20):  # the cancellations are handled
        await asyncio.sleep(0)
    assert "v1" not in backend.closed
    backend.gate("v1").set()
    for task in tasks:
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, GUARD_S)
    assert backend.closed == ["v1"]
    assert backend.rows("v1") == ([2] if batching else [1, 1])
    runner.close()
    manager.close()


async def test_closing_fails_queued_requests_with_503(repo) -> None:
    """A request waiting for its batch when the server shuts down (its runner, then its
    engines, closed) is failed with 503 unavailable, not left waiting; so is one that
    arrives after."""
    backend = RiggedBackend(gate_timeout_s=GUARD_S)
    manager = EngineManager(backend, ModelRepository(repo[0]), ServerMetrics(), AuditLog())
    runner = Runner(
        manager.metrics, manager.row_limits, batching=BatchPolicy(64, 60.0, 4, frozenset({"mlp"}))
    )
    manager.register("mlp")
    await manager.load("mlp", "v1")
    x = {INPUT_NAME: np.ones((1, 8), np.float32)}
    queued = asyncio.create_task(runner.infer(manager.slot("mlp"), x))
    await until(lambda: runner.batchers.queued() == 1)
    v1 = manager.slot("mlp").current
    assert v1 is not None
    runner.close()
    manager.close()
    with pytest.raises(Unavailable, match="shutting down") as caught:
        await asyncio.wait_for(queued, GUARD_S)
    assert caught.value.status == 503 and backend.runs == []
    with pytest.raises(Unavailable, match="shutting down"):
        await runner.run(v1, x)
    assert backend.closed == ["v1"]  # the pins are gone: the engine is closed


# --- which models batch -----------------------------------------------------------------


async def test_a_model_with_a_fixed_first_axis_runs_each_request_alone(
    repo, server_config: ServerConfig
) -> None:
    add_graph(repo[0], "fixed", "v1", doubling(2))
    backend = RiggedBackend(gate_timeout_s=GUARD_S)
    x = np.arange(16, dtype=np.float32).reshape(2, 8)
    async with batched(
        server_config, backend, models=[ModelSpec("fixed", "v1")], max_batch_size=8,
        max_queue_delay_us=LONG_DELAY_US,
    ) as (client, _):  # fmt: skip
        answers = await asyncio.gather(*(infer(client, x, "fixed") for _ in range(3)))
        assert [status for status, _ in answers] == [200] * 3
        for _, answer in answers:
            np.testing.assert_array_equal(output_of(answer), 2 * x)
        assert backend.rows() == [2, 2, 2]


async def test_a_model_whose_outputs_do_not_follow_the_rows_runs_unbatched_from_then_on(
    repo, server_config: ServerConfig
) -> None:
    """Rows and their column sums: a batch's output has 6 rows, not the batch's 5, so its
    requests are run one by one (each gets its own rows and sums), and the version's
    later requests run alone."""
    add_graph(repo[0], "sums", "v1", with_column_sums())
    rng = np.random.default_rng(7)
    xs = [rows_of(rng, n) for n in (2, 3)]
    backend = RiggedBackend(gate_timeout_s=GUARD_S)
    async with batched(
        server_config, backend, models=[ModelSpec("sums", "v1")], max_batch_size=5,
        max_queue_delay_us=LONG_DELAY_US,
    ) as (client, _):  # fmt: skip
        answers = await asyncio.gather(*(infer(client, x, "sums") for x in xs))
        for x, (status, answer) in zip(xs, answers, strict=True):
            assert status == 200
            expected = np.concatenate([x, x.sum(0, keepdims=True)])
            np.testing.assert_allclose(output_of(answer), expected, rtol=1e-5, atol=1e-6)
        assert sorted(backend.rows()) == [2, 3, 5]
        later = await asyncio.gather(*(infer(client, x, "sums") for x in xs))  # no delay
        assert [status for status, _ in later] == [200, 200]
        assert sorted(backend.rows()[3:]) == [2, 3]


def centring() -> onnx.GraphProto:
    """output = input - the mean of its rows: each row depends on every other, while the
    output's rows follow the input's (nothing the batcher can see)."""
    return helper.make_graph(
        [
            helper.make_node("ReduceMean", [INPUT_NAME], ["mean"], axes=[0], keepdims=1),
            helper.make_node("Sub", [INPUT_NAME, "mean"], [OUTPUT_NAME]),
        ],
        "centring",
        [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, ["batch", 8])],
    )


async def test_a_model_not_opted_in_is_never_batched(repo, server_config: ServerConfig) -> None:
    """Batching is a model's choice (its rows must be independent): with a batch size
    set, a model not opted in runs every request alone, and each client gets the answer
    to its own rows only; the model opted in beside it batches."""
    add_graph(repo[0], "centring", "v1", centring())
    rng = np.random.default_rng(11)
    xs = [rows_of(rng, n) for n in (2, 3)]
    backend = RiggedBackend(gate_timeout_s=GUARD_S)
    async with batched(
        server_config, backend, models=[ModelSpec("mlp", "v1"), ModelSpec("centring", "v1")],
        max_batch_size=8, max_queue_delay_us=50_000, batch_models=("mlp",),
    ) as (client, _):  # fmt: skip
        answers = await asyncio.gather(*(infer(client, x, "centring") for x in xs))
        for x, (status, answer) in zip(xs, answers, strict=True):
            assert status == 200, answer
            np.testing.assert_allclose(output_of(answer), x - x.mean(0), atol=1e-5)
        assert sorted(backend.rows()) == [2, 3]
        config = await (await client.get("/v2/models/centring/config")).json()
        assert config["max_batch_size"] == 0
        answers = await asyncio.gather(*(infer(client, x) for x in xs))
        assert [status for status, _ in answers] == [200, 200]
        assert sorted(backend.rows()[2:]) == [5]


def test_unbatchable_reasons_and_profile_limits() -> None:
    from model_server.backends.tensorrt_backend import ProfiledTensorSpec

    f32 = np.dtype(np.float32)

    @dataclasses.dataclass
    class Specs:
        inputs: tuple[TensorSpec, ...]
        outputs: tuple[TensorSpec, ...]
        platform: str = "test"

        def infer(self, feeds: Feeds) -> dict[str, np.ndarray]:
            raise NotImplementedError

        def close(self) -> None:
            pass

    dynamic = TensorSpec("x", f32, (-1, 8))
    assert unbatchable_reason(Specs((dynamic,), (dynamic,))) is None
    assert "input 'x'" in str(unbatchable_reason(Specs((TensorSpec("x", f32, (2, 8)),), ())))
    assert "output 'y'" in str(unbatchable_reason(Specs((dynamic,), (TensorSpec("y", f32, ()),))))
    profiled = ProfiledTensorSpec("x", f32, (-1, 8), (1, 8), (8, 8), (32, 8))
    assert engine_max_rows(Specs((profiled,), (dynamic,))) == 32
    assert engine_max_rows(Specs((dynamic,), (dynamic,))) is None


# --- configuration ----------------------------------------------------------------------


def test_the_batching_flags_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    config = parse_args(["--repository", "/m"])
    assert (config.max_batch_size, config.max_queue_delay_us) == (
        defaults.MAX_BATCH_SIZE,
        defaults.MAX_QUEUE_DELAY_MICROSECONDS,
    )
    config = parse_args(["--repository", "/m", "--max-batch-size", "32",
                         "--max-queue-delay-us", "500", "--batch-model", "mlp"])  # fmt: skip
    assert (config.max_batch_size, config.max_queue_delay_us) == (32, 500)
    policy = BatchPolicy.from_flags(config.max_batch_size, config.max_queue_delay_us, 4)
    assert policy == BatchPolicy(32, 0.0005, 4) and policy.enabled
    assert parse_args(["--repository", "/m"]).batch_models == ()  # opt-in only
    line = ["--repository", "/m", "--batch-model", "mlp", "--batch-model", "acme/m"]
    assert parse_args(line).batch_models == ("mlp", "acme/m")
    policy = BatchPolicy.from_flags(8, 0, 4, ("mlp",))
    assert policy.models == frozenset({"mlp"})
    monkeypatch.setenv("MODEL_SERVER_MAX_BATCH_SIZE", "16")
    assert parse_args(["--repository", "/m", "--batch-model", "mlp"]).max_batch_size == 16
    for bad in (["--max-batch-size", "-1"], ["--max-queue-delay-us", "-5"],
                ["--batch-model", "a b"]):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_args(["--repository", "/m", *bad])


def test_a_batch_size_without_a_model_to_batch_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--max-batch-size alone batched nothing, silently (batching is opt-in per model):
    refused at startup, saying why."""
    with pytest.raises(SystemExit):
        parse_args(["--repository", "/m", "--max-batch-size", "32"])
    assert "--batch-model" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["batch_models", "max_rows"])
def test_a_model_named_in_the_flags_that_is_not_served_is_refused_at_startup(
    repo, server_config: ServerConfig, flag: str
) -> None:
    """A typo in --batch-model or --max-rows would leave the model unbatched or
    unbounded, silently: a name that is no model of the server's is refused at startup
    (the server serves a fixed set of models, known then)."""
    value: Any = ("mlp", "mpl") if flag == "batch_models" else {"mlp": 8, "acme/mlp": 4}
    config = dataclasses.replace(server_config, max_batch_size=8, **{flag: value})
    with pytest.raises(ConfigError, match="mpl" if flag == "batch_models" else "acme/mlp"):
        ModelServer(config)


def _example() -> dict[str, Any]:
    [doc] = yaml.safe_load_all((ROOT / "examples" / "modeldeployment.yaml").read_text())
    return dict(doc)


@pytest.mark.parametrize(
    ("batching", "accepted"),
    [
        ({}, True),
        ({"maxBatchSize": 64, "maxQueueDelayMicroseconds": 2000}, True),
        ({"maxBatchSize": 4096, "maxQueueDelayMicroseconds": 1_000_000}, True),
        ({"maxBatchSize": 4097}, False),
        ({"maxBatchSize": -1}, False),
        ({"maxQueueDelayMicroseconds": 1_000_001}, False),
        ({"maxBatchSize": "8"}, False),
        ({"maxBatchSize": True}, False),
    ],
)
def test_the_crd_field_is_validated_by_the_schema_and_the_operator(
    batching: dict[str, Any], accepted: bool
) -> None:
    doc = _example()
    doc["spec"]["server"] = {"batching": batching}
    schema = ResourceSchema.load(ROOT / "deploy" / "crds" / "modeldeployment.yaml")
    assert (not schema.problems(doc)) == accepted
    if accepted:
        parse_spec(doc["spec"])
    else:
        with pytest.raises(SpecError, match=r"spec\.server\.batching"):
            parse_spec(doc["spec"])


@pytest.mark.parametrize("batching", [None, {"maxBatchSize": 32, "maxQueueDelayMicroseconds": 750}])
def test_the_crd_field_reaches_the_servers_arguments(batching: dict[str, Any] | None) -> None:
    doc = _example()
    if batching is not None:
        doc["spec"]["server"] = {"batching": batching}
    spec = parse_spec(doc["spec"])
    pod = deployment("m", "ns", spec)["spec"]["template"]["spec"]
    [server] = [c for c in pod["containers"] if c["name"] == "server"]
    assert server["args"][0] == "model-server"
    config = parse_args(server["args"][1:])  # what the real server makes of it
    expected = (
        (32, 750) if batching else (defaults.MAX_BATCH_SIZE, defaults.MAX_QUEUE_DELAY_MICROSECONDS)
    )
    assert (config.max_batch_size, config.max_queue_delay_us) == expected
    # the deployment's model opts in
    assert config.batch_models == ((spec.model,) if batching else ())
    line = argv.server_argv(
        argv.ServerArgs("m", max_batch_size=8, max_queue_delay_us=100, batch_models=("m",))
    )
    assert (parse_args(line[1:]).max_batch_size, parse_args(line[1:]).max_queue_delay_us) == (
        8,
        100,
    )


async def test_the_server_batches_what_its_command_line_asks(
    repo, server_config: ServerConfig
) -> None:
    """Flags through the real parser into a real server: two requests run as one."""
    line = ["--repository", str(repo[0]), "--model", "mlp=v1", "--max-batch-size", "2",
            "--max-queue-delay-us", str(LONG_DELAY_US), "--batch-model", "mlp"]  # fmt: skip
    config = dataclasses.replace(parse_args(line), cache_dir=server_config.cache_dir)
    backend = RiggedBackend(gate_timeout_s=GUARD_S)
    rng = np.random.default_rng(8)
    async with batched(config, backend) as (client, _server):
        answers = await asyncio.gather(*(infer(client, rows_of(rng, 1)) for _ in range(2)))
        assert [status for status, _ in answers] == [200, 200] and backend.rows() == [2]
