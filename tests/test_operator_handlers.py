"""The rollout daemon's error discipline, outside a running operator: a transient
Kubernetes API failure becomes ``kopf.TemporaryError`` (kopf restarts the daemon a little
later), while a refusal stays an error."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import kopf
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from model_operator.config import OperatorConfig
from model_operator.errors import ApiError
from model_operator.handlers import follow_rollouts
from model_operator.kube_client import KubeClient, load_configuration
from model_operator.spec import parse_spec
from model_operator.store_check import VersionCheck, check_version
from model_rollout_e2e.processes import free_port

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


class NeverStopped:
    """Stands in for kopf's ``stopped`` flag of a daemon that is not being stopped."""

    def __bool__(self) -> bool:
        return False

    async def wait(self, timeout: float | None = None) -> None:
        await asyncio.sleep(3600)


async def run_reconcile(api_url: str) -> None:
    body = kopf.Body(BODY)
    api = KubeClient(await load_configuration(api_url, None))
    try:
        await asyncio.wait_for(
            follow_rollouts(
                stopped=NeverStopped(),  # type: ignore[arg-type]
                body=body,
                name="m",
                namespace="ns",
                memo=kopf.Memo(config=OperatorConfig(check_store=False), api=api, wakers={}),
                logger=logging.getLogger("test"),
                pods_by_deployment={},  # type: ignore[arg-type]
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
    with pytest.raises(kopf.TemporaryError, match="Kubernetes API"):
        await run_reconcile(f"http://127.0.0.1:{free_port()}")


@pytest.mark.parametrize("status", [429, 500, 503])
async def test_overloaded_api_is_a_temporary_error(answering: dict[str, int], status: int) -> None:
    answering["status"] = status
    with pytest.raises(kopf.TemporaryError, match=f"HTTP {status}"):
        await run_reconcile(f"http://127.0.0.1:{answering['port']}")


async def test_a_refusal_is_not_retried_as_temporary(answering: dict[str, int]) -> None:
    answering["status"] = 403
    with pytest.raises(ApiError, match="HTTP 403") as caught:
        await run_reconcile(f"http://127.0.0.1:{answering['port']}")
    assert not isinstance(caught.value, kopf.TemporaryError)


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
    result, message = await check_version(spec)
    assert result is VersionCheck.UNREACHABLE
    assert "hunter2" not in message and "ops:" not in message
    assert "http://***@127.0.0.1" in message  # the endpoint is still named


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
