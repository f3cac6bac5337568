"""The binary tensor data extension over raw HTTP: the framing exactly as specified
(Triton's extension_binary_data.md), the edge cases a client library never sends (sizes
that do not add up, header lengths past the body, mixed forms), and inputs handed to
the engine as views of the body rather than copies."""

from __future__ import annotations

import json
import os
import struct
import tracemalloc
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from tritonclient.http import InferResult
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from model_rollout_contract.canary import PIN_HEADER, REQUESTS
from model_server.app import ModelServer
from model_server.backends.base import ModelFile
from model_server.backends.onnxruntime_backend import OnnxRuntimeBackend
from model_server.config import ModelSpec, ServerConfig
from model_server.errors import BadRequest
from model_server.protocol.binary_codec import read_binary_inputs, tensor_bytes, tensor_from_bytes
from model_server.protocol.tensor_spec import TensorSpec
from model_server.protocol.tensors import MAX_ELEMENTS, BinaryInput, decode_input_list
from tests.support.server import sample, samples, worker_processes, write_gate, write_manifest

INFER = "/v2/models/mlp/infer"
GATE = "/v2/models/gate/infer"
HEADER = "Inference-Header-Content-Length"
X = np.arange(16, dtype=np.float32).reshape(2, 8) / 10


def binary_body(
    binary: Mapping[str, np.ndarray],
    json_inputs: Mapping[str, np.ndarray] | None = None,
    **extra: Any,
) -> tuple[bytes, int]:
    """A request with ``binary`` inputs as raw bytes after the JSON (in that order) and
    ``json_inputs`` as JSON data; returns the body and its JSON's length."""
    inputs: list[dict[str, Any]] = [
        {
            "name": name,
            "datatype": {"b": "BOOL", "f": f"FP{a.itemsize * 8}"}[a.dtype.kind],
            "shape": list(a.shape),
            "parameters": {"binary_data_size": a.nbytes},
        }
        for name, a in binary.items()
    ]
    inputs += [
        {"name": name, "datatype": "FP32", "shape": list(a.shape), "data": a.ravel().tolist()}
        for name, a in (json_inputs or {}).items()
    ]
    header = json.dumps({"inputs": inputs, **extra}).encode()
    return header + b"".join(a.tobytes() for a in binary.values()), len(header)


def gate_inputs(rows: int = 2) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(rows)
    return {
        "mask": rng.random((rows, 3)) > 0.5,
        "half": rng.standard_normal((rows, 3)).astype(np.float16),
        "x": rng.standard_normal((rows, 3)).astype(np.float32),
    }


def parsed(body: bytes, headers: Mapping[str, str]) -> InferResult:
    """The answer as tritonclient reads it: its framing checked by a third party."""
    length = headers.get(HEADER)
    return InferResult.from_response_body(body, header_length=int(length) if length else None)


@pytest.fixture
async def gate_client(server_config: ServerConfig, repo) -> AsyncIterator[TestClient]:
    write_gate(repo[0] / "gate" / "v1" / "model.onnx")
    write_manifest(repo[0] / "gate" / "v1" / "model.onnx")
    config = replace(server_config, models=[ModelSpec("mlp", "v1"), ModelSpec("gate", "v1")])
    async with TestClient(TestServer(ModelServer(config).make_app())) as client:
        yield client


async def test_inputs_of_three_sizes_in_order_and_binary_outputs(gate_client: TestClient) -> None:
    inputs = gate_inputs()
    body, length = binary_body(inputs, parameters={"binary_data_output": True})
    response = await gate_client.post(GATE, data=body, headers={HEADER: str(length)})
    raw = await response.read()
    assert response.status == 200, raw[:300]
    assert response.headers["Content-Type"] == "application/octet-stream"
    result = parsed(raw, response.headers)
    sizes = {
        o["name"]: o["parameters"]["binary_data_size"] for o in result.get_response()["outputs"]
    }
    assert sizes == {"y": 24, "flipped": 6, "doubled": 12}
    assert int(response.headers[HEADER]) + sum(sizes.values()) == len(raw)
    np.testing.assert_array_equal(result.as_numpy("y"), np.where(inputs["mask"], inputs["x"], 0))
    np.testing.assert_array_equal(result.as_numpy("flipped"), ~inputs["mask"])
    np.testing.assert_array_equal(result.as_numpy("doubled"), inputs["half"] + inputs["half"])


