"""The rollout task's error discipline, outside a running operator: a transient
Kubernetes API failure ends its passes (:class:`TransientApiError`: they start again a
little later), while a refusal becomes a condition on the resource."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import kopf
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from model_operator import handlers
from model_operator.config import OperatorConfig
from model_operator.errors import TransientApiError
from model_operator.handlers import Follower, follow_rollouts
from model_operator.kube_client import KubeClient, load_configuration
from model_operator.planner import Event
from model_operator.pod_index import PodLookup
from model_operator.spec import parse_spec
from model_operator.store_check import VersionCheck, check_version
from model_rollout_e2e.processes import free_port
from tests.support.pod_lookup import NoPods

BODY = {
    "apiVersion": "serving.model-rollout.io/v1alpha1",
    "kind": "ModelDeployment",
    "metadata": {"name": "m", "namespace": "ns", "uid": "u-1", "generation": 1},
    "spec": {
        "model": "m",
        "version": "v1",
        "image": "i",
        "store": {"pvc": "claim"},
        "signingPublicKeySecret": "key",
    },
}


async def run_reconcile(
    api_url: str, interval_s: float = 30.0, pods: PodLookup | None = None
) -> None:
    body = kopf.Body(BODY)
    api = KubeClient(await load_configuration(api_url, None))
    try:
        await asyncio.wait_for(
            follow_rollouts(
                Follower(body),
                "m",
                "ns",
                kopf.Memo(
                    config=OperatorConfig(check_store=False, interval_s=interval_s),
                    api=api,
                    wakers={},
                ),
                logging.getLogger("test"),
                pods or NoPods(),
            ),
            30,
        )
    finally:
        await api.close()


@pytest.fixture
async def answering() -> AsyncIterator[dict[str, int]]:
    """An API server that answers every request with the status in ``answer["status"]``."""
    answer = {"status": 503}

    async def handle(request: web.Request) -> web.Response:
        return web.json_response({"kind": "Status"}, status=answer["status"])

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    answer["port"] = server.port or 0
    yield answer
    await server.close()


async def test_unreachable_api_is_a_temporary_error() -> None:
    with pytest.raises(TransientApiError) as raised:
        await run_reconcile(f"http://127.0.0.1:{free_port()}")
    assert raised.value.status == 0  # not reached


@pytest.mark.parametrize("status", [429, 500, 503])
async def test_overloaded_api_is_a_temporary_error(answering: dict[str, int], status: int) -> None:
    answering["status"] = status
    with pytest.raises(TransientApiError, match=f"HTTP {status}"):
        await run_reconcile(f"http://127.0.0.1:{answering['port']}")


async def test_a_refusal_is_a_condition_not_a_restart(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 403 (RBAC) is no reason to restart the passes: the API server's message
    becomes the Ready condition, and a Warning event, once."""
    message = 'serviceaccounts is forbidden: User "op" cannot create resource'
    patches: list[list[dict[str, Any]]] = []  # JSON patches: the uid tested, the status
    events: list[str] = []
    written = asyncio.Event()

    def status_of(patch: list[dict[str, Any]]) -> dict[str, Any]:
        assert patch[0] == {"op": "test", "path": "/metadata/uid", "value": "u-1"}
        [status] = [op["value"] for op in patch if op["path"] == "/status"]
        return dict(status)

    async def handle(request: web.Request) -> web.Response:
        if request.method == "PATCH" and request.path.endswith("/status"):
            patches.append(await request.json())
            written.set()
            return web.json_response({**BODY, "status": status_of(patches[-1])})
        return web.json_response({"kind": "Status", "message": message}, status=403)

    async def post(memo: object, body: object, event: Event, logger: object) -> None:
        events.append(f"{'Warning' if event.warning else 'Normal'} {event.reason}: {event.message}")

    monkeypatch.setattr(handlers, "_post", post)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    reconciling = asyncio.ensure_future(run_reconcile(f"http://127.0.0.1:{server.port}", 0.05))
    try:
        await asyncio.wait_for(written.wait(), 30)
        await asyncio.sleep(0.3)  # several resyncs: the same refusal is not written again
        assert not reconciling.done(), reconciling.exception()
    finally:
        reconciling.cancel()
        await server.close()
    [patch] = patches
    [ready] = status_of(patch)["conditions"]
    assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "False", "Forbidden")
    assert ready["message"] == message
    assert events == [f"Warning ApiRefused: {message}"]


