"""Whether a captured graph's replay is quick enough to run on the event loop, from the
replays that ran there.

Why a median over a window, fed by the event loop's replays only, with probes: the
first rule (a moving average of every replay, inference threads' included) was
bistable on the H200 host. One slow replay (a garbage collection, a busy GPU) lifted the
average past the budget; requests then went to the inference threads, whose replays,
timed with their waits for the GIL at 16 clients, took milliseconds and kept the average
there. Quick runs stayed off for the rest of the run (server time 11.8 ms instead of
0.28 ms, from one run to the next). Now one outlier moves nothing (half the window must
be slow), a thread's time (which measures the GIL, not the GPU) is never counted, and
while quick runs are off one request in ``probe_interval_s`` runs quick anyway, so a
GPU that is quick again is seen within a few probes. A GPU that stays slow costs the
event loop one slow replay per probe interval."""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable

REPLAY_WINDOW = 15  # replays whose median decides: 8 slow ones in a row turn quick runs off
PROBE_INTERVAL_S = 0.2  # while off, one replay this often runs on the loop to look again


class ReplayTimes:
    """The latest replay times of one engine's graphs, whole (copies in and out and the
    wait). Used from one thread, the event loop's, once the warm-up has seeded it."""

    def __init__(
        self,
        warm_up: Iterable[float],
        window: int = REPLAY_WINDOW,
        probe_interval_s: float = PROBE_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._times: deque[float] = deque(warm_up, maxlen=window)
        if not self._times:
            raise ValueError("a replay time is needed to start from")
        self._typical = statistics.median(self._times)
        self.probe_interval_s = probe_interval_s
        self._clock = clock
        self._last_probe = clock()

    @property
    def typical_s(self) -> float:
        """The median of the window."""
        return self._typical

    def allows(self, budget_s: float) -> bool:
        """Whether the next replay may run on the event loop: a typical one fits
        ``budget_s``, or it is time for a probe."""
        if self._typical <= budget_s:
            return True
        now = self._clock()
        if now - self._last_probe < self.probe_interval_s:
            return False
        self._last_probe = now
        return True

    def note(self, seconds: float) -> None:
        """A replay that ran on the event loop took ``seconds``."""
        self._times.append(seconds)
        self._typical = statistics.median(self._times)