async def test_outputs_binary_per_output_and_the_rest_json(gate_client: TestClient) -> None:
    inputs = gate_inputs(3)
    outputs = [
        {"name": "flipped", "parameters": {"binary_data": True}},
        {"name": "doubled", "parameters": {"binary_data": False}},
        {"name": "y"},
    ]
    body, length = binary_body(
        {"mask": inputs["mask"], "half": inputs["half"]},
        json_inputs={"x": inputs["x"]},
        outputs=outputs,
        parameters={"binary_data_output": False},
    )
    response = await gate_client.post(GATE, data=body, headers={HEADER: str(length)})
    raw = await response.read()
    assert response.status == 200, raw[:300]
    result = parsed(raw, response.headers)
    described = {o["name"]: o for o in result.get_response()["outputs"]}
    assert list(described) == ["flipped", "doubled", "y"]  # as requested
    assert described["flipped"]["parameters"] == {"binary_data_size": 9}
    assert "data" in described["doubled"] and "data" in described["y"]
    np.testing.assert_array_equal(result.as_numpy("flipped"), ~inputs["mask"])
    np.testing.assert_allclose(result.as_numpy("doubled"), inputs["half"] * 2, rtol=1e-3)


async def test_a_json_request_may_ask_for_binary_outputs(client: TestClient, repo) -> None:
    body = {
        "inputs": [
            {"name": "input", "shape": [2, 8], "datatype": "FP32", "data": X.ravel().tolist()}
        ],
        "parameters": {"binary_data_output": True},
    }
    response = await client.post(INFER, json=body)
    raw = await response.read()
    assert response.status == 200, raw[:300]
    result = parsed(raw, response.headers)
    np.testing.assert_allclose(result.as_numpy("output"), repo[1]["v1"].expected(X), atol=1e-5)


async def test_no_binary_output_asked_for_is_plain_json(client: TestClient, repo) -> None:
    body, length = binary_body({"input": X})
    response = await client.post(INFER, data=body, headers={HEADER: str(length)})
    assert response.status == 200
    assert response.content_type == "application/json" and HEADER not in response.headers
    answer = await response.json()
    np.testing.assert_allclose(
        np.asarray(answer["outputs"][0]["data"]).reshape(2, 4), repo[1]["v1"].expected(X), atol=1e-5
    )


async def test_a_chunked_binary_body(client: TestClient, repo) -> None:
    body, length = binary_body({"input": X}, parameters={"binary_data_output": True})

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: read as it comes
        for i in range(0, len(body), 7):
            yield body[i : i + 7]

    response = await client.post(INFER, data=chunks(), headers={HEADER: str(length)})
    raw = await response.read()
    assert response.status == 200, raw[:300]
    np.testing.assert_allclose(
        parsed(raw, response.headers).as_numpy("output"), repo[1]["v1"].expected(X), atol=1e-5
    )


def _good() -> tuple[dict[str, Any], bytes]:
    header = {
        "inputs": [
            {"name": "input", "shape": [2, 8], "datatype": "FP32",
             "parameters": {"binary_data_size": 64}}
        ]
    }  # fmt: skip
    return header, X.tobytes()


def _case(
    header: dict[str, Any] | None = None,
    data: bytes | None = None,
    length: str | int | None = "json",
    raw_header: bytes | None = None,
) -> tuple[bytes, str | None]:
    good_header, good_data = _good()
    text = raw_header if raw_header is not None else json.dumps(header or good_header).encode()
    data = good_data if data is None else data
    if length == "json":
        length = len(text)
    return text + data, None if length is None else str(length)


def _input(**changes: Any) -> dict[str, Any]:
    header, _ = _good()
    header["inputs"][0].update(changes)
    return header


