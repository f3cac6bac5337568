"""How a pinned version's inference reaches its engine: in a batch with other requests
pinned to the same version when the model batches (:mod:`.batching`), on the event loop
when the engine knows the run is quick (a CUDA graph replay: handing it to a thread and
back costs more than the run), else on an inference thread."""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Executor

import numpy as np

from model_server.lifecycle.model_slot import LoadedVersion, ModelSlot
from model_server.lifecycle.request_limits import RowLimits
from model_server.observability.metrics import ServerMetrics
from model_server.scheduling.batching import Batchers, BatchPolicy, run_to_completion


class Runner:
    """``quick_run_s``: the longest engine run the event loop may make itself (0: none,
    every run goes to an inference thread)."""

    def __init__(
        self,
        metrics: ServerMetrics,
        row_limits: RowLimits,
        executor: Executor | None = None,
        batching: BatchPolicy | None = None,
        quick_run_s: float = 0.0,
    ) -> None:
        self.executor = executor  # inference threads
        self.quick_run_s = quick_run_s
        self.batchers = Batchers(
            batching or BatchPolicy(),
            executor,
            lambda model, rows: metrics.batch_size.labels(model).observe(rows),
            row_limits,  # the models' bounds on a request (rows, memory): of a batch too
        )

    def batches(self, version: LoadedVersion) -> bool:
        return self.batchers.batches(version)

    async def run(
        self, version: LoadedVersion, feeds: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """Run one inference on a pinned version, off the event loop (its outputs are
        counted in the version's series there too) unless quick. A caller cancelled
        while the engine runs its inputs waits for that run to end, so that its pin
        outlives it."""
        if self.batchers.batches(version):
            return await self.batchers.run(version, feeds)
        if self.quick_run_s > 0:  # 0 (--quick-run-us 0): not even asked
            quick = version.infer_if_quick(feeds, self.quick_run_s)
            if quick is not None:
                return quick
        return await run_to_completion(self.executor, lambda: version.infer(feeds))

    async def infer(
        self, slot: ModelSlot, feeds: Mapping[str, np.ndarray]
    ) -> tuple[LoadedVersion, dict[str, np.ndarray]]:
        """Run on the slot's serving version, pinned for the run."""
        with slot.pin() as version:
            return version, await self.run(version, feeds)

    def close(self) -> None:
        self.batchers.close()  # queued requests fail with 503; runs under way finish
