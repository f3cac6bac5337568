"""A worker's part in a pool of server processes behind one port (:mod:`.pool`).

The kernel hands each connection to one worker (SO_REUSEPORT), so whichever worker a
scrape reaches must answer for the pod: besides the public port each worker serves a
private app on a Unix socket in the pool's 0700 directory, with its own metrics,
statistics and loaded state, and the public ``/metrics`` and statistics routes gather
the other workers' there and merge them (:mod:`.pool_metrics`, :mod:`.pool_statistics`).
A worker that does not answer within ``PEER_TIMEOUT_S`` (restarting, stopped) is left
out, counted and logged, so a scrape never hangs on one.

A worker listens on the public ports (HTTP and gRPC) only once its supervisor opens it
(``POST /open`` on the private app): at once after a first start, and after a restart
only once it has been given what the pool serves (:mod:`.pool_replay`), so that a
restarted worker never answers with the version it started on."""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import math
import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from model_server.dataplane.data_plane import DataPlane
from model_server.frontends.http.api import MERGED_METRICS, MERGED_STATISTICS
from model_server.lifecycle.model_slot import LoadedVersion
from model_server.observability.metrics import ServerMetrics
from model_server.pool.metrics import merge_expositions
from model_server.pool.statistics import merge_statistics
from model_server.security.rate_limits import RateLimit, TenantRateLimits

log = logging.getLogger(__name__)

PEER_TIMEOUT_S = 2.0  # a worker that has not answered by then is left out of the answer
PR_SET_PDEATHSIG = 1  # prctl(2)
WORKER_HEADER = "Model-Server-Worker"  # which worker answered (pool mode only)


def private_socket(directory: Path, index: int) -> Path:
    """Where worker ``index`` serves its private app."""
    return directory / f"worker-{index}.http"


def control_socket(directory: Path, index: int) -> Path:
    """Where worker ``index`` listens for the supervisor's control requests."""
    return directory / f"worker-{index}.sock"


