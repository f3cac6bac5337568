"""The leader's fence (issue 29), outside a cluster: a replica whose last renewal began
too long ago sends no write and runs no pass, whatever it was doing when it froze; one
that finds the Lease taken stops at once. (With two operator processes on a real API
server: ``tests/operator/test_control_plane_operator.py``.)"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator
from typing import Any, NoReturn

import kopf
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from model_operator.config import OperatorConfig, parse_args
from model_operator.errors import ApiError, TransientApiError
from model_operator.handlers import Follower, follow_rollouts
from model_operator.kube_client import KubeClient, load_configuration
from model_operator.leader import (
    FenceWatchdog,
    LeaderElection,
    LeaseFence,
    LeaseSettings,
    boottime,
)
from tests.support.pod_lookup import NoPods


class Lost(Exception):
    """What the tests' fences raise instead of ending the process."""


def lost(why: str) -> NoReturn:
    raise Lost(why)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        """A pause on this clock (no real time passes)."""
        assert seconds >= 0
        self.now += seconds
        await asyncio.sleep(0)


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
    assert LeaseSettings("ns", duration_s=15.0, margin_s=5.0).valid_s == 10.0


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
    api = KubeClient(await load_configuration(url, None), fence=fence)
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
    api = KubeClient(await load_configuration(url, None), fence=fence)
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
                NoPods(),
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
    settings = LeaseSettings("ns", identity="me")
    election = LeaderElection(LeaseApi(), settings, fence, sleep=clock.sleep)  # type: ignore[arg-type]
    with pytest.raises(Lost, match="taken by another replica"):
        await election.hold()


class OwnLease:
    """This replica's Lease, renewed through ``answers``: each try (a GET and a PATCH)
    takes the next answer: ``None`` succeeds, an exception is raised, ``"hang"`` never
    answers; the clock's time at each try's start is recorded."""

    def __init__(self, clock: Clock, answers: list[Any], takes_s: float = 0.0) -> None:
        self.clock, self.answers, self.takes_s = clock, answers, takes_s
        self.tries: list[float] = []
        self.patches: list[list[dict[str, Any]]] = []

    async def request(self, method: str, path: str, body: Any = None, *args: Any) -> Any:
        if method == "GET":
            self.tries.append(self.clock.now)
            answer = self.answers.pop(0) if self.answers else None
            if answer == "hang":
                await asyncio.Event().wait()
            if isinstance(answer, Exception):
                raise answer
            self.clock.now += self.takes_s  # a slow API server
            spec = {"holderIdentity": "me", "renewTime": "t", "leaseDurationSeconds": 15}
            return {"metadata": {"resourceVersion": "7"}, "spec": spec}
        self.patches.append(body)
        return {}


def _holding(api: OwnLease, clock: Clock, settings: LeaseSettings, **kw: Any) -> LeaderElection:
    fence = LeaseFence(settings.valid_s, lost, clock)
    fence.renewed(began=clock.now)  # it leads from now
    return LeaderElection(api, settings, fence, sleep=clock.sleep, **kw)  # type: ignore[arg-type]


async def _hold_until(election: LeaderElection, api: OwnLease, tries: int) -> None:
    """Hold the Lease until ``tries`` tries were made (or the fence is lost)."""
    task = asyncio.ensure_future(election.hold())
    while len(api.tries) < tries and not task.done():
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_renewals_are_scheduled_from_the_start_of_the_previous_one() -> None:
    """Every 2 s for a 15 s Lease, from when the last one began: an API server that
    takes 0.5 s per try does not make the renewals drift (2, 4, 6, not 2, 4.5, 7)."""
    clock = Clock()
    api = OwnLease(clock, [], takes_s=0.5)
    await _hold_until(_holding(api, clock, LeaseSettings("ns", identity="me")), api, 5)
    assert [round(t - 100.0, 6) for t in api.tries] == [2.0, 4.0, 6.0, 8.0, 10.0]


async def test_a_failed_renewal_is_tried_again_every_1_5_to_2_5_s_until_the_fence_ends() -> None:
    """With the API failing, the leader tries again after 1.5-2.5 s (jittered) for as
    long as the fence holds (12 s of a 15 s Lease), and lets go only then; one success
    in that time keeps the lead."""
    clock = Clock()
    failing = [TransientApiError(503, "injected")] * 100
    api = OwnLease(clock, failing)
    election = _holding(api, clock, LeaseSettings("ns", identity="me"), rng=random.Random(1))
    with pytest.raises(Lost, match=r"could not be renewed in time|not renewed for"):
        await election.hold()
    gaps = [b - a for a, b in zip(api.tries, api.tries[1:], strict=False)]
    assert api.tries[0] == 102.0 and len(api.tries) >= 5, api.tries
    assert all(1.5 <= gap <= 2.5 for gap in gaps), gaps
    assert len(set(gaps)) > 1  # jittered: replicas do not retry in step
    assert clock.now - 100.0 >= election.settings.valid_s  # not one try given up early

    clock = Clock()
    api = OwnLease(clock, [TransientApiError(503, "injected")] * 4)  # then it answers
    election = _holding(api, clock, LeaseSettings("ns", identity="me"), rng=random.Random(1))
    await _hold_until(election, api, 8)
    assert election.fence.remaining() > 0


