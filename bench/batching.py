"""Dynamic batching: throughput and latency at 1, 16 and 64 clients, with and without.

Starts a real server process per mode (batching off; on, with ``--max-batch-size`` and
each ``--delays-us``), drives it with the closed-loop load generator (each client sends
one 1-row request at a time), and reads the server's ``model_server_inference_batch_rows`` histogram
to report the rows per engine run. Prints a table and writes JSON.

    python bench/batching.py                                  # ONNX Runtime, this CPU
    python bench/batching.py --backend torch --out bench/results/h200/batching_torch.json

The default model is an MLP wide enough (64 -> 2048 x 3 -> 16, 33 MiB) that its engine
time, not HTTP, sets the pace of a batch-1 request on a CPU: the regime in which
batching pays (a matrix-vector product per request becomes one matrix-matrix product).
With ``--max-queue-delay-us 0`` a batch forms only from what queued while every one of
the version's inference threads (``--workers``) was busy; a delay lets batches fill.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_support import batch_histogram, publish_versions, write_json
from model_rollout_e2e.loadgen import LoadGenerator, LoadResult
from model_rollout_e2e.processes import ServerProcess


async def point(url: str, args: argparse.Namespace, clients: int) -> dict[str, Any]:
    """One closed-loop run of ``clients`` clients for ``args.seconds``."""
    runs0, rows0 = await asyncio.to_thread(batch_histogram, url)
    gen = LoadGenerator([url], "mlp", args.in_dim, concurrency=clients, timeout_s=60)
    gen.start_clock()
    result = await gen.run(args.seconds)
    runs1, rows1 = await asyncio.to_thread(batch_histogram, url)
    elapsed = max(s.started + s.latency_s for s in result.samples) if result.samples else 0
    summary = LoadResult.summary(result.samples)
    ok = summary["requests"] - summary["errors"]  # type: ignore[operator]
    return {
        "clients": clients,
        **summary,
        "throughput_rps": round(ok / elapsed, 1) if elapsed else 0.0,
        "rows_per_run": round((rows1 - rows0) / (runs1 - runs0), 2) if runs1 > runs0 else None,
    }


async def measure(work: Path, args: argparse.Namespace, name: str, flags: list[str]) -> dict:
    srv = ServerProcess(
        work / "repo",
        ["mlp=v1"],
        work / f"{name}.log",
        extra=[
            "--backend",
            args.backend,
            "--cache-dir",
            str(work / "cache"),
            "--workers",
            str(args.workers),
            *flags,
        ],
    ).start()
    try:
        srv.wait_ready(args.ready_timeout)
        warm = LoadGenerator([srv.url], "mlp", args.in_dim, concurrency=max(args.clients))
        await warm.run(args.warmup_seconds)  # threads, arenas and connections warmed up
        points = [await point(srv.url, args, clients) for clients in args.clients]
    finally:
        srv.stop()
    return {"mode": name, "flags": flags, "points": points}


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", default="onnxruntime", choices=["onnxruntime", "torch", "tensorrt"])
    p.add_argument("--seconds", type=float, default=5.0, help="load per client count")
    p.add_argument("--warmup-seconds", type=float, default=1.0)
    p.add_argument("--clients", type=_ints, default=[1, 16, 64], help="e.g. 1,16,64")
    p.add_argument("--workers", type=int, default=4, help="the server's inference threads")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument(
        "--delays-us", type=_ints, default=[0, 2000], help="queue delays to measure, e.g. 0,2000"
    )
    p.add_argument("--in-dim", type=int, default=64)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--ready-timeout", type=float, default=120)
    p.add_argument("--out", default="bench/results/batching.json")
    args = p.parse_args(argv)
    modes: list[tuple[str, list[str]]] = [("off", ["--max-batch-size", "0"])]
    modes += [
        (
            f"batch {args.max_batch_size}, delay {delay} us",
            [
                "--max-batch-size",
                str(args.max_batch_size),
                "--max-queue-delay-us",
                str(delay),
                "--batch-model",
                "mlp",
            ],
        )
        for delay in args.delays_us
    ]
    with tempfile.TemporaryDirectory(prefix="bench-batching-") as tmp:
        work = Path(tmp)
        model = publish_versions(work / "repo", args.in_dim, args.hidden, args.depth)
        model_mib = model.stat().st_size / 2**20
        results = [asyncio.run(measure(work, args, name, flags)) for name, flags in modes]
    print(
        f"\nmodel: {args.depth}-layer MLP {args.in_dim}->{args.hidden}->16, {model_mib:.1f} MiB, "
        f"backend {args.backend}, {args.workers} inference threads, {args.seconds:g} s per "
        f"point, host {platform.node()}"
    )
    columns = ("clients", "requests", "errors", "req/s", "p50 ms", "p99 ms", "rows/run")
    header = f"{'batching':<26} " + " ".join(f"{c:>8}" for c in columns)
    print(header)
    print("-" * len(header))
    for mode in results:
        for pt in mode["points"]:
            print(
                f"{mode['mode']:<26} {pt['clients']:>8} {pt['requests']:>8} {pt['errors']:>8} "
                f"{pt['throughput_rps']:>8} {pt['p50_ms'] or '-':>8} {pt['p99_ms'] or '-':>8} "
                f"{pt['rows_per_run'] or '-':>8}"
            )
    report = {
        "backend": args.backend,
        "model": {
            "in_dim": args.in_dim,
            "hidden": args.hidden,
            "depth": args.depth,
            "mib": round(model_mib, 2),
        },
        "workers": args.workers,
        "seconds_per_point": args.seconds,
        "host": platform.node(),
        "python": sys.version.split()[0],
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "modes": results,
    }
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
