"""The operator's pod index (:mod:`model_operator.pod_index`) on a scripted API: a pod
event wakes its ModelDeployment's task only when the pod's view changed, came or went
(at a thousand pods, every other event would be a pass for nothing)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any
from unittest.mock import patch

import aiohttp
import pytest

from model_operator import pod_index
from model_operator.errors import ApiError, TransientApiError
from model_operator.pod_index import PodIndex, namespace_matcher
from model_rollout_contract.annotations import DEPLOYMENT_LABEL, TARGET_VERSION
from model_rollout_contract.backoff import Backoff

FAST = Backoff(base_s=0.01, max_s=0.01)


def pod(name: str, owner: str = "mlp", version: str = "1", **annotations: str) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name, "namespace": "ns", "resourceVersion": version,
            "labels": {DEPLOYMENT_LABEL: owner}, "annotations": annotations,
        },
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
    }  # fmt: skip


class ScriptedApi:
    """A LIST of ``listed``, then one watch that yields what is put in ``events``."""

    def __init__(self, listed: list[dict[str, Any]]) -> None:
        self.listed = listed
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def request(self, method: str, path: str) -> dict[str, Any]:
        return {"items": self.listed, "metadata": {"resourceVersion": "1"}}

    @contextlib.asynccontextmanager
    async def stream(self, path: str, timeout_s: float) -> AsyncIterator[AsyncIterator[bytes]]:
        async def lines() -> AsyncIterator[bytes]:
            while True:
                yield json.dumps(await self.events.get()).encode()

        yield lines()


async def settle(api: ScriptedApi) -> None:
    while not api.events.empty():
        await asyncio.sleep(0)
    for _ in range(5):
        await asyncio.sleep(0)


async def test_only_a_change_of_a_pods_view_wakes_its_owner() -> None:
    api = ScriptedApi([pod("a"), pod("b", owner="other")])
    woken: list[tuple[str, str]] = []
    index = PodIndex(api, ["ns"], lambda ns, name: woken.append((ns, name)))  # type: ignore[arg-type]
    await index.start()
    try:
        assert sorted(woken) == [("ns", "mlp"), ("ns", "other")]
        assert [v.name for v in index.get(("ns", "mlp"), [])] == ["a"]
        woken.clear()
        # a new resourceVersion, the kubelet's timestamps: nothing the planner reads
        same = pod("a", version="2")
        same["status"]["startTime"] = "2026-12-06T00:00:00Z"
        await api.events.put({"type": "MODIFIED", "object": same})
        await settle(api)
        assert woken == []
        await api.events.put(
            {"type": "MODIFIED", "object": pod("a", "mlp", "3", **{TARGET_VERSION: "v2"})}
        )
        await settle(api)
        assert woken == [("ns", "mlp")]
        assert index.get(("ns", "mlp"), [])[0].target == "v2"
        deleting = pod("a", "mlp", "4", **{TARGET_VERSION: "v2"})
        deleting["metadata"]["deletionTimestamp"] = "2026-12-06T00:00:00Z"
        await api.events.put({"type": "MODIFIED", "object": deleting})
        await settle(api)
        assert woken == [("ns", "mlp"), ("ns", "mlp")] and index.get(("ns", "mlp"), []) == []
        await api.events.put({"type": "DELETED", "object": pod("b", owner="other")})
        await settle(api)
        assert woken[-1] == ("ns", "other") and index.get(("ns", "other"), []) == []
    finally:
        await index.stop()


def test_namespace_patterns_are_kopfs() -> None:
    matches = namespace_matcher(["rollouts-*", "!rollouts-x"])
    assert matches("rollouts-1") and not matches("rollouts-x") and not matches("other")
    assert namespace_matcher([])("anything")


async def test_a_refused_first_list_is_asked_again() -> None:
    """The operator does not start its passes on an empty index, nor crash, when the
    first LIST is refused or fails: it asks again until the API answers."""
    api = ScriptedApi([pod("a")])
    answers = iter([TransientApiError(503, "overloaded"), ApiError(403, "forbidden")])
    listed = api.request

    async def request(method: str, path: str) -> dict[str, Any]:
        answer = next(answers, None)
        if answer is not None:
            raise answer
        return await listed(method, path)

    api.request = request  # type: ignore[method-assign]
    index = PodIndex(api, ["ns"], lambda ns, name: None)  # type: ignore[arg-type]
    with patch("model_operator.pod_index.RELIST_BACKOFF", FAST):
        await index.start()
    try:
        assert [v.name for v in index.get(("ns", "mlp"), [])] == ["a"]
    finally:
        await index.stop()


async def test_a_watch_cut_in_an_unexpected_way_is_listed_and_watched_again() -> None:
    """A watch that fails with something other than an API error (the connection cut while
    an error answer was read: aiohttp's ClientPayloadError) must not end the index's
    watch for good: the pods are listed and watched again, and news still wakes."""
    api = ScriptedApi([pod("a")])
    streams = 0
    watch = api.stream

    @contextlib.asynccontextmanager
    async def stream(path: str, timeout_s: float) -> AsyncIterator[AsyncIterator[bytes]]:
        nonlocal streams
        streams += 1
        if streams == 1:
            raise aiohttp.ClientPayloadError("connection cut mid-answer")
        async with watch(path, timeout_s) as lines:
            yield lines

    api.stream = stream  # type: ignore[method-assign]
    woken: list[tuple[str, str]] = []
    index = PodIndex(api, ["ns"], lambda ns, name: woken.append((ns, name)))  # type: ignore[arg-type]
    with patch("model_operator.pod_index.RELIST_BACKOFF", FAST):
        await index.start()
        try:
            for _ in range(200):  # the first watch fails; the second is open
                if streams >= 2:
                    break
                await asyncio.sleep(0.01)
            assert streams >= 2, "the pod watch was not opened again"
            await api.events.put({"type": "ADDED", "object": pod("b")})
            await settle(api)
            for _ in range(100):
                if len(index.get(("ns", "mlp"), [])) == 2:
                    break
                await asyncio.sleep(0.01)
            assert sorted(v.name for v in index.get(("ns", "mlp"), [])) == ["a", "b"]
            assert woken[-1] == ("ns", "mlp")
        finally:
            await index.stop()


async def test_pods_that_cannot_be_listed_are_unseen_and_retried_with_backoff(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A LIST that keeps failing after the first (RBAC revoked, an API server that
    answers 500): the index says why the namespace's pods are unseen once that has
    lasted UNSEEN_AFTER_S, spaces its tries by the growing backoff, and, listed again,
    says they are seen and wakes the namespace's rollouts."""
    api = ScriptedApi([pod("a")])
    failing = {"on": False}
    listed = api.request

    async def request(method: str, path: str) -> dict[str, Any]:
        if failing["on"]:
            raise ApiError(403, 'pods is forbidden: User "op" cannot list resource "pods"')
        return await listed(method, path)

    watch = api.stream

    @contextlib.asynccontextmanager
    async def stream(path: str, timeout_s: float) -> AsyncIterator[AsyncIterator[bytes]]:
        if failing["on"]:
            raise TransientApiError(500, "etcdserver: leader changed")
        async with watch(path, timeout_s) as lines:
            yield lines

    api.request = request  # type: ignore[method-assign]
    api.stream = stream  # type: ignore[method-assign]
    pauses: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(seconds: float) -> None:
        pauses.append(seconds)
        await real_sleep(0.001)

    seen_again: list[str | None] = []
    monkeypatch.setattr(pod_index, "UNSEEN_AFTER_S", 0.05)
    monkeypatch.setattr(pod_index.asyncio, "sleep", sleep)
    index = PodIndex(api, ["ns"], lambda ns, name: None, seen_again.append)  # type: ignore[arg-type]
    await index.start()
    try:
        assert index.unseen("ns") is None
        failing["on"] = True
        api.events.put_nowait({"type": "ERROR", "object": {"code": 500, "message": "gone"}})
        for _ in range(500):
            if index.unseen("ns") is not None and len(pauses) >= 6:
                break
            await real_sleep(0.005)
        why = index.unseen("ns")
        assert why is not None and "forbidden" in why, why
        assert index.unseen("other") is None  # another scope's pods are not this one's
        assert [v.name for v in index.get(("ns", "mlp"), [])] == ["a"]  # the last LIST's
        policy = pod_index.RELIST_BACKOFF
        for attempt, pause in enumerate(pauses[:6]):
            assert policy.least(attempt) <= pause <= policy.cap(attempt), pauses
        assert pauses[5] > pauses[0]  # it grows: no storm on the API server that failed
        failing["on"] = False
        for _ in range(500):
            if seen_again:
                break
            await real_sleep(0.005)
        assert seen_again == ["ns"] and index.unseen("ns") is None
    finally:
        await index.stop()
