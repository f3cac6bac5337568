"""Retries with exponential backoff and jitter, for transient failures only, and the
random pause a process takes before its first store request or poll."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

from model_rollout_contract.backoff import Backoff

log = logging.getLogger(__name__)
T = TypeVar("T")
__all__ = ["Backoff", "retry_async", "start_jitter"]  # Backoff: the contract's


async def start_jitter(
    max_s: float, rng: random.Random, before: str, stop: asyncio.Event | None = None
) -> float:
    """Pause a random time of up to ``max_s`` (logged, so that it can be seen), or until
    ``stop`` is set; returns the pause drawn."""
    if max_s <= 0:
        return 0.0
    delay = rng.uniform(0, max_s)
    log.info("start jitter: waiting %.3f s before %s", delay, before)
    if stop is None:
        await asyncio.sleep(delay)
    else:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), delay)
    return delay


async def retry_async(
    operation: Callable[[], Awaitable[T]],
    is_transient: Callable[[BaseException], bool],
    backoff: Backoff,
    what: str,
) -> T:
    for attempt in range(backoff.attempts):
        try:
            return await operation()
        except Exception as exc:
            if not is_transient(exc) or attempt == backoff.attempts - 1:
                raise
            delay = backoff.delay(attempt)
            log.warning(
                "%s failed (%s); retry %d/%d in %.2fs",
                what,
                exc,
                attempt + 1,
                backoff.attempts - 1,
                delay,
            )
            await asyncio.sleep(delay)
    raise AssertionError("unreachable")
