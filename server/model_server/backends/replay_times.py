"""Whether a captured graph's replay is quick enough to run on the event loop, from the
GPU's own times of the latest replays, wherever they ran.

Why GPU times, from every replay: a rule fed by host times is bistable, since a host
time includes the waits for the GIL of a busy server, so one slow replay sends requests
to the threads, whose host-timed replays then keep them there (the rules tried, and how
they failed: bench/results/h200/NOTES.md, 2026-12-03). Each replay is timed by two CUDA
events (``torch_gpu.Captured``), so a thread's replay counts as much as the loop's and
the window never goes stale. Where the runtime allows it, the events and the copies in
and out are nodes of the captured graph itself, so their span holds no host step at all
(``bench/replay_timing.py`` compares the ways). The span is the GPU's time from the
graph's start to its end, other streams' work in between included.
Elsewhere the events are queued around the launch, and the thread's waits for the GIL
between them (after each torch call) stretch the span. That only ever adds time, so the
lower quartile decides: quick runs stop once three quarters of the window is slow and
come back once a quarter is quick. The price of that choice: a GPU slow for up to three
replays in four keeps them on, and each slow one holds the event loop for its length."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable

REPLAY_WINDOW = 16  # the latest replays' GPU times that decide


class ReplayTimes:
    """The GPU times of one engine's latest graph replays (copies in and out included),
    noted by whichever thread replayed; read by the event loop."""

    def __init__(self, warm_up: Iterable[float], window: int = REPLAY_WINDOW) -> None:
        self._lock = threading.Lock()
        self._times: deque[float] = deque(warm_up, maxlen=window)
        if not self._times:
            raise ValueError("a replay time is needed to start from")
        self._typical = self._quartile()

    def _quartile(self) -> float:
        ordered = sorted(self._times)
        return ordered[len(ordered) // 4]

    @property
    def typical_s(self) -> float:
        """The lower quartile of the window."""
        return self._typical

    def allows(self, budget_s: float) -> bool:
        """Whether the next replay may run on the event loop: a typical one fits."""
        return self._typical <= budget_s

    def note(self, seconds: float) -> None:
        """A replay took ``seconds`` of GPU time (from any thread)."""
        with self._lock:
            self._times.append(seconds)
            self._typical = self._quartile()