EDGE_CASES = {
    "binary part shorter than declared": _case(data=X.tobytes()[:60]),
    "binary part longer than declared": _case(data=X.tobytes() + b"\0\0\0\0"),
    "size that does not match shape and datatype": _case(
        _input(parameters={"binary_data_size": 60}), data=X.tobytes()[:60]
    ),
    "size of a string": _case(_input(parameters={"binary_data_size": "64"})),
    "size of a boolean": _case(_input(parameters={"binary_data_size": True})),
    "negative size": _case(_input(parameters={"binary_data_size": -64})),
    "parameters not an object": _case(_input(parameters=[64])),
    "data and binary_data_size both": _case(_input(data=X.ravel().tolist())),
    "header length past the body": _case(length=10_000),
    "header length not a number": _case(length="12abc"),
    "header length negative": _case(length="-5"),
    "header length that cuts the JSON": _case(length=20),
    "header length zero": _case(length=0),
    # past the 4300 digits Python's int() reads: a ValueError, once aiohttp's plain 500
    "header length of 5000 digits": _case(length="9" * 5000),
    "header length of 19 digits": _case(length="9" * 19),
    "binary data without the header length": _case(length=None),
    "BOOL binary data for an FP32 input": _case(
        _input(datatype="BOOL", parameters={"binary_data_size": 16}), data=b"\x01" * 16
    ),
    "BYTES binary data for an FP32 input": _case(
        _input(datatype="BYTES", parameters={"binary_data_size": 20}),
        data=serialize_byte_tensor(np.array([b"a"] * 4, dtype=object)).item(),
    ),
    "a shared-memory input": _case(_input(parameters={"shared_memory_region": "r0"})),
    "binary_data_output not a boolean": _case(
        {**_good()[0], "parameters": {"binary_data_output": "yes"}}
    ),
    "binary_data of an output not a boolean": _case(
        {**_good()[0], "outputs": [{"name": "output", "parameters": {"binary_data": 1}}]}
    ),
    "classification requested": _case(
        {**_good()[0], "outputs": [{"name": "output", "parameters": {"classification": 2}}]}
    ),
    "a sequence": _case({**_good()[0], "parameters": {"sequence_id": 7}}),
}


@pytest.mark.parametrize("case", sorted(EDGE_CASES))
async def test_framing_edge_cases_are_400_json(client: TestClient, case: str) -> None:
    body, length = EDGE_CASES[case]
    headers = {HEADER: length} if length is not None else {}
    response = await client.post(INFER, data=body, headers=headers)
    assert response.status == 400, (case, (await response.text())[:300])
    assert response.content_type == "application/json"
    answer = await response.json()
    assert answer["code"] == "bad_request" and answer["error"], answer
    fine, length = _case()
    assert (await client.post(INFER, data=fine, headers={HEADER: str(length)})).status == 200


async def test_framing_errors_say_what_is_wrong(client: TestClient) -> None:
    body, length = _case(data=X.tobytes()[:60])
    response = await client.post(INFER, data=body, headers={HEADER: str(length)})
    assert "binary_data_size 64" in (await response.json())["error"]
    body, length = _case(data=X.tobytes() + b"\0" * 4)
    response = await client.post(INFER, data=body, headers={HEADER: str(length)})
    assert "68 bytes after its JSON" in (await response.json())["error"]


