"""The leader's fence (issue 29), outside a cluster: a replica whose last renewal began
too long ago sends no write and runs no pass, whatever it was doing when it froze; one
that finds the Lease taken stops at once. (With two operator processes on a real API
server: ``tests/test_control_plane_operator.py``.)"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any, NoReturn

import kopf
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from model_operator.config import OperatorConfig
from model_operator.handlers import Follower, follow_rollouts
from model_operator.kube_client import KubeClient, load_configuration
from model_operator.leader import LeaderElection, LeaseFence, LeaseSettings


class Lost(Exception):
    """What the tests' fences raise instead of ending the process."""


def lost(why: str) -> NoReturn:
    raise Lost(why)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_fence_holds_from_the_start_of_a_renewal_for_its_validity() -> None:
    clock = Clock()
    fence = LeaseFence(10.0, lost, clock)
    with pytest.raises(Lost, match="not renewed for 10s"):
        fence.check()  # never renewed: never leads
    fence.renewed(began=95.0)  # a renewal that began 5 s ago and took its time
    fence.check()
    fence.renewed(began=90.0)  # an older one answered late counts for nothing
    clock.now = 104.9
    fence.check()
    clock.now = 105.0  # 10 s after the renewal began: out, however long it was paused
    with pytest.raises(Lost):
        fence.check()
    assert LeaseSettings("ns", duration_s=15.0, renew_s=5.0).valid_s == 10.0


@pytest.fixture
async def api_server() -> AsyncIterator[tuple[str, list[str]]]:
    """An API server that answers every request with ``{}`` and records it."""
    seen: list[str] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append(f"{request.method} {request.path}")
        return web.json_response({})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield f"http://127.0.0.1:{server.port}", seen
    await server.close()


async def test_a_fenced_client_sends_no_write_once_out_of_time(
    api_server: tuple[str, list[str]],
) -> None:
    url, seen = api_server
    clock = Clock()
    fence = LeaseFence(10.0, lost, clock)
    fence.renewed(began=clock.now)
    api = KubeClient(await load_configuration(url, None), before_write=fence.check)
    try:
        await api.merge_patch("/api/v1/namespaces/ns/pods/p", {"metadata": {}})
        clock.now += 10.0  # paused (SIGSTOP) past its time, mid-pass
        assert await api.request("GET", "/api/v1/namespaces/ns/pods/p") == {}  # reads go on
        with pytest.raises(Lost):
            await api.merge_patch("/api/v1/namespaces/ns/pods/p", {"metadata": {}})
        with pytest.raises(Lost):
            await api.request("POST", "/api/v1/namespaces/ns/events", {})
    finally:
        await api.close()
    assert seen == ["PATCH /api/v1/namespaces/ns/pods/p", "GET /api/v1/namespaces/ns/pods/p"]


async def test_a_pass_does_not_start_once_out_of_time(api_server: tuple[str, list[str]]) -> None:
    url, seen = api_server
    fence = LeaseFence(10.0, lost, Clock())  # never renewed
    api = KubeClient(await load_configuration(url, None), before_write=fence.check)
    body = kopf.Body({"metadata": {"name": "m", "namespace": "ns"}, "spec": {}})
    memo = kopf.Memo(config=OperatorConfig(check_store=False), api=api, wakers={}, fence=fence)
    try:
        with pytest.raises(Lost):
            await follow_rollouts(
                Follower(body),
                "m",
                "ns",
                memo,
                logging.getLogger("test"),
                {},  # type: ignore[arg-type]
            )
    finally:
        await api.close()
    assert seen == []  # not even a read: nothing decided on a stale view


class LeaseApi:
    """A Lease that another replica has just renewed."""

    async def request(self, method: str, path: str, *args: Any) -> Any:
        assert method == "GET", "no write to a Lease held by another replica"
        spec = {"holderIdentity": "other", "renewTime": "now", "leaseDurationSeconds": 15}
        return {"metadata": {"resourceVersion": "7"}, "spec": spec}


async def test_a_leader_that_finds_its_lease_taken_stops_at_once() -> None:
    clock = Clock()
    fence = LeaseFence(10.0, lost, clock)
    fence.renewed(began=clock.now)  # still in time: it is the Lease that says no
    settings = LeaseSettings("ns", identity="me", renew_s=0.01, retry_s=0.01)
    election = LeaderElection(LeaseApi(), settings, fence)  # type: ignore[arg-type]
    with pytest.raises(Lost, match="taken by another replica"):
        await election.hold()
