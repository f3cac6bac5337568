"""The most rows (the first axis) one request may give a model: a request's memory
grows with its rows in every activation of the graph, far past its body's size (a 1.6 MB
body took 397 MiB on a model of 1024-wide layers), so rows are bounded per model, and a
request over the bound is refused (400) before it runs.

A model's bound is the one its configuration names (the server's ``--max-rows``,
``[TENANT/]NAME=ROWS``), else derived: the memory one request may take
(``--request-memory-mb``) over the engine's estimate of its memory per row
(``bytes_per_row``; ONNX Runtime's: :mod:`.backends.onnx_rows`). An engine without an
estimate (torch; TensorRT, bounded by its optimization profile) and no configured bound
has none."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from .backends.base import Engine
from .errors import BadRequest


@dataclass(frozen=True)
class RowLimits:
    request_memory_bytes: int
    configured: Mapping[str, int] = field(default_factory=dict)  # by model key

    def max_rows(self, key: str, engine: Engine) -> int | None:
        """The bound on ``key``'s requests run on ``engine`` (None: none)."""
        configured = self.configured.get(key)
        if configured is not None:
            return configured
        per_row = getattr(engine, "bytes_per_row", None)
        if not per_row:
            return None
        return max(1, self.request_memory_bytes // per_row)

    def check(self, key: str, engine: Engine, feeds: Mapping[str, np.ndarray]) -> None:
        """Refuse (400) a request whose inputs have more rows than ``key`` allows."""
        limit = self.max_rows(key, engine)
        if limit is None:
            return
        for name, rows in input_rows(engine, feeds).items():
            if rows > limit:
                raise BadRequest(
                    f"input {name!r}: {rows} rows; model {key!r} takes at most "
                    f"{limit} rows per request (send fewer rows per request)"
                )


def input_rows(engine: Engine, feeds: Mapping[str, np.ndarray]) -> dict[str, int]:
    """The rows of each input whose first axis is dynamic (a batch): a fixed first axis
    (a table of fixed size given with every request) is no rows."""
    dynamic = {spec.name for spec in engine.inputs if spec.shape and spec.shape[0] < 0}
    return {
        name: int(np.shape(array)[0])
        for name, array in feeds.items()
        if name in dynamic and np.ndim(array)
    }
