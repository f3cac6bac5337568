"""The KServe v2 gRPC API (issue 12), driven by a third-party client: ``tritonclient.grpc``
(its asyncio client, and its own generated stub where a call needs what the client does
not send: typed contents, trailing metadata). The server is a real one on real ports
(in this event loop, or a process of its own), serving real ONNX models.

Also: the committed protocol code is what protoc writes from the vendored protos, the
dependency bounds are what that code checks at import, and the service is Triton's on
the wire."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import signal
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tomllib
import tritonclient.grpc as grpcclient
import yaml
from aiohttp.test_utils import TestClient, TestServer
from google.protobuf.descriptor import Descriptor
from tritonclient.grpc import service_pb2 as triton_pb
from tritonclient.grpc import service_pb2_grpc as triton_pb_grpc
from tritonclient.grpc.aio import InferenceServerClient
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

from model_rollout_contract import argv, defaults
from model_rollout_e2e.onnx_models import INPUT_NAME, OUTPUT_NAME
from model_rollout_e2e.processes import ServerProcess, free_port
from model_server import errors
from model_server.app import SERVER, ModelServer
from model_server.config import MAX_REQUEST_BYTES, ModelSpec, ServerConfig, parse_args
from model_server.errors import BadRequest
from model_server.frontends.grpc.api import STATUS_CODES, UNIMPLEMENTED, InferenceService
from model_server.frontends.grpc.codec import decode_request, encode_response
from model_server.frontends.grpc.protocol import generate
from model_server.frontends.grpc.protocol import grpc_service_pb2 as pb
from model_server.protocol.tensor_spec import TensorSpec
from tests.support.server import (
    ADMIN,
    ADMIN_TOKEN,
    GatedBackend,
    RaisingBackend,
    add_version,
    ask,
    sample,
    samples,
    write_gate,
    write_manifest,
)

ROOT = Path(__file__).resolve().parents[4]
SERVICE = "inference.GRPCInferenceService"
ADMIN_METADATA = {"authorization": f"Bearer {ADMIN_TOKEN}"}  # gRPC metadata keys: lower case


@dataclasses.dataclass
class Served:
    server: ModelServer
    http: TestClient
    client: InferenceServerClient  # tritonclient.grpc.aio
    stub: Any  # tritonclient's generated stub, on a channel of its own
    versions: dict[str, Any]


@pytest.fixture
async def served(server_config: ServerConfig, repo) -> AsyncIterator[Served]:
    async with serving(dataclasses.replace(server_config, grpc_port=0), repo[1]) as s:
        yield s


class serving:
    """A ModelServer on real ports (HTTP through aiohttp's test server, gRPC its own),
    with tritonclient's clients connected to its gRPC port."""

    def __init__(self, config: ServerConfig, versions: dict[str, Any], backend: Any = None):
        self.app = ModelServer(config, backend).make_app()
        self.versions = versions

    async def __aenter__(self) -> Served:
        self.http = TestClient(TestServer(self.app))
        try:
            await self.http.start_server()
        except BaseException:
            await self.http.close()  # what did start is stopped (on_cleanup runs)
            raise
        server = self.app[SERVER]
        assert server.grpc is not None and server.grpc.port
        url = f"127.0.0.1:{server.grpc.port}"
        self.channel = grpc.aio.insecure_channel(url)
        self.client = InferenceServerClient(url)
        stub = triton_pb_grpc.GRPCInferenceServiceStub(self.channel)
        return Served(server, self.http, self.client, stub, self.versions)

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()
        await self.channel.close()
        await self.http.close()


def triton_input(x: np.ndarray, name: str = INPUT_NAME) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(x.shape), grpcclient.np_to_triton_dtype(x.dtype))
    tensor.set_data_from_numpy(x)
    return tensor


def batch(seed: int, rows: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 8)).astype(np.float32)


