"""Hot swap vs. restart under steady load, and cold start with engine-cache hit vs. miss.

Runs real server processes on 127.0.0.1 and a closed-loop load generator, all phases in
one run so the figures are comparable. Prints a table and writes JSON (and a PNG plot of
latency over time when matplotlib is installed). For each model size the hot swap's p99
while the new version loads is compared with the steady p99, and the server's own mean
time per request (its ``model_server_inference_request_duration_seconds``) is given beside the
clients' latency.

One swap's window holds a thousand or so requests, so its p99 rests on a dozen of them:
``--swaps N`` swaps to N new versions in turn (v2, v3, ...), each after a steady window of
its own and followed by half a second left out of both (the pushed-out version released),
and pools the windows; each swap's own ratio is kept too.

    python bench/swap_under_load.py --backend onnxruntime --seconds 4
    python bench/swap_under_load.py --backend torch --concurrency 16   # 25 and 400 MiB
    python bench/swap_under_load.py --backend torch --concurrency 16 --no-restart --swaps 5
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
from dataclasses import dataclass
from pathlib import Path

from bench_support import DEPTH, SIZES, publish_sized, server_seconds, write_json
from model_rollout_e2e.loadgen import LoadGenerator, LoadResult
from model_rollout_e2e.processes import ServerProcess, free_port
from model_server.config import QUICK_RUN_US

ADMIN_TOKEN = "bench-token"
SETTLE_S = 0.5  # after a switch completes: still its window, then left out of the next


@dataclass(frozen=True)
class Switch:
    """One switch to ``version`` in a load generator's clock: its steady window runs from
    ``steady_from`` to ``at``; its own from ``at`` to ``SETTLE_S`` after ``done``."""

    version: str
    steady_from: float
    at: float
    done: float
    call_ms: float  # hot swap: the server's load+swap; restart: stop to ready


def post(url: str) -> dict:
    request = urllib.request.Request(
        url, method="POST", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def mean_ms(seconds_requests: list[float]) -> float | None:
    """The server's mean time per request, from its summed (seconds, requests)."""
    seconds, count = seconds_requests
    return round(seconds / count * 1000, 3) if count else None


def first_version_time(result: LoadResult, version: str, after: float) -> float | None:
    times = [
        s.started + s.latency_s
        for s in result.samples
        if s.ok and s.version == version and s.started >= after
    ]
    return min(times) - after if times else None


def ratio(window: dict, steady: dict) -> float | None:
    if steady["p99_ms"] and window["p99_ms"]:
        return round(float(window["p99_ms"]) / float(steady["p99_ms"]), 2)
    return None


def phase_report(result: LoadResult, switches: list[Switch], model: str) -> dict:
    """Each switch's steady window and its own, pooled over the switches and one by one;
    "after" runs from the last switch's window to the end."""
    steady_samples = [sample for sw in switches for sample in result.window(sw.steady_from, sw.at)]
    during_samples = [
        sample for sw in switches for sample in result.window(sw.at, sw.done + SETTLE_S)
    ]
    steady = LoadResult.summary(steady_samples)
    during = LoadResult.summary(during_samples)
    first = switches[0]
    each = []
    for sw in switches:
        own_steady = LoadResult.summary(result.window(sw.steady_from, sw.at))
        own = LoadResult.summary(result.window(sw.at, sw.done + SETTLE_S))
        each.append(
            {
                "version": sw.version,
                "at": round(sw.at, 4),  # the load generator's clock, as the samples'
                "done": round(sw.done, 4),
                "swap_call_ms": sw.call_ms,
                "steady_p99_ms": own_steady["p99_ms"],
                "during_swap_p99_ms": own["p99_ms"],
                "p99_during_over_steady": ratio(own, own_steady),
            }
        )
    return {
        "model": model,
        "steady": steady,
        "during_swap": during,
        "after": LoadResult.summary(result.window(switches[-1].done + SETTLE_S, 1e9)),
        "p99_during_over_steady": ratio(during, steady),
        "swap_call_ms": first.call_ms,
        "time_to_new_version_s": first_version_time(result, first.version, first.at),
        "switches": each,
        "samples": result.samples,
        "switch_at": first.at,
    }


def server(
    work: Path,
    args: argparse.Namespace,
    name: str,
    model: str,
    version: str,
    cache: Path,
    port: int | None = None,
) -> ServerProcess:
    token = work / "token"
    token.write_text(ADMIN_TOKEN)
    return ServerProcess(
        work / "repo",
        [f"{model}={version}"],
        work / f"{name}.log",
        port=port,
        extra=[
            "--backend",
            args.backend,
            "--cache-dir",
            str(cache),
            "--admin-token-file",
            str(token),
            "--workers",
            str(args.workers),
            "--quick-run-us",
            str(args.quick_run_us),
        ],
    )


