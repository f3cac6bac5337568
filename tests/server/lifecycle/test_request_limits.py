"""Rows per request are bounded per model (issue 27): a request's memory grows with its
rows in every activation of the graph, far past its body's size, so a small body could
take gigabytes and take the pod from everyone. Refused with 400 before any run, over
HTTP JSON, HTTP binary data and gRPC alike."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnx
import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer
from onnx import TensorProto, helper

from model_operator.manifests import deployment
from model_operator.spec import SpecError, parse_spec
from model_rollout_contract import defaults
from model_rollout_e2e.onnx_models import INPUT_NAME
from model_server.app import SERVER, ModelServer
from model_server.backends.base import ModelFile
from model_server.backends.onnx_rows import bytes_per_row
from model_server.config import ModelSpec, ServerConfig, parse_args
from model_server.errors import BadRequest
from model_server.frontends.grpc.protocol import grpc_service_pb2 as pb
from model_server.frontends.grpc.protocol import grpc_service_pb2_grpc as pb_grpc
from model_server.lifecycle.request_limits import RowLimits
from model_server.protocol.tensor_spec import TensorSpec
from model_server.protocol.tensors import MAX_ELEMENTS
from tests.support.crd_validation import ResourceSchema
from tests.support.server import add_version, infer_body, sample, samples, write_manifest

ROOT = Path(__file__).resolve().parents[3]
WIDE = "/v2/models/wide/infer"
HIDDEN = 16384  # one hidden layer: 128 KiB a row, a few hundred KiB of weights
PER_ROW = 2 * HIDDEN * 4 + 8 * 4 + 4 * 4  # twice the widest tensor, plus input and output


@pytest.fixture
def wide_config(server_config: ServerConfig, repo) -> ServerConfig:
    add_version(repo[0], "wide", "v1", seed=4, hidden=HIDDEN, depth=2)
    return dataclasses.replace(
        server_config, models=[ModelSpec("mlp", "v1"), ModelSpec("wide", "v1")]
    )


@pytest.fixture
async def wide_client(wide_config: ServerConfig) -> AsyncIterator[TestClient]:
    async with TestClient(TestServer(ModelServer(wide_config).make_app())) as client:
        yield client


def rows(n: int) -> np.ndarray:
    return np.ones((n, 8), np.float32)


def test_memory_per_row_is_estimated_from_the_graph(repo) -> None:
    version = add_version(repo[0], "wide", "v1", seed=4, hidden=HIDDEN, depth=2)
    assert bytes_per_row(ModelFile.read(version.path).data) == PER_ROW


async def test_a_request_of_more_rows_than_the_default_allows_is_400_before_it_runs(
    wide_client: TestClient,
) -> None:
    """The default: --request-memory-mb (1 GiB) over the model's memory per row. One row
    more than that (a 256 KiB body, which ran and took about a gigabyte) is refused."""
    limit = defaults.REQUEST_MEMORY_MB * 2**20 // PER_ROW
    x = rows(limit + 1)
    header = json.dumps(
        {"inputs": [{"name": INPUT_NAME, "datatype": "FP32", "shape": list(x.shape),
                     "parameters": {"binary_data_size": x.nbytes}}]}
    ).encode()  # fmt: skip
    response = await wide_client.post(
        WIDE,
        data=header + x.tobytes(),
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    answer = await response.json()
    assert response.status == 400, answer
    assert answer["code"] == "bad_request" and f"at most {limit} rows" in answer["error"]
    found = samples(await (await wide_client.get("/metrics")).text())
    assert sample(found, "model_server_version_requests_total", model="wide", version="v1") == 0


async def test_the_bound_holds_over_json_binary_and_grpc(wide_config: ServerConfig) -> None:
    config = dataclasses.replace(wide_config, request_memory_mb=4, grpc_port=0)
    limit = 4 * 2**20 // PER_ROW
    app = ModelServer(config).make_app()
    async with TestClient(TestServer(app)) as client:
        for n, status in ((limit + 1, 400), (limit, 200)):
            response = await client.post(WIDE, json=infer_body(rows(n)))
            assert response.status == status, (n, await response.text())
            x = rows(n)
            header = json.dumps(
                {"inputs": [{"name": INPUT_NAME, "datatype": "FP32", "shape": [n, 8],
                             "parameters": {"binary_data_size": x.nbytes}}]}
            ).encode()  # fmt: skip
            response = await client.post(
                WIDE,
                data=header + x.tobytes(),
                headers={"Inference-Header-Content-Length": str(len(header))},
            )
            assert response.status == status, (n, await response.text())
        grpc_port = app[SERVER].grpc.port  # type: ignore[union-attr]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            request = pb.ModelInferRequest(model_name="wide")
            request.inputs.add(name=INPUT_NAME, datatype="FP32", shape=[limit + 1, 8])
            request.raw_input_contents.append(rows(limit + 1).tobytes())
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.ModelInfer(request)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"at most {limit} rows" in (caught.value.details() or "")


async def test_a_models_configured_bound_wins(wide_config: ServerConfig) -> None:
    config = dataclasses.replace(wide_config, max_rows={"mlp": 3})
    async with TestClient(TestServer(ModelServer(config).make_app())) as client:
        refused = await client.post("/v2/models/mlp/infer", json=infer_body(rows(4)))
        assert refused.status == 400 and "at most 3 rows" in (await refused.json())["error"]
        fine = await client.post("/v2/models/mlp/infer", json=infer_body(rows(3)))
        assert fine.status == 200


def test_the_flags(tmp_path: Path) -> None:
    config = parse_args(
        ["--repository", str(tmp_path), "--max-rows", "mlp=64", "--max-rows", "acme/m=8",
         "--request-memory-mb", "256"]
    )  # fmt: skip
    assert config.max_rows == {"mlp": 64, "acme/m": 8} and config.request_memory_mb == 256
    assert parse_args(["--repository", str(tmp_path)]).max_rows == {}
    for bad in (["--max-rows", "mlp"], ["--max-rows", "mlp=0"], ["--max-rows", "a b=3"],
                ["--request-memory-mb", "0"]):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_args(["--repository", str(tmp_path), *bad])


def _example() -> dict[str, Any]:
    [doc] = yaml.safe_load_all((ROOT / "examples" / "modeldeployment.yaml").read_text())
    return dict(doc)


@pytest.mark.parametrize(("rows", "accepted"), [(64, True), (0, False), ("8", False)])
def test_the_crd_field_reaches_the_servers_arguments(rows: Any, accepted: bool) -> None:
    """spec.server.maxRowsPerRequest is the deployment's model's --max-rows; absent, the
    server derives the bound."""
    doc = _example()
    schema = ResourceSchema.load(ROOT / "deploy" / "crds" / "modeldeployment.yaml")
    assert not schema.problems(doc)
    config = parse_args(_server_args(parse_spec(doc["spec"]))[1:])
    assert config.max_rows == {}
    doc["spec"]["server"] = {"maxRowsPerRequest": rows}
    assert (not schema.problems(doc)) == accepted
    if not accepted:
        with pytest.raises(SpecError, match=r"spec\.server\.maxRowsPerRequest"):
            parse_spec(doc["spec"])
        return
    spec = parse_spec(doc["spec"])
    config = parse_args(_server_args(spec)[1:])
    assert config.max_rows == {spec.model: rows}


def _server_args(spec: Any) -> list[str]:
    pod = deployment("m", "ns", spec)["spec"]["template"]["spec"]
    [server] = [c for c in pod["containers"] if c["name"] == "server"]
    return list(server["args"])


def _write_with_table(path: Path) -> None:
    """``y = x`` with ``x: [batch, 8]`` beside ``t: [64, 2]``, a fixed-size table whose
    first axis is no batch: its 64 are no rows."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"]), helper.make_node("Identity", ["t"], ["u"])],
        "table",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8]),
            helper.make_tensor_value_info("t", TensorProto.FLOAT, [64, 2]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8]),
            helper.make_tensor_value_info("u", TensorProto.FLOAT, [64, 2]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True)
    onnx.save(model, path)
    write_manifest(path)