async def refusal(call: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        await call
    return caught.value


async def rpc_error(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


def trailer(error: grpc.aio.AioRpcError, key: str) -> str | None:
    return dict(error.trailing_metadata() or ()).get(key)


# -- the protocol code ----------------------------------------------------------------
def test_the_committed_code_is_what_protoc_writes_from_the_vendored_protos(
    tmp_path: Path,
) -> None:
    for fresh in generate.generate(tmp_path):
        committed = generate.HERE / fresh.name
        assert committed.read_text() == fresh.read_text(), (
            f"{committed} is stale: run make grpc-protocol"
        )


def test_dependency_bounds_are_what_the_generated_code_checks_at_import() -> None:
    server_deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["server"]
    bounds = dict(re.fullmatch(r"([\w-]+)>=([\d.]+)", d).groups() for d in server_deps)  # type: ignore[union-attr]
    for module in ("grpc_service_pb2.py", "model_config_pb2.py"):
        text = (generate.HERE / module).read_text()
        found = re.search(r"Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", text)
        assert found is not None
        assert bounds["protobuf"] == ".".join(found.groups()), module
    grpc_code = (generate.HERE / "grpc_service_pb2_grpc.py").read_text()
    found = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_code)
    assert found is not None and bounds["grpcio"] == found.group(1)


def _fields(message: Descriptor) -> dict[str, tuple[int, int, bool, str | None]]:
    return {
        f.name: (
            f.number,
            f.type,
            f.is_repeated,
            f.message_type.full_name if f.message_type else None,
        )
        for f in message.fields
    }


def _same_on_the_wire(theirs: Descriptor, ours: Descriptor, seen: set[str]) -> None:
    """Every field of tritonclient's message is ours too (number, type, repeated), and the
    same holds for every message it contains."""
    if theirs.full_name in seen:
        return
    seen.add(theirs.full_name)
    assert ours.full_name == theirs.full_name
    mine = _fields(ours)
    for name, field in _fields(theirs).items():
        assert mine.get(name) == field, f"{theirs.full_name}.{name}"
    for f in theirs.fields:
        if f.message_type is not None:
            _same_on_the_wire(f.message_type, ours.fields_by_name[f.name].message_type, seen)


def test_the_service_is_tritons_on_the_wire_and_both_live_in_one_process() -> None:
    theirs = triton_pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    ours = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert ours.full_name == theirs.full_name == SERVICE
    assert {m.name for m in theirs.methods} <= {m.name for m in ours.methods}
    seen: set[str] = set()
    for method in theirs.methods:
        mine = ours.methods_by_name[method.name]
        assert (mine.client_streaming, mine.server_streaming) == (
            method.client_streaming,
            method.server_streaming,
        )
        _same_on_the_wire(method.input_type, mine.input_type, seen)
        _same_on_the_wire(method.output_type, mine.output_type, seen)
    # a request tritonclient writes is read back field for field
    request = grpcclient.InferInput(INPUT_NAME, [1, 8], "FP32")
    request.set_data_from_numpy(np.ones((1, 8), np.float32))
    wire = triton_pb.ModelInferRequest(
        model_name="mlp", id="r1", inputs=[request._get_tensor()], raw_input_contents=[b"x"]
    ).SerializeToString()
    parsed = pb.ModelInferRequest.FromString(wire)
    assert (parsed.model_name, parsed.id, list(parsed.inputs[0].shape)) == ("mlp", "r1", [1, 8])


def test_every_rpc_of_the_service_is_served_here_or_refused_with_a_reason() -> None:
    for method in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
        assert method.name in vars(InferenceService), f"{method.name} falls back to the stub's"
    assert set(UNIMPLEMENTED) <= set(vars(InferenceService))


def test_the_server_imports_grpc_only_when_its_port_is_on() -> None:
    """The GPU machine's benchmarks run servers without grpcio."""
    code = (
        "import sys; from model_server.config import parse_args; "
        "from model_server.app import ModelServer; "
        "ModelServer(parse_args(['--repository', '/nonexistent'])); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'grpc'"
        " or m.startswith('model_server.grpc')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_every_serving_error_has_a_grpc_status() -> None:
    def subclasses(cls: type) -> list[type]:
        return [cls, *(s for sub in cls.__subclasses__() for s in subclasses(sub))]

    for cls in subclasses(errors.ServingError):
        assert cls.status in STATUS_CODES, cls.__name__
    assert STATUS_CODES[404] == grpc.StatusCode.NOT_FOUND
    assert STATUS_CODES[503] == grpc.StatusCode.UNAVAILABLE


# -- the codec, on real messages --------------------------------------------------------
BYTES_SPEC = (TensorSpec("text", np.dtype(object), (-1,)),)


def test_bytes_tensors_read_and_written_as_tritonclient_frames_them() -> None:
    values = np.array([b"", b"caf\xc3\xa9", b"\x00\xff" * 3], dtype=object)
    raw = serialize_byte_tensor(values).item()
    request = pb.ModelInferRequest(raw_input_contents=[raw])
    request.inputs.add(name="text", datatype="BYTES", shape=[3])
    decoded = decode_request(request, BYTES_SPEC)
    assert list(decoded.feeds["text"]) == list(values)
    typed = pb.ModelInferRequest()
    typed.inputs.add(name="text", datatype="BYTES", shape=[3]).contents.bytes_contents.extend(
        values.tolist()
    )
    assert list(decode_request(typed, BYTES_SPEC).feeds["text"]) == list(values)
    answer = encode_response("m", "v1", "r", {"out": values.reshape(3, 1)})
    wire = triton_pb.ModelInferResponse.FromString(answer.SerializeToString())
    got = grpcclient.InferResult(wire).as_numpy("out")
    assert got.shape == (3, 1) and list(got.ravel()) == list(values)
    for short in (raw[:-1], raw[:2], raw + b"\x00"):
        broken = pb.ModelInferRequest(raw_input_contents=[short])
        broken.inputs.add(name="text", datatype="BYTES", shape=[3])
        with pytest.raises(BadRequest):
            decode_request(broken, BYTES_SPEC)


@pytest.mark.parametrize(
    ("datatype", "field", "values", "why"),
    [
        ("INT8", "int_contents", [1, 300], "outside INT8's range"),
        ("UINT8", "uint_contents", [1, 256], "outside UINT8's range"),
        ("FP16", "fp32_contents", [1.0, 2.0], "raw_input_contents only"),
        ("FP32", "int_contents", [1, 2], "int_contents given for a FP32 input"),
        ("FP32", "fp32_contents", [1.0], "1 values in fp32_contents for a shape [2]"),
    ],
)
def test_typed_contents_are_checked_like_any_input(
    datatype: str, field: str, values: list[Any], why: str
) -> None:
    dtypes = {"INT8": np.int8, "UINT8": np.uint8, "FP16": np.float16, "FP32": np.float32}
    spec = (TensorSpec("x", np.dtype(dtypes[datatype]), (2,)),)
    request = pb.ModelInferRequest()
    getattr(request.inputs.add(name="x", datatype=datatype, shape=[2]).contents, field).extend(
        values
    )
    with pytest.raises(BadRequest, match=re.escape(why)):
        decode_request(request, spec)


# -- health, metadata and configuration through tritonclient ---------------------------
async def test_health_metadata_and_config_through_tritonclient(served: Served) -> None:
    client = served.client
    assert await client.is_server_live() and await client.is_server_ready()
    assert await client.is_model_ready("mlp")
    assert await client.is_model_ready("mlp", "v1")
    server = await client.get_server_metadata()
    assert server.name and server.version and "model_repository" in server.extensions
    meta = await client.get_model_metadata("mlp")
    assert (meta.name, list(meta.versions), meta.platform) == ("mlp", ["v1"], "onnxruntime_onnx")
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
        (INPUT_NAME, "FP32", [-1, 8])
    ]
    assert [t.name for t in meta.outputs] == [OUTPUT_NAME]
    config = (await client.get_model_config("mlp")).config
    assert (config.name, config.platform, config.max_batch_size) == ("mlp", "onnxruntime_onnx", 0)
    assert config.input[0].name == INPUT_NAME and list(config.input[0].dims) == [-1, 8]
    assert grpcclient.model_config_pb2.DataType.Name(config.input[0].data_type) == "TYPE_FP32"
    as_json = await client.get_model_metadata("mlp", as_json=True)
    assert as_json["inputs"][0]["datatype"] == "FP32"


# -- inference --------------------------------------------------------------------------
async def test_infer_with_raw_contents_as_tritonclient_sends_them(served: Served) -> None:
    x, v1 = batch(1), served.versions["v1"]
    result = await served.client.infer(
        "mlp",
        [triton_input(x)],
        request_id="req-1",
        outputs=[grpcclient.InferRequestedOutput(OUTPUT_NAME)],
    )
    response = result.get_response()
    assert (response.model_name, response.model_version, response.id) == ("mlp", "v1", "req-1")
    assert len(response.raw_output_contents) == 1  # answers are raw, as Triton's
    np.testing.assert_allclose(result.as_numpy(OUTPUT_NAME), v1.expected(x), atol=1e-4)
    unnamed = (await served.client.infer("mlp", [triton_input(x)])).get_response()
    assert unnamed.id  # one is made up when the request has none


async def test_infer_with_typed_contents(served: Served) -> None:
    x, v1 = batch(2, rows=2), served.versions["v1"]
    request = triton_pb.ModelInferRequest(model_name="mlp")
    tensor = request.inputs.add(name=INPUT_NAME, datatype="FP32", shape=list(x.shape))
    tensor.contents.fp32_contents.extend(x.ravel().tolist())
    response = await served.stub.ModelInfer(request)
    got = grpcclient.InferResult(response).as_numpy(OUTPUT_NAME)
    np.testing.assert_allclose(got, v1.expected(x), atol=1e-4)
    tensor.contents.fp32_contents.append(1.0)  # one value too many
    error = await rpc_error(served.stub.ModelInfer(request))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert trailer(error, "error-code") == "bad_request"


async def test_a_retained_version_answers_by_version(served: Served) -> None:
    reload = await served.http.post("/v1/reload?target_version=v2", headers=ADMIN)
    assert reload.status == 200, await reload.text()
    x, client = batch(3), served.client
    for version, asked in (("v2", ""), ("v1", "v1"), ("v2", "v2")):
        result = await client.infer("mlp", [triton_input(x)], model_version=asked)
        assert result.get_response().model_version == version
        np.testing.assert_allclose(
            result.as_numpy(OUTPUT_NAME), served.versions[version].expected(x), atol=1e-4
        )
    assert await client.is_model_ready("mlp", "v1")
    error = await refusal(client.infer("mlp", [triton_input(x)], model_version="v3"))
    assert error.status() == "StatusCode.NOT_FOUND", error
    pinned = await client.infer("mlp", [triton_input(x)], headers={"x-model-version": "v1"})
    assert pinned.get_response().model_version == "v1"


async def test_refusals_are_the_grpc_status_of_their_http_status(served: Served) -> None:
    client, x = served.client, batch(4)

    async def status(call: Any) -> str:
        return (await refusal(call)).status()

    assert await status(client.infer("nope", [triton_input(x)])) == "StatusCode.NOT_FOUND"
    assert await status(client.get_model_metadata("nope")) == "StatusCode.NOT_FOUND"
    assert await status(client.infer("bad name!", [triton_input(x)])) == (
        "StatusCode.INVALID_ARGUMENT"
    )
    wrong_type = triton_input(x.astype(np.float64))
    assert await status(client.infer("mlp", [wrong_type])) == "StatusCode.INVALID_ARGUMENT"
    wrong_shape = triton_input(np.ones((2, 3), np.float32))
    assert await status(client.infer("mlp", [wrong_shape])) == "StatusCode.INVALID_ARGUMENT"
    unknown = triton_input(x, name="other")
    assert await status(client.infer("mlp", [unknown])) == "StatusCode.INVALID_ARGUMENT"
    stateful = client.infer("mlp", [triton_input(x)], sequence_id=7, sequence_start=True)
    assert await status(stateful) == "StatusCode.INVALID_ARGUMENT"
    missing_output = [grpcclient.InferRequestedOutput("nope")]
    assert await status(client.infer("mlp", [triton_input(x)], outputs=missing_output)) == (
        "StatusCode.INVALID_ARGUMENT"
    )

    short = triton_pb.ModelInferRequest(model_name="mlp", raw_input_contents=[b"\0" * 31])
    short.inputs.add(name=INPUT_NAME, datatype="FP32", shape=[1, 8])
    error = await rpc_error(served.stub.ModelInfer(short))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "31 bytes" in error.details()
    both = triton_pb.ModelInferRequest(model_name="mlp", raw_input_contents=[b"\0" * 32])
    both.inputs.add(name=INPUT_NAME, datatype="FP32", shape=[1, 8]).contents.fp32_contents.extend(
        [0.0] * 8
    )
    error = await rpc_error(served.stub.ModelInfer(both))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "raw_input_contents" in (
        error.details()
    )
    shared = triton_pb.ModelInferRequest(model_name="mlp")
    tensor = shared.inputs.add(name=INPUT_NAME, datatype="FP32", shape=[1, 8])
    tensor.parameters["shared_memory_region"].string_param = "region"
    error = await rpc_error(served.stub.ModelInfer(shared))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "shared-memory" in error.details()

    rows = MAX_REQUEST_BYTES // 32 + 1  # one row of 8 FP32 over the limit
    huge = triton_pb.ModelInferRequest(model_name="mlp", raw_input_contents=[b"\0" * rows * 32])
    huge.inputs.add(name=INPUT_NAME, datatype="FP32", shape=[rows, 8])
    error = await rpc_error(served.stub.ModelInfer(huge))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    for call in (
        client.get_system_shared_memory_status(),
        client.get_cuda_shared_memory_status(),
        client.get_log_settings(),
        client.get_trace_settings(),
    ):
        error_text = await refusal(call)
        assert error_text.status() == "StatusCode.UNIMPLEMENTED" and "not supported" in str(
            error_text
        )
    # the server is fine afterwards
    assert (await client.infer("mlp", [triton_input(x)])).get_response().model_version == "v1"


async def test_grpc_inferences_are_in_the_same_metrics_as_http_ones(served: Served) -> None:
    x = batch(5)
    for _ in range(3):
        await served.client.infer("mlp", [triton_input(x)])
    await refusal(served.client.infer("mlp", [triton_input(x.astype(np.float64))]))
    text = await (await served.http.get("/metrics")).text()
    found = samples(text)
    assert sample(found, "model_server_inference_requests_total", model="mlp", code="200") == 3
    assert sample(found, "model_server_inference_requests_total", model="mlp", code="400") == 1
    stats = await served.client.get_inference_statistics("mlp")
    assert [s.name for s in stats.model_stats] == ["mlp"]
    assert stats.model_stats[0].inference_stats.success.count == 3


async def test_a_bad_model_version_is_counted_as_http_counts_it(served: Served) -> None:
    """A malformed ``model_version`` is the client's mistake: INVALID_ARGUMENT, counted
    as 400 (as the HTTP API counts ``/versions/bad name!/infer``); one not loaded is
    NOT_FOUND, counted as 404. Neither is a 500 in the metrics."""
    x, client = batch(6), served.client
    malformed = await refusal(client.infer("mlp", [triton_input(x)], model_version="bad name!"))
    assert malformed.status() == "StatusCode.INVALID_ARGUMENT", malformed
    missing = await refusal(client.infer("mlp", [triton_input(x)], model_version="v9"))
    assert missing.status() == "StatusCode.NOT_FOUND", missing
    http = await served.http.post("/v2/models/mlp/versions/bad%20name!/infer", json={"inputs": []})
    assert http.status == 400
    found = samples(await (await served.http.get("/metrics")).text())
    assert sample(found, "model_server_inference_requests_total", model="mlp", code="400") == 2
    assert sample(found, "model_server_inference_requests_total", model="mlp", code="404") == 1
    assert sample(found, "model_server_inference_requests_total", model="mlp", code="500") == 0


async def test_inputs_that_disagree_on_a_shared_dim_are_invalid_argument(
    server_config: ServerConfig, repo
) -> None:
    """As over HTTP: inputs giving the model's named axis ``batch`` two sizes are the
    client's INVALID_ARGUMENT (counted 400), never INTERNAL on the version's series."""
    write_gate(repo[0] / "gate" / "v1" / "model.onnx")
    write_manifest(repo[0] / "gate" / "v1" / "model.onnx")
    config = dataclasses.replace(
        server_config, grpc_port=0, models=[ModelSpec("mlp", "v1"), ModelSpec("gate", "v1")]
    )
    async with serving(config, repo[1]) as s:
        request = triton_pb.ModelInferRequest(model_name="gate")
        rows = {"mask": 2, "half": 2, "x": 3}
        for name, datatype, dtype in (
            ("mask", "BOOL", np.bool_), ("half", "FP16", np.float16), ("x", "FP32", np.float32)
        ):  # fmt: skip
            request.inputs.add(name=name, datatype=datatype, shape=[rows[name], 3])
            request.raw_input_contents.append(np.zeros((rows[name], 3), dtype).tobytes())
        error = await rpc_error(s.stub.ModelInfer(request, metadata=(("x-model-version", "v1"),)))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert "'batch'" in error.details()
        found = samples(await (await s.http.get("/metrics")).text())
        assert sample(found, "model_server_inference_requests_total", model="gate", code="400") == 1
        assert sample(found, "model_server_inference_requests_total", model="gate", code="500") == 0


async def test_an_engine_raising_is_internal_with_its_message(
    server_config: ServerConfig, repo
) -> None:
    config = dataclasses.replace(server_config, grpc_port=0)
    async with serving(config, repo[1], RaisingBackend()) as s:
        request = triton_pb.ModelInferRequest(model_name="mlp")
        request.inputs.add(name=INPUT_NAME, datatype="FP32", shape=[1, 8])
        request.raw_input_contents.append(np.full((1, 8), 1000.0, np.float32).tobytes())
        error = await rpc_error(s.stub.ModelInfer(request))
        assert error.code() == grpc.StatusCode.INTERNAL
        assert error.details() == f"internal error: {RaisingBackend.MESSAGE}"
        assert trailer(error, "error-code") == "internal_error"
        fine = await s.client.infer("mlp", [triton_input(np.ones((1, 8), np.float32))])
        assert fine.get_response().model_version == "v1"


# -- the model repository extension ---------------------------------------------------
async def test_repository_index_load_and_unload_need_the_admin_token(served: Served) -> None:
    client, x = served.client, batch(6)
    index = await client.get_model_repository_index(headers=ADMIN_METADATA)
    assert [(m.name, m.version, m.state) for m in index.models] == [
        ("mlp", "v1", "READY"),
        ("mlp", "v2", "UNAVAILABLE"),
        ("mlp", "v3", "UNAVAILABLE"),
    ]
    ready = await served.stub.RepositoryIndex(
        triton_pb.RepositoryIndexRequest(ready=True), metadata=tuple(ADMIN_METADATA.items())
    )
    assert [(m.name, m.version) for m in ready.models] == [("mlp", "v1")]
    for headers in (None, {"authorization": "Bearer wrong"}):
        for call in (
            client.get_model_repository_index(headers=headers),
            client.load_model("mlp", headers=headers),
            client.unload_model("mlp", headers=headers),
        ):
            error = await refusal(call)
            assert error.status() == "StatusCode.UNAUTHENTICATED", error
    assert await client.is_model_ready("mlp")  # nothing was unloaded

    await client.unload_model("mlp", headers=ADMIN_METADATA)
    assert not await client.is_model_ready("mlp")
    error = await refusal(client.infer("mlp", [triton_input(x)]))
    assert error.status() in ("StatusCode.NOT_FOUND", "StatusCode.UNAVAILABLE"), error
    await client.load_model("mlp", headers=ADMIN_METADATA)
    assert await client.is_model_ready("mlp")
    answer = await client.infer("mlp", [triton_input(x)])
    assert answer.get_response().model_version in served.versions
    events = [e for e in served.server.audit.events if e.get("source") == "grpc"]
    assert events and all(e["who"] == "admin" for e in events), served.server.audit.events


async def test_the_repository_extension_is_off_without_an_admin_token(
    server_config: ServerConfig, repo
) -> None:
    config = dataclasses.replace(server_config, grpc_port=0, admin_token_file=None)
    async with serving(config, repo[1]) as s:
        error = await refusal(s.client.load_model("mlp", headers=ADMIN_METADATA))
        assert error.status() == "StatusCode.PERMISSION_DENIED", error


# -- tenants ----------------------------------------------------------------------------
async def test_tenants_are_told_apart_by_the_calls_metadata(tmp_path: Path) -> None:
    root = tmp_path / "models"
    versions = {"acme": add_version(root, "acme/mlp", "v1", seed=11)}
    versions["beta"] = add_version(root, "beta/mlp", "v1", seed=12)
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(
        "tenants:\n"
        "  acme: {api_key: acme-key, models: [mlp]}\n"
        "  beta: {api_key: beta-key, models: [mlp]}\n"
    )
    config = ServerConfig(
        repository=root, tenants_file=tenants, grpc_port=0, cache_dir=tmp_path / "cache"
    )
    async with serving(config, versions) as s:
        x = batch(7)
        for tenant in ("acme", "beta"):
            for headers in (
                {"authorization": f"Bearer {tenant}-key"},
                {"x-api-key": f"{tenant}-key"},
            ):
                result = await s.client.infer("mlp", [triton_input(x)], headers=headers)
                np.testing.assert_allclose(
                    result.as_numpy(OUTPUT_NAME), versions[tenant].expected(x), atol=1e-4
                )
        for headers in (None, {"authorization": "Bearer nobody"}):
            error = await refusal(s.client.infer("mlp", [triton_input(x)], headers=headers))
            assert error.status() == "StatusCode.UNAUTHENTICATED", error
        error = await rpc_error(s.stub.ModelMetadata(pb.ModelMetadataRequest(name="mlp")))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert trailer(error, "error-code") == "unauthorized"
        text = await (await s.http.get("/metrics")).text()
        # no tenant: "mlp" names no model served here (they are tenant/mlp), so no series
        unknown = sample(
            samples(text), "model_server_inference_requests_total", model="(unknown)", code="401"
        )
        assert unknown == 2


# -- a hot swap under load ------------------------------------------------------------
CLIENTS = 6
SWAPS = 9
BETWEEN_SWAPS = 50  # answers of each version under load before the next swap


async def _infer_until(
    client: InferenceServerClient,
    versions: dict[str, Any],
    stop: asyncio.Event,
    seen: Counter[str],
    failures: list[str],
    seed: int,
) -> None:
    rng = np.random.default_rng(seed)
    while not stop.is_set():
        x = rng.standard_normal((int(rng.integers(1, 5)), 8)).astype(np.float32)
        try:
            result = await client.infer("mlp", [triton_input(x)])
        except InferenceServerException as exc:
            failures.append(str(exc))
            continue
        version = result.get_response().model_version
        expected = versions[version].expected(x) if version in versions else None
        if expected is None or not np.allclose(result.as_numpy(OUTPUT_NAME), expected, atol=1e-4):
            failures.append(f"an answer of {version!r} that is not that version's")
        seen[version] += 1


async def test_hot_swaps_under_grpc_load_fail_no_request(served: Served, server_config) -> None:
    """Several tritonclient clients infer without pause while the version is swapped
    again and again, by the control socket (as the sidecar does) and by the HTTP admin
    API: no call fails, and every answer is wholly the version it names."""
    versions, socket = served.versions, server_config.control_socket
    stop, seen, failures = asyncio.Event(), Counter[str](), list[str]()
    clients = [InferenceServerClient(f"127.0.0.1:{served.server.grpc.port}") for _ in range(3)]
    load = [
        asyncio.create_task(
            _infer_until(clients[i % len(clients)], versions, stop, seen, failures, seed=i)
        )
        for i in range(CLIENTS)
    ]
    try:
        order = ["v2", "v3", "v1"] * (SWAPS // 3)
        for i, target in enumerate(order):
            answered = sum(seen.values())
            while sum(seen.values()) < answered + BETWEEN_SWAPS:  # this version under load
                await asyncio.sleep(0.005)
                assert not failures, failures[:3]
            if i % 2:
                reply = await served.http.post(f"/v1/reload?target_version={target}", headers=ADMIN)
                assert reply.status == 200, await reply.text()
            else:
                v = versions[target]
                answer = await ask(
                    socket,
                    {"op": "load", "model": "mlp", "version": target, "path": str(v.path),
                     "sha256": v.sha256},
                )  # fmt: skip
                assert answer["ok"], answer
        answered = sum(seen.values())
        while sum(seen.values()) < answered + BETWEEN_SWAPS:  # and the last one too
            await asyncio.sleep(0.005)
    finally:
        stop.set()
        await asyncio.gather(*load)
        for c in clients:
            await c.close()
    assert failures == []
    assert set(seen) == {"v1", "v2", "v3"}, seen
    assert sum(seen.values()) >= (SWAPS + 1) * BETWEEN_SWAPS


# -- shutdown -------------------------------------------------------------------------
def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except OSError:
        return False
    return True


async def test_stopping_lets_calls_in_flight_finish_and_refuses_new_ones(
    server_config: ServerConfig, repo
) -> None:
    backend = GatedBackend()
    config = dataclasses.replace(server_config, grpc_port=0)
    async with serving(config, repo[1], backend) as s:
        x = batch(8)
        backend.gate.clear()  # the next inference waits
        in_flight = asyncio.create_task(s.client.infer("mlp", [triton_input(x)]))
        while 'model_server_inference_requests_in_flight{model="mlp"} 1.0' not in (
            await (await s.http.get("/metrics")).text()
        ):
            await asyncio.sleep(0.01)
        assert s.server.grpc is not None and s.server.grpc.port
        port = s.server.grpc.port
        stopping = asyncio.create_task(s.server.grpc.stop(60))
        while await asyncio.to_thread(_accepts, port):  # the listener closes first
            await asyncio.sleep(0.01)
        fresh = InferenceServerClient(f"127.0.0.1:{port}")
        try:
            error = await refusal(fresh.is_server_live())
            assert error.status() == "StatusCode.UNAVAILABLE", error
        finally:
            await fresh.close()
        assert not in_flight.done()
        backend.gate.set()
        result = await in_flight
        np.testing.assert_allclose(
            result.as_numpy(OUTPUT_NAME), s.versions["v1"].expected(x), atol=1e-4
        )
        await stopping


async def test_a_grpc_port_in_use_fails_the_start_instead_of_sharing_it(
    server_config: ServerConfig, repo
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = dataclasses.replace(server_config, grpc_port=taken.getsockname()[1])
        with pytest.raises(RuntimeError, match="Failed to bind"):
            async with serving(config, repo[1]):
                pass


async def test_a_server_process_serves_grpc_unready_while_draining_then_exits(
    tmp_path: Path,
) -> None:
    root = tmp_path / "models"
    v1 = add_version(root, "mlp", "v1", seed=1)
    port = free_port()
    server = ServerProcess(
        root, ["mlp=v1"], tmp_path / "server.log",
        extra=["--grpc-port", str(port), "--drain-seconds", "30"],
    ).start()  # fmt: skip
    try:
        await asyncio.to_thread(server.wait_ready)
        async with InferenceServerClient(f"127.0.0.1:{port}") as client:
            x = batch(9)
            assert await client.is_server_ready()
            assert server.proc is not None
            server.proc.send_signal(signal.SIGTERM)
            while await client.is_server_ready():  # the signal is handled on the loop
                await asyncio.sleep(0.02)
            result = await client.infer("mlp", [triton_input(x)])  # still served
            np.testing.assert_allclose(result.as_numpy(OUTPUT_NAME), v1.expected(x), atol=1e-4)
            server.proc.send_signal(signal.SIGTERM)  # a second signal ends the drain
            assert await asyncio.to_thread(server.run_to_end, 60) == 0, server.log_tail()
        assert "serving gRPC on" in (tmp_path / "server.log").read_text()
    finally:
        server.kill()


# -- configuration ----------------------------------------------------------------------
def test_pods_serve_grpc_on_the_contracts_port() -> None:
    from model_operator.manifests import deployment, service
    from model_operator.spec import parse_spec

    line = argv.server_argv(argv.ServerArgs("resnet"))
    assert parse_args(line[1:]).grpc_port == defaults.SERVER_GRPC_PORT
    assert parse_args(["--repository", "/m"]).grpc_port is None  # off unless asked
    with pytest.raises(SystemExit):
        parse_args(["--repository", "/m", "--grpc-port", "70000"])
    [doc] = yaml.safe_load_all((ROOT / "examples" / "modeldeployment.yaml").read_text())
    spec = parse_spec(doc["spec"])
    server = deployment("d", "ns", spec)["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "grpc", "containerPort": defaults.SERVER_GRPC_PORT} in server["ports"]
    assert {"name": "grpc", "port": defaults.SERVER_GRPC_PORT, "targetPort": "grpc"} in (
        service("d", "ns", spec)["spec"]["ports"]
    )
