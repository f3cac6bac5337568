"""Runs the server until SIGTERM or SIGINT, then shuts down without dropping a request.

A pod's endpoints learn of its termination only after the kubelet has sent SIGTERM, so
the server keeps serving for ``drain_seconds`` with readiness at 503 (every answer now
closes its connection, so clients with kept-alive connections move on), then stops
listening, lets the requests in flight finish, and exits with status 0. A second signal
ends the drain at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from pathlib import Path

from aiohttp import web

from .app import SERVER, create_app
from .config import ServerConfig

log = logging.getLogger(__name__)

IN_FLIGHT_GRACE_S = 60.0  # after the drain: how long requests in flight may still take


async def serve(config: ServerConfig) -> None:
    """Serve until SIGTERM or SIGINT, then drain and finish what is in flight."""
    loop = asyncio.get_running_loop()
    signalled = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signalled.set)
    app = create_app(config)
    runner = web.AppRunner(app, handle_signals=False, access_log=None,
                           shutdown_timeout=IN_FLIGHT_GRACE_S)  # fmt: skip
    await runner.setup()  # loads the models (on_startup)
    try:
        await web.TCPSite(runner, config.host, config.port).start()
        log.info("serving on %s:%d", config.host, config.port)
        await signalled.wait()
        signalled.clear()
        app[SERVER].plane.begin_drain()
        log.info("draining: unready, serving for %.1f s more", config.drain_seconds)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(signalled.wait(), config.drain_seconds)
        log.info("drained: no new connections; finishing the requests in flight")
    finally:
        await runner.cleanup()  # stops listening, waits for in-flight requests, on_cleanup
    log.info("stopped")


def run(config: ServerConfig) -> None:
    Path(config.repository).mkdir(parents=True, exist_ok=True)
    asyncio.run(serve(config))
