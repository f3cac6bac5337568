"""Per-tenant request rate limits: a token bucket per tenant (``requests_per_second``
refill, ``burst`` capacity), refilled lazily from a monotonic clock when a request comes
(no background task). A request over the limit is :class:`~.errors.RateLimited` with the
whole seconds until a token is back, which the transports answer as 429 + Retry-After
(HTTP) or RESOURCE_EXHAUSTED + ``retry-after`` (gRPC)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from model_server.errors import RateLimited


@dataclass(frozen=True)
class RateLimit:
    requests_per_second: float
    burst: int

    def __post_init__(self) -> None:
        if not (self.requests_per_second > 0 and math.isfinite(self.requests_per_second)):
            raise ValueError("rate_limit.requests_per_second must be a positive number")
        if self.burst < 1:
            raise ValueError("rate_limit.burst must be at least 1")

    @classmethod
    def parse(cls, raw: Any, tenant: str) -> RateLimit:
        """``{requests_per_second: R, burst: B}`` (burst defaults to ceil(R))."""
        if not isinstance(raw, dict) or set(raw) - {"requests_per_second", "burst"}:
            raise ValueError(f"tenant {tenant!r}: rate_limit is {{requests_per_second, burst}}")
        rate = raw.get("requests_per_second")
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 < rate < 1e9:
            raise ValueError(
                f"tenant {tenant!r}: rate_limit.requests_per_second must be a positive number"
            )
        burst = raw.get("burst", math.ceil(rate))
        if isinstance(burst, bool) or not isinstance(burst, int):
            raise ValueError(f"tenant {tenant!r}: rate_limit.burst is a whole number")
        try:
            return cls(float(rate), burst)
        except ValueError as exc:
            raise ValueError(f"tenant {tenant!r}: {exc}") from None


class TokenBucket:
    def __init__(self, limit: RateLimit, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.clock = clock
        self.tokens = float(limit.burst)
        self.updated = clock()

    def take(self) -> float:
        """Take one token: 0 when granted, else the seconds until one is back."""
        now = self.clock()
        rate = self.limit.requests_per_second
        self.tokens = min(float(self.limit.burst), self.tokens + (now - self.updated) * rate)
        self.updated = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / rate


class TenantRateLimits:
    """The buckets of the tenants that have a limit (one without is never limited)."""

    def __init__(
        self,
        limits: Mapping[str, RateLimit],
        clock: Callable[[], float] = time.monotonic,
        on_limited: Callable[[str], None] | None = None,
    ) -> None:
        self.buckets = {tenant: TokenBucket(limit, clock) for tenant, limit in limits.items()}
        self.on_limited = on_limited

    def admit(self, tenant: str | None) -> None:
        """Count one request of ``tenant``, or raise ``RateLimited``."""
        bucket = self.buckets.get(tenant) if tenant is not None else None
        if bucket is None:
            return
        wait = bucket.take()
        if wait > 0:
            if self.on_limited is not None:
                self.on_limited(tenant or "")
            raise RateLimited(
                f"tenant {tenant!r} is over its request rate limit "
                f"({bucket.limit.requests_per_second:g}/s, burst {bucket.limit.burst})",
                retry_after_s=max(1, math.ceil(wait)),
            )
