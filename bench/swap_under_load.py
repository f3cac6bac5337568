"""Hot swap vs. restart under steady load, and cold start with engine-cache hit vs. miss.

Runs real server processes on 127.0.0.1 and a closed-loop load generator, all phases in
one run so the figures are comparable. Prints a table and writes JSON (and a PNG plot of
latency over time when matplotlib is installed).

    python bench/swap_under_load.py --backend onnxruntime --seconds 4
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

from model_rollout_contract.manifest import Manifest, sha256_file
from model_rollout_e2e.loadgen import LoadGenerator, LoadResult
from model_rollout_e2e.onnx_models import write_mlp
from model_rollout_e2e.processes import ServerProcess, free_port

ADMIN_TOKEN = "bench-token"


def publish(root: Path, version: str, seed: int, args: argparse.Namespace) -> Path:
    path = root / "mlp" / version / "model.onnx"
    write_mlp(path, seed, in_dim=args.in_dim, hidden=args.hidden, out_dim=16, depth=args.depth)
    manifest = Manifest("mlp", version, "model.onnx", sha256_file(path), path.stat().st_size)
    (path.parent / "manifest.json").write_bytes(manifest.to_bytes())
    return path


def post(url: str) -> dict:
    request = urllib.request.Request(
        url, method="POST", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def first_version_time(result: LoadResult, version: str, after: float) -> float | None:
    times = [
        s.started + s.latency_s
        for s in result.samples
        if s.ok and s.version == version and s.started >= after
    ]
    return min(times) - after if times else None


def phase_report(
    result: LoadResult, switch_at: float, switched_at: float, switch_ms: float
) -> dict:
    """Windows before, during (until 0.5 s after the switch completed) and after."""
    return {
        "steady": LoadResult.summary(result.window(0, switch_at)),
        "during_swap": LoadResult.summary(result.window(switch_at, switched_at + 0.5)),
        "after": LoadResult.summary(result.window(switched_at + 0.5, 1e9)),
        "swap_call_ms": switch_ms,  # hot swap: the server's load+swap; restart: stop to ready
        "time_to_new_version_s": first_version_time(result, "v2", switch_at),
        "samples": result.samples,
        "switch_at": switch_at,
    }


def server(
    work: Path,
    args: argparse.Namespace,
    name: str,
    version: str,
    cache: Path,
    port: int | None = None,
) -> ServerProcess:
    token = work / "token"
    token.write_text(ADMIN_TOKEN)
    return ServerProcess(
        work / "repo",
        [f"mlp={version}"],
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
        ],
    )


async def phase_hot_swap(work: Path, args: argparse.Namespace) -> dict:
    srv = server(work, args, "hot-swap", "v1", work / "cache").start()
    try:
        srv.wait_ready(args.ready_timeout)
        gen = LoadGenerator([srv.url], "mlp", args.in_dim, concurrency=args.concurrency)
        gen.start_clock()
        task = asyncio.create_task(gen.run())
        await asyncio.sleep(args.seconds)
        swap_at = gen.now()
        answer = await asyncio.to_thread(post, f"{srv.url}/v1/reload?target_version=v2")
        swap_done = gen.now()
        await asyncio.sleep(args.seconds)
        gen.stop()
        result = await task
    finally:
        srv.stop()
    return phase_report(result, swap_at, swap_done, answer["duration_ms"])


async def phase_restart(work: Path, args: argparse.Namespace) -> dict:
    port = free_port()
    old = server(work, args, "restart-old", "v1", work / "cache", port=port).start()
    old.wait_ready(args.ready_timeout)
    gen = LoadGenerator([old.url], "mlp", args.in_dim, concurrency=args.concurrency)
    gen.start_clock()
    task = asyncio.create_task(gen.run())
    await asyncio.sleep(args.seconds)
    switch_at = gen.now()
    old.stop()
    new = server(work, args, "restart-new", "v2", work / "cache", port=port).start()
    try:
        await asyncio.to_thread(new.wait_ready, args.ready_timeout)
        back_at = gen.now()
        await asyncio.sleep(args.seconds)
        gen.stop()
        result = await task
    finally:
        new.stop()
    return phase_report(result, switch_at, back_at, round((back_at - switch_at) * 1000, 3))


def phase_cold_start(work: Path, args: argparse.Namespace) -> dict:
    cache = work / "cold-cache"
    times = {}
    for label in ("miss", "hit"):
        srv = server(work, args, f"cold-{label}", "v1", cache).start()
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", default="onnxruntime", choices=["onnxruntime", "torch", "tensorrt"])
    p.add_argument("--seconds", type=float, default=4.0, help="load before and after each switch")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--in-dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--ready-timeout", type=float, default=120)
    p.add_argument("--out", default="bench/results/swap_under_load.json")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-swap-") as tmp:
        work = Path(tmp)
        model = publish(work / "repo", "v1", 1, args)
        publish(work / "repo", "v2", 2, args)
        phases = {
            "hot swap": asyncio.run(phase_hot_swap(work, args)),
            "restart": asyncio.run(phase_restart(work, args)),
        }
        cold = phase_cold_start(work, args)
        model_mib = model.stat().st_size / 2**20
    print(
        f"\nmodel: {args.depth}-layer MLP, {model_mib:.1f} MiB, backend {args.backend}, "
        f"{args.concurrency} concurrent clients, host {platform.node()}"
    )
    columns = ("requests", "errors", "p50 ms", "p99 ms", "max ms")
    header = f"{'scenario':<10} {'window':<12} " + " ".join(f"{c:>8}" for c in columns)
    print(header)
    print("-" * len(header))
    for name, phase in phases.items():
        for window in ("steady", "during_swap", "after"):
            s = phase[window]
            print(
                f"{name:<10} {window:<12} {s['requests']:>8} {s['errors']:>6} "
                f"{s['p50_ms'] or '-':>8} {s['p99_ms'] or '-':>8} {s['max_ms'] or '-':>8}"
            )
        print(
            f"{name:<10} switch took {phase['swap_call_ms']:.1f} ms; first v2 answer "
            f"{phase['time_to_new_version_s']:.3f} s after the switch began"
        )
    print(
        f"cold start to ready: cache miss {cold['cache_miss_s']:.3f} s, "
        f"cache hit {cold['cache_hit_s']:.3f} s"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "backend": args.backend,
        "model_mib": round(model_mib, 2),
        "concurrency": args.concurrency,
        "host": platform.node(),
        "python": sys.version.split()[0],
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "phases": {
            n: {k: v for k, v in ph.items() if k not in ("samples", "switch_at")}
            for n, ph in phases.items()
        },
        "cold_start": cold,
    }
    out.write_text(json.dumps(report, indent=2))
    png = out.with_suffix(".png")
    if plot(png, phases):
        print(f"plot: {png}")
    print(f"json: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
