"""Where a load's time goes, stage by stage, as the server itself measures it (the
``stages_ms`` of each load's admin answer), beside what the machine allows for a file of
that size: its read from the page cache, its sha256 and, on a GPU, its copy to the
device from pinned and pageable memory. The server reads and hashes a model file in one
pass (``read_hash``, then ``hash_wait`` for the hash to catch up): their sum is bounded
below by the longer of the read into fresh pages and the sha256, printed as its floor.
Versions are published with their digest per ``--digest-chunk-mib`` MiB (as ``publish``
writes them), which the server checks on several threads: the sha256's share of the
floor is then split among them; ``--digest-chunk-mib 0`` publishes the whole-file digest
alone.

A real server process on 127.0.0.1, started as a pod runs it (with an engine cache);
``--loads N`` swaps to N new versions in turn, under ``--clients`` closed-loop clients
(0: an idle server), and the table gives each stage's median over them.

    python bench/load_stages.py                                  # 25 MiB, ONNX Runtime
    python bench/load_stages.py --backend torch --size large     # 400 MiB on a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench_support import (
    SIZES,
    add_load_flags,
    physical_limits,
    print_stages,
    publish_sized,
    write_json,
)
from model_rollout_e2e.loadgen import LoadGenerator
from model_rollout_e2e.processes import ServerProcess
from model_server.files.chunk_verifier import WORKERS

ADMIN_TOKEN = "bench-token"


def reload(url: str, version: str) -> dict:
    request = urllib.request.Request(
        f"{url}/v1/reload?target_version={version}",
        method="POST",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return dict(json.loads(response.read()))


async def measure(args: argparse.Namespace, work: Path) -> list[dict]:
    token = work / "token"
    token.write_text(ADMIN_TOKEN)
    extra = ["--backend", args.backend, "--admin-token-file", str(token)]
    extra += ["--inference-nice", str(args.inference_nice)]
    extra += ["--spare-copy-mb", str(args.spare_copy_mb)]
    extra += ["--pin-private-copies"] if args.pin_private_copies else []
    extra += ["--cache-dir", str(work / "cache")] if not args.no_cache else []
    server = ServerProcess(work / "repo", [f"{args.size}=v1"], work / "server.log", extra=extra)
    server.start()
    answers = []
    try:
        server.wait_ready(args.ready_timeout)
        gen = None
        task = None
        if args.clients:
            gen = LoadGenerator([server.url], args.size, SIZES[args.size][0], args.clients)
            gen.start_clock()
            task = asyncio.create_task(gen.run())
        for n in range(2, args.loads + 2):
            await asyncio.sleep(args.pause_s)
            answers.append(await asyncio.to_thread(reload, server.url, f"v{n}"))
        if gen is not None and task is not None:
            gen.stop()
            result = await task
            failed = sum(1 for s in result.samples if not s.ok)
            print(f"{len(result.samples)} requests meanwhile, {failed} failed")
    finally:
        server.stop()
    return answers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", default="onnxruntime", choices=["onnxruntime", "torch"])
    p.add_argument("--size", default="small", choices=sorted(SIZES))
    p.add_argument("--loads", type=int, default=5, help="new versions loaded in turn")
    p.add_argument("--clients", type=int, default=8, help="closed-loop clients (0: idle)")
    p.add_argument("--pause-s", type=float, default=1.0, help="serving before each load")
    p.add_argument("--no-cache", action="store_true", help="no --cache-dir (pods have one)")
    p.add_argument("--inference-nice", type=int, default=0, help="the server's flag")
    add_load_flags(p)
    p.add_argument("--ready-timeout", type=float, default=120)
    p.add_argument("--out", default="bench/results/load_stages.json")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-stages-") as tmp:
        work = Path(tmp)
        for n in range(1, args.loads + 2):
            chunk = args.digest_chunk_mib * 2**20 or None
            model = publish_sized(work / "repo", args.size, f"v{n}", n, args.size, chunk)
        device = "cuda" if args.backend == "torch" else None
        limits = physical_limits(model, device)
        answers = asyncio.run(measure(args, work))
    stages = [answer["stages_ms"] for answer in answers]
    title = (
        f"{args.backend}, {limits['bytes'] / 2**20:.1f} MiB, {args.loads} loads, "
        f"{args.clients} clients, host {platform.node()}"
    )
    medians = print_stages(title, stages, limits)
    threads = WORKERS if args.digest_chunk_mib else 1  # the chunks are hashed on WORKERS threads
    floor = max(limits["page_cache_read_fresh_pages"]["ms"], limits["sha256"]["ms"] / threads)
    label = f"read_hash + hash_wait floor ({threads} hash threads)"
    print(f"  {label:<46} {floor:>8.2f} ms")
    report = {
        "backend": args.backend,
        "size": args.size,
        "model_mib": round(limits["bytes"] / 2**20, 2),
        "clients": args.clients,
        "cache": not args.no_cache,
        "inference_nice": args.inference_nice,
        "spare_copy_mb": args.spare_copy_mb,
        "pin_private_copies": args.pin_private_copies,
        "digest_chunk_mib": args.digest_chunk_mib,
        "host": platform.node(),
        "python": sys.version.split()[0],
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_ms_median": round(statistics.median(a["duration_ms"] for a in answers), 3),
        "stages_ms_median": medians,
        "loads": answers,
        "limits": limits,
    }
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
