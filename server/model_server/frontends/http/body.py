"""Reading an HTTP request body once, into one buffer that tensors can be views of.

``aiohttp``'s ``request.read()`` gathers the chunks in a bytearray and then copies them
into ``bytes``; this reads a body of announced length into one buffer laid out so that
the binary tensor data after a JSON header of ``align_after`` bytes starts on an
``ALIGNMENT`` boundary (:mod:`.binary_codec` can then hand the engine views of the body,
writable, instead of copies). A body without a length (chunked), or compressed (aiohttp
inflates ``Content-Encoding: gzip/deflate`` bodies as it reads them), is gathered as it
comes. Either way a body over ``max_bytes`` is aiohttp's own 413, at once when its
Content-Length says so; a body of which no byte arrives for ``timeout_s`` is 408
(``RequestTimeout``), so a stalled client does not hold its connection for ever, while a
large upload that is slow but moving is never cut (an idle timeout, not one on the whole
body).

The memory a body holds follows the bytes that arrived, never the length a client
announced (:class:`BodyBuffer`): a connection that announces 64 MiB and sends ten bytes
holds ten bytes, however many such connections there are."""

from __future__ import annotations

import asyncio

import numpy as np
from aiohttp import web

from model_server.config import MAX_REQUEST_BYTES
from model_server.errors import BadRequest, RequestTimeout
from model_server.protocol.binary_codec import ALIGNMENT


class BodyBuffer:
    """A body of ``length`` announced bytes, filled chunk by chunk: the chunks are kept as
    they come until half of the body has arrived, and only then is the one aligned
    buffer of its whole length made (the chunks copied in, the rest read straight into
    it). So it holds at most three times what arrived, never more than twice its length,
    and copies each byte once, as a buffer made up front would."""

    def __init__(self, length: int, align_after: int | None = None) -> None:
        self.length = length
        self.align_after = align_after or 0
        self.received = 0
        self._chunks: list[bytes] = []
        self._body: memoryview | None = None
        self._lay_out_once_half_arrived()

    @property
    def allocated(self) -> int:
        """The bytes this buffer holds now."""
        if self._body is None:
            return sum(len(c) for c in self._chunks)
        return self.length + ALIGNMENT

    def add(self, chunk: bytes) -> None:
        if self.received + len(chunk) > self.length:  # the parser holds bodies to their length
            raise BadRequest(f"the request body is longer than its Content-Length {self.length}")
        if self._body is None:
            self._chunks.append(chunk)
        else:
            self._body[self.received : self.received + len(chunk)] = chunk
        self.received += len(chunk)
        self._lay_out_once_half_arrived()

    def body(self) -> memoryview:
        """The whole body, once it has arrived (its ``align_after`` byte aligned)."""
        if self.received < self.length:
            raise BadRequest(
                f"the request body ended after {self.received} of its {self.length} bytes"
            )
        assert self._body is not None  # laid out once half of it arrived
        return self._body

    def _lay_out_once_half_arrived(self) -> None:
        if self._body is not None or 2 * self.received < self.length:
            return
        buffer = bytearray(self.length + ALIGNMENT)
        address = np.frombuffer(buffer, np.uint8).ctypes.data
        pad = -(address + self.align_after) % ALIGNMENT
        body = memoryview(buffer)[pad : pad + self.length]
        filled = 0
        for chunk in self._chunks:
            body[filled : filled + len(chunk)] = chunk
            filled += len(chunk)
        self._chunks.clear()
        self._body = body


def _too_large(max_bytes: int, size: int) -> web.HTTPRequestEntityTooLarge:
    return web.HTTPRequestEntityTooLarge(max_size=max_bytes, actual_size=size)


async def read_body(
    request: web.Request,
    timeout_s: float,
    align_after: int | None = None,
    max_bytes: int = MAX_REQUEST_BYTES,
) -> memoryview:
    """The request's whole body, as long as none of its bytes takes over ``timeout_s``
    to come; with ``align_after``, the byte at that offset is ``ALIGNMENT``-aligned when
    the body's length is known in advance."""
    length = request.content_length
    if length is not None and length > max_bytes:  # refused before reading a byte
        raise _too_large(max_bytes, length)
    identity = request.headers.get("Content-Encoding", "identity").lower() == "identity"
    if length is None or not identity:
        return await _gather(request, timeout_s, max_bytes)
    buffer = BodyBuffer(length, align_after)
    while buffer.received < length:
        chunk = await _next_chunk(request, timeout_s)
        if not chunk:
            break  # the connection ended early: body() says so
        buffer.add(chunk)
    return buffer.body()


async def _next_chunk(request: web.Request, timeout_s: float) -> bytes:
    """The body's next bytes; 408 when none come for ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            return await request.content.readany()
    except TimeoutError:
        raise RequestTimeout(f"no byte of the request body arrived for {timeout_s:g} s") from None


async def _gather(request: web.Request, timeout_s: float, max_bytes: int) -> memoryview:
    buffer = bytearray()
    while chunk := await _next_chunk(request, timeout_s):
        buffer += chunk
        if len(buffer) > max_bytes:
            raise _too_large(max_bytes, len(buffer))
    return memoryview(buffer)
