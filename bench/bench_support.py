"""What the benchmark scripts share, so that each script is a leaf that imports no other:
where figures are written, the MLPs they serve, the server metrics they read, and the
operator's planner on a virtual clock."""

from __future__ import annotations

import json
import random
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from model_operator.spec import parse_spec
from model_rollout_e2e.onnx_models import publish_mlp
from model_rollout_e2e.simulation import SimCluster

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


# the operator's planner on a virtual clock: a staged rollout beside all pods at once
STRATEGIES = {
    "staged": {
        "canary": {"percent": 10, "pauseSeconds": 30},
        "rollout": {"batchPercent": 25, "maxConcurrentLoads": 8, "jitterSeconds": 5},
    },
    "all-at-once": {"canary": {"percent": 0}, "rollout": {"batchPercent": 100, "jitterSeconds": 0}},
}


def simulate(replicas: int, strategy: str, seed: int) -> dict[str, float | int]:
    rng = random.Random(seed)
    durations: dict[tuple[str, str], float] = {}

    def load_seconds(pod: str, version: str) -> float:
        return durations.setdefault((pod, version), rng.uniform(2, 6))

    spec = parse_spec(
        {
            "model": "m",
            "version": "v2",
            "image": "i",
            "replicas": replicas,
            "store": {"url": "s3://bucket/p"},
            "signingPublicKeySecret": "signing-key",
            **STRATEGIES[strategy],
        }
    )
    cluster = SimCluster(replicas, "v1", load_seconds, seed=seed)
    start = cluster.now
    plan = cluster.run(spec, dt=0.1)
    assert plan.phase == "Available" and cluster.serving() == {"v2": replicas}
    return {
        "replicas": replicas,
        "peak_concurrent_loads": cluster.max_loading,
        "total_s": round(cluster.now - start, 1),
        "batches": plan.state.batch,
    }
