"""Cold start: engine cache miss vs. hit, and N pods of one node starting together with
the shared, locked cache (one build, the others wait and reuse) vs. each building alone.

The engine here is ONNX Runtime's optimised model (the embedded default); with TensorRT
the same cache holds .engine files and a build takes seconds to minutes, so the ratios
grow accordingly.

    python bench/cold_start.py
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_support import write_json
from model_rollout_e2e.onnx_models import write_mlp
from model_server.backends.base import ModelFile
from model_server.backends.engine_cache import EngineCache
from model_server.backends.onnxruntime_backend import OnnxRuntimeBackend
from model_server.lifecycle.load_pipeline import warm_up


def start_pod(model: str, cache_dir: str, queue: multiprocessing.Queue) -> None:
    started = time.monotonic()
    backend = OnnxRuntimeBackend(cache=EngineCache(cache_dir, suffix="onnx"))
    engine = backend.load(ModelFile.read(model))
    warm_up(engine)
    queue.put({"seconds": time.monotonic() - started, "built": not backend.last_cache_hit})


def concurrent_start(model: Path, pods: int, shared: bool, work: Path) -> dict[str, float]:
    ctx = multiprocessing.get_context("fork")
    queue: multiprocessing.Queue = ctx.Queue()
    caches = [work / "shared"] * pods if shared else [work / f"own-{i}" for i in range(pods)]
    started = time.monotonic()
    procs = [ctx.Process(target=start_pod, args=(str(model), str(c), queue)) for c in caches]
    for p in procs:
        p.start()
    results = [queue.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return {
        "wall_s": round(time.monotonic() - started, 3),
        "builds": sum(r["built"] for r in results),
        "slowest_pod_s": round(max(r["seconds"] for r in results), 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--pods", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default="bench/results/cold_start.json")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-cold-") as tmp:
        work = Path(tmp)
        model = work / "repo" / "mlp" / "v1" / "model.onnx"
        write_mlp(model, 1, in_dim=256, hidden=args.hidden, out_dim=16, depth=args.depth)
        size_mib = model.stat().st_size / 2**20
        miss, hit = [], []
        for i in range(args.repeat):
            cache = EngineCache(work / f"cache-{i}", suffix="onnx")
            for bucket in (miss, hit):
                started = time.monotonic()
                backend = OnnxRuntimeBackend(cache=cache)
                warm_up(backend.load(ModelFile.read(model)))
                bucket.append(time.monotonic() - started)
        together = {
            label: concurrent_start(model, args.pods, shared, work / label)
            for label, shared in (("shared cache + lock", True), ("each pod builds", False))
        }
    report = {
        "model_mib": round(size_mib, 1),
        "load_cache_miss_s": round(statistics.median(miss), 3),
        "load_cache_hit_s": round(statistics.median(hit), 3),
        "concurrent_pods": args.pods,
        "concurrent": together,
    }
    print(
        f"model {size_mib:.1f} MiB; load + warm-up, median of {args.repeat}: "
        f"cache miss {report['load_cache_miss_s']:.3f} s, hit {report['load_cache_hit_s']:.3f} s"
    )
    print(f"{args.pods} pods starting together:")
    print(f"  {'mode':<22} {'builds':>6} {'wall s':>8} {'slowest pod s':>14}")
    for label, row in together.items():
        print(f"  {label:<22} {row['builds']:>6} {row['wall_s']:>8} {row['slowest_pod_s']:>14}")
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
