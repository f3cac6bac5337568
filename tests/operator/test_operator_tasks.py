"""A ModelDeployment's task (issue 29): one per object (its uid), never inherited by
another object created later under the same name; after transient API failures it
backs off exponentially, with jitter, by the contract's one Backoff. (The uid test of
the status write on a real API server: ``tests/operator/test_control_plane_operator.py``.)"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf
import pytest
from prometheus_client import generate_latest

from model_operator import handlers
from model_operator.config import OperatorConfig
from model_operator.errors import TransientApiError
from model_operator.metrics import OperatorMetrics
from model_operator.planner import Event
from model_rollout_contract.annotations import RETRY
from model_rollout_contract.backoff import Backoff
from model_sidecar import retry
from tests.support.pod_lookup import NoPods


def _body(uid: str, **status: Any) -> kopf.Body:
    meta = {"name": "m", "namespace": "ns", "uid": uid}
    return kopf.Body({"metadata": meta, "spec": {}, "status": status})


def test_one_backoff_for_every_program() -> None:
    assert retry.Backoff is Backoff  # the sidecar's is the contract's
    assert isinstance(handlers.TASK_BACKOFF, Backoff)


async def test_a_resource_created_again_under_its_name_gets_a_task_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Deleted while its DELETED event was missed (a cut watch, a relist), then created
    again: the old object's task and its memory (status, rollout) end; the new object's
    task starts from the new object."""
    started: list[handlers.Follower] = []

    async def follow(follower: handlers.Follower, *args: Any) -> None:
        started.append(follower)
        await asyncio.Event().wait()

    monkeypatch.setattr(handlers, "follow", follow)
    memo = kopf.Memo(config=OperatorConfig(), followers={}, wakers={}, pods=None)
    log = logging.getLogger("test")

    async def seen(body: kopf.Body) -> None:
        await handlers.resource_changed(
            event={"type": "MODIFIED"}, body=body, namespace="ns", name="m", memo=memo,
            logger=log,
        )  # fmt: skip
        await asyncio.sleep(0)

    await seen(_body("uid-old", phase="Canary"))
    await seen(_body("uid-old", phase="Canary"))  # the same object: the same task
    assert len(started) == 1
    old = started[0]
    await seen(_body("uid-new"))
    assert len(started) == 2, "the new object was handed to the old object's task"
    new = started[1]
    assert old.task is not None and old.task.cancelled()
    assert new.uid == "uid-new" and new.body["status"] == {}
    assert memo.followers[("ns", "m")] is new
    assert new.task is not None
    new.task.cancel()


async def test_a_task_backs_off_exponentially_and_honours_retry_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    failures = [TransientApiError(503, "down")] * 6 + [
        TransientApiError(429, "busy", retry_after_s=90.0)
    ]

    async def follow_rollouts(*args: Any) -> None:
        raise failures.pop(0)

    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        if not failures:
            raise asyncio.CancelledError

    monkeypatch.setattr(handlers, "follow_rollouts", follow_rollouts)
    monkeypatch.setattr(handlers.asyncio, "sleep", sleep)
    follower = handlers.Follower(_body("u"))
    memo = kopf.Memo(config=OperatorConfig())
    with pytest.raises(asyncio.CancelledError):
        await handlers.follow(follower, "m", "ns", memo, logging.getLogger("test"), {})  # type: ignore[arg-type]
    policy = handlers.TASK_BACKOFF
    assert len(waits) == 7
    for attempt, wait in enumerate(waits[:6]):
        assert policy.least(attempt) <= wait <= policy.cap(attempt), (attempt, waits)
    assert policy.least(5) > policy.cap(0)  # it grows, and not in step (jitter: a range)
    assert waits[6] >= 90.0  # the API server's Retry-After