async def phase_hot_swap(work: Path, args: argparse.Namespace, model: str) -> dict:
    srv = server(work, args, f"hot-swap-{model}", model, "v1", work / "cache").start()
    in_dim = SIZES[model][0]
    switches: list[Switch] = []
    steady_time = [0.0, 0.0]  # the server's (seconds, requests) in the steady windows
    during_time = [0.0, 0.0]  # and in the switches' own

    async def add(into: list[float], since: tuple[float, float]) -> tuple[float, float]:
        now = await asyncio.to_thread(server_seconds, srv.url, model)
        into[0] += now[0] - since[0]
        into[1] += now[1] - since[1]
        return now

    try:
        srv.wait_ready(args.ready_timeout)
        gen = LoadGenerator([srv.url], model, in_dim, concurrency=args.concurrency)
        gen.start_clock()
        task = asyncio.create_task(gen.run())
        warm_up = min(1.0, args.seconds / 2)
        await asyncio.sleep(warm_up)
        for n in range(2, args.swaps + 2):
            steady_from = gen.now()
            mark = await asyncio.to_thread(server_seconds, srv.url, model)
            await asyncio.sleep(args.seconds - warm_up if n == 2 else args.seconds)
            at = gen.now()
            mark = await add(steady_time, mark)
            answer = await asyncio.to_thread(post, f"{srv.url}/v1/reload?target_version=v{n}")
            done = gen.now()
            await asyncio.sleep(SETTLE_S)
            await add(during_time, mark)
            switches.append(Switch(f"v{n}", steady_from, at, done, answer["duration_ms"]))
            await asyncio.sleep(SETTLE_S)  # left out: the pushed-out version's release
        await asyncio.sleep(max(0.0, args.seconds - 2 * SETTLE_S))
        gen.stop()
        result = await task
    finally:
        srv.stop()
    report = phase_report(result, switches, model)
    report["server_mean_ms"] = {
        "steady": mean_ms(steady_time),
        "during_swap": mean_ms(during_time),
    }
    return report


async def phase_restart(work: Path, args: argparse.Namespace, model: str) -> dict:
    port = free_port()
    old = server(work, args, "restart-old", model, "v1", work / "cache", port=port).start()
    old.wait_ready(args.ready_timeout)
    gen = LoadGenerator([old.url], model, SIZES[model][0], concurrency=args.concurrency)
    gen.start_clock()
    task = asyncio.create_task(gen.run())
    await asyncio.sleep(args.seconds)
    switch_at = gen.now()
    old.stop()
    new = server(work, args, "restart-new", model, "v2", work / "cache", port=port).start()
    try:
        await asyncio.to_thread(new.wait_ready, args.ready_timeout)
        back_at = gen.now()
        await asyncio.sleep(args.seconds)
        gen.stop()
        result = await task
    finally:
        new.stop()
    switch = Switch(
        "v2", min(1.0, switch_at / 2), switch_at, back_at, round((back_at - switch_at) * 1000, 3)
    )
    return phase_report(result, [switch], model)


def phase_cold_start(work: Path, args: argparse.Namespace, model: str) -> dict:
    cache = work / "cold-cache"
    times = {}
    for label in ("miss", "hit"):
        srv = server(work, args, f"cold-{label}", model, "v1", cache).start()
        try:
            times[label] = round(srv.wait_ready(args.ready_timeout), 3)
        finally:
            srv.stop()
    return {"cache_miss_s": times["miss"], "cache_hit_s": times["hit"]}


