"""Large JSON bodies are decoded and encoded in worker processes, not on the event loop.

orjson (like every JSON library for Python) holds the GIL for a whole parse, so a
thread would not free the event loop: a 50 MB body measured zero loop turns in the half
second its parse took on a thread. Only the JSON goes to a worker: binary tensor data
after it (:mod:`.binary_codec`) is read on the loop as views of the body, which costs
no parse. A worker process parses, checks the element counts
and builds the arrays; only the arrays come back (pickled as raw buffers), so the
server's own memory never holds the millions of Python floats a large body becomes.
Small bodies stay on the loop, where a parse costs less than the trip to a worker.

Large bodies waiting for a worker are bounded (``max_pending_decodes``, counting those
being decoded): past it a request is answered 503 ``unavailable`` with Retry-After at
once, before its body is read when its length is announced, instead of queueing
64 MiB bodies without limit. Encodes are not bounded: their outputs exist already."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from collections.abc import Callable, Mapping
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

import numpy as np

from model_server.errors import Unavailable
from model_server.protocol.tensor_spec import TensorSpec
from model_server.protocol.tensors import BinaryOutput
from model_server.protocol.v2_codec import (
    Buffer,
    DecodedRequest,
    decode_header,
    encode_response,
    output_elements,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

INLINE_BODY_BYTES = 256 * 1024  # bodies up to this size are decoded on the event loop
INLINE_OUTPUT_ELEMENTS = 32 * 1024  # responses up to this many values are encoded there
PENDING_DECODES_PER_PROCESS = 2  # large bodies being decoded or waiting, per worker
RETRY_AFTER_S = 1  # what a client refused for a full queue is told to wait


class JsonCodec:
    def __init__(
        self,
        processes: int = 2,
        inline_body_bytes: int = INLINE_BODY_BYTES,
        inline_output_elements: int = INLINE_OUTPUT_ELEMENTS,
        max_pending_decodes: int | None = None,
    ) -> None:
        self.processes = processes
        self.inline_body_bytes = inline_body_bytes
        self.inline_output_elements = inline_output_elements
        self.max_pending_decodes = (
            max_pending_decodes
            if max_pending_decodes is not None
            else PENDING_DECODES_PER_PROCESS * processes
        )
        self.pending_decodes = 0  # large bodies being decoded or waiting for a worker
        self._pool: ProcessPoolExecutor | None = None  # started with the first large body

    def check_room(self, body_bytes: int | None) -> None:
        """Raise ``Unavailable`` (with Retry-After) if a body of this size would have to
        wait behind a full queue of large bodies; ``None``: size not known yet."""
        if body_bytes is None or body_bytes <= self.inline_body_bytes:
            return
        if self.pending_decodes >= self.max_pending_decodes:
            raise Unavailable(
                f"{self.pending_decodes} large request bodies are being decoded or waiting "
                f"for the {self.processes} JSON worker process(es); retry later",
                retry_after_s=RETRY_AFTER_S,
            )

    async def decode(
        self, raw: Buffer, charset: str, specs: tuple[TensorSpec, ...]
    ) -> DecodedRequest:
        """A request's JSON (the body, or the header before its binary data), decoded."""
        if len(raw) <= self.inline_body_bytes:
            return decode_header(raw, charset, specs)
        self.check_room(len(raw))  # on the event loop, like the count: no race
        self.pending_decodes += 1
        try:  # a view cannot be pickled: the worker gets a copy of the JSON's bytes
            data = bytes(raw) if isinstance(raw, memoryview) else raw
            return await self._in_worker(decode_header, data, charset, specs)
        finally:
            self.pending_decodes -= 1

    async def encode(
        self,
        name: str,
        version: str,
        request_id: str,
        outputs: Mapping[str, np.ndarray | BinaryOutput],
    ) -> bytes:
        """The response's JSON (binary outputs are only described there)."""
        if output_elements(outputs) <= self.inline_output_elements:
            return encode_response(name, version, request_id, outputs)
        return await self._in_worker(encode_response, name, version, request_id, dict(outputs))

    async def _in_worker(self, fn: Callable[..., T], *args: Any) -> T:
        pool = self._pool
        if pool is None:
            # spawn: a fork of this threaded process could inherit locks held by other threads
            pool = self._pool = ProcessPoolExecutor(
                self.processes, mp_context=multiprocessing.get_context("spawn")
            )
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
        except BrokenProcessPool as exc:
            if self._pool is pool:  # the next large body gets new workers
                self._pool = None
                pool.shutdown(wait=False, cancel_futures=True)
            log.error("a JSON worker process died (out of memory?): %s", exc)
            raise Unavailable("the JSON worker process died; the request was not run") from exc

    def close(self) -> None:
        """Stop the workers now: at shutdown nothing they hold is worth waiting for, and
        one stuck in a parse would otherwise keep the server from exiting (the
        interpreter joins them at exit) until the kubelet's SIGKILL."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        # the pool's own list (Python 3.14 has ProcessPoolExecutor.kill_workers for this)
        workers = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for worker in workers:
            worker.kill()
