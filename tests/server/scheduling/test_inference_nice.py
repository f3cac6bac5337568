"""Inference threads may run at a lower CPU priority than the server's other threads, so
that a version loading beside the serving one takes a busy CPU first."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from model_server.app import ModelServer
from model_server.backends.cpu_priority import thread_nice
from model_server.config import ServerConfig, parse_args


async def test_inference_threads_yield_the_cpu_to_loads_when_told(
    server_config: ServerConfig,
) -> None:
    """``--inference-nice N``: each inference thread's nice value is N above the
    server's, the loader's stays the server's, so a load takes a busy CPU first."""
    base = ["--repository", str(server_config.repository)]
    assert parse_args(base).inference_nice == 0
    assert parse_args([*base, "--inference-nice", "5"]).inference_nice == 5
    with pytest.raises(SystemExit):
        parse_args([*base, "--inference-nice", "20"])
    server = ModelServer(dataclasses.replace(server_config, inference_nice=3))
    try:
        own = thread_nice()
        assert own is not None
        inference = await asyncio.get_running_loop().run_in_executor(server.executor, thread_nice)
        assert inference == min(19, own + 3)
        assert thread_nice() == own  # this thread, as a loader's: unchanged
    finally:
        server.executor.shutdown()
