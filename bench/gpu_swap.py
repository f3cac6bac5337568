"""Double buffering on a GPU: the engine manager with the torch backend (weights in
device memory), no HTTP in the way.

Measures inference latency while serving, the time to load + warm up a new version beside
the old one, the instant rollback, and device memory before, during (two copies) and after
the old version is released when its last request finishes. The figure that matters is
p99 while v2 loads against the steady p99 (their ratio is printed): a load copies on its
own stream, through pinned chunks, so it should not show in the serving version's tail.

One load gives a p99 from its window's slowest few dozen requests, so one stall moves it:
``--loads N`` loads N new versions in turn (v2, v3, ...; each beside the serving one and,
from the second on, the retained one, the oldest released once it drains, as a rollout
forward does), each after a steady window of
its own, and pools the windows (each load's own ratio is kept too). The half second after
each swap, while the version it pushed out is released, is its own window.

    python bench/gpu_swap.py                          # 400 MiB MLP, 4 clients, batch 32
    python bench/gpu_swap.py --clients 16 --batch 1   # needs torch with CUDA
    python bench/gpu_swap.py --clients 16 --batch 1 --loads 5

After the table it prints each stage of the loads (read, hash, parse, upload, bind,
warm_up, release, swap, other: the server's own timing, medians over the loads) beside
the limits for the file's size: its read from the page cache, its sha256, and its copy
to the GPU from pinned and from pageable memory.
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

from bench_support import (
    add_load_flags,
    physical_limits,
    print_stages,
    publish_versions,
    write_json,
)
from model_server.backends.torch_backend import TorchBackend
from model_server.backends.torch_gpu import CHUNK_BYTES
from model_server.config import GIL_SWITCH_INTERVAL_US, QUICK_RUN_US
from model_server.files import chunk_verifier
from model_server.files.spare_copies import SpareCopies
from model_server.lifecycle.engine_manager import EngineManager
from model_server.lifecycle.repository import ModelRepository
from model_server.observability.audit import AuditLog
from model_server.observability.metrics import ServerMetrics
from model_server.scheduling.runner import Runner


def p50(latencies_s: list[float]) -> float | None:
    return _percentile_ms(latencies_s, 50)


def p99(latencies_s: list[float]) -> float | None:
    return _percentile_ms(latencies_s, 99)


def peak_ms(latencies_s: list[float]) -> float | None:
    return round(max(latencies_s) * 1000, 3) if latencies_s else None


def ratio(window_s: list[float], steady_s: list[float]) -> float | None:
    """p99 of ``window_s`` over that of ``steady_s``; None where either is empty."""
    top, bottom = p99(window_s), p99(steady_s)
    return round(top / bottom, 2) if top is not None and bottom else None


def _percentile_ms(latencies_s: list[float], q: float) -> float | None:
    if not latencies_s:
        return None
    return round(float(np.percentile(np.array(latencies_s) * 1000, q)), 3)


async def measure(args: argparse.Namespace, root: Path) -> dict:
    import torch

    backend = TorchBackend(
        "cuda", chunk_bytes=int(args.staging_chunk_mib * 2**20), pin_copies=args.pin_private_copies
    )
    threads = ThreadPoolExecutor(args.workers, thread_name_prefix="infer")
    manager = EngineManager(
        backend,
        ModelRepository(root, SpareCopies(args.spare_copy_mb * 2**20)),
        ServerMetrics(),
        AuditLog(),
        retain=args.retain,
    )
    runner = Runner(
        manager.metrics, manager.row_limits, executor=threads, quick_run_s=args.quick_run_us / 1e6
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
        "hash_threads": chunk_verifier.WORKERS,
        "staging_chunk_mib": args.staging_chunk_mib,
        "gil_switch_interval_us": args.gil_switch_interval_us,
        "quick_run_us": args.quick_run_us,
        "sample_memory_ms": args.sample_memory_ms,
        "steady_s": args.steady_s,
        "after_s": args.after_s,
        "load_count": args.loads,
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
        await asyncio.gather(*(runner.infer(manager.slot("mlp"), x) for _ in range(args.workers)))
    latencies: list[float] = []

    async def client(stop: asyncio.Event) -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            await runner.infer(manager.slot("mlp"), x)
            latencies.append(time.perf_counter() - t0)
            await asyncio.sleep(0)  # a quick run answers without yielding: let others in

    stop = asyncio.Event()
    clients = [asyncio.create_task(client(stop)) for _ in range(args.clients)]
    samples = 0

    async def sample_memory(until: asyncio.Event, every_s: float) -> None:
        """The old way of finding the peak, kept to show what it cost: each call takes
        the caching allocator's lock with the GIL held, so a poll that lands while the
        load's thread allocates weights stalls the event loop, and every client. Polls
        only while a version loads, so the steady windows stay free of them."""
        nonlocal samples
        while not until.is_set():
            torch.cuda.memory_allocated()
            samples += 1
            await asyncio.sleep(every_s)

    steady: list[float] = []
    during: list[float] = []
    after: list[float] = []
    loads: list[dict] = []
    for n in range(2, args.loads + 2):
        mark = len(latencies)
        await asyncio.sleep(args.steady_s)
        steady_n = latencies[mark:]
        torch.cuda.reset_peak_memory_stats()  # the peak of this load's copies, unpolled
        mark = len(latencies)
        loaded = asyncio.Event()
        sampler = (
            asyncio.create_task(sample_memory(loaded, args.sample_memory_ms / 1000))
            if args.sample_memory_ms > 0
            else None
        )
        swap = await manager.load("mlp", f"v{n}")
        loaded.set()
        during_n = latencies[mark:]
        if sampler is not None:
            await sampler
        mark = len(latencies)
        await asyncio.sleep(args.after_s)  # the pushed-out version is released meanwhile
        after_n = latencies[mark:]
        steady += steady_n
        during += during_n
        after += after_n
        loads.append(
            {
                "version": f"v{n}",
                "load_warmup_ms": round(swap.duration_s * 1000, 2),
                # the server's own timing of each stage (load_stages), adding up to it
                "stages_ms": {k: round(v * 1000, 3) for k, v in swap.stages_s.items()},
                "peak_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1),
                "steady_p99": p99(steady_n),
                "during_p99": p99(during_n),
                "after_p99": p99(after_n),
                "p99_during_over_steady": ratio(during_n, steady_n),
                "requests": {"steady": len(steady_n), "during": len(during_n)},
            }
        )
    report["loads"] = loads
    report["swap_load_warmup_ms"] = loads[0]["load_warmup_ms"]
    report["memory_polls"] = samples
    report["memory_mib"]["both_loaded_peak"] = loads[0]["peak_mib"]
    report["weights_mib"]["after_loads"] = weights()
    back = await manager.rollback("mlp")
    report["rollback_ms"] = round(back.duration_s * 1000, 3)
    stop.set()
    await asyncio.gather(*clients)
    last = f"v{args.loads + 1}"
    manager.slot("mlp").retain = 1
    await manager.load("mlp", last)  # retain 1: the rolled-back-to one goes once drained
    torch.cuda.synchronize()
    report["memory_mib"]["after_release"] = mib()
    report["memory_mib"]["reserved_after_release"] = round(torch.cuda.memory_reserved() / 2**20, 1)
    report["weights_mib"]["after_release"] = weights()
    report["closed_versions"] = list(manager.slot("mlp").closed_versions)
    report["latency_ms"] = {
        "steady_p50": p50(steady),
        "steady_p99": p99(steady),
        "steady_max": peak_ms(steady),
        "during_swap_p50": p50(during),
        "during_swap_p99": p99(during),
        "during_swap_max": peak_ms(during),
        "after_swap_p99": p99(after),
    }
    report["p99_during_over_steady"] = ratio(during, steady)
    report["p99_after_over_steady"] = ratio(after, steady)
    report["requests"] = {
        "steady": len(steady),
        "during_swap": len(during),
        "after_swap": len(after),
        "all": len(latencies),
    }
    manager.close()
    threads.shutdown()
    return report


def table(report: dict) -> str:
    lat = report["latency_ms"]
    rows = [
        ("model", f"{report['model_mib']} MiB, batch {report['batch']}, "
         f"{report['clients']} clients, {report['workers']} threads"),
        ("first load + warm-up beside v1", f"{report['swap_load_warmup_ms']} ms"),
        ("rollback to the retained version", f"{report['rollback_ms']} ms"),
        ("p50 / p99 steady", f"{lat['steady_p50']} / {lat['steady_p99']} ms"),
        ("p50 / p99 while loading", f"{lat['during_swap_p50']} / {lat['during_swap_p99']} ms"),
        ("p99 while loading / steady", f"{report['p99_during_over_steady']}x"),
        ("p99 after the swap / steady", f"{report['p99_after_over_steady']}x"),
        ("each load's p99 ratio", ", ".join(
            f"{load['p99_during_over_steady']}x" for load in report["loads"])),
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
        "--staging-chunk-mib",
        type=float,
        default=CHUNK_BYTES / 2**20,
        help="the pinned chunks a load is staged through on its way to the GPU",
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
        help="poll torch.cuda.memory_allocated on the event loop while each version loads (the "
        "bench's old way of finding the peak; 0: read the allocator's peak instead)",
    )
    add_load_flags(p)
    p.add_argument(
        "--hash-threads",
        type=int,
        default=chunk_verifier.WORKERS,
        help="threads that check a load's chunk digests (the server's: one core less than "
        "the machine's, at most 4); fewer leave more of the GIL to serving",
    )
    p.add_argument("--steady-s", type=float, default=2.0, help="steady serving before each load")
    p.add_argument(
        "--after-s",
        type=float,
        default=0.5,
        help="the window after each swap, while the version it pushed out is released",
    )
    p.add_argument(
        "--loads",
        type=int,
        default=1,
        help="versions loaded in turn, their windows pooled (one load's p99 rests on its "
        "slowest few dozen requests)",
    )
    p.add_argument("--out", default="bench/results/gpu_swap.json")
    args = p.parse_args(argv)
    if args.loads < 1:
        p.error("--loads must be at least 1")
    sys.setswitchinterval(args.gil_switch_interval_us / 1e6)
    chunk_verifier.WORKERS = args.hash_threads  # read at each load
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        root = Path(tmp)
        chunk = args.digest_chunk_mib * 2**20 or None
        publish_versions(
            root, args.in_dim, args.hidden, args.depth, count=args.loads + 1, chunk_size=chunk
        )
        model = root / "mlp" / "v1" / "model.onnx"
        size = model.stat().st_size / 2**20
        limits = physical_limits(model, "cuda")  # before the loads: nothing else runs
        report = {"model_mib": round(size, 1), **asyncio.run(measure(args, root))}
        report["limits"] = limits
    print(json.dumps(report, indent=2))
    print(table(report))
    report["stages_ms_median"] = print_stages(
        f"each load's stages ({args.loads} loads; the server's own timing)",
        [load["stages_ms"] for load in report["loads"]],
        limits,
    )
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