def end_with_supervisor() -> None:
    """Have the kernel send this worker SIGTERM (a drain, as from the kubelet) when its
    supervisor dies, even by SIGKILL, so that no worker outlives its pool (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the supervisor's signals only
        return
    if os.getppid() == 1:  # the supervisor died before the prctl
        os.kill(os.getpid(), signal.SIGTERM)


def worker_rate_limits(limits: TenantRateLimits, size: int) -> TenantRateLimits:
    """Each tenant's bucket for one of ``size`` workers: 1/N of its rate, and of its
    burst rounded up (the pod as a whole admits what one server would, give or take
    where the kernel sends a tenant's connections)."""
    return TenantRateLimits(
        {
            tenant: RateLimit(
                bucket.limit.requests_per_second / size, math.ceil(bucket.limit.burst / size)
            )
            for tenant, bucket in limits.buckets.items()
        },
        on_limited=limits.on_limited,
    )


class PoolPeers:
    """The other workers of this worker's pool, reached on their private sockets."""

    def __init__(
        self, directory: Path, index: int, size: int, timeout_s: float = PEER_TIMEOUT_S
    ) -> None:
        self.directory = directory
        self.index = index
        self.size = size
        self.timeout_s = timeout_s
        self._sessions: dict[int, aiohttp.ClientSession] = {}

    def _session(self, peer: int) -> aiohttp.ClientSession:
        session = self._sessions.get(peer)
        if session is None or session.closed:
            connector = aiohttp.UnixConnector(path=str(private_socket(self.directory, peer)))
            timeout = aiohttp.ClientTimeout(total=self.timeout_s)
            session = self._sessions[peer] = aiohttp.ClientSession(
                connector=connector, timeout=timeout
            )
        return session

    async def _one(self, peer: int, path: str, params: Sequence[tuple[str, str]]) -> bytes | None:
        try:
            async with self._session(peer).get(f"http://worker{path}", params=params) as answer:
                if answer.status != 200:
                    return None  # e.g. a version this worker does not hold: nothing to add
                return await answer.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            log.warning("pool: worker %d did not answer %s: %r; left out", peer, path, exc)
            return None

    async def others(
        self, path: str, params: Sequence[tuple[str, str]] = ()
    ) -> tuple[list[bytes], int]:
        """The other workers' answers to ``GET path`` and how many gave none."""
        peers = [p for p in range(self.size) if p != self.index]
        answers = await asyncio.gather(*(self._one(p, path, params) for p in peers))
        got = [a for a in answers if a is not None]
        return got, len(answers) - len(got)

    async def close(self) -> None:
        for session in self._sessions.values():
            await session.close()
        self._sessions.clear()


async def pool_metrics(peers: PoolPeers, metrics: ServerMetrics) -> web.Response:
    """The pod's exposition: this worker's and every other worker's, merged."""
    own = generate_latest(metrics.registry).decode()
    others, unanswered = await peers.others("/metrics")
    body = merge_expositions([own, *(o.decode() for o in others)], unanswered)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def pool_statistics(
    peers: PoolPeers, own: dict[str, Any], keys: list[str], version: str | None
) -> dict[str, Any]:
    """The pod's statistics of ``keys`` (``own``: this worker's, already checked)."""
    params = [("key", k) for k in keys] + ([("version", version)] if version else [])
    others, _ = await peers.others("/statistics", params)
    return merge_statistics([own, *(json.loads(o) for o in others)])


def _held(version: LoadedVersion) -> dict[str, str]:
    """A loaded version as a load names it again: the file it was loaded from (the
    sidecar may announce one outside ``<model>/<version>/``) and its digest."""
    return {"version": version.version, "sha256": version.sha256, "path": str(version.path)}


def loaded_state(plane: DataPlane) -> dict[str, Any]:
    """Every model's serving version, its retained ones (least recently served first)
    and its traffic policy: what the supervisor replays to a restarted worker."""
    state: dict[str, Any] = {}
    for key in plane.model_keys():
        slot = plane.manager.slot(key)
        current = slot.current
        state[key] = {
            "serving": _held(current) if current else None,
            "retained": [_held(v) for v in slot.retained()],
            "policy": slot.policy.to_json() if slot.policy else None,
        }
    return state


def private_app(plane: DataPlane, metrics: ServerMetrics, opened: asyncio.Event) -> web.Application:
    """This worker's own numbers and state, for the other workers and the supervisor;
    ``POST /open`` (the supervisor's, once the worker holds what the pool serves) sets
    ``opened``: only then does the worker listen on the public ports."""

    async def own_metrics(request: web.Request) -> web.Response:
        body = generate_latest(metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def own_statistics(request: web.Request) -> web.Response:
        keys = [k for k in request.query.getall("key", []) if k in plane.manager.slots]
        version = request.query.get("version")
        try:
            return web.json_response(plane.statistics(keys, version))
        except Exception as exc:  # a version not held here: this worker adds nothing
            return web.json_response({"error": str(exc)}, status=404)

    async def state(request: web.Request) -> web.Response:
        return web.json_response(loaded_state(plane))

    async def open_ports(request: web.Request) -> web.Response:
        opened.set()
        return web.json_response({"ok": True})

    app = web.Application()
    app.add_routes(
        [
            web.get("/metrics", own_metrics),
            web.get("/statistics", own_statistics),
            web.get("/state", state),
            web.post("/open", open_ports),
        ]
    )
    return app


def install_pool_handlers(app: web.Application, peers: PoolPeers) -> None:
    """A worker of a pool answers for the whole pod: ``/metrics`` and the statistics merged
    over every worker, and each answer says which worker gave it."""

    async def merged_metrics(metrics: ServerMetrics) -> web.Response:
        return await pool_metrics(peers, metrics)

    async def merged_statistics(
        own: dict[str, Any], keys: list[str], version: str | None
    ) -> dict[str, Any]:
        return await pool_statistics(peers, own, keys, version)

    app[MERGED_METRICS] = merged_metrics
    app[MERGED_STATISTICS] = merged_statistics
    tag_responses(app, peers.index)


def tag_responses(app: web.Application, index: int) -> None:
    """Say in every answer which worker gave it (tests and benchmarks see the spread)."""
    value = str(index)

    async def tag(request: web.Request, response: web.StreamResponse) -> None:
        response.headers[WORKER_HEADER] = value

    app.on_response_prepare.append(tag)
