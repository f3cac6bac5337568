"""``model-server --processes N``: one server of N processes behind one port.

One event loop answers about 1400 batch-1 requests per second; a pod is one server on
one port. So the process started is a supervisor (no model, no backend): it starts N
workers, ordinary servers of the same flags that bind the port with SO_REUSEPORT (the
kernel spreads the connections over the workers that listen, and a worker listens only
once the supervisor opens it: its models loaded and, after a restart, given what the
pool serves), and a private directory (0700) holds each worker's control socket and
private app (:mod:`.pool_worker`). The configured control socket is the supervisor's,
relaying to every worker (:mod:`.pool_relay`).

A worker that exits unexpectedly is restarted with a backoff; before it listens or
counts as healthy it is given the state of a healthy one (:mod:`.pool_replay`). A
worker that exits before its first start completes fails the pool (a bad flag, a
backend missing: restarting would not help). SIGTERM or SIGINT is forwarded to every
worker (each in a process group of its own, so a signal to the supervisor's group
reaches it once), each drains as one server does (:mod:`.serving`); the supervisor
exits 0 once all have exited 0. A second SIGTERM changes nothing; a second SIGINT ends
the drains at once, as does the kubelet's SIGKILL after the grace period (the workers
then get SIGTERM from the kernel: ``pool_worker.end_with_supervisor``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from model_server.config import ServerConfig
from model_server.pool.gpu_sharing import pool_without_mps_warning
from model_server.pool.relay import ControlRelay, RelaySocketServer, WorkerLink, manifest_digests
from model_server.pool.replay import ReplayFailed, fetch_state, open_worker, replay
from model_server.pool.worker import control_socket, private_socket

log = logging.getLogger(__name__)

START_POLL_S = 0.1  # how often a starting worker's control socket is tried
BACKOFF_S = (0.5, 30.0)  # a restart's first and largest delay (doubling between)
STABLE_S = 60.0  # a worker that ran this long restarts again after the first delay
OPEN_ATTEMPTS = 4  # a worker's /open, tried this often (its private app coming up)
OPEN_RETRY_S = 0.25  # before the second try, doubling after


def worker_argv(argv: list[str], directory: Path, index: int, size: int) -> list[str]:
    """The command of worker ``index``: the pool's flags, then its own (the last of a
    flag given twice wins)."""
    return [
        sys.executable, "-m", "model_server", *argv,
        "--processes", "1", "--worker-index", str(index), "--pool-size", str(size),
        "--pool-dir", str(directory),
        "--control-socket", str(control_socket(directory, index)),
    ]  # fmt: skip


class Worker:
    def __init__(self, pool: Pool, index: int) -> None:
        self.pool = pool
        self.index = index
        self.link = WorkerLink(index, control_socket(pool.directory, index))
        self.process: asyncio.subprocess.Process | None = None
        self.started_once = False

    async def _started(self) -> bool:
        """Wait until the worker's control socket answers (its startup loads are done);
        False if it exits first."""
        process = self.process
        assert process is not None
        while process.returncode is None:
            with contextlib.suppress(OSError):
                _, writer = await asyncio.open_unix_connection(str(self.link.path))
                writer.close()
                return True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.wait(), START_POLL_S)
        return False

    async def _catch_up(self) -> None:
        """Give a restarted worker the state of a healthy one, swaps held meanwhile, and
        only then open its public ports."""
        async with self.pool.relay.exclusive():
            peer = next((w for w in self.pool.workers if w.link.healthy.is_set()), None)
            if peer is not None:
                state = await fetch_state(private_socket(self.pool.directory, peer.index))
                await replay(state, self.link)
            await self._open()

    async def _open(self) -> None:
        """Let the worker listen on the public ports; it counts as healthy from then. A
        call that fails is tried again (``OPEN_ATTEMPTS``): one failure on the first
        start would fail the whole pool."""
        socket = private_socket(self.pool.directory, self.index)
        for attempt in range(OPEN_ATTEMPTS):
            try:
                await open_worker(socket)
                break
            except ReplayFailed as exc:
                if attempt == OPEN_ATTEMPTS - 1 or self.pool.stopping:
                    raise
                log.warning("pool: worker %d: %s; trying again", self.index, exc)
                await asyncio.sleep(OPEN_RETRY_S * 2**attempt)
        self.link.healthy_since = time.monotonic()
        self.link.healthy.set()

    async def run(self) -> int:
        """Run (and restart) this worker until the pool stops; its last exit status."""
        delay = BACKOFF_S[0]
        while True:
            began = time.monotonic()
            argv = worker_argv(self.pool.argv, self.pool.directory, self.index, self.pool.size)
            # a process group of its own: a signal to the supervisor's group reaches the
            # worker once, through the supervisor, not a second time from the sender
            self.process = await asyncio.create_subprocess_exec(*argv, process_group=0)
            log.info("pool: worker %d started (pid %d)", self.index, self.process.pid)
            if await self._started():
                try:
                    if self.started_once:
                        await self._catch_up()
                    else:
                        await self._open()
                    self.started_once = True
                except ReplayFailed as exc:
                    if self.pool.stopping:  # told to stop meanwhile: it drains and exits
                        log.info("pool: worker %d stopped before it was opened (%s)",
                                 self.index, exc)  # fmt: skip
                    else:
                        log.error("pool: worker %d could not catch up: %s; restarting",
                                  self.index, exc)  # fmt: skip
                        self.process.kill()
            code = await self.process.wait()
            self.link.healthy.clear()
            if self.pool.stopping:
                return code
            if not self.started_once:
                log.error("pool: worker %d exited with %d before it started", self.index, code)
                self.pool.fail(code or 1)
                return code or 1
            if time.monotonic() - began > STABLE_S:
                delay = BACKOFF_S[0]
            log.error("pool: worker %d exited with %d; restarting in %.1f s",
                      self.index, code, delay)  # fmt: skip
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.pool.stopped.wait(), delay)
            if self.pool.stopping:
                return code
            delay = min(delay * 2, BACKOFF_S[1])

    def signal(self, sig: int) -> None:
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(sig)


class Pool:
    def __init__(self, config: ServerConfig, argv: list[str], directory: Path) -> None:
        self.config = config
        self.argv = argv
        self.directory = directory
        self.size = config.processes
        self.workers = [Worker(self, i) for i in range(self.size)]
        self.relay = ControlRelay(
            [w.link for w in self.workers], manifest_digests(config.repository)
        )
        self.stopped = asyncio.Event()
        self.failed: int | None = None

    @property
    def stopping(self) -> bool:
        return self.stopped.is_set()

    def stop(self, sig: int) -> None:
        """Forward ``sig`` to every worker: the first SIGTERM or SIGINT starts their
        drains; a later SIGTERM changes nothing (a drain is never cut short by one), a
        later SIGINT ends their drains at once."""
        if self.stopping and sig == signal.SIGTERM:
            log.info("pool: SIGTERM again: the workers go on draining (SIGINT ends that)")
            return
        log.info("pool: signal %d: passing it to the %d workers", sig, self.size)
        self.stopped.set()
        for worker in self.workers:
            worker.signal(sig)

    def fail(self, code: int) -> None:
        if self.failed is None:
            self.failed = code
            self.stop(signal.SIGTERM)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop, sig)
        relay = None
        if self.config.control_socket is not None:
            relay = RelaySocketServer(self.relay, self.config.control_socket)
            await relay.start()
        try:
            codes = await asyncio.gather(*(w.run() for w in self.workers))
        finally:
            if relay is not None:
                await relay.stop()
        if self.failed is not None:
            return self.failed
        bad = [(i, c) for i, c in enumerate(codes) if c != 0]
        if bad:
            log.error("pool: workers exited with %s", bad)
            return 1
        log.info("pool: every worker stopped")
        return 0


def run_pool(config: ServerConfig, argv: list[str]) -> int:
    """Supervise ``config.processes`` workers of ``argv`` until signalled; the exit status."""
    if warning := pool_without_mps_warning(config.backend, config.processes):
        log.warning("pool: %s", warning)
    directory = Path(tempfile.mkdtemp(prefix="model-server-pool."))  # $TMPDIR, mode 0700
    try:
        return asyncio.run(Pool(config, argv, directory).run())
    finally:
        shutil.rmtree(directory, ignore_errors=True)
