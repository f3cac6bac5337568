"""Exponential backoff with jitter: the one way the programs space their retries (the
sidecar's store, control socket and pod watch; the operator's rollout tasks)."""

from __future__ import annotations

import random
from dataclasses import dataclass


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
