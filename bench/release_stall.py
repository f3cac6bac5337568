"""What letting a model's bytes go costs the threads that serve: a 400 MiB model file's
bytes, freed four ways, beside threads that stand for serving work. One ticks every
0.2 ms (its longest gap: how long it could not get the GIL); one maps, touches and
unmaps 256 KiB regions as Python's allocator and the CUDA driver do (its longest call:
how long it waited for the process's memory-map lock); with ``--busy-threads N``, N more
run Python without pause, as a loaded event loop and inference threads do (then the
release's own time shows how often it had to ask for the GIL back).

* ``bytes``: how the server held a model file's bytes before (freed with the GIL held);
* ``one munmap``: the server's private copy (a memfd mapping) unmapped in one call;
* ``madvise 2 MiB chunks``: the pages given back 2 MiB at a time with ``MADV_REMOVE``
  (which holds the GIL), then the empty mapping unmapped: the server's way for a day;
* ``PrivateCopy.close``: what the server does now, on a loader's thread: one
  ``madvise(MADV_REMOVE)`` through ctypes punching a hole in the memfd, without the GIL,
  then the empty mapping unmapped.

    python bench/release_stall.py --mib 400 --repeat 3
    python bench/release_stall.py --mib 400 --repeat 3 --busy-threads 1
"""

from __future__ import annotations

import argparse
import mmap
import os
import platform
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from bench_support import write_json
from model_server.files.private_copy import PrivateCopy, read_into_private_copy


class Watchers:
    """The two stand-in threads and the worst each saw in a window."""

    def __init__(self, busy_threads: int) -> None:
        self.stop = threading.Event()
        self.gil_gaps: list[tuple[float, float]] = []  # (when, gap)
        self.map_calls: list[tuple[float, float]] = []  # (when, call)
        self.threads = [
            threading.Thread(target=self._tick, daemon=True),
            threading.Thread(target=self._map, daemon=True),
        ] + [threading.Thread(target=self._spin, daemon=True) for _ in range(busy_threads)]

    def _spin(self) -> None:
        while not self.stop.is_set():
            sum(range(1000))

    def _tick(self) -> None:
        last = time.perf_counter()
        while not self.stop.is_set():
            time.sleep(0.0002)
            now = time.perf_counter()
            self.gil_gaps.append((now, now - last))
            last = now

    def _map(self) -> None:
        while not self.stop.is_set():
            started = time.perf_counter()
            region = mmap.mmap(-1, 256 * 1024)
            region[0] = region[4096] = 1
            region.close()
            self.map_calls.append((started, time.perf_counter() - started))
            time.sleep(0.0002)

    def worst(self, since: float) -> tuple[float, float]:
        gil = max((g for at, g in self.gil_gaps if at >= since), default=0.0)
        mapping = max((c for at, c in self.map_calls if at >= since), default=0.0)
        return gil, mapping

    def __enter__(self) -> Watchers:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()


def private_copy(path: Path) -> PrivateCopy:
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_into_private_copy(fd, path.stat().st_size, path.name, str(path))
    finally:
        os.close(fd)


def one_munmap(holder: dict) -> None:
    copy: PrivateCopy = holder.pop("data")
    copy.view.release()
    assert copy.mapping is not None
    copy.mapping.close()


def drop(holder: dict) -> None:
    """``bytes`` are freed when their last reference goes."""
    del holder["data"]


def madvise_chunks(holder: dict) -> None:
    copy: PrivateCopy = holder.pop("data")
    copy.view.release()
    mapping = copy.mapping
    assert mapping is not None
    for start in range(0, len(mapping), 2 * 2**20):
        mapping.madvise(mmap.MADV_REMOVE, start, min(2 * 2**20, len(mapping) - start))
        time.sleep(0)  # madvise holds the GIL: let a waiting thread have it
    mapping.close()


def close_private_copy(holder: dict) -> None:
    holder.pop("data").close()


def measure(name: str, data: object, release: Callable[[dict], None], busy_threads: int) -> dict:
    holder = {"data": data}
    del data
    with Watchers(busy_threads) as watchers:
        time.sleep(0.2)
        since = time.perf_counter()
        release(holder)
        took = time.perf_counter() - since
        time.sleep(0.1)
        gil, mapping = watchers.worst(since)
    return {
        "way": name,
        "release_ms": round(took * 1000, 1),
        "worst_gil_wait_ms": round(gil * 1000, 2),
        "worst_map_call_ms": round(mapping * 1000, 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mib", type=int, default=400, help="size of the model file")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--busy-threads", type=int, default=0, help="threads running Python")
    p.add_argument("--gil-switch-interval-us", type=int, default=5000, help="as the server sets it")
    p.add_argument("--out", default="bench/results/release_stall.json")
    args = p.parse_args(argv)
    sys.setswitchinterval(args.gil_switch_interval_us / 1e6)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-release-") as tmp:
        path = Path(tmp) / "model.onnx"
        path.write_bytes(os.urandom(args.mib * 2**20))
        ways: list[tuple[str, Callable[[], object], Callable[[dict], None]]] = [
            ("bytes", path.read_bytes, drop),
            ("one munmap", lambda: private_copy(path), one_munmap),
            ("madvise 2 MiB chunks", lambda: private_copy(path), madvise_chunks),
            ("PrivateCopy.close", lambda: private_copy(path), close_private_copy),
        ]
        for _ in range(args.repeat):
            for name, make, release in ways:
                rows.append(measure(name, make(), release, args.busy_threads))
    print(
        f"\n{args.mib} MiB, {args.repeat} runs each, {args.busy_threads} busy threads, "
        f"switch interval {args.gil_switch_interval_us} us, host {platform.node()}"
    )
    print(f"{'way':<22} {'release ms':>11} {'worst GIL wait ms':>18} {'worst map call ms':>18}")
    for r in rows:
        print(
            f"{r['way']:<22} {r['release_ms']:>11} {r['worst_gil_wait_ms']:>18} "
            f"{r['worst_map_call_ms']:>18}"
        )
    report = {
        "mib": args.mib,
        "busy_threads": args.busy_threads,
        "gil_switch_interval_us": args.gil_switch_interval_us,
        "host": platform.node(),
        "rows": rows,
    }
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
