"""Where a load shows in the serving version's tail: a timeline of one load of v2 beside
a serving v1 (the engine manager, no HTTP), with each step of the load timed and the
slowest requests placed on it. A thread ticking every 0.2 ms records every gap over 2 ms
(the GIL held, or the process's memory-map lock) beside them.

The load's steps are timed by wrapping them (reading and hashing, the weight walk, the
upload, warm-up and graph captures, letting the file's bytes go): a diagnostic, so it
reaches into the server's modules by name.

    python bench/load_timeline.py                       # torch on CUDA, 400 MiB, batch 32
    python bench/load_timeline.py --backend onnxruntime --hidden 1024
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from bench_support import publish_versions, write_json
from model_server.backends import make_backend
from model_server.backends.base import ModelFile
from model_server.config import GIL_SWITCH_INTERVAL_US
from model_server.lifecycle import load_pipeline
from model_server.lifecycle.engine_manager import EngineManager
from model_server.lifecycle.repository import ModelRepository
from model_server.observability.audit import AuditLog
from model_server.observability.metrics import ServerMetrics
from model_server.scheduling.runner import Runner

Step = tuple[str, float, float]  # (name, start, end), perf_counter seconds


def time_steps(steps: list[Step]) -> None:
    """Wrap the load's steps so that each call appends (name, start, end) to ``steps``."""

    def wrap(owner: Any, attr: str, name: str) -> None:
        inner: Callable[..., Any] = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                steps.append((name, started, time.perf_counter()))

        setattr(owner, attr, timed)

    wrap(load_pipeline.LoadPipeline, "_read_checked", "read and hash")
    wrap(load_pipeline, "warm_up", "warm-up")
    wrap(ModelFile, "release", "let the bytes go")
    try:
        from model_server.backends import onnx_weights, torch_backend

        wrap(onnx_weights, "load", "weight walk")
        wrap(torch_backend.TorchEngine, "_upload", "upload")
        wrap(torch_backend.TorchEngine, "_capture", "graph capture")
    except ImportError:  # no torch: the ONNX Runtime steps alone
        pass


def ticker(stop: threading.Event, gaps: list[tuple[float, float]]) -> None:
    last = time.perf_counter()
    while not stop.is_set():
        time.sleep(0.0002)
        now = time.perf_counter()
        if now - last > 0.002:
            gaps.append((last, now))
        last = now


async def timeline(args: argparse.Namespace, root: Path) -> dict:
    steps: list[Step] = []
    time_steps(steps)
    options = {"device": args.device} if args.backend == "torch" else {}
    backend = make_backend(args.backend, None, **options)
    threads = ThreadPoolExecutor(args.workers, thread_name_prefix="infer")
    manager = EngineManager(backend, ModelRepository(root), ServerMetrics(), AuditLog(), retain=2)
    runner = Runner(manager.metrics, manager.row_limits, executor=threads)
    manager.register("mlp")
    await manager.load("mlp", "v1")
    x = {"input": np.random.default_rng(0).standard_normal((args.batch, args.in_dim), np.float32)}
    for _ in range(20):
        await asyncio.gather(*(runner.infer(manager.slot("mlp"), x) for _ in range(args.workers)))
    requests: list[tuple[float, float]] = []
    stop = asyncio.Event()

    async def client() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            await runner.infer(manager.slot("mlp"), x)
            requests.append((started, time.perf_counter()))

    gaps: list[tuple[float, float]] = []
    stop_ticker = threading.Event()
    tick = threading.Thread(target=ticker, args=(stop_ticker, gaps), daemon=True)
    tick.start()
    clients = [asyncio.create_task(client()) for _ in range(args.clients)]
    await asyncio.sleep(args.steady_s)
    steps.clear()
    gaps.clear()
    steady_until = time.perf_counter()
    t0 = time.perf_counter()
    await manager.load("mlp", "v2")
    t1 = time.perf_counter()
    await asyncio.sleep(0.3)
    stop.set()
    await asyncio.gather(*clients)
    stop_ticker.set()
    manager.close()
    threads.shutdown()
    ms = lambda t: round((t - t0) * 1000, 2)  # noqa: E731
    steady = np.array([b - a for a, b in requests if a < steady_until]) * 1000
    during = [(a, b) for a, b in requests if t0 <= a < t1]
    lat = np.array([b - a for a, b in during]) * 1000
    slow = sorted(during, key=lambda r: r[0] - r[1])[: args.slowest]
    return {
        "backend": args.backend,
        "batch": args.batch,
        "clients": args.clients,
        "gil_switch_interval_us": args.gil_switch_interval_us,
        "load_ms": ms(t1),
        "steady_p50_ms": round(float(np.percentile(steady, 50)), 3),
        "steady_p99_ms": round(float(np.percentile(steady, 99)), 3),
        "during_p50_ms": round(float(np.percentile(lat, 50)), 3) if lat.size else None,
        "during_p99_ms": round(float(np.percentile(lat, 99)), 3) if lat.size else None,
        "requests_during": len(during),
        # (step, start ms, duration ms), relative to the load's start
        "steps": [(name, ms(a), round((b - a) * 1000, 2)) for name, a, b in steps],
        "gaps": [(ms(a), round((b - a) * 1000, 2)) for a, b in gaps if a >= t0 - 0.01],
        "slowest": [(ms(a), round((b - a) * 1000, 2)) for a, b in slow],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", default="torch", choices=["torch", "onnxruntime"])
    p.add_argument("--device", default="cuda", help="torch's device")
    p.add_argument("--in-dim", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--workers", type=int, default=4, help="inference threads")
    p.add_argument("--gil-switch-interval-us", type=int, default=GIL_SWITCH_INTERVAL_US)
    p.add_argument("--steady-s", type=float, default=2.0)
    p.add_argument("--slowest", type=int, default=12, help="requests listed")
    p.add_argument("--out", default="bench/results/load_timeline.json")
    args = p.parse_args(argv)
    sys.setswitchinterval(args.gil_switch_interval_us / 1e6)
    with tempfile.TemporaryDirectory(prefix="bench-timeline-") as tmp:
        root = Path(tmp)
        publish_versions(root, args.in_dim, args.hidden, args.depth, count=2)
        report = asyncio.run(timeline(args, root))
    report["host"] = platform.node()
    print(
        f"load of v2 beside v1: {report['load_ms']} ms; p50 / p99 steady "
        f"{report['steady_p50_ms']} / {report['steady_p99_ms']} ms, while loading "
        f"{report['during_p50_ms']} / {report['during_p99_ms']} ms"
    )
    print(f"\n{'step':<18} {'from ms':>9} {'took ms':>9}")
    for name, start, took in report["steps"]:
        print(f"{name:<18} {start:>9} {took:>9}")
    print(f"\n{'gap of the ticker at ms':<24} {'gap ms':>8}")
    for start, took in report["gaps"]:
        print(f"{start:<24} {took:>8}")
    print(f"\n{'slow request from ms':<21} {'took ms':>8}")
    for start, took in report["slowest"]:
        print(f"{start:<21} {took:>8}")
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
