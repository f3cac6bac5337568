"""Retries with exponential backoff and full jitter, for transient failures only."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    attempts: int = 5
    base_s: float = 0.2
    max_s: float = 10.0

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Full jitter: uniform in [0, min(max, base * 2**attempt)]."""
        cap = min(self.max_s, self.base_s * (2**attempt))
        return (rng or random).uniform(0, cap)


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
