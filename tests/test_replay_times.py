"""When a graph replay runs on the event loop: the rule that decides, with a clock of
the test's own (the GPU side is in test_torch_backend_gpu)."""

from __future__ import annotations

import pytest

from model_server.backends.replay_times import REPLAY_WINDOW, ReplayTimes


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def times_of(replays: list[float], clock: Clock) -> ReplayTimes:
    return ReplayTimes(replays, window=REPLAY_WINDOW, probe_interval_s=0.2, clock=clock)


def test_warm_up_replays_decide_until_others_come() -> None:
    times = times_of([0.0001, 0.0002, 0.009], Clock())
    assert times.typical_s == 0.0002
    assert times.allows(0.0003)
    assert not times.allows(0.0001)


def test_one_slow_replay_does_not_turn_quick_runs_off() -> None:
    """The moving average it replaces went past a 300 us budget after one 5 ms replay."""
    times = times_of([0.0002] * 7, Clock())
    times.note(0.005)
    assert times.allows(0.0003)


def test_replays_that_stay_slow_turn_quick_runs_off() -> None:
    times = times_of([0.0002] * 7, Clock())
    for _ in range(REPLAY_WINDOW // 2 + 1):
        times.note(0.002)
    assert times.typical_s == 0.002
    assert not times.allows(0.0003)


def test_while_off_one_replay_per_interval_probes_and_quick_ones_bring_it_back() -> None:
    """Without probes nothing could bring quick runs back: only the event loop's replays
    are counted, and none run there while quick runs are off."""
    clock = Clock()
    times = times_of([0.002] * REPLAY_WINDOW, clock)
    assert not times.allows(0.0003)  # the interval since it was made has not passed
    probes = 0
    for _ in range(REPLAY_WINDOW):
        clock.now += 0.05
        if times.allows(0.0003):
            probes += 1
            times.note(0.0002)
    assert probes == 3  # 0.75 s: one each 0.2 s, no more
    for _ in range(REPLAY_WINDOW):
        clock.now += 0.2
        assert times.allows(0.0003)  # a probe: the interval has passed
        times.note(0.0002)
        if times.typical_s <= 0.0003:
            break
    assert times.allows(0.0003)
    clock.now += 0.001
    assert times.allows(0.0003)  # on again: no interval between quick runs


def test_no_replay_time_to_start_from_is_refused() -> None:
    with pytest.raises(ValueError):
        ReplayTimes([])
