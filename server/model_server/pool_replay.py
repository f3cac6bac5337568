"""What a restarted worker of a pool is given before it counts as healthy: the state a
healthy worker holds. A restarted worker loads CURRENT and TRAFFIC from the volume at
startup, as a restarted server does; the sidecar may have swapped since without writing
them yet, so for every model whose serving version or policy differs from the healthy
worker's, the restarted one is sent the load (with the policy, its stable version first
when it lacks it) or the traffic op that makes it the same. A load names the file the
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

from .pool_relay import WorkerLink

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


async def replay(state: dict[str, Any], link: WorkerLink) -> None:
    """Make ``link``'s worker serve what ``state`` says, model by model."""
    for key, held in state.items():
        serving = held["serving"]
        if serving is None:
            continue
        policy = TrafficPolicy.from_json(held["policy"]) if held["policy"] else None
        now = _checked(await link.ask(StatusRequest(key)), f"status of {key}")
        assert isinstance(now, StatusReply)
        if (now.version, now.sha256) != (serving["version"], serving["sha256"]):
            if policy is not None and policy.stable not in now.loaded:
                stable = {v["version"]: v for v in held["retained"]}.get(policy.stable)
                if stable is not None:
                    request = LoadRequest(key, policy.stable, stable["path"], stable["sha256"])
                    _checked(await link.ask(request), f"load of {key} {policy.stable}")
            request = LoadRequest(
                key, serving["version"], serving["path"], serving["sha256"], policy
            )
            _checked(await link.ask(request), f"load of {key} {serving['version']}")
            log.info("pool: worker %d given %s %s", link.index, key, serving["version"])
        elif now.policy != policy:
            _checked(await link.ask(TrafficRequest(key, policy)), f"traffic of {key}")
            log.info("pool: worker %d given the traffic policy of %s", link.index, key)
