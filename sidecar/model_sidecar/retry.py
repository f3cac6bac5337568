"""Retries with exponential backoff and jitter, for transient failures only, and the
random pause a process takes before its first store request or poll."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """``floor`` is the shortest pause as a share of the longest: 0 (full jitter) spreads
    a fleet's retries widest; above 0 it also bounds how often one client can retry
    (what a client of a shared server such as the Kubernetes API needs)."""

    attempts: int = 5
    base_s: float = 0.2
    max_s: float = 10.0
    floor: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.floor <= 1.0:
            raise ValueError(f"Backoff.floor is a share of the pause, 0 to 1: {self.floor}")

    def cap(self, attempt: int) -> float:
        """The longest pause after ``attempt`` (0-based) failures: min(max, base * 2**n)."""
        return min(self.max_s, self.base_s * (2 ** min(attempt, 64)))

    def least(self, attempt: int) -> float:
        """The shortest pause after ``attempt`` failures: floor * cap(attempt)."""
        return self.floor * self.cap(attempt)

    def delay(
        self, attempt: int, rng: random.Random | None = None, retry_after_s: float | None = None
    ) -> float:
        """Uniform in [least(attempt), cap(attempt)], and never shorter than a server's
        ``Retry-After``."""
        drawn = (rng or random).uniform(self.least(attempt), self.cap(attempt))
        return drawn if retry_after_s is None else max(drawn, retry_after_s)


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
