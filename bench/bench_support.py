"""What the benchmark scripts share, so that each script is a leaf that imports no other:
where figures are written, the MLPs they serve, the server metrics they read, a load's
stages beside the machine's limits, and the operator's planner on a virtual clock."""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import random
import statistics
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from model_operator.spec import parse_spec
from model_rollout_e2e.onnx_models import publish_mlp
from model_rollout_e2e.simulation import SimCluster
from model_server.config import ServerConfig

# 8-layer MLPs: (input width, hidden width); about 25 MiB and 400 MiB of fp32 weights
SIZES = {"small": (256, 1024), "large": (1024, 4096)}
DEPTH = 8
OUT_DIM = 16


def add_load_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of the benchmarks that load versions: how the versions are published
    (``--digest-chunk-mib``) and the server's own flags that change a load."""
    parser.add_argument(
        "--digest-chunk-mib",
        type=int,
        default=8,
        help="the manifests' digest per this many MiB, as publish writes them, checked on "
        "several threads (0: the whole file's only, hashed in one stream)",
    )
    parser.add_argument(
        "--spare-copy-mb",
        type=int,
        default=ServerConfig.spare_copy_mb,
        help="the server's flag: the last private copy kept for the next load (0: none)",
    )
    parser.add_argument(
        "--pin-private-copies", action="store_true", help="the server's flag (torch)"
    )


def write_json(out: str | Path, report: Any) -> Path:
    """Write ``report`` to ``out`` as indented JSON, its folder made, and print where
    last (so a run's log says which file holds what it printed)."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"json: {path}")
    return path


def publish_sized(
    root: Path, model: str, version: str, seed: int, size: str, chunk_size: int | None = None
) -> Path:
    """``model:version``, a :data:`DEPTH`-layer MLP of one of :data:`SIZES` (its manifest
    with the file's digest per ``chunk_size`` bytes if given)."""
    in_dim, hidden = SIZES[size]
    path, _ = publish_mlp(
        root, model, version, seed, chunk_size,
        in_dim=in_dim, hidden=hidden, out_dim=OUT_DIM, depth=DEPTH,
    )  # fmt: skip
    return path


def publish_versions(
    root: Path,
    in_dim: int,
    hidden: int,
    depth: int,
    count: int = 1,
    model: str = "mlp",
    chunk_size: int | None = None,
) -> Path:
    """v1 to v``count`` of one MLP shape, each with its own weights (seed = its number)
    and its digest per ``chunk_size`` bytes if given; the path of the last."""
    path = root
    for seed in range(1, count + 1):
        path, _ = publish_mlp(
            root, model, f"v{seed}", seed, chunk_size,
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


def _best_seconds(run: Any, repeats: int = 7) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def _rate(nbytes: int, seconds: float) -> dict[str, float]:
    return {"ms": round(seconds * 1000, 3), "gb_per_s": round(nbytes / seconds / 1e9, 2)}


def physical_limits(path: Path, device: str | None = None) -> dict[str, Any]:
    """What a load of the file at ``path`` cannot beat on this machine, each the best of
    a few runs: its bytes read from the page cache into memory already touched (the read
    itself), into fresh pages (what a new private copy pays for them), and their sha256;
    with ``device`` (``cuda``, torch installed), their copy to the GPU from pinned and
    from pageable memory."""
    size = path.stat().st_size
    path.read_bytes()  # in the page cache now
    buffer = bytearray(size)
    fd = os.open(path, os.O_RDONLY)
    try:

        def fresh() -> None:
            with mmap.mmap(-1, size) as pages, memoryview(pages) as view:
                os.preadv(fd, [view], 0)

        limits: dict[str, Any] = {
            "bytes": size,
            "page_cache_read": _rate(size, _best_seconds(lambda: os.preadv(fd, [buffer], 0))),
            "page_cache_read_fresh_pages": _rate(size, _best_seconds(fresh)),
        }
    finally:
        os.close(fd)
    data = bytes(buffer)
    limits["sha256"] = _rate(size, _best_seconds(lambda: hashlib.sha256(data).digest()))
    if device is not None:
        limits.update(_host_to_device(size, device))
    return limits


def _host_to_device(size: int, device: str) -> dict[str, Any]:
    import torch

    target = torch.empty(size, dtype=torch.uint8, device=device)
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(size, dtype=torch.uint8)

    def copy(source: Any) -> None:
        target.copy_(source, non_blocking=True)
        torch.cuda.synchronize()

    copy(pinned)  # the first copy sets the device up
    return {
        "h2d_pinned": _rate(size, _best_seconds(lambda: copy(pinned))),
        "h2d_pageable": _rate(size, _best_seconds(lambda: copy(pageable))),
        "device_name": torch.cuda.get_device_name(),
    }


def print_stages(title: str, stages_ms: list[dict[str, float]], limits: dict[str, Any]) -> dict:
    """A table of each stage's median, min and max over the loads (the server's own
    ``stages_ms``), beside the machine's limits for the file's size; returns the medians."""
    names = list(dict.fromkeys(name for load in stages_ms for name in load))
    medians = {}
    print(f"\n{title}")
    print(f"{'stage':<14} {'median ms':>10} {'min':>8} {'max':>8}")
    for name in names:
        values = sorted(load.get(name, 0.0) for load in stages_ms)
        medians[name] = round(statistics.median(values), 3)
        print(f"{name:<14} {medians[name]:>10.2f} {values[0]:>8.2f} {values[-1]:>8.2f}")
    totals = sorted(sum(load.values()) for load in stages_ms)
    print(f"{'= load':<14} {statistics.median(totals):>10.2f} {totals[0]:>8.2f} {totals[-1]:>8.2f}")
    mib = limits["bytes"] / 2**20
    print(f"limits for {mib:.1f} MiB on this machine (best of 7):")
    for key, label in (
        ("page_cache_read", "read from the page cache into touched memory"),
        ("page_cache_read_fresh_pages", "read from the page cache into fresh pages"),
        ("sha256", "sha256"),
        ("h2d_pinned", "host to device, pinned"),
        ("h2d_pageable", "host to device, pageable"),
    ):
        if key in limits:
            rate = limits[key]
            print(f"  {label:<46} {rate['ms']:>8.2f} ms  {rate['gb_per_s']:>6.2f} GB/s")
    return medians
