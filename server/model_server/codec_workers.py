"""Large JSON bodies are decoded and encoded in worker processes, not on the event loop.

``json`` (like every JSON library for Python) holds the GIL for a whole parse, so a
thread would not free the event loop: a 50 MB body measured zero loop turns in the half
second its parse took on a thread. A worker process parses, checks the element counts
and builds the arrays; only the arrays come back (pickled as raw buffers), so the
server's own memory never holds the millions of Python floats a large body becomes.
Small bodies stay on the loop, where a parse costs less than the trip to a worker."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

import numpy as np

from .backends.base import TensorSpec
from .errors import Unavailable
from .v2_codec import InferenceRequest, decode_request, encode_response, output_elements

log = logging.getLogger(__name__)
T = TypeVar("T")

INLINE_BODY_BYTES = 256 * 1024  # bodies up to this size are decoded on the event loop
INLINE_OUTPUT_ELEMENTS = 32 * 1024  # responses up to this many values are encoded there


class JsonCodec:
    def __init__(
        self,
        processes: int = 2,
        inline_body_bytes: int = INLINE_BODY_BYTES,
        inline_output_elements: int = INLINE_OUTPUT_ELEMENTS,
    ) -> None:
        self.processes = processes
        self.inline_body_bytes = inline_body_bytes
        self.inline_output_elements = inline_output_elements
        self._pool: ProcessPoolExecutor | None = None  # started with the first large body

    async def decode(
        self, raw: bytes, charset: str, specs: tuple[TensorSpec, ...]
    ) -> InferenceRequest:
        if len(raw) <= self.inline_body_bytes:
            return decode_request(raw, charset, specs)
        return await self._in_worker(decode_request, raw, charset, specs)

    async def encode(
        self, name: str, version: str, request_id: str, outputs: dict[str, np.ndarray]
    ) -> bytes:
        if output_elements(outputs) <= self.inline_output_elements:
            return encode_response(name, version, request_id, outputs)
        return await self._in_worker(encode_response, name, version, request_id, outputs)

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
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
