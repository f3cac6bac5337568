"""How the kubelet stand-ins and test helpers read a watch (``raw_api.watch_events``)
without a cluster: a fake ``_preload_content=False`` response."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
from kubernetes_asyncio.client.exceptions import ApiException

from model_rollout_e2e.raw_api import WatchEnded, WatchGone, watch_events


class _Content:
    def __init__(self, lines: list[bytes]) -> None:
        self.lines = list(lines)

    async def readline(self) -> bytes:
        return self.lines.pop(0) if self.lines else b""


class _Response:
    def __init__(self, lines: list[bytes], status: int = 200, body: bytes = b"") -> None:
        self.status, self.reason, self.body = status, "Reason", body
        self.content = _Content(lines)
        self.released = False

    async def read(self) -> bytes:
        return self.body

    def release(self) -> None:
        self.released = True


def _line(kind: str, obj: dict[str, Any]) -> bytes:
    return json.dumps({"type": kind, "object": obj}).encode() + b"\n"


async def _all(response: _Response) -> list[tuple[str, dict[str, Any]]]:
    return [event async for event in watch_events(response)]


async def test_each_event_until_the_server_ends_the_watch_blank_lines_skipped() -> None:
    response = _Response([_line("ADDED", {"a": 1}), b"\n", _line("BOOKMARK", {"b": 2})])
    assert await _all(response) == [("ADDED", {"a": 1}), ("BOOKMARK", {"b": 2})]
    assert response.released


@pytest.mark.parametrize(("code", "raised"), [(410, WatchGone), (500, WatchEnded)])
async def test_an_error_event_ends_the_watch(code: int, raised: type[Exception]) -> None:
    status = {"kind": "Status", "code": code, "message": "too old resource version"}
    response = _Response([_line("MODIFIED", {}), _line("ERROR", status), _line("ADDED", {})])
    with pytest.raises(raised) as error:
        await _all(response)
    assert isinstance(error.value, ApiException) and error.value.status == code
    assert error.value.reason == "too old resource version"
    assert response.released


async def test_an_error_status_is_an_api_exception_not_an_ended_watch() -> None:
    response = _Response([_line("ADDED", {})], status=403, body=b"forbidden")
    with pytest.raises(ApiException) as error:
        await _all(response)
    assert not isinstance(error.value, WatchEnded) and error.value.status == 403
    assert response.released


async def test_a_reader_that_leaves_early_releases_the_response() -> None:
    response = _Response([_line("ADDED", {}), _line("DELETED", {})])
    async with contextlib.aclosing(watch_events(response)) as events:
        assert await anext(events) == ("ADDED", {})
    assert response.released