class UnseenPods(NoPods):
    def unseen(self, namespace: str, /) -> str | None:
        return "the operator cannot list or watch the pods: pods is forbidden"


async def test_a_rollout_holds_while_its_pods_are_unseen(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pod watch keeps failing (RBAC revoked): a pass planned on the last views could
    start loads already done or miss new pods, so none runs. Ready is False saying why,
    written once with one Warning event; nothing else is asked of the API server."""
    requests: list[str] = []
    patches: list[list[dict[str, Any]]] = []
    events: list[str] = []
    written = asyncio.Event()

    async def handle(request: web.Request) -> web.Response:
        requests.append(f"{request.method} {request.path}")
        if request.method == "PATCH" and request.path.endswith("/status"):
            patches.append(await request.json())
            written.set()
            [status] = [op["value"] for op in patches[-1] if op["path"] == "/status"]
            return web.json_response({**BODY, "status": status})
        return web.json_response({"kind": "Status", "message": "unexpected"}, status=500)

    async def post(memo: object, body: object, event: Event, logger: object) -> None:
        events.append(f"{'Warning' if event.warning else 'Normal'} {event.reason}")

    monkeypatch.setattr(handlers, "_post", post)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    url = f"http://127.0.0.1:{server.port}"
    reconciling = asyncio.ensure_future(run_reconcile(url, 0.05, UnseenPods()))
    try:
        await asyncio.wait_for(written.wait(), 30)
        await asyncio.sleep(0.3)  # several resyncs: the same hold is not written again
        assert not reconciling.done(), reconciling.exception()
    finally:
        reconciling.cancel()
        await server.close()
    assert requests == [
        "PATCH /apis/serving.model-rollout.io/v1alpha1/namespaces/ns/modeldeployments/m/status"
    ]
    [ready] = next(op["value"] for op in patches[0] if op["path"] == "/status")["conditions"]
    assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "False", "PodsUnseen")
    assert "pods is forbidden" in ready["message"] and "holds" in ready["message"]
    assert events == ["Warning PodsUnseen"]


# --- the store check's messages (issue 13 follow-up) --------------------------------


async def test_store_check_messages_never_carry_credentials_of_a_url(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The operator's own endpoint (its environment, e.g. from the chart's credentials
    Secret) may carry user:password@; boto3's error quotes it, and the message becomes a
    condition anyone who can read the resource sees."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://ops:hunter2@127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    spec = parse_spec({**BODY["spec"], "store": {"url": "s3://models/team"}})
    answer = await check_version(spec)
    assert answer.result is VersionCheck.UNREACHABLE
    assert "hunter2" not in answer.message and "ops:" not in answer.message
    assert "http://***@127.0.0.1" in answer.message  # the endpoint is still named


def test_a_status_that_differs_only_in_update_times_is_not_written_again() -> None:
    """Each tenant model's status entry carries its own lastUpdateTime: a pass that moved
    nothing must not write the status (and wake itself) for it."""
    from model_operator.handlers import _changed

    def at(when: str, phase: str = "Available") -> dict:  # type: ignore[type-arg]
        tenant = {"phase": phase, "lastUpdateTime": when}
        return {"phase": "Available", "lastUpdateTime": when, "tenants": {"acme": tenant}}

    old, new = at("t1"), at("t2")
    assert not _changed(old, new)
    assert _changed(old, at("t2", "Canary"))
    assert _changed(old, {**new, "tenants": {}})  # a tenant model removed


async def test_the_echo_of_its_own_status_write_does_not_wake_the_task() -> None:
    """The watch brings back every status the task writes; a pass on that copy would
    find nothing to do (issue 28 item 8: no pass, at 1000 pods, for the operator's own
    write). A change of the spec, or a status the task did not write, still wakes it."""
    written = {"phase": "Available", "currentVersion": "v1"}
    memo = kopf.Memo(wakers={}, followers={})
    follower = memo.followers[("ns", "m")] = Follower(kopf.Body(BODY))
    follower.written = written
    logger = logging.getLogger("test")

    async def event(body: dict[str, Any]) -> bool:
        wake = handlers._waker(memo, "ns", "m")
        wake.clear()
        await handlers.resource_changed(
            {"type": "MODIFIED", "object": body}, kopf.Body(body), "ns", "m", memo, logger
        )  # type: ignore[arg-type]
        return wake.is_set()

    assert not await event({**BODY, "status": written})
    assert await event({**BODY, "status": {**written, "phase": "Progressing"}})
    assert await event({**BODY, "spec": {**BODY["spec"], "version": "v2"}, "status": written})