def _feeds_body(feeds: dict[str, np.ndarray]) -> dict[str, Any]:
    return {
        "inputs": [
            {"name": n, "datatype": "FP32", "shape": list(a.shape), "data": a.ravel().tolist()}
            for n, a in feeds.items()
        ]
    }


async def test_a_fixed_first_axis_is_no_rows(server_config: ServerConfig, repo) -> None:
    """Only a dynamic first axis counts as rows: an input of fixed shape [64, 2] is no
    request of 64 rows (before, refused with 400 for a model of at most 3 rows)."""
    _write_with_table(repo[0] / "table" / "v1" / "model.onnx")
    config = dataclasses.replace(
        server_config, models=[ModelSpec("table", "v1")], max_rows={"table": 3}
    )
    t = np.ones((64, 2), np.float32)
    async with TestClient(TestServer(ModelServer(config).make_app())) as client:
        fine = await client.post("/v2/models/table/infer", json=_feeds_body({"x": rows(3), "t": t}))
        assert fine.status == 200, await fine.text()
        refused = await client.post(
            "/v2/models/table/infer", json=_feeds_body({"x": rows(4), "t": t})
        )
        assert refused.status == 400 and "'x': 4 rows" in (await refused.json())["error"]


def _write_sequence(path: Path) -> None:
    """``x: [batch, seq, 8]`` through a 4096-wide layer, averaged over ``seq``: each
    position of a row takes the layer's width, so memory grows with rows times ``seq``
    (shape inference counts ``seq`` as 1 in the estimate per row)."""
    weights = np.full((8, 4096), 0.01, np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["h"]),
            helper.make_node("ReduceMean", ["h"], ["y"], axes=[1], keepdims=0),
        ],
        "sequence",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4096])],
        [onnx.numpy_helper.from_array(weights, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True)
    onnx.save(model, path)
    write_manifest(path)


async def test_a_second_dynamic_axis_counts_in_a_requests_memory(
    server_config: ServerConfig, repo
) -> None:
    """Rows were bounded, but one row of a [batch, seq] input could be any length: its
    elements are bounded by the model's estimate too (before, one row of seq over the
    bound ran: 200)."""
    path = repo[0] / "sequence" / "v1" / "model.onnx"
    _write_sequence(path)
    per_row = bytes_per_row(ModelFile.read(path).data)
    assert per_row is not None
    config = dataclasses.replace(
        server_config, models=[ModelSpec("sequence", "v1")], request_memory_mb=4
    )
    most = 4 * 2**20 // per_row  # positions (rows times seq) one request may have
    async with TestClient(TestServer(ModelServer(config).make_app())) as client:
        for shape, status in (((1, most), 200), ((1, most + 1), 400), ((2, most // 2 + 1), 400)):
            x = np.ones((*shape, 8), np.float32)
            response = await client.post("/v2/models/sequence/infer", json=_feeds_body({"x": x}))
            assert response.status == status, (shape, await response.text())
            if status == 400:
                assert "--request-memory-mb" in (await response.json())["error"]


class _NoEstimate:
    """An engine with no memory estimate per row (as torch's)."""

    platform = "test"
    inputs = (TensorSpec("x", np.dtype(np.float32), (-1, -1)),)
    outputs = (TensorSpec("y", np.dtype(np.float32), (-1, -1)),)

    def infer(self, feeds: Any) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def close(self) -> None:
        pass


def test_a_model_without_an_estimate_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """No estimate (torch, an unknown graph) and no --max-rows: said once per model,
    and only the element limit bounds its requests."""
    limits = RowLimits(2**20)
    engine = _NoEstimate()
    with caplog.at_level(logging.WARNING, logger="model_server.lifecycle.request_limits"):
        for _ in range(3):
            limits.check("seq", engine, {"x": np.ones((4000, 200), np.float32)})
        with pytest.raises(BadRequest, match="elements"):
            limits.check("seq", engine, {"x": np.ones((1, MAX_ELEMENTS + 1), np.bool_)})
    said = [r.getMessage() for r in caplog.records if "no memory estimate" in r.getMessage()]
    assert len(said) == 1 and "'seq'" in said[0], said


@pytest.mark.parametrize(
    ("entry", "accepted"),
    [
        ({"batching": True, "maxRowsPerRequest": 16}, True),
        ({"batching": False}, True),
        ({"maxRowsPerRequest": 0}, False),
        ({"batching": "yes"}, False),
    ],
)
def test_tenant_models_set_their_batching_and_rows_through_the_crd(
    entry: dict[str, Any], accepted: bool
) -> None:
    """spec.tenants.models[] entries opt their model in to batching (under
    spec.server.batching's sizes) and bound its rows, as spec.server does for the
    deployment's model: each reaches the server's --batch-model / --max-rows."""
    doc = _example()
    doc["spec"]["server"] = {"batching": {"maxBatchSize": 8}}
    model = {"name": "acme-m", "tenant": "acme", "model": "m", "version": "v1", **entry}
    doc["spec"]["tenants"] = {"secretName": "keys", "models": [model]}
    for crd in ("deploy/crds", "deploy/helm/model-rollout/crds"):
        schema = ResourceSchema.load(ROOT / crd / "modeldeployment.yaml")
        assert (not schema.problems(doc)) == accepted, schema.problems(doc)
    if not accepted:
        with pytest.raises(SpecError, match=r"spec\.tenants\.models\[0\]"):
            parse_spec(doc["spec"])
        return
    spec = parse_spec(doc["spec"])
    config = parse_args(_server_args(spec)[1:])
    batched = (spec.model, "acme/m") if entry.get("batching") else (spec.model,)
    assert config.batch_models == batched
    rows = {"acme/m": entry["maxRowsPerRequest"]} if "maxRowsPerRequest" in entry else {}
    assert config.max_rows == rows


def test_a_tenant_model_batching_needs_a_batch_size() -> None:
    doc = _example()
    model = {"name": "acme-m", "tenant": "acme", "model": "m", "version": "v1", "batching": True}
    doc["spec"]["tenants"] = {"secretName": "keys", "models": [model]}
    with pytest.raises(SpecError, match=r"maxBatchSize"):
        parse_spec(doc["spec"])
