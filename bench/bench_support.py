"""What the benchmark scripts share, so that each script is a leaf that imports no other:
where figures are written, the MLPs they serve, and the server metrics they read."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from model_rollout_e2e.onnx_models import publish_mlp

# 8-layer MLPs: (input width, hidden width); about 25 MiB and 400 MiB of fp32 weights
SIZES = {"small": (256, 1024), "large": (1024, 4096)}
DEPTH = 8
OUT_DIM = 16


def write_json(out: str | Path, report: Any) -> Path:
    """Write ``report`` to ``out`` as indented JSON, its folder made, and print where
    last (so a run's log says which file holds what it printed)."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"json: {path}")
    return path


def publish_sized(root: Path, model: str, version: str, seed: int, size: str) -> Path:
    """``model:version``, a :data:`DEPTH`-layer MLP of one of :data:`SIZES`."""
    in_dim, hidden = SIZES[size]
    path, _ = publish_mlp(
        root, model, version, seed, in_dim=in_dim, hidden=hidden, out_dim=OUT_DIM, depth=DEPTH
    )
    return path


def publish_versions(
    root: Path, in_dim: int, hidden: int, depth: int, count: int = 1, model: str = "mlp"
) -> Path:
    """v1 to v``count`` of one MLP shape, each with its own weights (seed = its number);
    the path of the last."""
    path = root
    for seed in range(1, count + 1):
        path, _ = publish_mlp(
            root, model, f"v{seed}", seed,
            in_dim=in_dim, hidden=hidden, out_dim=OUT_DIM, depth=depth,
        )  # fmt: skip
    return path


def metric_samples(url: str) -> Iterator[tuple[str, Sample]]:
    """Each sample of the server's ``/metrics`` at ``url``, with its family's name."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            yield family.name, sample


def server_seconds(url: str, model: str) -> tuple[float, float]:
    """(sum, count) of the server's own request-duration histogram for ``model``."""
    total = count = 0.0
    for family, sample in metric_samples(url):
        if family != "model_server_inference_request_duration_seconds":
            continue
        if sample.labels.get("model") != model:
            continue
        if sample.name.endswith("_sum"):
            total = sample.value
        elif sample.name.endswith("_count"):
            count = sample.value
    return total, count


def batch_histogram(url: str) -> tuple[float, float]:
    """(engine runs, rows) so far, from the server's model_server_inference_batch_rows histogram."""
    runs = rows = 0.0
    for _, sample in metric_samples(url):
        if sample.name == "model_server_inference_batch_rows_count":
            runs += sample.value
        elif sample.name == "model_server_inference_batch_rows_sum":
            rows += sample.value
    return runs, rows
