"""Our hot swap beside MLServer's, in one run on one machine: the same model (the 25 MiB
8-layer MLP), the same ONNX Runtime and session options, the same closed-loop clients
(e2e's load generator, KServe v2 JSON), each server switched from v1 to v2 under load.

MLServer 1.7.1 runs in a venv of its own (``mlserver==1.7.1``, our ``onnxruntime``
version, ``uvloop<0.22``: newer uvloop kills its worker at start), created with pip from
PyPI under ``--venv`` and reused when present. It serves the model through a small
runtime (an ``MLModel`` making an ``InferenceSession`` from the file, as ours does:
one intra-op thread, default optimisation) and switches the way its repository API
does: the model's ``model-settings.json`` names v2, then ``POST
/v2/repository/models/mlp/load``. Ours: ``POST /v1/reload?target_version=v2``, with an
engine cache as in a pod.

Each round starts both servers afresh on v1 (in turn, the order alternating) and
switches each once; the table gives each figure's median over the rounds.

    python bench/mlserver_side_by_side.py --rounds 3
    python bench/mlserver_side_by_side.py --rounds 3 --inference-nice 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnxruntime

from bench_support import SIZES, publish_sized, write_json
from model_rollout_e2e.loadgen import LoadGenerator, LoadResult
from model_rollout_e2e.processes import ServerProcess, free_port, http_ok

ADMIN_TOKEN = "bench-token"
MODEL = "mlp"
REQUIREMENTS = ("mlserver==1.7.1", f"onnxruntime=={onnxruntime.__version__}", "uvloop<0.22")
DEFAULT_VENV = Path.home() / ".cache" / "model-rollout-bench" / "mlserver-venv"
SETTLE_S = 0.5  # after a switch completes: still its window

RUNTIME = '''
import numpy as np
import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse
from mlserver.utils import get_model_uri


class OnnxModel(MLModel):
    """The model's file in an ONNX Runtime session, with the options ours uses."""

    async def load(self) -> bool:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        uri = await get_model_uri(self._settings)
        self._session = ort.InferenceSession(uri, options, providers=["CPUExecutionProvider"])
        self._input = self._session.get_inputs()[0].name
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        x = NumpyCodec.decode_input(payload.inputs[0]).astype(np.float32)
        [y] = self._session.run(None, {self._input: x})
        return InferenceResponse(
            model_name=self.name,
            model_version=self.version,
            outputs=[NumpyCodec.encode_output("output", y)],
        )
