"""The most rows (the first axis) one request may give a model: a request's memory
grows with its rows in every activation of the graph, far past its body's size (a 1.6 MB
body took 397 MiB on a model of 1024-wide layers), so rows are bounded per model, and a
request over the bound is refused (400) before it runs.

A model's bound is the one its configuration names (the server's ``--max-rows``,
``[TENANT/]NAME=ROWS``), else derived: the memory one request may take
(``--request-memory-mb``) over the engine's estimate of its memory per row
(``bytes_per_row``; ONNX Runtime's: :mod:`.backends.onnx_rows`). An engine without an
estimate (torch; TensorRT, bounded by its optimization profile) and no configured bound
has none.

Rows are not all: an input with a dynamic axis besides the batch (a sequence length,
``[batch, seq]``) makes each row as long as the client likes. The estimate counts such
axes as 1, so a request's memory is about the estimate per row times its rows times the
product of its other dynamic dims (the largest over its inputs): that is bounded by
``--request-memory-mb`` too, whatever the configured rows. A model with no estimate is
bounded by the element limit alone (``MAX_ELEMENTS`` values per input), said once in the
log so that its operator can give it ``--max-rows``."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from model_server.backends.base import Engine
from model_server.errors import BadRequest
from model_server.protocol.tensors import MAX_ELEMENTS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RowLimits:
    request_memory_bytes: int
    configured: Mapping[str, int] = field(default_factory=dict)  # by model key
    # the models said to have no estimate (each said once)
    _unestimated: set[str] = field(default_factory=set, compare=False, repr=False)

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
        rows = input_rows(engine, feeds)
        if limit is not None:
            for name, count in rows.items():
                if count > limit:
                    raise BadRequest(
                        f"input {name!r}: {count} rows; model {key!r} takes at most "
                        f"{limit} rows per request (send fewer rows per request)"
                    )
        per_row = getattr(engine, "bytes_per_row", None)
        if not per_row:
            self._without_estimate(key, feeds)
            return
        extent = request_extent(engine, feeds)
        if extent <= 1:
            return  # no other dynamic axis longer than 1: the rows' bound is the memory's
        taken = per_row * max(rows.values(), default=1) * extent
        if taken > self.request_memory_bytes:
            raise BadRequest(
                f"model {key!r}: this request's {max(rows.values(), default=1)} rows of "
                f"{extent} positions each (its dynamic axes besides the first) would take "
                f"about {taken >> 20} MiB; one request may take {self.request_memory_bytes >> 20} "
                "MiB (the server's --request-memory-mb): send fewer or shorter rows"
            )

    def batch_rows(self, key: str, engine: Engine, feeds: Mapping[str, np.ndarray]) -> int | None:
        """The most rows one engine run of requests like ``feeds`` (the same dims but the
        first) may have: a batch is one run, bounded as one request is (None: no bound)."""
        bounds = [self.max_rows(key, engine)]
        per_row = getattr(engine, "bytes_per_row", None)
        if per_row:
            per_row *= request_extent(engine, feeds)
            bounds.append(max(1, self.request_memory_bytes // per_row))
        found = [bound for bound in bounds if bound is not None]
        return min(found) if found else None

    def _without_estimate(self, key: str, feeds: Mapping[str, np.ndarray]) -> None:
        """A model with no estimate per row: the element limit bounds each input."""
        if key not in self._unestimated:
            self._unestimated.add(key)
            log.warning(
                "model %r has no memory estimate per row: its requests are bounded by the "
                "element limit alone (%d values per input%s); --max-rows bounds its rows",
                key, MAX_ELEMENTS,
                f", at most {self.configured[key]} rows" if key in self.configured else "",
            )  # fmt: skip
        for name, array in feeds.items():
            if np.size(array) > MAX_ELEMENTS:
                raise BadRequest(f"input {name!r}: more than {MAX_ELEMENTS} elements")


def request_extent(engine: Engine, feeds: Mapping[str, np.ndarray]) -> int:
    """What one row of the request holds per position of the estimate: the product of
    its dynamic dims besides the first, the largest over its inputs (1: none)."""
    return max((_extent(spec.shape, feeds.get(spec.name)) for spec in engine.inputs), default=1)


def _extent(shape: tuple[int, ...], array: np.ndarray | None) -> int:
    """The product of an input's dynamic dims besides a dynamic first one (1: none)."""
    if array is None or np.ndim(array) != len(shape):
        return 1
    dims = np.shape(array)
    return math.prod(dims[i] for i, want in enumerate(shape) if want < 0 and i > 0) or 1


def input_rows(engine: Engine, feeds: Mapping[str, np.ndarray]) -> dict[str, int]:
    """The rows of each input whose first axis is dynamic (a batch): a fixed first axis
    (a table of fixed size given with every request) is no rows."""
    dynamic = {spec.name for spec in engine.inputs if spec.shape and spec.shape[0] < 0}
    return {
        name: int(np.shape(array)[0])
        for name, array in feeds.items()
        if name in dynamic and np.ndim(array)
    }