class RecordingBackend(OnnxRuntimeBackend):
    """ONNX Runtime whose engines note, for every run, whether each input owns its
    memory (a copy) or is a view, and how its data is aligned."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict[str, tuple[bool, bool, int]]] = []

    def load(self, model: ModelFile):  # type: ignore[override]
        engine = super().load(model)
        inner, backend = engine.infer, self

        def infer(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
            backend.seen.append(
                {
                    n: (a.flags.owndata, a.flags.writeable, a.ctypes.data % 64)
                    for n, a in feeds.items()
                }
            )
            return inner(feeds)

        engine.infer = infer  # type: ignore[method-assign]
        return engine


async def test_binary_inputs_reach_the_engine_as_aligned_views_of_the_body(
    server_config: ServerConfig, repo
) -> None:
    backend = RecordingBackend()
    async with TestClient(TestServer(ModelServer(server_config, backend).make_app())) as client:
        x = np.random.default_rng(2).standard_normal((1000, 8)).astype(np.float32)
        for pad in range(3):  # JSON headers of three lengths: the body is laid out for each
            body, length = binary_body({"input": x}, id="p" * pad)
            response = await client.post(INFER, data=body, headers={HEADER: str(length)})
            assert response.status == 200, (await response.text())[:300]
            np.testing.assert_allclose(
                np.asarray((await response.json())["outputs"][0]["data"]).reshape(1000, 4),
                repo[1]["v1"].expected(x),
                atol=1e-4,
            )
    runs = backend.seen[-3:]
    assert runs == [{"input": (False, True, 0)}] * 3  # a view, writable, 64-byte aligned


async def test_an_unaligned_input_is_copied_once(gate_client: TestClient) -> None:
    """After 6 bytes of BOOL, an FP32 input starts unaligned: it is copied rather than
    handed over unaligned, and the answer is right."""
    inputs = gate_inputs()
    body, length = binary_body({"mask": inputs["mask"], "x": inputs["x"], "half": inputs["half"]})
    response = await gate_client.post(GATE, data=body, headers={HEADER: str(length)})
    assert response.status == 200, (await response.text())[:300]
    answer = {o["name"]: o["data"] for o in (await response.json())["outputs"]}
    np.testing.assert_array_equal(
        np.asarray(answer["y"], np.float32).reshape(2, 3), np.where(inputs["mask"], inputs["x"], 0)
    )


# --- the codec on its own: BYTES, views, sizes ---------------------------------------


def test_bytes_elements_as_tritonclient_frames_them() -> None:
    values = np.array([b"a", b"", b"\xff\x00xyz", "naïve".encode()], dtype=object)
    framed = serialize_byte_tensor(values).item()  # the third party's framing
    parsed_here = tensor_from_bytes("s", np.dtype(object), (2, 2), memoryview(framed))
    assert parsed_here.shape == (2, 2) and parsed_here.ravel().tolist() == values.tolist()
    ours = bytes(tensor_bytes(values.reshape(2, 2), "s"))
    assert ours == framed
    assert deserialize_bytes_tensor(ours).tolist() == values.tolist()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x01\x00\x00", "3 bytes of binary data cannot hold 2"),  # too short for 2 prefixes
        (b"\x02\x00\x00\x00ab\x01\x00", "ends after 1 of 2"),  # the 2nd prefix cut short
        (b"\x01\x00\x00\x00a\x05\x00\x00\x00ab", "past its binary data"),  # overruns
        (b"\x01\x00\x00\x00a\x01\x00\x00\x00bEXTRA", "5 bytes left"),
    ],
)
def test_bytes_framing_errors(data: bytes, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        tensor_from_bytes("s", np.dtype(object), (2,), memoryview(data))


def test_a_bytes_count_the_data_cannot_hold_allocates_nothing_for_it() -> None:
    """A shape of 16 Mi BYTES elements over 8 bytes of data is refused before the array
    of 16 Mi references (128 MiB) is made for it: what is allocated follows the bytes."""
    tracemalloc.start()
    try:
        with pytest.raises(BadRequest, match="cannot hold 16777216 BYTES elements"):
            tensor_from_bytes("s", np.dtype(object), (MAX_ELEMENTS,), memoryview(b"\0" * 8))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_json_bytes_are_utf8_strings() -> None:
    spec = TensorSpec("s", np.dtype(object), (-1,))
    body = {"inputs": [{"name": "s", "datatype": "BYTES", "shape": [2], "data": ["ab", "ç"]}]}
    decoded = decode_input_list(body, (spec,))
    assert decoded.feeds["s"].tolist() == [b"ab", "ç".encode()]
    bad = {"inputs": [{"name": "s", "datatype": "BYTES", "shape": [1], "data": [3]}]}
    with pytest.raises(BadRequest, match="not a string"):
        decode_input_list(bad, (spec,))


def test_an_aligned_input_is_a_view_and_an_unaligned_one_a_copy() -> None:
    buffer = bytearray(8 + 64)
    offset = -np.frombuffer(buffer, np.uint8).ctypes.data % 16
    view = memoryview(buffer)[offset : offset + 64]
    aligned = tensor_from_bytes("x", np.dtype(np.float32), (2, 8), view)
    assert np.shares_memory(aligned, np.frombuffer(buffer, np.uint8))
    shifted = memoryview(buffer)[offset + 1 : offset + 1 + 8]
    unaligned = tensor_from_bytes("x", np.dtype(np.float32), (2,), shifted)
    assert unaligned.flags.aligned and not np.shares_memory(
        unaligned, np.frombuffer(buffer, np.uint8)
    )


def test_inputs_fill_the_binary_part_exactly() -> None:
    slots = (
        BinaryInput("a", np.dtype(np.uint8), (3,), 3),
        BinaryInput("b", np.dtype(np.int16), (2,), 4),
    )
    data = bytes([1, 2, 3]) + struct.pack("<hh", -2, 300)
    feeds = read_binary_inputs(slots, memoryview(data))
    assert feeds["a"].tolist() == [1, 2, 3] and feeds["b"].tolist() == [-2, 300]
    with pytest.raises(BadRequest, match="add up to 7"):
        read_binary_inputs(slots, memoryview(data + b"\0"))
    with pytest.raises(BadRequest, match="binary_data_size 4"):
        read_binary_inputs(slots, memoryview(data[:-1]))


async def test_a_large_json_header_goes_to_a_worker_and_its_binary_part_stays(
    gate_client: TestClient,
) -> None:
    """A header over 256 KiB (here ``x`` as 60 000 JSON numbers) is decoded in a JSON
    worker process; the binary inputs after it are read from the body here."""
    inputs = gate_inputs(20_000)
    before = set(worker_processes(os.getpid()))
    body, length = binary_body(
        {"mask": inputs["mask"], "half": inputs["half"]},
        json_inputs={"x": inputs["x"]},
        parameters={"binary_data_output": True},
    )
    assert length > 256 * 1024
    response = await gate_client.post(GATE, data=body, headers={HEADER: str(length)})
    raw = await response.read()
    assert response.status == 200, raw[:300]
    assert set(worker_processes(os.getpid())) - before  # a worker was started for it
    result = parsed(raw, response.headers)
    np.testing.assert_array_equal(result.as_numpy("y"), np.where(inputs["mask"], inputs["x"], 0))
    np.testing.assert_array_equal(result.as_numpy("flipped"), ~inputs["mask"])


@pytest.mark.parametrize("byte", [2, 255])
async def test_bool_bytes_other_than_0_and_1_are_400(gate_client: TestClient, byte: int) -> None:
    """BOOL is one byte, 0 or 1 (extension_binary_data.md): ONNX Runtime would read 2 or
    255 as false, answering something the client did not ask."""
    inputs = gate_inputs()
    body, length = binary_body(inputs)
    mask_at = length  # the mask's bytes come first after the JSON
    raw = bytearray(body)
    raw[mask_at + 1] = byte
    response = await gate_client.post(GATE, data=bytes(raw), headers={HEADER: str(length)})
    answer = await response.json()
    assert response.status == 400, answer
    assert answer["code"] == "bad_request" and "'mask'" in answer["error"], answer
    fine, length = binary_body(inputs)
    assert (await gate_client.post(GATE, data=fine, headers={HEADER: str(length)})).status == 200


def test_raw_bool_bytes_are_0_or_1() -> None:
    """The check is in the reader gRPC's raw_input_contents share with HTTP."""
    ok = tensor_from_bytes("m", np.dtype(np.bool_), (3,), memoryview(bytes([0, 1, 1])))
    assert ok.tolist() == [False, True, True]
    with pytest.raises(BadRequest, match="0 or 1"):
        tensor_from_bytes("m", np.dtype(np.bool_), (3,), memoryview(bytes([0, 1, 2])))


