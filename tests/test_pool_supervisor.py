"""The pool's supervisor starting and stopping a worker (issue 27 hostile review): the
first start's ``/open`` is retried like any other call to a worker that is coming up, and
a stop while a restarted worker catches up ends with the worker's own clean exit, not a
SIGKILL and a non-zero status."""

from __future__ import annotations

from pathlib import Path

import pytest

from model_server import pool as pool_module
from model_server.config import ServerConfig
from model_server.pool import Pool
from model_server.pool_replay import ReplayFailed


def pool_of(tmp_path: Path, size: int = 2) -> Pool:
    config = ServerConfig(repository=tmp_path / "models", processes=size)
    directory = tmp_path / "pool"
    directory.mkdir()
    return Pool(config, [], directory)


async def test_the_first_open_is_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One failed ``/open`` (the worker's private app not answering yet) used to fail
    the worker's first start, and with it the whole pool."""
    pool = pool_of(tmp_path)
    calls: list[Path] = []

    async def flaky(socket: Path) -> None:
        calls.append(socket)
        if len(calls) == 1:
            raise ReplayFailed("POST /open on 0.sock: ConnectionRefusedError()")

    monkeypatch.setattr(pool_module, "open_worker", flaky)
    monkeypatch.setattr(pool_module, "OPEN_RETRY_S", 0.0, raising=False)
    worker = pool.workers[0]
    await worker._open()
    assert len(calls) == 2 and worker.link.healthy.is_set()
