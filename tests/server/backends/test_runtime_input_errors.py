"""A runtime failure on inputs that passed the server's checks (issue 27, hostile review):
a model whose dynamic axes are unnamed or named apart (so nothing says they must agree)
or a Reshape that fails for some row count raises in ONNX Runtime as FAIL, not as
INVALID_ARGUMENT. Such a failure is the client's inputs' (400), not the version's: any
client could otherwise fail a canary through the pin header (the analysis counts a
version's 5xx). A runtime failure that is no shape check stays a 500."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from onnxruntime.capi.onnxruntime_pybind11_state import Fail

from model_rollout_contract.canary import PIN_HEADER, REQUESTS
from model_server.app import ModelServer
from model_server.backends.base import ModelFile
from model_server.backends.onnxruntime_backend import OnnxRuntimeBackend, input_error
from model_server.config import ModelSpec, ServerConfig
from model_server.errors import BadRequest
from tests.support.server import sample, samples, write_apart, write_pairs


@pytest.fixture
async def shapes_client(server_config: ServerConfig, repo) -> AsyncIterator[TestClient]:
    write_apart(repo[0] / "apart" / "v1" / "model.onnx")
    write_pairs(repo[0] / "pairs" / "v1" / "model.onnx")
    config = dataclasses.replace(
        server_config,
        models=[ModelSpec("mlp", "v1"), ModelSpec("apart", "v1"), ModelSpec("pairs", "v1")],
    )
    async with TestClient(TestServer(ModelServer(config).make_app())) as client:
        yield client


def _input(name: str, x: np.ndarray) -> dict[str, object]:
    return {"name": name, "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}


async def test_a_runtime_shape_failure_is_400_and_no_failure_of_the_pinned_version(
    shapes_client: TestClient,
) -> None:
    apart = {"inputs": [_input("a", np.ones((2, 3), np.float32)),
                        _input("b", np.ones((3, 3), np.float32))]}  # fmt: skip
    pairs = {"inputs": [_input("x", np.ones((3, 3), np.float32))]}
    for model, body in (("apart", apart), ("pairs", pairs)):
        for _ in range(3):
            response = await shapes_client.post(
                f"/v2/models/{model}/infer", json=body, headers={PIN_HEADER: "v1"}
            )
            answer = await response.json()
            assert response.status == 400, answer
            assert answer["code"] == "bad_request", answer
    found = samples(await (await shapes_client.get("/metrics")).text())
    for model in ("apart", "pairs"):
        assert sample(found, REQUESTS, model=model, version="v1", code="400") == 3
        assert sample(found, REQUESTS, model=model, version="v1", code="500") == 0
    fine = {"inputs": [_input("x", np.ones((1, 3), np.float32))]}
    assert (await shapes_client.post("/v2/models/pairs/infer", json=fine)).status == 200


def test_the_engine_raises_bad_request_for_a_shape_failure(tmp_path: Path) -> None:
    write_pairs(tmp_path / "pairs" / "v1" / "model.onnx")
    engine = OnnxRuntimeBackend().load(ModelFile.read(tmp_path / "pairs" / "v1" / "model.onnx"))
    with pytest.raises(BadRequest, match="cannot be reshaped"):
        engine.infer({"x": np.ones((3, 3), np.float32)})


@pytest.mark.parametrize(
    "message",
    [
        "[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running MatMul "
        "node. Name:'' Status Message: /onnxruntime_src/onnxruntime/core/framework/bfc_arena.cc"
        ":376 void* onnxruntime::BFCArena::AllocateRawInternal(size_t, bool, ...) Failed to "
        "allocate memory for requested buffer of size 4294967296",
        "[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running MatMul "
        "node. Name:'' Status Message: bad allocation",
        "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Exception during initialization: ...",
        "[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running Custom "
        "node. Name:'' Status Message: the kernel lost its device",
    ],
)
def test_other_runtime_failures_stay_the_servers(message: str) -> None:
    """Memory, device or kernel faults are the server's (500): only the runtime's own
    shape checks are the client's."""
    assert input_error(Fail(message)) is None


@pytest.mark.parametrize(
    ("message", "inputs"),
    [
        ("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)", True),
        (
            "The size of tensor a (2) must match the size of tensor b (3) at non-singleton "
            "dimension 0",
            True,
        ),
        ("shape '[3]' is invalid for input of size 9", True),
        ("CUDA out of memory. Tried to allocate 4.00 GiB (GPU 0; 79.10 GiB total capacity)", False),
        ("CUDA error: an illegal memory access was encountered", False),
        (
            "CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb, m, n, k, "
            "&alpha, a, lda, b, ldb, &beta, c, ldc)`",
            False,
        ),
        ("engine is closed", False),
    ],
)
def test_torch_shape_checks_are_the_clients_and_its_faults_the_servers(
    message: str, inputs: bool
) -> None:
    from model_server.backends.torch_backend import input_error as torch_input_error

    assert (torch_input_error(RuntimeError(message)) is not None) is inputs
