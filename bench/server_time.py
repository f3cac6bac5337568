"""The server's own time per request under N closed-loop clients, over KServe v2 JSON and
the binary tensor extension: the mean of the server's
``model_server_inference_request_duration_seconds`` (from its first byte handled to its
answer) beside the clients' latency.

At N clients a server that finishes R requests a second holds each one about N / R
seconds (Little's law), so this figure is the server's throughput seen from one request:
it drops only as the work per request (event loop, decoding, engine, metrics) drops.

    python bench/server_time.py --backend torch --clients 1,16 --protocols json,binary
    python bench/server_time.py --backend torch --batching off,16:0,16:500

``--servers K`` starts K independent servers (clients spread over their ports);
``--processes K`` starts each server as one of K processes behind one port (the server's
``--processes``: the kernel spreads the connections, /metrics is the pool's).

``--client-processes P`` spreads the clients over P processes: one asyncio client process
tops out near 6000 requests a second, less than several server processes answer.

``--batching`` takes modes, each ``off`` or ``ROWS:DELAY_US`` (the server's
``--max-batch-size`` and ``--max-queue-delay-us``); each mode gets a server of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import platform
import sys
import tempfile
import time
import urllib.request
from multiprocessing.connection import Connection
from pathlib import Path

import aiohttp
import numpy as np

from bench_support import DEPTH, SIZES, batch_histogram, publish_sized, server_seconds, write_json
from model_rollout_e2e.processes import ServerProcess, wait_until
from model_server.config import QUICK_RUN_US

MODEL = "mlp"


def batching_flags(mode: str) -> list[str]:
    """The server's batching arguments for one ``--batching`` mode: off or ROWS:DELAY_US."""
    if mode == "off":
        return ["--max-batch-size", "0"]
    rows, sep, delay = mode.partition(":")
    if not (sep and rows.isdigit() and delay.isdigit() and int(rows) > 0):
        raise argparse.ArgumentTypeError(f"batching mode {mode!r}: expected off or ROWS:DELAY_US")
    return ["--max-batch-size", rows, "--max-queue-delay-us", delay, "--batch-model", MODEL]


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


async def client_loops(
    urls: list[str], protocol: str, in_dim: int, clients: int, until: float
) -> tuple[list[tuple[float, float, int]], str | None]:
    """``clients`` closed-loop clients until wall-clock ``until``, client i on server
    ``i % len(urls)``: each answer's (wall-clock end, latency, status) and the first
    error's text."""
    body, headers = request(protocol, in_dim)
    samples: list[tuple[float, float, int]] = []
    first_error: list[str] = []

    async def client(session: aiohttp.ClientSession, url: str) -> None:
        while time.time() < until:
            t = time.perf_counter()
            async with session.post(
                f"{url}/v2/models/{MODEL}/infer", data=body, headers=headers
            ) as response:
                answer = await response.read()
                if response.status != 200 and not first_error:
                    first_error.append(f"{response.status} {answer[:300]!r}")
                samples.append((time.time(), time.perf_counter() - t, response.status))

    connector = aiohttp.TCPConnector(limit=clients * 2)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(client(session, urls[i % len(urls)]) for i in range(clients)))
    return samples, first_error[0] if first_error else None


def client_process(
    urls: list[str], protocol: str, in_dim: int, clients: int, until: float, out: Connection
) -> None:
    """One client process: its share of the clients; the samples go back over ``out``."""
    out.send(asyncio.run(client_loops(urls, protocol, in_dim, clients, until)))
    out.close()


def shares(clients: int, processes: int) -> list[int]:
    """``clients`` spread over at most ``processes`` client processes, none empty."""
    processes = max(1, min(processes, clients))
    return [clients // processes + (i < clients % processes) for i in range(processes)]


def measure(
    urls: list[str],
    protocol: str,
    in_dim: int,
    clients: int,
    seconds: float,
    client_processes: int = 1,
) -> dict:
    """``clients`` closed-loop clients spread over ``client_processes`` processes (one
    asyncio process tops out near 6000 requests a second, under what several servers
    answer), measured over one wall-clock window after a second of warm-up."""
    spawn = multiprocessing.get_context("spawn")
    warm_s, start = 1.0, time.time() + 2.0  # the processes' start-up comes first
    t0, t1 = start + warm_s, start + warm_s + seconds
    workers = []
    for n in shares(clients, client_processes):
        # each process's clients take servers in turn from a different one
        offset = sum(w[2] for w in workers)
        mine = [urls[(offset + i) % len(urls)] for i in range(len(urls))]
        receive, send = spawn.Pipe(duplex=False)
        proc = spawn.Process(
            target=client_process, args=(mine, protocol, in_dim, n, t1 + 0.2, send)
        )
        proc.start()
        workers.append((proc, receive, n))
    time.sleep(max(0.0, t0 - time.time()))
    before, runs0 = server_total(urls), batches_total(urls)
    time.sleep(max(0.0, t1 - time.time()))
    after, runs1 = server_total(urls), batches_total(urls)
    samples: list[tuple[float, float, int]] = []
    errors: list[str] = []
    for proc, receive, _ in workers:
        got, error = receive.recv()
        proc.join()
        samples.extend(got)
        errors.extend([error] if error else [])
    window = [(lat, status) for at, lat, status in samples if t0 <= at < t1]
    ok = np.array([lat for lat, status in window if status == 200]) * 1000
    count = after[1] - before[1]
    runs, rows = runs1[0] - runs0[0], runs1[1] - runs0[1]
    return {
        "protocol": protocol,
        "clients": clients,
        "client_processes": len(workers),
        "requests": len(window),
        "errors": sum(1 for _, status in window if status != 200),
        "per_second": round(len(window) / seconds),
        "client_p50_ms": round(float(np.percentile(ok, 50)), 3) if ok.size else None,
        "client_p99_ms": round(float(np.percentile(ok, 99)), 3) if ok.size else None,
        "server_mean_ms": round((after[0] - before[0]) / count * 1000, 3) if count else None,
        "rows_per_run": round(rows / runs, 2) if runs > 0 else None,
        "first_error": errors[0] if errors else None,
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
                "--quick-run-us",
                str(args.quick_run_us),
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
                **measure(
                    urls, protocol, SIZES[args.size][0], n, args.seconds, args.client_processes
                ),
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
    p.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="processes the clients are spread over (one asyncio process: ~6000 req/s)",
    )
    p.add_argument(
        "--quick-run-us",
        type=int,
        default=QUICK_RUN_US,
        help="the server's --quick-run-us (0: every engine run on an inference thread)",
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
        publish_sized(work / "repo", MODEL, "v1", 1, args.size)
        rows = [row for mode in args.batching for row in run_mode(work, args, mode)]
    print(
        f"\n{DEPTH}-layer MLP ({args.size}), batch 1, backend {args.backend}, "
        f"{args.servers} server(s) of {args.processes} process(es) of {args.workers} "
        f"inference threads, quick runs up to {args.quick_run_us} us, "
        f"clients in {args.client_processes} process(es), "
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
    report = {
        "backend": args.backend,
        "size": args.size,
        "workers": args.workers,
        "servers": args.servers,
        "processes": args.processes,
        "client_processes": args.client_processes,
        "quick_run_us": args.quick_run_us,
        "seconds_per_case": args.seconds,
        "host": platform.node(),
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": rows,
    }
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