'''


def mlserver_venv(venv: Path) -> Path:
    """The venv's ``mlserver``, the venv made (pip, PyPI) unless it holds these
    requirements already."""
    marker = venv / "model-rollout-bench.txt"
    wanted = "\n".join(REQUIREMENTS)
    if marker.exists() and marker.read_text() == wanted:
        return venv / "bin" / "mlserver"
    venv.parent.mkdir(parents=True, exist_ok=True)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, *REQUIREMENTS], check=True)
    marker.write_text(wanted)
    return venv / "bin" / "mlserver"


def post(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def wait_for(url: str, timeout_s: float, alive: Callable[[], bool]) -> float:
    started = time.monotonic()
    while not http_ok(url):
        if not alive() or time.monotonic() - started > timeout_s:
            raise RuntimeError(f"{url} never answered")
        time.sleep(0.1)
    return time.monotonic() - started


@dataclass
class Server:
    """A server on v1 and how to switch it to v2."""

    name: str
    url: str
    switch: Callable[[], dict]
    stop: Callable[[], None]


def start_ours(work: Path, round_: int, args: argparse.Namespace) -> Server:
    token = work / "token"
    token.write_text(ADMIN_TOKEN)
    extra = ["--admin-token-file", str(token), "--workers", str(args.workers)]
    if args.inference_nice:  # only when asked: a server before the flag runs too
        extra += ["--inference-nice", str(args.inference_nice)]
    extra += ["--cache-dir", str(work / f"cache-{round_}")]
    log = work / f"ours-{round_}.log"
    server = ServerProcess(work / "repo", [f"{MODEL}=v1"], log, extra=extra).start()
    server.wait_ready(args.ready_timeout)

    def switch() -> dict:
        status, body = post(
            f"{server.url}/v1/reload?target_version=v2",
            {"Authorization": f"Bearer {ADMIN_TOKEN}"},
        )
        answer = json.loads(body)
        return {"status": status, "stages_ms": answer.get("stages_ms")}

    return Server("model-server", server.url, switch, server.stop)


def _model_settings(folder: Path, model_file: Path, version: str) -> None:
    settings = {
        "name": MODEL,
        "implementation": "ort_runtime.OnnxModel",
        "parameters": {"uri": str(model_file), "version": version},
    }
    (folder / "model-settings.json").write_text(json.dumps(settings))


def start_mlserver(work: Path, round_: int, args: argparse.Namespace, binary: Path) -> Server:
    root = work / f"mlserver-{round_}"
    folder = root / MODEL
    folder.mkdir(parents=True)
    (root / "ort_runtime.py").write_text(RUNTIME)
    _model_settings(folder, work / "repo" / MODEL / "v1" / "model.onnx", "v1")
    port = free_port()
    settings = {
        "http_port": port,
        "grpc_port": free_port(),
        "metrics_port": free_port(),
        "debug": False,
    }
    (root / "settings.json").write_text(json.dumps(settings))
    env = {**os.environ, "PYTHONPATH": str(root)}
    log = (work / f"mlserver-{round_}.log").open("wb")
    process = subprocess.Popen(
        [str(binary), "start", str(root)], cwd=root, env=env, stdout=log, stderr=log
    )
    url = f"http://127.0.0.1:{port}"
    wait_for(f"{url}/v2/models/{MODEL}/ready", args.ready_timeout, lambda: process.poll() is None)

    def switch() -> dict:
        _model_settings(folder, work / "repo" / MODEL / "v2" / "model.onnx", "v2")
        status, _ = post(f"{url}/v2/repository/models/{MODEL}/load")
        return {"status": status}

    def stop() -> None:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()

    return Server("mlserver-1.7.1", url, switch, stop)


async def switch_under_load(server: Server, args: argparse.Namespace) -> dict:
    gen = LoadGenerator([server.url], MODEL, SIZES["small"][0], concurrency=args.clients)
    gen.start_clock()
    task = asyncio.create_task(gen.run())
    await asyncio.sleep(args.seconds)
    at = gen.now()
    answer = await asyncio.to_thread(server.switch)
    done = gen.now()
    await asyncio.sleep(args.seconds)
    gen.stop()
    result = await task
    return report(result, at, done, answer)


def report(result: LoadResult, at: float, done: float, answer: dict) -> dict:
    firsts = [s.started + s.latency_s for s in result.samples if s.ok and s.version == "v2"]
    during = result.window(at, done + SETTLE_S)
    return {
        **answer,
        "switch_call_ms": round((done - at) * 1000, 3),
        "first_v2_answer_ms": round((min(firsts) - at) * 1000, 3) if firsts else None,
        "steady": LoadResult.summary(result.window(0.5, at)),
        "during": LoadResult.summary(during),
        "failed_all": sum(1 for s in result.samples if not s.ok),
        "requests_all": len(result.samples),
        "errors_seen": sorted({s.error[:120] for s in result.samples if s.error})[:5],
    }


def median(rounds: list[dict], key: Callable[[dict], float | None]) -> float | None:
    values = [v for v in (key(r) for r in rounds) if v is not None]
    return round(statistics.median(values), 3) if values else None


def print_table(results: dict[str, list[dict]]) -> dict:
    columns = {
        "switch call ms": lambda r: r["switch_call_ms"],
        "first v2 answer ms": lambda r: r["first_v2_answer_ms"],
        "failed (whole run)": lambda r: r["failed_all"],
        "requests (whole run)": lambda r: r["requests_all"],
        "p50 ms during": lambda r: r["during"]["p50_ms"],
        "p99 ms during": lambda r: r["during"]["p99_ms"],
        "p99 ms steady": lambda r: r["steady"]["p99_ms"],
    }
    medians = {
        name: {col: median(rounds, key) for col, key in columns.items()}
        for name, rounds in results.items()
    }
    print(f"\nmedians over {len(next(iter(results.values())))} rounds")
    print(f"{'':<22}" + "".join(f"{name:>18}" for name in medians))
    for col in columns:
        print(f"{col:<22}" + "".join(f"{m[col]!s:>18}" for m in medians.values()))
    ours, theirs = medians.get("model-server"), medians.get("mlserver-1.7.1")
    if ours and theirs and ours["switch call ms"] and theirs["switch call ms"]:
        share = ours["switch call ms"] / theirs["switch call ms"]
        print(f"switch call, ours / MLServer's: {share:.2f}x")
    return medians


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--workers", type=int, default=4, help="our server's inference threads")
    p.add_argument("--inference-nice", type=int, default=0, help="our server's --inference-nice")
    p.add_argument("--seconds", type=float, default=2.0, help="load before and after each switch")
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="MLServer's venv")
    p.add_argument("--ready-timeout", type=float, default=120)
    p.add_argument("--out", default="bench/results/mlserver_side_by_side.json")
    args = p.parse_args(argv)
    binary = mlserver_venv(args.venv)
    results: dict[str, list[dict]] = {"model-server": [], "mlserver-1.7.1": []}
    with tempfile.TemporaryDirectory(prefix="bench-mlserver-") as tmp:
        work = Path(tmp)
        for version, seed in (("v1", 1), ("v2", 2)):
            model_file = publish_sized(work / "repo", MODEL, version, seed, "small")
        mib = model_file.stat().st_size / 2**20
        starts: list[Callable[[int], Server]] = [
            lambda r: start_ours(work, r, args),
            lambda r: start_mlserver(work, r, args, binary),
        ]
        for round_ in range(args.rounds):
            order = starts if round_ % 2 == 0 else starts[::-1]
            for start in order:
                server = start(round_)
                try:
                    outcome = asyncio.run(switch_under_load(server, args))
                finally:
                    server.stop()
                results[server.name].append(outcome)
                print(
                    f"round {round_ + 1} {server.name}: switch {outcome['switch_call_ms']} ms, "
                    f"first v2 answer {outcome['first_v2_answer_ms']} ms, "
                    f"failed {outcome['failed_all']} of {outcome['requests_all']}"
                )
    medians = print_table(results)
    write_json(
        args.out,
        {
            "model_mib": round(mib, 2),
            "clients": args.clients,
            "workers": args.workers,
            "inference_nice": args.inference_nice,
            "requirements": list(REQUIREMENTS),
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "load_average_at_end": os.getloadavg(),
            "python": sys.version.split()[0],
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "medians": medians,
            "rounds": results,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
