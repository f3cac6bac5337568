"""kubernetes_asyncio calls answered as plain JSON (``_preload_content=False``: no model
objects, which cost time for a thousand pods and drop fields they do not know).

With ``_preload_content=False`` the client raises nothing for an error status, so every
call goes through :func:`json_call`, which raises :class:`ApiException` as a preloaded
call would.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable
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