async def test_passes_started_again_neither_act_twice_nor_start_from_a_stale_status(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pass acts on the retry annotation, writes its status, removes the annotation,
    then its Event post fails transiently: the passes start again. The watch's copy still
    shows the annotation and the status from before (it lags behind the writes). The
    restarted passes must start from the status the API server holds, and must ask the
    API server about the annotation instead of acting on it a second time."""
    stale = {"phase": "Degraded", "rollout": {"toVersion": "v2", "stage": "failed"}}
    written = {"phase": "Progressing", "rollout": {"toVersion": "v2", "stage": "canary"}}
    body = kopf.Body(
        {
            "metadata": {
                "name": "m", "namespace": "ns", "uid": "u",
                "annotations": {RETRY: "v2"},
            },
            "spec": {},
            "status": stale,
        }
    )  # fmt: skip
    passes: list[tuple[dict[str, Any], frozenset[str]]] = []
    posts: list[str] = []

    async def reconcile_pass(
        body: kopf.Body, status: dict[str, Any], *args: Any, removed: frozenset[str], **kw: Any
    ) -> handlers.Pass:
        passes.append((dict(status), removed))
        if len(passes) == 2:
            raise asyncio.CancelledError  # seen what the restarted pass starts from
        acted = () if RETRY in removed else (RETRY,)
        return handlers.Pass(written, None, (Event("RolloutRetried", "again"),), acted)

    async def post(*args: Any) -> None:
        posts.append("event")
        raise TransientApiError(503, "the API server is restarting")

    async def replace_status(*args: Any) -> dict[str, Any]:
        return written

    async def read_status(*args: Any) -> dict[str, Any]:
        return written

    async def clear_annotations(*args: Any) -> None:
        return None

    async def read_annotations(*args: Any) -> dict[str, str]:
        return {}  # the API server has it removed

    async def no_wait(seconds: float) -> None:
        return None

    monkeypatch.setattr(handlers, "reconcile_pass", reconcile_pass)
    monkeypatch.setattr(handlers, "_post", post)
    monkeypatch.setattr(handlers.cluster, "replace_status", replace_status)
    monkeypatch.setattr(handlers.cluster, "read_status", read_status, raising=False)
    monkeypatch.setattr(handlers.cluster, "clear_annotations", clear_annotations)
    monkeypatch.setattr(handlers.cluster, "read_annotations", read_annotations)
    monkeypatch.setattr(handlers.asyncio, "sleep", no_wait)
    memo = kopf.Memo(config=OperatorConfig(), wakers={}, api=object())
    follower = handlers.Follower(body)
    with pytest.raises(asyncio.CancelledError):
        await handlers.follow(follower, "m", "ns", memo, logging.getLogger("test"), NoPods())
    assert posts == ["event"] and len(passes) == 2
    status, removed = passes[1]
    assert status == written, "the restarted passes started from the watch's stale status"
    assert RETRY in removed, "the restarted passes would act on the removed retry again"


async def test_a_deleted_resource_leaves_no_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its DELETED event ends its task and removes its series (a Degraded gauge left
    behind would keep an alert firing for a resource that no longer exists)."""

    async def follow(follower: handlers.Follower, *args: Any) -> None:
        await asyncio.Event().wait()

    monkeypatch.setattr(handlers, "follow", follow)
    metrics = OperatorMetrics()
    memo = kopf.Memo(config=OperatorConfig(), followers={}, wakers={}, pods=None, metrics=metrics)
    body = _body("u", phase="Degraded")
    for kind in ("ADDED", "DELETED"):
        await handlers.resource_changed(
            event={"type": kind}, body=body, namespace="ns", name="m", memo=memo,
            logger=logging.getLogger("test"),
        )  # fmt: skip
        if kind == "ADDED":
            metrics.observe("ns", "m", {"phase": "Degraded", "versions": {"v1": 1}})
    assert memo.followers == {}
    assert 'name="m"' not in generate_latest(metrics.registry).decode()


def test_no_handler_needs_a_finalizer() -> None:
    """kopf puts its finalizer on a resource only for a handler that needs one (a
    daemon, a timer, a deletion handler): none is registered, so deleting a
    ModelDeployment while the operator is down is never blocked (on a real API server:
    ``test_a_model_deployment_is_deleted_while_the_operator_is_down``)."""
    registry = handlers.register(OperatorConfig())
    assert registry._changing.get_all_handlers() == []  # no create/update/delete/resume
    assert registry._spawning.get_all_handlers() == []  # no daemon, no timer
    kinds = (registry._watching, registry._indexing)
    assert not any(
        getattr(handler, "requires_finalizer", False)
        for kind in kinds
        for handler in kind.get_all_handlers()
    )
