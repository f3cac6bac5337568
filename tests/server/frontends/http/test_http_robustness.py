"""Hostile requests get a 4xx JSON answer, never a plain-text 500 (issue 13, server
robustness): shapes that overflow, element counts that wrap, unhashable output names,
unknown charsets and codecs that are no text encoding, deeply nested JSON, non-ASCII
credentials, loosely typed data; what a request allocates follows the bytes it sent,
not what its shape or Content-Length announce; and a failure that is no client's fault
(an engine raising) is a 500 JSON answer too."""

from __future__ import annotations

import asyncio
import bz2
import codecs
import json
import logging
import tracemalloc
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, replace

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from model_server.app import ModelServer
from model_server.config import MAX_REQUEST_BYTES, ServerConfig
from model_server.errors import BadRequest, RequestTimeout
from model_server.frontends.http.body import BodyBuffer, read_body
from model_server.protocol.binary_codec import ALIGNMENT
from tests.support.server import ADMIN, RaisingBackend, infer_body

INFER = "/v2/models/mlp/infer"
X1 = np.ones((1, 8), np.float32)
GUARD_S = 60.0  # hang guard, never a measured bound
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def body(shape: list[int], data: object, datatype: str = "FP32", **extra: object) -> dict:
    return {
        "inputs": [{"name": "input", "shape": shape, "datatype": datatype, "data": data}],
        **extra,
    }


async def answer(response) -> dict:  # type: ignore[no-untyped-def]
    assert response.content_type == "application/json", await response.text()
    payload: dict = await response.json()
    assert set(payload) >= {"error", "code"}, payload
    return payload


@pytest.mark.parametrize(
    ("name", "request_body"),
    [
        ("shape entry of 2**63", body([2**63, 8], [0.0] * 8)),
        ("shape whose element count wraps to 0 in int64", body([2**32, 2**32, 8], [])),
        ("negative shape entry", body([-1, 8], [0.0] * 8)),
        ("unhashable output name", {**body([1, 8], [0.0] * 8), "outputs": [{"name": ["x"]}]}),
        ("null in FP32 data", body([1, 8], [None] + [0.0] * 7)),
        ("a string in FP32 data", body([1, 8], ["1.5"] + [0.0] * 7)),
        ("a boolean in FP32 data", body([1, 8], [True] + [0.0] * 7)),
        ("data nested past the shape", body([1, 8], [[[0.0]]] * 8)),
    ],
)
async def test_malformed_tensors_are_400(client: TestClient, name: str, request_body: dict) -> None:
    response = await client.post(INFER, json=request_body)
    assert response.status == 400, (name, await response.text())
    assert (await answer(response))["code"] == "bad_request"


async def test_json_nested_2000_deep_is_400(client: TestClient) -> None:
    text = "[" * 2000 + "]" * 2000
    response = await client.post(INFER, data=text, headers={"Content-Type": "application/json"})
    assert response.status == 400 and (await answer(response))["code"] == "bad_request"


async def test_an_unknown_charset_is_4xx(client: TestClient) -> None:
    response = await client.post(
        INFER,
        data=json.dumps(body([1, 8], [0.0] * 8)).encode(),
        headers={"Content-Type": "application/json; charset=no-such-charset"},
    )
    assert response.status in (400, 415), await response.text()
    await answer(response)


@pytest.mark.parametrize("header", ["Authorization", "X-API-Key"])
async def test_non_ascii_credentials_are_401(client: TestClient, header: str) -> None:
    raw = "Bearer t\xe9st\xff" if header == "Authorization" else "k\xe9y\xff"
    response = await client.post(
        "/v1/reload?target_version=v2", headers={header: raw.encode("latin-1").decode("latin-1")}
    )
    assert response.status == 401, await response.text()
    await answer(response)


async def test_a_too_large_body_is_413_and_counted_as_413(client: TestClient) -> None:
    response = await client.post(
        INFER,
        data=b"[" + b"0," * (40 * 2**20) + b"0]",
        headers={"Content-Type": "application/json"},
    )
    assert response.status == 413, await response.text()
    await answer(response)
    metrics = await (await client.get("/metrics")).text()
    assert 'model_server_inference_requests_total{code="413",model="mlp"} 1.0' in metrics