def plot(path: Path, phases: dict) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(9, 4))
    for name, phase in phases.items():
        samples = phase["samples"]
        t0 = phase["switch_at"]
        ok = [(s.started - t0, s.latency_s * 1000) for s in samples if s.ok]
        bad = [(s.started - t0, s.latency_s * 1000) for s in samples if not s.ok]
        ax.scatter([t for t, _ in ok], [lat for _, lat in ok], s=3, label=f"{name} ok")
        if bad:
            ax.scatter(
                [t for t, _ in bad],
                [lat for _, lat in bad],
                s=6,
                marker="x",
                label=f"{name} failed ({len(bad)})",
            )
    ax.axvline(0, color="grey", linestyle="--")
    ax.set_yscale("log")
    ax.set_xlabel("seconds from the switch to v2")
    ax.set_ylabel("latency (ms)")
    ax.set_title("Hot swap vs. restart under load")
    ax.legend(markerscale=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def print_table(args: argparse.Namespace, phases: dict, sizes_mib: dict, cold: dict) -> None:
    print(
        f"\nmodels: {DEPTH}-layer MLPs "
        + ", ".join(f"{name} {mib:.1f} MiB" for name, mib in sizes_mib.items())
        + f"; backend {args.backend}, {args.concurrency} concurrent clients, "
        f"{args.workers} inference threads, quick runs up to {args.quick_run_us} us, "
        f"host {platform.node()}"
    )
    columns = ("requests", "errors", "p50 ms", "p99 ms", "max ms")
    header = f"{'scenario':<18} {'window':<12} " + " ".join(f"{c:>8}" for c in columns)
    print(header)
    print("-" * len(header))
    for name, phase in phases.items():
        for window in ("steady", "during_swap", "after"):
            s = phase[window]
            print(
                f"{name:<18} {window:<12} {s['requests']:>8} {s['errors']:>8} "
                f"{s['p50_ms'] or '-':>8} {s['p99_ms'] or '-':>8} {s['max_ms'] or '-':>8}"
            )
        print(
            f"{name:<18} first switch took {phase['swap_call_ms']:.1f} ms; first "
            f"{phase['switches'][0]['version']} answer "
            f"{phase['time_to_new_version_s']:.3f} s after the switch began; p99 during / "
            f"steady {phase['p99_during_over_steady']}x"
        )
        if len(phase["switches"]) > 1:
            print(
                f"{name:<18} each switch's p99 during / steady: "
                + ", ".join(f"{sw['p99_during_over_steady']}x" for sw in phase["switches"])
            )
        if "server_mean_ms" in phase:
            server = phase["server_mean_ms"]
            print(
                f"{name:<18} server's own mean time per request: steady "
                f"{server['steady']} ms, during the swap {server['during_swap']} ms"
            )
    if cold:
        print(
            f"cold start to ready: cache miss {cold['cache_miss_s']:.3f} s, "
            f"cache hit {cold['cache_hit_s']:.3f} s"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", default="onnxruntime", choices=["onnxruntime", "torch", "tensorrt"])
    p.add_argument("--seconds", type=float, default=4.0, help="load before and after each switch")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument(
        "--sizes",
        help=f"comma-separated model sizes of {sorted(SIZES)} to hot-swap (default: small; "
        "small,large for the GPU backends)",
    )
    p.add_argument(
        "--no-restart", action="store_true", help="only the hot swaps (no restart, cold start)"
    )
    p.add_argument(
        "--quick-run-us",
        type=int,
        default=QUICK_RUN_US,
        help="the server's --quick-run-us: graph replays this quick run on the event loop",
    )
    p.add_argument(
        "--swaps",
        type=int,
        default=1,
        help="hot swaps to new versions in turn, their windows pooled",
    )
    p.add_argument("--ready-timeout", type=float, default=120)
    p.add_argument("--out", default="bench/results/swap_under_load.json")
    args = p.parse_args(argv)
    if args.swaps < 1:
        p.error("--swaps must be at least 1")
    gpu = args.backend in ("torch", "tensorrt")
    sizes = (args.sizes or ("small,large" if gpu else "small")).split(",")
    if unknown := set(sizes) - set(SIZES):
        p.error(f"unknown sizes {sorted(unknown)}; choose from {sorted(SIZES)}")
    phases: dict = {}
    cold: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-swap-") as tmp:
        work = Path(tmp)
        sizes_mib = {}
        for size in sizes:
            model = publish_sized(work / "repo", size, "v1", 1, size)
            for seed in range(2, args.swaps + 2):
                publish_sized(work / "repo", size, f"v{seed}", seed, size)
            sizes_mib[size] = model.stat().st_size / 2**20
        for size in sizes:
            phases[f"{size}: hot swap"] = asyncio.run(phase_hot_swap(work, args, size))
        if not args.no_restart:
            phases[f"{sizes[0]}: restart"] = asyncio.run(phase_restart(work, args, sizes[0]))
            cold = phase_cold_start(work, args, sizes[0])
    print_table(args, phases, sizes_mib, cold)
    report = {
        "backend": args.backend,
        "model_mib": {name: round(mib, 2) for name, mib in sizes_mib.items()},
        "concurrency": args.concurrency,
        "workers": args.workers,
        "quick_run_us": args.quick_run_us,
        "swaps": args.swaps,
        "host": platform.node(),
        "python": sys.version.split()[0],
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "phases": {
            n: {k: v for k, v in ph.items() if k not in ("samples", "switch_at")}
            for n, ph in phases.items()
        },
        "cold_start": cold,
    }
    out = write_json(args.out, report)
    png = out.with_suffix(".png")
    if plot(png, phases):
        print(f"plot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
