"""kubernetes_asyncio calls answered as plain JSON (``_preload_content=False``: no model
objects, which cost time for a thousand pods and drop fields they do not know).

With ``_preload_content=False`` the client raises nothing for an error status, so every
call goes through :func:`json_call`, which raises :class:`ApiException` as a preloaded
call would, and every watch is read by :func:`watch_events`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Awaitable
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException


def check(response: Any, body: bytes = b"") -> None:
    if not 200 <= response.status <= 299:
        reason = body.decode(errors="replace")[:1000] or str(response.reason)
        raise ApiException(status=response.status, reason=reason)


async def json_call(pending: Awaitable[Any]) -> dict[str, Any]:
    """Await a ``_preload_content=False`` call: its JSON body, or :class:`ApiException`."""
    response = await pending
    try:
        body: bytes = await response.read()
    finally:
        response.release()
    check(response, body)
    return dict(json.loads(body)) if body else {}


class WatchEnded(ApiException):
    """The API server ended a watch with an ERROR event (its object a Status)."""


class WatchGone(WatchEnded):
    """The watch's resourceVersion was compacted away (410): list again."""


async def watch_events(response: Any) -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
    """The events of a ``watch=True, _preload_content=False`` response, each as (type,
    object), until the server ends the watch: an error status raises
    :class:`ApiException`, an ERROR event :class:`WatchGone` (410) or :class:`WatchEnded`.
    The response is released when this ends (``contextlib.aclosing`` to leave early)."""
    try:
        if not 200 <= response.status <= 299:
            check(response, await response.read())
        while line := await response.content.readline():
            if not line.strip():
                continue
            event = json.loads(line)
            kind, obj = str(event.get("type")), event.get("object") or {}
            if kind == "ERROR":
                ended = WatchGone if obj.get("code") == 410 else WatchEnded
                raise ended(status=obj.get("code"), reason=str(obj.get("message")))
            yield kind, obj
    finally:
        response.release()
