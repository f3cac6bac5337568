"""The server's own time per request under N closed-loop clients, over KServe v2 JSON and
the binary tensor extension: the mean of the server's ``inference_request_duration_seconds``
(from its first byte handled to its answer) beside the clients' latency.

At N clients a server that finishes R requests a second holds each one about N / R
seconds (Little's law), so this figure is the server's throughput seen from one request:
it drops only as the work per request (event loop, decoding, engine, metrics) drops.

    python bench/server_time.py --backend torch --clients 1,16 --protocols json,binary
    python bench/server_time.py --backend torch --batching off,16:0,16:500

``--servers K`` starts K independent servers (clients spread over their ports);
``--processes K`` starts each server as one of K processes behind one port (the server's
``--processes``: the kernel spreads the connections, /metrics is the pool's).

``--batching`` takes modes, each ``off`` or ``ROWS:DELAY_US`` (the server's
``--max-batch-size`` and ``--max-queue-delay-us``); each mode gets a server of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import numpy as np

from batching import batch_histogram
from model_rollout_e2e.processes import ServerProcess, wait_until
from swap_under_load import DEPTH, SIZES, publish, server_seconds

MODEL = "mlp"


def batching_flags(mode: str) -> list[str]:
    """The server's batching arguments for one ``--batching`` mode: off or ROWS:DELAY_US."""
    if mode == "off":
        return ["--max-batch-size", "0"]
    rows, sep, delay = mode.partition(":")
    if not (sep and rows.isdigit() and delay.isdigit() and int(rows) > 0):
        raise argparse.ArgumentTypeError(f"batching mode {mode!r}: expected off or ROWS:DELAY_US")
    return ["--max-batch-size", rows, "--max-queue-delay-us", delay]


def batching_modes(text: str) -> list[str]:
    modes = [part.strip() for part in text.split(",") if part.strip()]
    for mode in modes:
        batching_flags(mode)  # refuse a bad mode before any server starts
    return modes