async def test_ints_are_accepted_as_fp32(client: TestClient) -> None:
    response = await client.post(INFER, json=body([1, 8], [0, 1, 2, 3, 4, 5, 6, 7]))
    assert response.status == 200, await response.text()
    nested = await client.post(INFER, json=body([1, 8], [[0.0] * 8]))
    assert nested.status == 200, await nested.text()
    assert ADMIN  # the fixture's token exists (admin paths are covered elsewhere)


# --- charsets: text encodings only ------------------------------------------------------

ONE_ROW = json.dumps(body([1, 8], [0.0] * 8)).encode()


@pytest.mark.parametrize(
    ("charset", "raw"),
    [
        ("rot13", codecs.encode(ONE_ROW.decode(), "rot13").encode()),
        ("zlib", zlib.compress(ONE_ROW)),  # a body that would inflate into a valid one
        ("bz2", bz2.compress(ONE_ROW)),
        ("hex", ONE_ROW.hex().encode()),
        ("base64", codecs.encode(ONE_ROW, "base64")),
        ("uu", codecs.encode(ONE_ROW, "uu")),
    ],
)
async def test_a_codec_that_is_no_text_encoding_is_415(
    client: TestClient, charset: str, raw: bytes
) -> None:
    """Python's codecs that transform bytes are not charsets: each is refused unapplied."""
    response = await client.post(
        INFER, data=raw, headers={"Content-Type": f"application/json; charset={charset}"}
    )
    assert response.status == 415, await response.text()
    payload = await answer(response)
    assert payload["code"] == "unsupported_media_type" and "not a text encoding" in payload["error"]


async def test_a_zlib_bomb_as_a_charset_is_never_inflated(client: TestClient) -> None:
    """64 KiB of body that zlib inflates to 64 MiB: refused with nothing inflated."""
    bomb = zlib.compress(b'{"inputs": [' + b" " * (64 << 20) + b"]}", 9)
    with traced() as memory:
        response = await client.post(
            INFER, data=bomb, headers={"Content-Type": "application/json; charset=zlib"}
        )
    assert response.status == 415, await response.text()
    assert memory.peak < 16 << 20, memory.peak


@pytest.mark.parametrize(
    ("charset", "raw"),
    [("ascii", b"\xff\xfe{}"), ("utf-16", b"{\x00\x00"), ("utf-8", b"\xff{}")],
)
async def test_a_body_that_is_not_its_charset_is_400(
    client: TestClient, charset: str, raw: bytes
) -> None:
    response = await client.post(
        INFER, data=raw, headers={"Content-Type": f"application/json; charset={charset}"}
    )
    assert response.status == 400, await response.text()
    assert (await answer(response))["code"] == "bad_request"


@pytest.mark.parametrize("charset", ["utf-16", "latin-1", "utf-8-sig"])
async def test_a_body_in_a_text_encoding_is_decoded(client: TestClient, charset: str) -> None:
    response = await client.post(
        INFER,
        data=ONE_ROW.decode().encode(charset),
        headers={"Content-Type": f"application/json; charset={charset}"},
    )
    assert response.status == 200, await response.text()


# --- what a request allocates follows what it sent --------------------------------------


@dataclass
class Traced:
    peak: int = 0  # the most bytes Python (and numpy) had allocated at once meanwhile


@contextmanager
def traced() -> Iterator[Traced]:
    """Python's allocations (numpy's too) traced meanwhile: their peak, once it ends."""
    found = Traced()
    tracemalloc.start()
    try:
        yield found
    finally:
        found.peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()


async def test_json_data_far_short_of_its_shape_allocates_for_the_data(
    client: TestClient,
) -> None:
    """Eight values for a shape of 16 Mi FP32 (64 MiB): a 400, and the array was never
    made at the shape's size."""
    with traced() as memory:
        response = await client.post(INFER, json=body([2 * 1024 * 1024, 8], [[0.0] * 8]))
    assert response.status == 400, await response.text()
    assert "8 values do not fill its shape" in (await answer(response))["error"]
    assert memory.peak < 16 << 20, memory.peak


