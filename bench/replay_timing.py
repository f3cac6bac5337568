"""How three ways of timing a CUDA graph's replay read on a busy host: whether quick
runs (``--quick-run-us``) can be decided from the GPU's time of a replay. Needs torch
with CUDA.

Each variant replays a batch-1 MLP's graph from pinned host buffers, with two timing
events, and reads the events' span once the stream is synchronized:

* ``around``: events, copies in and out queued around the graph's launch (five torch
  calls, each a trip back for the GIL), the torch backend's fallback;
* ``copies_in_graph``: the copies captured in the graph, the events around its launch;
* ``whole_graph``: copies and events (``external``) captured in the graph, as the torch
  backend captures where the runtime allows it.

Idle, all three read the GPU's time. With ``--threads`` replaying threads and
``--busy-threads`` threads running Python, a thread's waits for the GIL between the two
records count in the span, except in ``whole_graph``, where there is no host step
between them.

    python bench/replay_timing.py --threads 16 --busy-threads 2
"""

from __future__ import annotations

import argparse
import itertools
import platform
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bench_support import write_json

VARIANTS = ("around", "copies_in_graph", "whole_graph")
Replay = Callable[[np.ndarray], tuple[np.ndarray, float]]


def make_replay(torch: Any, variant: str, weights: list[Any]) -> Replay:
    """A captured replay of ``variant`` on a stream of its own (as each inference thread
    has): returns the outputs and the events' span (s)."""
    stream = torch.cuda.Stream(priority=-1)
    in_dim, out_dim = weights[0].shape[0], weights[-1].shape[1]
    host_in = torch.empty(1, in_dim, pin_memory=True)
    host_out = torch.empty(1, out_dim, pin_memory=True)
    device_in = torch.empty(1, in_dim, device="cuda")

    def mlp(x: Any) -> Any:
        for w in weights:
            x = torch.relu(x @ w)
        return x

    with torch.cuda.stream(stream):
        mlp(device_in)  # kernels chosen and workspaces allocated before the capture
    stream.synchronize()
    copies_inside = variant != "around"
    events_inside = variant == "whole_graph"
    started, finished = (
        torch.cuda.Event(enable_timing=True, external=events_inside) for _ in range(2)
    )
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            if events_inside:
                started.record(stream)
            if copies_inside:
                device_in.copy_(host_in, non_blocking=True)
            device_out = mlp(device_in)
            if copies_inside:
                host_out.copy_(device_out, non_blocking=True)
            if events_inside:
                finished.record(stream)
        finally:
            graph.capture_end()

    def replay(x: np.ndarray) -> tuple[np.ndarray, float]:
        host_in.numpy()[...] = x
        with torch.cuda.stream(stream):
            if not events_inside:
                started.record(stream)
            if not copies_inside:
                device_in.copy_(host_in, non_blocking=True)
            graph.replay()
            if not copies_inside:
                host_out.copy_(device_out, non_blocking=True)
            if not events_inside:
                finished.record(stream)
            stream.synchronize()
        return host_out.numpy().copy(), started.elapsed_time(finished) / 1000

    return replay


def busy(stop: threading.Event) -> None:
    """Python bytecode, as a loaded server's event loop and codecs run it."""
    n = 0
    while not stop.is_set():
        n += 1


def contend(replays: list[Replay], x: np.ndarray, busy_threads: int, seconds: float) -> dict:
    """Every replay on its own thread for ``seconds``, beside ``busy_threads``. (No
    inference mode: it is per thread, and its tensors could not be copied into on the
    others.)"""
    stop = threading.Event()
    spans: list[float] = []
    hosts: list[float] = []
    lock = threading.Lock()

    def worker(replay: Replay) -> None:
        while not stop.is_set():
            t = time.perf_counter()
            _, span = replay(x)
            took = time.perf_counter() - t
            with lock:
                spans.append(span)
                hosts.append(took)

    threads = [threading.Thread(target=busy, args=(stop,)) for _ in range(busy_threads)]
    threads += [threading.Thread(target=worker, args=(r,)) for r in replays]
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    if not spans:
        raise RuntimeError("no replay finished: see the threads' errors above")
    us = lambda values, q: round(float(np.percentile(values, q)) * 1e6, 1)  # noqa: E731
    return {
        "replays_per_s": round(len(spans) / seconds, 1),
        "span_p25_us": us(spans, 25),
        "span_p50_us": us(spans, 50),
        "span_p90_us": us(spans, 90),
        "host_p50_us": us(hosts, 50),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--in-dim", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--threads", type=int, default=16, help="replaying threads")
    p.add_argument("--busy-threads", type=int, default=2, help="threads running Python")
    p.add_argument("--seconds", type=float, default=2.0, help="per variant")
    p.add_argument("--out", default="bench/results/replay_timing.json")
    args = p.parse_args(argv)
    import torch

    torch.manual_seed(0)
    dims = [args.in_dim] + [args.hidden] * args.depth
    weights = [torch.randn(a, b, device="cuda") * 0.01 for a, b in itertools.pairwise(dims)]
    x = np.random.default_rng(0).standard_normal((1, args.in_dim)).astype(np.float32)
    expected = torch.from_numpy(x).cuda()
    for w in weights:
        expected = torch.relu(expected @ w)
    expected_np = expected.cpu().numpy()
    rows = []
    for variant in VARIANTS:
        one = make_replay(torch, variant, weights)
        got, _ = one(x)
        idle = sorted(one(x)[1] for _ in range(200))
        replays = [make_replay(torch, variant, weights) for _ in range(args.threads)]
        row = {
            "variant": variant,
            "max_abs_error": float(np.abs(got - expected_np).max()),
            "idle_span_p50_us": round(idle[100] * 1e6, 1),
            **contend(replays, x, args.busy_threads, args.seconds),
        }
        rows.append(row)
    report = {
        "device": torch.cuda.get_device_name(),
        "host": platform.node(),
        "threads": args.threads,
        "busy_threads": args.busy_threads,
        "seconds": args.seconds,
        "model": {"in_dim": args.in_dim, "hidden": args.hidden, "depth": args.depth},
        "rows": rows,
    }
    print(
        f"\nbatch-1 {args.depth}-layer MLP graph, {args.threads} replaying threads, "
        f"{args.busy_threads} busy threads, {args.seconds:g} s each, {report['device']}"
    )
    print(
        f"{'variant':<16} {'idle span us':>12} {'span p25 us':>11} {'p50 us':>9} "
        f"{'p90 us':>9} {'host p50 us':>11} {'replays/s':>9}"
    )
    for r in rows:
        print(
            f"{r['variant']:<16} {r['idle_span_p50_us']:>12} {r['span_p25_us']:>11} "
            f"{r['span_p50_us']:>9} {r['span_p90_us']:>9} {r['host_p50_us']:>11} "
            f"{r['replays_per_s']:>9}"
        )
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