async def test_inputs_that_disagree_on_a_shared_dim_are_400_and_not_the_versions_error(
    gate_client: TestClient,
) -> None:
    """``mask``, ``half`` and ``x`` share the symbolic first dim ``batch``: a request
    giving them 2, 2 and 3 rows is the client's mistake, refused before any run, as JSON
    or as binary data; pinned to a version (as a canary's candidate), it is the
    server's 400 and no error of that version's (canary analysis reads the version's
    5xx: before, each was a 500 there and failed the candidate)."""
    inputs = gate_inputs(2)
    inputs["x"] = gate_inputs(3)["x"]  # where(mask, x, 0) cannot broadcast them
    json_body = {
        "inputs": [
            {"name": name, "datatype": {"b": "BOOL", "f": f"FP{a.itemsize * 8}"}[a.dtype.kind],
             "shape": list(a.shape), "data": a.ravel().tolist()}
            for name, a in inputs.items()
        ]
    }  # fmt: skip
    binary, length = binary_body(inputs)
    for _ in range(3):
        for response in (
            await gate_client.post(GATE, json=json_body, headers={PIN_HEADER: "v1"}),
            await gate_client.post(GATE, data=binary, headers={HEADER: str(length)}),
        ):
            answer = await response.json()
            assert response.status == 400, answer
            assert answer["code"] == "bad_request" and "'batch'" in answer["error"], answer
    found = samples(await (await gate_client.get("/metrics")).text())
    assert sample(found, "model_server_inference_requests_total", model="gate", code="400") == 6
    assert sample(found, REQUESTS, model="gate", version="v1", code="500") == 0
    fine, length = binary_body(gate_inputs(2))
    assert (await gate_client.post(GATE, data=fine, headers={HEADER: str(length)})).status == 200


def test_the_runtimes_argument_errors_are_400(tmp_path: Path) -> None:
    """What ONNX Runtime refuses as an invalid argument (a rank or a fixed dim the
    checks before it would have caught) is the client's 400, never a 500."""
    write_gate(tmp_path / "model.onnx")
    engine = OnnxRuntimeBackend().load(ModelFile.read(tmp_path / "model.onnx"))
    feeds = gate_inputs(2)
    feeds["x"] = np.ones((2, 4), np.float32)  # its second dim is 3
    with pytest.raises(BadRequest, match="x"):
        engine.infer(feeds)