def test_a_body_buffer_grows_with_the_bytes_received_and_ends_aligned() -> None:
    length, chunk = 8 << 20, 64 << 10
    data = np.random.default_rng(0).integers(0, 256, length, dtype=np.uint8).tobytes()
    for align_after in (0, 5, 63):
        buffer = BodyBuffer(length, align_after)
        assert buffer.allocated == 0  # the announced length alone allocates nothing
        for start in range(0, length, chunk):
            buffer.add(data[start : start + chunk])
            assert buffer.allocated <= 2 * buffer.received + ALIGNMENT
        body = buffer.body()
        assert body == data
        assert (np.frombuffer(body, np.uint8).ctypes.data + align_after) % ALIGNMENT == 0


def test_a_body_buffer_refuses_what_does_not_match_its_length() -> None:
    buffer = BodyBuffer(10)
    buffer.add(b"12345")
    with pytest.raises(BadRequest, match="ended after 5 of its 10 bytes"):
        buffer.body()
    with pytest.raises(BadRequest, match="longer than its Content-Length 10"):
        buffer.add(b"123456")
    assert BodyBuffer(0).body() == b""


@asynccontextmanager
async def listening(app: web.Application) -> AsyncIterator[tuple[str, int]]:
    """``app`` served as the server serves it (an ``AppRunner``: unlike aiohttp's test
    server, it does not cancel a handler whose client left), on a free port."""
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        yield host, port
    finally:
        await runner.cleanup()


async def test_connections_announcing_large_bodies_hold_only_what_they_sent(
    server_config: ServerConfig, caplog: pytest.LogCaptureFixture
) -> None:
    """Four connections announce 64 MiB bodies and send 10 bytes each: once each
    request's handler is reading its body, the server holds about those bytes, not
    4 x 64 MiB. The clients then leave: that is logged as such, not as a server error,
    and the server serves on."""
    caplog.set_level(logging.INFO, logger="model_server")
    app = ModelServer(server_config).make_app()
    reading: list[web.Request] = []

    @web.middleware
    async def note_reading(request: web.Request, handler: Handler) -> web.StreamResponse:
        reading.append(request)  # the handler runs in this step, up to its first wait
        return await handler(request)

    app.middlewares.append(note_reading)
    head = (
        f"POST {INFER} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {64 << 20}\r\n\r\n"
    ).encode()
    async with listening(app) as (host, port), asyncio.timeout(GUARD_S):
        with traced() as memory:
            connections = [await asyncio.open_connection(host, port) for _ in range(4)]
            for _, writer in connections:
                writer.write(head + b'{"inputs":')
                await writer.drain()
            while len(reading) < len(connections):
                await asyncio.sleep(0.01)
            while any(r.content.total_bytes < 10 for r in reading):  # all arrived
                await asyncio.sleep(0.01)
        assert memory.peak < 8 << 20, memory.peak
        for _, writer in connections:
            writer.close()
        while sum("the client left" in r.getMessage() for r in caplog.records) < 4:
            await asyncio.sleep(0.01)
        async with aiohttp.ClientSession() as session:
            x = np.ones((1, 8), np.float32)
            url = f"http://{host}:{port}{INFER}"
            async with session.post(url, json=infer_body(x)) as response:
                assert response.status == 200, await response.text()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


# --- failures that are no client's fault are JSON too -----------------------------------


@pytest.fixture
async def failing_client(server_config: ServerConfig) -> AsyncIterator[TestClient]:
    app = ModelServer(server_config, RaisingBackend()).make_app()
    async with TestClient(TestServer(app)) as test_client:
        yield test_client


async def test_an_engine_raising_is_a_500_json_answer_and_logged(
    failing_client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="model_server")
    x = np.full((1, 8), 1000.0, np.float32)
    response = await failing_client.post(INFER, json=infer_body(x))
    assert response.status == 500, await response.text()
    payload = await answer(response)
    assert payload == {
        "error": f"internal error: {RaisingBackend.MESSAGE}",
        "code": "internal_error",
    }
    [record] = [r for r in caplog.records if r.name == "model_server.frontends.http.api"]
    assert record.exc_info is not None and "POST /v2/models/mlp/infer" in record.getMessage()
    fine = await failing_client.post(INFER, json=infer_body(np.ones((1, 8), np.float32)))
    assert fine.status == 200, await fine.text()


