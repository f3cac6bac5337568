"""When a graph replay runs on the event loop: the rule that decides, fed by hand here
(the CUDA events that time real replays are in test_torch_backend_gpu)."""

from __future__ import annotations

import pytest

from model_server.backends.replay_times import REPLAY_WINDOW, ReplayTimes


def test_warm_up_replays_decide_until_others_come() -> None:
    times = ReplayTimes([0.0001, 0.0002, 0.009, 0.009])
    assert times.typical_s == 0.0002  # the lower quartile
    assert times.allows(0.0003)
    assert not times.allows(0.0001)


def test_one_slow_replay_does_not_turn_quick_runs_off() -> None:
    """The moving average it replaces went past a 300 us budget after one 5 ms replay."""
    times = ReplayTimes([0.0002] * 7)
    times.note(0.005)
    assert times.allows(0.0003)


def test_replays_stretched_now_and_then_do_not_turn_quick_runs_off() -> None:
    """A replay's events stretch when its thread waits for the GIL before the copy out:
    that only adds time, so while a quarter of the window is clean, it decides."""
    times = ReplayTimes([0.0002] * 7)
    for i in range(REPLAY_WINDOW):
        times.note(0.0002 if i % 3 == 0 else 0.004)
    assert times.allows(0.0003)


def test_replays_that_are_slow_on_the_gpu_turn_quick_runs_off_and_quick_ones_back_on() -> None:
    """Every replay counts, a thread's as much as the loop's: while quick runs are off the
    threads' replays keep the window current, so nothing needs probing."""
    times = ReplayTimes([0.0002] * 7)
    for _ in range(REPLAY_WINDOW):
        times.note(0.002)
    assert times.typical_s == 0.002 and not times.allows(0.0003)
    for _ in range(REPLAY_WINDOW - REPLAY_WINDOW // 4):
        times.note(0.0002)
    assert times.allows(0.0003)


def test_no_replay_time_to_start_from_is_refused() -> None:
    with pytest.raises(ValueError):
        ReplayTimes([])
