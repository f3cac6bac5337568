"""Runs the server until SIGTERM or SIGINT, then shuts down without dropping a request.

A pod's endpoints learn of its termination only after the kubelet has sent SIGTERM, so
the server keeps serving for ``drain_seconds`` with readiness at 503 (every answer now
closes its connection, so clients with kept-alive connections move on), then stops
listening (HTTP and gRPC: gRPC clients get a GOAWAY then; the HTTP connections the kernel
had accepted are still served, see :mod:`.drain`), closes the connections idle between
requests, lets the requests in flight finish for up to ``inflight_grace_seconds`` (what
the pod's grace period leaves after the preStop pause and the drain:
``model_rollout_contract.defaults.INFLIGHT_GRACE_SECONDS``), cancels any still running,
and exits with status 0. A second signal ends the drain at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from pathlib import Path

from aiohttp import web

from model_server.app import SERVER, ModelServer, create_app
from model_server.config import ServerConfig
from model_server.frontends.http.drain import Listener, finish_connections, listen
from model_server.pool.worker import private_app, private_socket

log = logging.getLogger(__name__)

# once the grace is over, what a request still running gets to unwind after its cancel
CANCEL_SECONDS = 0.1


async def serve(config: ServerConfig) -> None:
    """Serve until SIGTERM or SIGINT, then drain and finish what is in flight."""
    loop = asyncio.get_running_loop()
    signalled = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signalled.set)
    app = create_app(config)
    runner = web.AppRunner(app, handle_signals=False, access_log=None,
                           shutdown_timeout=CANCEL_SECONDS)  # fmt: skip
    opened = asyncio.Event()
    async with contextlib.AsyncExitStack() as stack:
        if config.in_pool:  # the pool's other workers and its supervisor ask it here
            stack.push_async_callback((await start_private(app[SERVER], opened)).cleanup)
        await runner.setup()  # loads the models (on_startup)
        # stops listening, cancels what is left, on_cleanup (before the private app's)
        stack.push_async_callback(runner.cleanup)
        serving = True
        if config.in_pool:
            log.info("loaded: listening once the pool's supervisor opens this worker")
            serving = await _first(opened, signalled)  # False: stopped before it listened
            if serving:
                await app[SERVER].start_grpc()
        if serving:
            await _serve_and_drain(runner, app, config, signalled)
    log.info("stopped")


async def _serve_and_drain(
    runner: web.AppRunner, app: web.Application, config: ServerConfig, signalled: asyncio.Event
) -> None:
    assert runner.server is not None  # set up
    # a pool's workers share the port: the kernel spreads connections over them
    sockets = await listen(config.host, config.port, reuse_port=config.in_pool)
    listeners = [Listener(sock, runner.server) for sock in sockets]
    log.info("serving on %s:%d", config.host, config.port)
    await signalled.wait()
    signalled.clear()
    app[SERVER].plane.begin_drain()
    log.info("draining: unready, serving for %.1f s more", config.drain_seconds)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(signalled.wait(), config.drain_seconds)
    await _finish_in_flight(runner.server, listeners, app, config.inflight_grace_seconds)


async def _first(wanted: asyncio.Event, other: asyncio.Event) -> bool:
    """Wait for either event: whether ``wanted`` was set."""
    waits = [asyncio.ensure_future(e.wait()) for e in (wanted, other)]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
    return wanted.is_set()


async def start_private(server: ModelServer, opened: asyncio.Event) -> web.AppRunner:
    """The private app of a pool's worker on its Unix socket in the pool's directory
    (before the startup loads: the supervisor opens the worker there once they are done)."""
    config = server.config
    assert config.pool_dir is not None and config.worker_index is not None
    runner = web.AppRunner(private_app(server.plane, server.metrics, opened), access_log=None)
    await runner.setup()
    await web.UnixSite(runner, str(private_socket(config.pool_dir, config.worker_index))).start()
    return runner


async def _finish_in_flight(
    server: web.Server, listeners: list[Listener], app: web.Application, grace_s: float
) -> None:
    """Stop listening (serving the connections already accepted), close the connections
    idle between requests, and give the requests in flight up to ``grace_s`` to finish
    (gRPC's too); the runner's cleanup then cancels what is left."""
    taken = sum([await listener.close() for listener in listeners])
    grpc = app[SERVER].grpc
    grpc_stopped = asyncio.ensure_future(grpc.stop(grace_s)) if grpc is not None else None
    log.info("drained: no new connections (%d taken from the backlog); finishing the "
             "requests in flight", taken)  # fmt: skip
    left = await finish_connections(server, grace_s)
    if grpc_stopped is not None:
        await grpc_stopped  # its calls done, or cancelled after the same grace
    requests = app[SERVER].in_flight.count
    if requests:
        log.warning(
            "%d request(s) still in flight after the %g s grace: cancelling them", requests, grace_s
        )
    if len(left) > requests:
        log.warning(
            "%d connection(s) sent no request to answer within the %g s grace: closing them",
            len(left) - requests,
            grace_s,
        )


def run(config: ServerConfig) -> None:
    Path(config.repository).mkdir(parents=True, exist_ok=True)
    sys.setswitchinterval(config.gil_switch_interval_us / 1e6)
    asyncio.run(serve(config))