# --- stalled and oversized bodies (issue 27) -----------------------------------------


async def answer_to_stalled(
    host: str, port: int, head: bytes, sent: bytes, *, until_closed: bool = True
) -> bytes:
    """What the server writes back to a request that sends ``head`` and ``sent`` of its
    body and then nothing: up to the server closing the connection (``until_closed``),
    else the answer's status line."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(head + sent)
        await writer.drain()
        return await (reader.read() if until_closed else reader.readuntil(b"\r\n"))
    finally:
        writer.close()


def request_head(length: int) -> bytes:
    return (
        f"POST {INFER} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


async def test_a_stalled_body_is_answered_408_and_its_connection_closed(
    server_config: ServerConfig,
) -> None:
    """Issue 27: a client announces a body, sends ten bytes and stalls; the server answers
    408 once the body read timeout passes and closes the connection (its descriptor freed)
    instead of holding it for ever."""
    config = replace(server_config, body_read_timeout_seconds=0.2)
    app = ModelServer(config).make_app()
    async with listening(app) as (host, port), asyncio.timeout(GUARD_S):
        metrics_url = f"http://{host}:{port}/metrics"
        reply = await answer_to_stalled(host, port, request_head(1000), b'{"inputs":')
        status_line, _, rest = reply.partition(b"\r\n")
        assert status_line.startswith(b"HTTP/1.1 408 "), reply
        assert b'"code": "request_timeout"' in rest, reply
        async with aiohttp.ClientSession() as session, session.get(metrics_url) as response:
            text = await response.text()
        assert 'code="408"' in text


async def test_a_body_announced_over_the_limit_is_413_before_it_is_read(
    server_config: ServerConfig,
) -> None:
    """Issue 27: a Content-Length over the limit is refused at once (413), not after
    reading the body up to the limit."""
    app = ModelServer(server_config).make_app()
    head = request_head(MAX_REQUEST_BYTES + 1)
    async with listening(app) as (host, port), asyncio.timeout(GUARD_S):
        reply = await answer_to_stalled(host, port, head, b"{", until_closed=False)
        assert reply.startswith(b"HTTP/1.1 413 "), reply


async def test_requests_to_unknown_models_create_no_series(client: TestClient) -> None:
    """Issue 27: any client could add series by naming models that do not exist; they are
    counted under one placeholder label, never under the name the client chose."""
    for i in range(5):
        response = await client.post(f"/v2/models/attacker-{i}/infer", json=infer_body(X1))
        assert response.status == 404, await response.text()
    metrics = await (await client.get("/metrics")).text()
    assert "attacker" not in metrics
    assert 'code="404",model="(unknown)"} 5.0' in metrics


class _Trickle:
    """A request body arriving in ``pieces``, ``gap_s`` apart (an upload slow but moving)."""

    def __init__(self, pieces: list[bytes], gap_s: float) -> None:
        self.content_length = sum(len(p) for p in pieces)
        self.headers: dict[str, str] = {}
        self.content = self
        self._pieces = list(pieces)
        self._gap_s = gap_s

    async def readany(self) -> bytes:
        if not self._pieces:
            return b""
        await asyncio.sleep(self._gap_s)
        return self._pieces.pop(0)


async def test_a_slow_body_that_keeps_arriving_is_not_cut() -> None:
    """The body read timeout is an idle one: a large upload that keeps moving (here six
    pieces 0.25 s apart, 1.5 s in all) is read whole under a timeout of 1 s; only a body
    that stops arriving for that long is 408 (before, the timeout bounded the whole body:
    408 here)."""
    body = bytes(range(256)) * 24
    pieces = [body[i : i + 1024] for i in range(0, len(body), 1024)]
    assert len(pieces) == 6
    read = await read_body(_Trickle(pieces, 0.25), 1.0)  # type: ignore[arg-type]
    assert bytes(read) == body
    with pytest.raises(RequestTimeout):
        await read_body(_Trickle(pieces, 0.5), 0.1)  # type: ignore[arg-type]
