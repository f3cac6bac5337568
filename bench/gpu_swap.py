"""Double buffering on a GPU: the engine manager with the torch backend (weights in
device memory), no HTTP in the way.

Measures inference latency while serving, the time to load + warm up a new version beside
the old one, the instant rollback, and device memory before, during (two copies) and after
the old version is released when its last request finishes. The figure that matters is
p99 while v2 loads against the steady p99 (their ratio is printed): a load copies on its
own stream, through pinned chunks, so it should not show in the serving version's tail.

    python bench/gpu_swap.py                          # 400 MiB MLP, 4 clients, batch 32
    python bench/gpu_swap.py --clients 16 --batch 1   # needs torch with CUDA
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from bench_output import write_json
from model_rollout_e2e.onnx_models import write_mlp
from model_server.audit import AuditLog
from model_server.backends.torch_backend import TorchBackend
from model_server.backends.torch_gpu import CHUNK_BYTES
from model_server.config import GIL_SWITCH_INTERVAL_US, QUICK_RUN_US
from model_server.engine_manager import EngineManager
from model_server.metrics import ServerMetrics
from model_server.repository import ModelRepository


def write_versions(root: Path, args: argparse.Namespace) -> None:
    """v1 and v2 of the MLP ``args`` describe (``--in-dim``, ``--hidden``, ``--depth``)."""
    for version, seed in (("v1", 1), ("v2", 2)):
        write_mlp(
            root / "mlp" / version / "model.onnx",
            seed,
            in_dim=args.in_dim,
            hidden=args.hidden,
            out_dim=16,
            depth=args.depth,
        )


async def measure(args: argparse.Namespace, root: Path) -> dict:
    import torch

    backend = TorchBackend("cuda", chunk_bytes=int(args.chunk_mib * 2**20))
    threads = ThreadPoolExecutor(args.workers, thread_name_prefix="infer")
    manager = EngineManager(
        backend,
        ModelRepository(root),
        ServerMetrics(),
        AuditLog(),
        retain=args.retain,
        executor=threads,
        quick_run_s=args.quick_run_us / 1e6,
    )
    manager.register("mlp")
    mib = lambda: round(torch.cuda.memory_allocated() / 2**20, 1)  # noqa: E731

    def weights() -> dict[str, float]:
        """Device memory held by each loaded version's weights."""
        return {v.version: round(v.memory_bytes / 2**20, 1) for v in manager.slot("mlp").loaded()}

    report: dict = {
        "device": torch.cuda.get_device_name(),
        "clients": args.clients,
        "batch": args.batch,
        "workers": args.workers,
        "chunk_mib": args.chunk_mib,
        "gil_switch_interval_us": args.gil_switch_interval_us,
        "quick_run_us": args.quick_run_us,
        "sample_memory_ms": args.sample_memory_ms,
        "memory_mib": {"empty": mib()},
        "weights_mib": {},
    }
    t = time.perf_counter()
    await manager.load("mlp", "v1")
    report["first_load_ms"] = round((time.perf_counter() - t) * 1000, 2)
    report["memory_mib"]["v1"] = mib()
    report["weights_mib"]["after_v1"] = weights()
    x = {
        "input": np.random.default_rng(0).standard_normal(
            (args.batch, args.in_dim), dtype=np.float32
        )
    }
    for _ in range(20):  # each inference thread makes its stream and buffers before timing
        await asyncio.gather(*(manager.infer("mlp", x) for _ in range(args.workers)))
    latencies: list[float] = []

    async def client(stop: asyncio.Event) -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            await manager.infer("mlp", x)
            latencies.append(time.perf_counter() - t0)
            await asyncio.sleep(0)  # a quick run answers without yielding: let others in

    stop = asyncio.Event()
    clients = [asyncio.create_task(client(stop)) for _ in range(args.clients)]
    await asyncio.sleep(args.steady_s)
    steady = list(latencies)
    torch.cuda.reset_peak_memory_stats()  # the peak of both copies, without polling
    samples = 0

    async def sample_memory(every_s: float) -> None:
        """The old way of finding the peak, kept to show what it cost: each call takes
        the caching allocator's lock with the GIL held, so a poll that lands while the
        load's thread allocates weights stalls the event loop, and every client."""
        nonlocal samples
        while not stop.is_set():
            torch.cuda.memory_allocated()
            samples += 1
            await asyncio.sleep(every_s)

    sampler = (
        asyncio.create_task(sample_memory(args.sample_memory_ms / 1000))
        if args.sample_memory_ms > 0
        else None
    )
    before = len(latencies)
    swap = await manager.load("mlp", "v2")
    during = latencies[before:]
    report["swap_load_warmup_ms"] = round(swap.duration_s * 1000, 2)
    await asyncio.sleep(0.5)
    peak = torch.cuda.max_memory_allocated() / 2**20
    report["memory_polls"] = samples
    report["memory_mib"]["both_loaded_peak"] = round(peak, 1)
    report["weights_mib"]["after_v2"] = weights()
    back = await manager.rollback("mlp")
    report["rollback_ms"] = round(back.duration_s * 1000, 3)
    stop.set()
    await asyncio.gather(*clients, *([sampler] if sampler is not None else []))
    manager.slot("mlp").retain = 1
    await manager.load("mlp", "v2")  # retain 1: v1 is released once drained
    torch.cuda.synchronize()
    report["memory_mib"]["after_release"] = mib()
    report["memory_mib"]["reserved_after_release"] = round(torch.cuda.memory_reserved() / 2**20, 1)
    report["weights_mib"]["after_release"] = weights()
    report["closed_versions"] = list(manager.slot("mlp").closed_versions)
    ms = lambda v: round(float(np.percentile(np.array(v) * 1000, 50)), 3)  # noqa: E731
    p99 = lambda v: round(float(np.percentile(np.array(v) * 1000, 99)), 3)  # noqa: E731
    report["latency_ms"] = {
        "steady_p50": ms(steady),
        "steady_p99": p99(steady),
        "steady_max": round(max(steady) * 1000, 3),
        "during_swap_p50": ms(during) if during else None,
        "during_swap_p99": p99(during) if during else None,
        "during_swap_max": round(max(during) * 1000, 3) if during else None,
    }
    if during:
        report["p99_during_over_steady"] = round(p99(during) / p99(steady), 2)
    report["requests"] = {"steady": len(steady), "during_swap": len(during), "all": len(latencies)}
    manager.close()
    threads.shutdown()
    return report


