"""Closed-loop HTTP load generator that records every request (time, latency, result,
answering version) so runs can be cut into phases and plotted."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp
import numpy as np


@dataclass(frozen=True)
class Sample:
    started: float  # seconds since the run began
    latency_s: float
    ok: bool
    version: str | None
    target: str
    error: str | None = None


@dataclass
class LoadResult:
    samples: list[Sample] = field(default_factory=list)

    def window(self, start: float, end: float) -> list[Sample]:
        return [s for s in self.samples if start <= s.started < end]

    @staticmethod
    def summary(samples: Sequence[Sample]) -> dict[str, float | int | None]:
        ok = np.array([s.latency_s for s in samples if s.ok]) * 1000
        return {
            "requests": len(samples),
            "errors": sum(1 for s in samples if not s.ok),
            "p50_ms": round(float(np.percentile(ok, 50)), 3) if ok.size else None,
            "p99_ms": round(float(np.percentile(ok, 99)), 3) if ok.size else None,
            "max_ms": round(float(ok.max()), 3) if ok.size else None,
        }


def v2_body(x: np.ndarray, input_name: str = "input") -> dict:
    return {
        "inputs": [
            {
                "name": input_name,
                "shape": list(x.shape),
                "datatype": "FP32",
                "data": x.ravel().tolist(),
            }
        ]
    }


class LoadGenerator:
    """``concurrency`` workers each send one request at a time to a random target URL."""

    def __init__(
        self,
        targets: Sequence[str],
        model: str,
        in_dim: int,
        concurrency: int = 8,
        timeout_s: float = 10.0,
        headers: dict[str, str] | None = None,
        think_s: float = 0.0,
    ) -> None:
        """``think_s``: each client's pause between requests (0: closed loop, as fast as
        the servers answer; a pause leaves CPU to everything else on a small machine)."""
        self.think_s = think_s
        self.targets = list(targets)
        self.model = model
        self.concurrency = concurrency
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.headers = headers or {}
        self.body = v2_body(np.ones((1, in_dim), np.float32))
        self.result = LoadResult()
        self._stop = asyncio.Event()
        self._t0 = 0.0

    def now(self) -> float:
        return time.monotonic() - self._t0

    async def _worker(self, session: aiohttp.ClientSession, seed: int) -> None:
        rng = random.Random(seed)
        while not self._stop.is_set():
            target = rng.choice(self.targets)
            started = self.now()
            t = time.perf_counter()
            try:
                async with session.post(
                    f"{target}/v2/models/{self.model}/infer", json=self.body, headers=self.headers
                ) as response:
                    payload = await response.json(content_type=None)
                    ok = response.status == 200
                    version = payload.get("model_version") if ok else None
                    error = None if ok else f"HTTP {response.status}: {payload}"
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                ok, version, error = False, None, f"{type(exc).__name__}: {exc}"
            self.result.samples.append(
                Sample(started, time.perf_counter() - t, ok, version, target, error)
            )
            if not ok:
                await asyncio.sleep(0.01)  # a refused connection fails fast: do not spin
            elif self.think_s:
                await asyncio.sleep(self.think_s)

    async def run(self, duration_s: float | None = None) -> LoadResult:
        self._t0 = self._t0 or time.monotonic()
        connector = aiohttp.TCPConnector(limit=self.concurrency * 2)
        async with aiohttp.ClientSession(connector=connector, timeout=self.timeout) as session:
            workers = [
                asyncio.create_task(self._worker(session, i)) for i in range(self.concurrency)
            ]
            if duration_s is not None:
                await asyncio.sleep(duration_s)
                self._stop.set()
            await asyncio.gather(*workers)
        return self.result

    def start_clock(self) -> None:
        self._t0 = time.monotonic()

    def stop(self) -> None:
        self._stop.set()
