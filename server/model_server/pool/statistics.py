"""The statistics (Triton's ``model_stats``) of a pool of server processes: every
worker's answer summed per (model, version), as one server would count them. Counts and
nanoseconds add up (each request was served by one worker); ``last_inference`` is the
latest of them."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any


def _add_durations(into: dict[str, Any], other: dict[str, Any]) -> None:
    """Add every ``{count, ns}`` of ``other`` into ``into`` (absent ones copied)."""
    for field, duration in other.items():
        if not isinstance(duration, dict):
            continue
        held = into.setdefault(field, {"count": 0, "ns": 0})
        held["count"] += int(duration.get("count", 0))
        held["ns"] += int(duration.get("ns", 0))


def _add_stat(into: dict[str, Any], other: dict[str, Any]) -> None:
    into["last_inference"] = max(into["last_inference"], other["last_inference"])
    into["inference_count"] += other["inference_count"]
    into["execution_count"] += other["execution_count"]
    _add_durations(into["inference_stats"], other["inference_stats"])
    batches = {b["batch_size"]: b for b in into["batch_stats"]}
    for batch in other["batch_stats"]:
        held = batches.get(batch["batch_size"])
        if held is None:
            batches[batch["batch_size"]] = copy.deepcopy(batch)
        else:
            _add_durations(held, {k: v for k, v in batch.items() if k != "batch_size"})
    into["batch_stats"] = [batches[size] for size in sorted(batches)]


def merge_statistics(answers: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """One ``{"model_stats": [...]}`` of the sum of every worker's, in the first
    answer's order (a version only some workers hold comes after)."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for answer in answers:
        for stat in answer["model_stats"]:
            key = (stat["name"], stat["version"])
            if key in merged:
                _add_stat(merged[key], stat)
            else:
                merged[key] = copy.deepcopy(stat)
    return {"model_stats": list(merged.values())}