def table(report: dict) -> str:
    lat = report["latency_ms"]
    rows = [
        ("model", f"{report['model_mib']} MiB, batch {report['batch']}, "
         f"{report['clients']} clients, {report['workers']} threads"),
        ("load + warm-up of v2 beside v1", f"{report['swap_load_warmup_ms']} ms"),
        ("rollback to the retained v1", f"{report['rollback_ms']} ms"),
        ("p50 / p99 steady", f"{lat['steady_p50']} / {lat['steady_p99']} ms"),
        ("p50 / p99 while v2 loads", f"{lat['during_swap_p50']} / {lat['during_swap_p99']} ms"),
        ("p99 while loading / steady", f"{report.get('p99_during_over_steady')}x"),
        ("requests steady / while loading", f"{report['requests']['steady']} / "
         f"{report['requests']['during_swap']}"),
    ]  # fmt: skip
    return "\n".join(f"{k:<34} {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--in-dim", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--retain", type=int, default=2)
    p.add_argument("--workers", type=int, default=4, help="inference threads")
    p.add_argument(
        "--chunk-mib", type=float, default=CHUNK_BYTES / 2**20, help="load staging chunk"
    )
    p.add_argument(
        "--gil-switch-interval-us",
        type=int,
        default=GIL_SWITCH_INTERVAL_US,
        help="sys.setswitchinterval, as the server's flag of that name sets it",
    )
    p.add_argument(
        "--quick-run-us",
        type=int,
        default=QUICK_RUN_US,
        help="the server's --quick-run-us: graph replays this quick run on the event loop",
    )
    p.add_argument(
        "--sample-memory-ms",
        type=float,
        default=0.0,
        help="poll torch.cuda.memory_allocated on the event loop while v2 loads (the "
        "bench's old way of finding the peak; 0: read the allocator's peak instead)",
    )
    p.add_argument("--steady-s", type=float, default=2.0, help="steady serving before the load")
    p.add_argument("--out", default="bench/results/gpu_swap.json")
    args = p.parse_args(argv)
    sys.setswitchinterval(args.gil_switch_interval_us / 1e6)
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        root = Path(tmp)
        write_versions(root, args)
        size = (root / "mlp" / "v1" / "model.onnx").stat().st_size / 2**20
        report = {"model_mib": round(size, 1), **asyncio.run(measure(args, root))}
    print(json.dumps(report, indent=2))
    print(table(report))
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
