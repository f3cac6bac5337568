"""What a restarted worker of a pool is given before it counts as healthy: the state a
healthy worker holds. A restarted worker loads CURRENT and TRAFFIC from the volume at
startup, as a restarted server does; the sidecar may have swapped since without writing
them yet, so for every model whose versions or policy differ from the healthy worker's,
the restarted one is sent the loads (its retained versions in the order served, then
the serving one with the policy) or the traffic op that make it the same. A retained
version whose file is gone (the sidecar removed it since) is skipped, with a log line:
its load would fail on every restart, and the worker would never catch up. A load names the file the
healthy worker loaded (the sidecar may announce one outside ``<model>/<version>/``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import aiohttp

from model_rollout_contract.canary import TrafficPolicy
from model_rollout_contract.control import (
    ErrorReply,
    LoadRequest,
    Reply,
    StatusReply,
    StatusRequest,
    TrafficRequest,
)
from model_server.pool.relay import WorkerLink

log = logging.getLogger(__name__)

STATE_TIMEOUT_S = 10.0


class ReplayFailed(Exception):
    """The restarted worker could not be given the pool's state (it is restarted)."""


async def _private(socket: Path, method: str, path: str) -> Any:
    """A worker's private app's JSON answer to ``method path``."""
    connector = aiohttp.UnixConnector(path=str(socket))
    timeout = aiohttp.ClientTimeout(total=STATE_TIMEOUT_S)
    try:
        async with (
            aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
            session.request(method, f"http://worker{path}") as answer,
        ):
            answer.raise_for_status()
            return await answer.json()
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
        raise ReplayFailed(f"{method} {path} on {socket.name}: {exc!r}") from exc


async def fetch_state(private_socket: Path) -> dict[str, Any]:
    """A healthy worker's loaded state (``pool_worker.loaded_state``)."""
    state: dict[str, Any] = await _private(private_socket, "GET", "/state")
    return state


async def open_worker(private_socket: Path) -> None:
    """Have a worker listen on the public ports (it holds what the pool serves)."""
    await _private(private_socket, "POST", "/open")


def _checked(reply: Reply, what: str) -> Reply:
    if isinstance(reply, ErrorReply):
        raise ReplayFailed(f"{what}: {reply.error} ({reply.code})")
    return reply


def _load(key: str, held: dict[str, str], policy: TrafficPolicy | None = None) -> LoadRequest:
    return LoadRequest(key, held["version"], held["path"], held["sha256"], policy)


async def replay(state: dict[str, Any], link: WorkerLink) -> None:
    """Make ``link``'s worker hold what ``state`` says, model by model: the retained
    versions in the same order (a rollback naming none then goes where the others go),
    the serving one, the policy."""
    for key, held in state.items():
        serving = held["serving"]
        if serving is None:
            continue
        policy = TrafficPolicy.from_json(held["policy"]) if held["policy"] else None
        wanted = [*held["retained"], serving]  # least recently served first
        now = _checked(await link.ask(StatusRequest(key)), f"status of {key}")
        assert isinstance(now, StatusReply)
        if (now.version, now.sha256, list(now.loaded)) != (
            serving["version"], serving["sha256"], [v["version"] for v in wanted]
        ):  # fmt: skip
            for version in held["retained"]:
                if not Path(version["path"]).is_file():  # removed since: never loadable
                    log.warning(
                        "pool: worker %d not given %s %s: its file %s is gone",
                        link.index, key, version["version"], version["path"],
                    )  # fmt: skip
                    continue
                _checked(await link.ask(_load(key, version)), f"load of {key} {version}")
            request = _load(key, serving, policy)
            _checked(await link.ask(request), f"load of {key} {serving['version']}")
            log.info("pool: worker %d given %s %s", link.index, key, serving["version"])
            now = _checked(await link.ask(StatusRequest(key)), f"status of {key}")
            assert isinstance(now, StatusReply)
        if now.policy != policy:
            _checked(await link.ask(TrafficRequest(key, policy)), f"traffic of {key}")
            log.info("pool: worker %d given the traffic policy of %s", link.index, key)