async def test_a_renewal_honours_retry_after() -> None:
    clock = Clock()
    busy = TransientApiError(429, "too many requests", retry_after_s=6.0)
    api = OwnLease(clock, [busy])
    election = _holding(api, clock, LeaseSettings("ns", identity="me"))
    await _hold_until(election, api, 2)
    assert api.tries[1] - api.tries[0] >= 6.0


async def test_a_renewal_that_gets_no_answer_is_given_up_and_tried_again() -> None:
    """A try has a time-out of its own: an API server that never answers does not hold
    up the next try until the fence is gone."""
    clock = Clock()
    api = OwnLease(clock, ["hang", "hang"])
    settings = LeaseSettings("ns", identity="me", try_timeout_s=0.05)
    election = _holding(api, clock, settings)
    await _hold_until(election, api, 4)
    assert election.fence.remaining() > 0  # the third try renewed it


def test_lease_seconds_are_rounded_up_and_less_than_one_second_is_refused() -> None:
    assert LeaseSettings("ns", duration_s=2.5, margin_s=0.5, renew_s=0.3).lease_seconds == 3
    assert LeaseSettings.scaled("ns", "me", 15.0) == LeaseSettings("ns", identity="me")
    for duration in (1.0, 2.5, 3.0, 15.0, 60.0):
        settings = LeaseSettings.scaled("ns", "me", duration)
        assert 0 < settings.renew_s < settings.valid_s < settings.lease_seconds
    with pytest.raises(ValueError, match="at least 1s"):
        LeaseSettings("ns", duration_s=0.5)
    with pytest.raises(SystemExit):
        parse_args(["--leader-election", "--lease-seconds", "0.5"])


async def test_the_lease_written_holds_whole_seconds_rounded_up() -> None:
    clock = Clock()
    api = OwnLease(clock, [])
    settings = LeaseSettings.scaled("ns", "me", 2.5)
    await _holding(api, clock, settings).try_acquire()
    written = {op["path"]: op["value"] for op in api.patches[0] if op["op"] == "add"}
    assert written["/spec/leaseDurationSeconds"] == 3


def test_the_fence_counts_time_on_clock_boottime(monkeypatch: pytest.MonkeyPatch) -> None:
    """A suspended machine's monotonic clock stops; CLOCK_BOOTTIME does not: the fence
    reads the latter, so it is not still valid on wake-up."""
    real = time.clock_gettime

    def clock_gettime(clock_id: int) -> float:
        return 5000.0 if clock_id == time.CLOCK_BOOTTIME else real(clock_id)

    monkeypatch.setattr(time, "clock_gettime", clock_gettime)
    monkeypatch.setattr(time, "monotonic", lambda: 10.0)
    fence = LeaseFence(10.0, lost)
    assert fence.clock() == 5000.0 and boottime() == 5000.0


async def test_a_write_is_given_no_longer_than_the_fence_has_left(
    api_server: tuple[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _ = api_server
    clock = Clock()
    fence = LeaseFence(10.0, lost, clock)
    fence.renewed(began=clock.now - 9.25)  # 0.75 s left
    api = KubeClient(await load_configuration(url, None), timeout_s=15.0, fence=fence)
    timeouts: list[float] = []
    client = api._open()
    real = client.call_api

    async def call_api(*args: Any, **kwargs: Any) -> Any:
        timeouts.append(kwargs["_request_timeout"])
        return await real(*args, **kwargs)

    monkeypatch.setattr(client, "call_api", call_api)
    try:
        await api.request("GET", "/api/v1/namespaces/ns/pods/p")
        await api.merge_patch("/api/v1/namespaces/ns/pods/p", {"metadata": {}})
    finally:
        await api.close()
    assert timeouts == [15.0, 0.75]


def test_the_watchdog_ends_a_write_that_outlives_the_fence() -> None:
    clock = Clock()
    fence = LeaseFence(10.0, lost, clock)
    fence.renewed(began=clock.now)
    watchdog = FenceWatchdog(fence)
    with fence.writing() as left:
        assert left == 10.0
        clock.now += 9.0
        watchdog.check()  # in time
        clock.now += 1.0  # the write is still in flight when the fence ends
        with pytest.raises(Lost, match="outlived"):
            watchdog.check()
    watchdog.check()  # nothing in flight: the renewal loop's own check says when it is lost


class ConflictingLease(OwnLease):
    """This replica's Lease, whose renewal PATCHes first meet ``conflicts``."""

    def __init__(self, clock: Clock, conflicts: list[Exception]) -> None:
        super().__init__(clock, [])
        self.conflicts = conflicts

    async def request(self, method: str, path: str, body: Any = None, *args: Any) -> Any:
        if method == "PATCH" and self.conflicts:
            self.patches.append(body)
            raise self.conflicts.pop(0)
        return await super().request(method, path, body, *args)


async def test_a_conflict_renewing_its_own_lease_is_read_again_not_taken_for_a_loss() -> None:
    """A 409/422 on the renewal while the Lease it read names this replica: its own late
    try landed meanwhile, or someone edited the Lease's labels. The Lease is read again
    on the next try; it is lost only if another replica holds it."""
    clock = Clock()
    api = ConflictingLease(clock, [ApiError(409, "conflict"), ApiError(422, "test failed")])
    election = _holding(api, clock, LeaseSettings("ns", identity="me"))
    await _hold_until(election, api, 4)
    assert election.fence.remaining() > 0 and len(api.patches) >= 3
