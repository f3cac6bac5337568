"""The pool's supervisor starting and stopping a worker (issue 27 hostile review): the
first start's ``/open`` is retried like any other call to a worker that is coming up, and
a stop while a restarted worker catches up ends with the worker's own clean exit, not a
SIGKILL and a non-zero status."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from model_server.config import ServerConfig
from model_server.pool import supervisor as pool_module
from model_server.pool.replay import ReplayFailed
from model_server.pool.supervisor import Pool

# a worker as the supervisor sees one: its control socket answers; SIGTERM drains a
# moment, then exits 0
FAKE_WORKER = """
import signal, socket, sys, time
listener = socket.socket(socket.AF_UNIX)
listener.bind(sys.argv[1])
listener.listen()
def drain(*_):
    time.sleep(0.5)
    sys.exit(0)
signal.signal(signal.SIGTERM, drain)
while True:
    connection, _ = listener.accept()
    connection.close()
"""


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


async def test_a_stop_during_catch_up_ends_in_the_workers_clean_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM reaches a restarted worker while it is being given the pool's state; the
    replay then fails (the worker drains): the supervisor lets it exit (0) instead of
    killing it (-9, and the pool's status 1)."""
    pool = pool_of(tmp_path)
    worker, peer = pool.workers
    peer.link.healthy.set()  # the healthy worker the state comes from
    worker.started_once = True  # a restart: it catches up before it opens

    def argv(_argv: list[str], _directory: Path, _index: int, _size: int) -> list[str]:
        return [sys.executable, "-c", FAKE_WORKER, str(worker.link.path)]

    async def state_then_stop(_socket: Path) -> dict[str, object]:
        pool.stop(signal.SIGTERM)
        raise ReplayFailed("GET /state: the worker is draining")

    monkeypatch.setattr(pool_module, "worker_argv", argv)
    monkeypatch.setattr(pool_module, "fetch_state", state_then_stop)
    assert await worker.run() == 0
