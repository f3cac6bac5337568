"""Where one load's time went, stage by stage, measured where each stage runs: the load's
admin answer (``stages_ms``) and ``model_server_load_stage_duration_seconds{stage}`` say
it, so a slow load is explained by the server itself rather than guessed from outside.

Stages run one after the other (some on the loader's threads, some on the event loop);
what lies between them (thread hand-offs, the wait for the model's load lock, the budget)
is ``other``: the stages and ``other`` add up to the load's duration."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping

# the stages a load can report, in the order they run (a backend reports its own
# among these: ONNX Runtime ``cache``, ``optimize``, ``session``, ``row_estimate``;
# torch ``parse``, ``upload``, ``bind``)
# the wait for an earlier load's private copy to be let go (on the release thread, once
# its engine held its own), when it had not been yet: copies never pile up
RELEASE = "release"
# the model file into its private copy, its sha256 computed alongside, chunk by chunk
# (or its manifest's chunk digests checked, on several threads)
READ_HASH = "read_hash"
HASH_WAIT = "hash_wait"  # after the model's last byte was read, the wait for its check
READ = "read"  # the manifest and golden set beside the model file
GOLDEN_PARSE = "golden_parse"  # the golden set's digest checked and its arrays read
ENGINE = "engine"  # the backend's load, less the stages it reports itself
WARM_UP = "warm_up"  # the warm-up inference(s)
GOLDEN = "golden"  # the golden set's inputs run and their answers compared
SWAP = "swap"  # the new version installed as the serving one, and reported
OTHER = "other"  # the rest of the load's duration: hand-offs and waits between stages


class LoadStages:
    """Seconds per stage of one load; a stage entered twice adds up."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - started)

    def add(self, name: str, seconds: float) -> None:
        self._seconds[name] = self._seconds.get(name, 0.0) + seconds

    def merge(self, seconds: Mapping[str, float]) -> None:
        for name, value in seconds.items():
            self.add(name, value)

    def total_s(self) -> float:
        return sum(self._seconds.values())

    def closed(self, duration_s: float) -> dict[str, float]:
        """The stages, and what the load's ``duration_s`` spent outside them as
        ``other`` (never negative)."""
        seconds = dict(self._seconds)
        seconds[OTHER] = max(0.0, duration_s - self.total_s())
        return seconds


def milliseconds(seconds: Mapping[str, float]) -> dict[str, float]:
    """Stages as an answer shows them: milliseconds to the microsecond."""
    return {name: round(value * 1000, 3) for name, value in seconds.items()}