def request(protocol: str, in_dim: int) -> tuple[bytes, dict[str, str]]:
    """One batch-1 request body and its headers."""
    x = np.ones((1, in_dim), np.float32)
    tensor = {"name": "input", "shape": [1, in_dim], "datatype": "FP32"}
    if protocol == "json":
        body = json.dumps({"inputs": [{**tensor, "data": x.ravel().tolist()}]}).encode()
        return body, {"Content-Type": "application/json"}
    header = json.dumps(
        {
            "inputs": [{**tensor, "parameters": {"binary_data_size": x.nbytes}}],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    return header + x.tobytes(), {
        "Inference-Header-Content-Length": str(len(header)),
        "Content-Type": "application/octet-stream",
    }


def server_total(urls: list[str]) -> tuple[float, float]:
    """(sum, count) of the request-duration histograms of every server, added up."""
    parts = [server_seconds(url, MODEL) for url in urls]
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


def batches_total(urls: list[str]) -> tuple[float, float]:
    parts = [batch_histogram(url) for url in urls]
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


async def measure(
    urls: list[str], protocol: str, in_dim: int, clients: int, seconds: float
) -> dict:
    """``clients`` closed-loop clients, client i on server ``i % len(urls)``."""
    body, headers = request(protocol, in_dim)
    samples: list[tuple[float, float, int]] = []  # (when, latency, status)
    start = time.monotonic()
    stop = asyncio.Event()
    first_error: list[str] = []

    async def client(session: aiohttp.ClientSession, url: str) -> None:
        while not stop.is_set():
            t = time.perf_counter()
            async with session.post(
                f"{url}/v2/models/{MODEL}/infer", data=body, headers=headers
            ) as response:
                answer = await response.read()
                if response.status != 200 and not first_error:
                    first_error.append(f"{response.status} {answer[:300]!r}")
                samples.append((time.monotonic() - start, time.perf_counter() - t, response.status))

    connector = aiohttp.TCPConnector(limit=clients * 2)
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks = [asyncio.create_task(client(session, urls[i % len(urls)])) for i in range(clients)]
        await asyncio.sleep(1.0)  # warm: every inference thread has run
        before = await asyncio.to_thread(server_total, urls)
        runs0, rows0 = await asyncio.to_thread(batches_total, urls)
        t0 = time.monotonic() - start
        await asyncio.sleep(seconds)
        after = await asyncio.to_thread(server_total, urls)
        runs1, rows1 = await asyncio.to_thread(batches_total, urls)
        t1 = time.monotonic() - start
        stop.set()
        await asyncio.gather(*tasks)
    window = [(lat, status) for at, lat, status in samples if t0 <= at < t1]
    ok = np.array([lat for lat, status in window if status == 200]) * 1000
    count = after[1] - before[1]
    return {
        "protocol": protocol,
        "clients": clients,
        "requests": len(window),
        "errors": sum(1 for _, status in window if status != 200),
        "per_second": round(len(window) / (t1 - t0)),
        "client_p50_ms": round(float(np.percentile(ok, 50)), 3) if ok.size else None,
        "client_p99_ms": round(float(np.percentile(ok, 99)), 3) if ok.size else None,
        "server_mean_ms": round((after[0] - before[0]) / count * 1000, 3) if count else None,
        "rows_per_run": round((rows1 - rows0) / (runs1 - runs0), 2) if runs1 > runs0 else None,
        "first_error": first_error[0] if first_error else None,
    }


def run_mode(work: Path, args: argparse.Namespace, mode: str) -> list[dict]:
    """Every protocol and client count against ``--servers`` servers (one process each, all
    on the same device) started with ``mode``'s batching."""
    servers = [
        ServerProcess(
            work / "repo",
            [f"{MODEL}=v1"],
            work / f"server-{mode.replace(':', '-')}-{i}.log",
            extra=[
                "--backend",
                args.backend,
                "--workers",
                str(args.workers),
                "--processes",
                str(args.processes),
                *batching_flags(mode),
            ],
        ).start()
        for i in range(args.servers)
    ]
    try:
        for server in servers:
            server.wait_ready(120)
            if args.processes > 1:  # ready once every process answers the pool's scrape
                wait_until(
                    lambda url=server.url: (
                        "model_server_pool_workers_unanswered 0.0"
                        in urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
                    ),
                    120,
                    what="every process of the server",
                )
        urls = [server.url for server in servers]
        rows = [
            {
                "batching": mode,
                "servers": args.servers,
                "processes": args.processes,
                **asyncio.run(measure(urls, protocol, SIZES[args.size][0], n, args.seconds)),
            }
            for protocol in args.protocols.split(",")
            for n in (int(c) for c in args.clients.split(","))
        ]
        if any(r["errors"] or r["client_p50_ms"] is None for r in rows):
            print(f"batching {mode}: failed requests; server log:\n{servers[0].log_tail()}")
        return rows
    finally:
        for server in servers:
            server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", default="onnxruntime", choices=["onnxruntime", "torch", "tensorrt"])
    p.add_argument("--size", default="small", choices=sorted(SIZES))
    p.add_argument("--clients", default="1,16", help="comma-separated client counts")
    p.add_argument("--protocols", default="json,binary", help="json, binary or both")
    p.add_argument("--workers", type=int, default=4, help="the server's inference threads")
    p.add_argument(
        "--servers", type=int, default=1, help="server processes, clients spread over them"
    )
    p.add_argument(
        "--processes",
        type=int,
        default=1,
        help="processes of each server behind its one port (the server's --processes)",
    )
    p.add_argument("--seconds", type=float, default=3.0, help="measured per case")
    p.add_argument(
        "--batching",
        type=batching_modes,
        default=["off"],
        help="server batching modes, each off or ROWS:DELAY_US, e.g. off,16:0,16:500",
    )
    p.add_argument("--out", default="bench/results/server_time.json")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-server-time-") as tmp:
        work = Path(tmp)
        publish(work / "repo", MODEL, "v1", 1, args.size)
        rows = [row for mode in args.batching for row in run_mode(work, args, mode)]
    print(
        f"\n{DEPTH}-layer MLP ({args.size}), batch 1, backend {args.backend}, "
        f"{args.servers} server(s) of {args.processes} process(es) of {args.workers} "
        "inference threads, "
        f"{args.seconds:g} s per case, host {platform.node()}"
    )
    print(
        f"{'batching':<10} {'protocol':<8} {'clients':>7} {'req/s':>7} {'errors':>7} "
        f"{'p50 ms':>8} {'p99 ms':>8} {'server ms':>10} {'rows/run':>8}"
    )
    for r in rows:
        cells = [r[k] for k in ("client_p50_ms", "client_p99_ms", "server_mean_ms")]
        p50, p99, server_ms = ("-" if c is None else c for c in cells)
        print(
            f"{r['batching']:<10} {r['protocol']:<8} {r['clients']:>7} {r['per_second']:>7} "
            f"{r['errors']:>7} {p50:>8} {p99:>8} {server_ms:>10} {r['rows_per_run'] or '-':>8}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "backend": args.backend,
        "size": args.size,
        "workers": args.workers,
        "servers": args.servers,
        "processes": args.processes,
        "seconds_per_case": args.seconds,
        "host": platform.node(),
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": rows,
    }
    out.write_text(json.dumps(report, indent=2))
    print(f"json: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
