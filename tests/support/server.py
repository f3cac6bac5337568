"""Helpers shared by the test modules: model repositories and v2 request bodies."""

from __future__ import annotations

import contextlib
import io
import json
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import onnx
import yaml
from onnx import TensorProto, helper
from prometheus_client.parser import text_string_to_metric_families

from model_rollout_contract.canary import GOLDEN_FILE
from model_rollout_contract.manifest import (
    MANIFEST_NAME,
    Manifest,
    sha256_bytes,
    sha256_file,
    sha256_file_chunked,
)
from model_rollout_e2e.loadgen import v2_body
from model_rollout_e2e.onnx_models import INPUT_NAME, MlpWeights, reference_forward, write_mlp
from model_server.backends.base import ModelFile
from model_server.backends.onnxruntime_backend import OnnxRuntimeBackend
from model_server.lifecycle.engine_manager import EngineManager
from model_server.lifecycle.model_slot import LoadedVersion
from model_server.scheduling.runner import Runner

IN_DIM = 8


@dataclass
class Version:
    name: str
    path: Path
    weights: MlpWeights
    sha256: str

    def expected(self, x: np.ndarray) -> np.ndarray:
        return reference_forward(self.weights, x)


def add_version(
    root: Path,
    model: str,
    version: str,
    seed: int,
    manifest: bool = True,
    chunk_size: int | None = None,
    **dims: int,
) -> Version:
    path = root / model / version / "model.onnx"
    weights = write_mlp(path, seed, in_dim=IN_DIM, **dims)
    digest = write_manifest(path, chunk_size) if manifest else sha256_file(path)
    return Version(version, path, weights, digest)


def write_manifest(path: Path, chunk_size: int | None = None) -> str:
    """The contract's manifest beside the model file at ``<root>/[<tenant>/]<model>/
    <version>/<file>``, describing its bytes as they are (the server loads no version
    without one, or a digest in the request), with their sha256 per ``chunk_size`` bytes
    if given; returns the file's digest."""
    digest, chunks = sha256_file_chunked(path, chunk_size) if chunk_size else (None, None)
    m = Manifest(
        model=path.parent.parent.name,
        version=path.parent.name,
        file=path.name,
        sha256=digest or sha256_file(path),
        size=path.stat().st_size,
        chunks=chunks,
    )
    (path.parent / "manifest.json").write_bytes(m.to_bytes())
    return m.sha256


def golden_npz(
    inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray], **tolerance: float
) -> bytes:
    """The bytes of a ``golden.npz`` (the contract's format), built in memory."""
    arrays = {f"input/{k}": v for k, v in inputs.items()}
    arrays |= {f"output/{k}": v for k, v in outputs.items()}
    arrays |= {k: np.float64(v) for k, v in tolerance.items()}
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # type: ignore[arg-type]
    return buffer.getvalue()


def add_golden(version: Version, data: bytes, named: bytes | None = None) -> None:
    """Put ``data`` beside ``version`` as its golden set and name it in its manifest
    (with the digest and size of ``named``, default ``data``: pass other bytes to make
    the digest wrong)."""
    directory = version.path.parent
    (directory / GOLDEN_FILE).write_bytes(data)
    described = data if named is None else named
    raw = json.loads((directory / MANIFEST_NAME).read_bytes())
    raw["golden"] = {"file": GOLDEN_FILE, "sha256": sha256_bytes(described), "size": len(described)}
    (directory / MANIFEST_NAME).write_bytes(
        Manifest.from_bytes(json.dumps(raw).encode()).to_bytes()
    )


def samples(exposition: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of a Prometheus text exposition, parsed by prometheus_client's own
    parser: {(sample name, labels): value}."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
    }


def sample(
    found: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    """One sample's value (0 when the series does not exist)."""
    return found.get((name, frozenset(labels.items())), 0.0)


def binomial_bounds(n: int, p: float, tail: float = 1e-9) -> tuple[int, int]:
    """The smallest [low, high] holding a Binomial(n, p) count with probability at
    least 1 - 2 * tail: a bound generous enough that a fair split essentially never
    fails it, computed from the distribution itself."""
    pmf = [math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(n + 1)]
    low, below = 0, 0.0
    while below + pmf[low] < tail:
        below += pmf[low]
        low += 1
    high, above = n, 0.0
    while above + pmf[high] < tail:
        above += pmf[high]
        high -= 1
    return low, high


def infer_body(x: np.ndarray) -> dict[str, Any]:
    return v2_body(x, INPUT_NAME)


def output_of(response_json: dict[str, Any]) -> np.ndarray:
    out = response_json["outputs"][0]
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def which_version(versions: dict[str, Version], x: np.ndarray, answer: dict[str, Any]) -> str:
    """The version whose reference output the answer matches; asserts it is the claimed one."""
    got = output_of(answer)
    matches = [n for n, v in versions.items() if np.allclose(got, v.expected(x), atol=1e-4)]
    assert matches == [answer["model_version"]], (
        f"answer claims {answer['model_version']} but matches {matches}: {json.dumps(answer)[:200]}"
    )
    return matches[0]


async def infer_on(
    manager: EngineManager, key: str, feeds: Mapping[str, np.ndarray], runner: Runner | None = None
) -> tuple[LoadedVersion, dict[str, np.ndarray]]:
    """An inference on ``key``'s serving version as the data plane runs one: through
    ``runner``, by default one with no batching, on the loop's default threads."""
    runner = runner or Runner(manager.metrics, manager.row_limits)
    return await runner.infer(manager.slot(key), feeds)


async def ask(socket_path: Path, request: dict[str, Any] | bytes) -> dict[str, Any]:
    """One request on a new connection to a control socket, and its reply."""
    import asyncio

    reader, writer = await asyncio.open_unix_connection(str(socket_path))
    payload = request if isinstance(request, bytes) else json.dumps(request).encode()
    writer.write(payload + b"\n")
    await writer.drain()
    answer: dict[str, Any] = json.loads(await reader.readline())
    writer.close()
    return answer


def child_pids(parent: int) -> list[int]:
    """Pids of ``parent``'s children now, over all its threads (read from /proc). A
    thread may end between the listing and the read (CI saw it): its children then show
    under another thread of the process, so that thread is skipped."""
    children: list[int] = []
    for task in Path(f"/proc/{parent}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            children += [int(p) for p in (task / "children").read_text().split()]
    return children


def command_line(pid: int) -> list[bytes]:
    """A process's argv from /proc; empty once it has gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except FileNotFoundError:
        return []


def worker_processes(parent: int) -> list[int]:
    """Pids of the ``multiprocessing`` spawn workers that ``parent`` started (read from
    /proc): the server's JSON workers."""
    return sorted(
        pid for pid in child_pids(parent) if any(b"spawn_main" in a for a in command_line(pid))
    )


class GatedBackend(OnnxRuntimeBackend):
    """ONNX Runtime whose engines block inference until a gate opens (to hold requests
    in flight across a swap), and whose v-nan model produces NaN at warm-up."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.closed: list[Path] = []

    def load(self, model: ModelFile):  # type: ignore[override]
        engine = super().load(model)
        backend = self
        inner_infer, inner_close = engine.infer, engine.close

        def infer(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
            backend.gate.wait(10)
            out = inner_infer(feeds)
            if "nan" in model.path.parent.name:  # the version's directory: v-nan
                out = {k: v * np.nan for k, v in out.items()}
            return out

        def close() -> None:
            backend.closed.append(model.path)
            inner_close()

        engine.infer = infer  # type: ignore[method-assign]
        engine.close = close  # type: ignore[method-assign]
        return engine


class RaisingBackend(OnnxRuntimeBackend):
    """ONNX Runtime whose engines raise at run time (as an engine can: no ServingError)
    on any input holding 1000."""

    MESSAGE = "the engine cannot run these inputs"

    def load(self, model: ModelFile):  # type: ignore[override]
        engine = super().load(model)
        inner = engine.infer

        def infer(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
            if any(np.any(a == 1000.0) for a in feeds.values()):
                raise RuntimeError(RaisingBackend.MESSAGE)
            return inner(feeds)

        engine.infer = infer  # type: ignore[method-assign]
        return engine


async def keep_sending(
    url: str, body: Mapping[str, Any], statuses: list[int], errors: list[str]
) -> None:
    """One client on one kept-alive connection, posting ``body`` to ``url`` until an
    answer says the server closes the connection (it drains on SIGTERM: a load balancer
    would send elsewhere now). Every status goes to ``statuses`` and a failed request to
    ``errors`` (ending the client), so a SIGTERM test can send under load and then assert
    that no request failed while the server drained."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
        while True:
            try:
                async with session.post(url, json=body) as response:
                    await response.read()
                    statuses.append(response.status)
                    if response.headers.get("Connection", "").lower() == "close":
                        return
            except aiohttp.ClientError as exc:
                errors.append(repr(exc))
                return


TENANT_KEYS: Mapping[str, str] = {"acme": "key-acme", "globex": "key-globex"}


def write_tenants(
    path: Path,
    keys: Mapping[str, str] = TENANT_KEYS,
    models: Sequence[str] = ("mlp",),
    rate_limits: Mapping[str, Mapping[str, float]] | None = None,
) -> Path:
    """Write a ``--tenants-file`` at ``path`` (and return it): each tenant of ``keys``
    with its API key, serving ``models``, and the rate limit ``rate_limits`` gives it,
    if any. One writer, so the tenant tests agree on the file's shape."""
    tenants: dict[str, dict[str, Any]] = {}
    for tenant, key in keys.items():
        tenants[tenant] = {"api_key": key, "models": list(models)}
        if rate_limits and tenant in rate_limits:
            tenants[tenant]["rate_limit"] = dict(rate_limits[tenant])
    path.write_text(yaml.safe_dump({"tenants": tenants}))
    return path


def write_gate(path: Path) -> None:
    """Three inputs of three sizes (BOOL: 1 byte, FP16: 2, FP32: 4) and three outputs:
    ``y = where(mask, x, 0)``, ``flipped = not mask``, ``doubled = half + half``."""
    batch = ["batch", 3]
    graph = helper.make_graph(
        [
            helper.make_node("Where", ["mask", "x", "zero"], ["y"]),
            helper.make_node("Not", ["mask"], ["flipped"]),
            helper.make_node("Add", ["half", "half"], ["doubled"]),
        ],
        "gate",
        [
            helper.make_tensor_value_info("mask", TensorProto.BOOL, batch),
            helper.make_tensor_value_info("half", TensorProto.FLOAT16, batch),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, batch),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, batch),
            helper.make_tensor_value_info("flipped", TensorProto.BOOL, batch),
            helper.make_tensor_value_info("doubled", TensorProto.FLOAT16, batch),
        ],
        [helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def _save_graph(graph: onnx.GraphProto, path: Path) -> None:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)
    write_manifest(path)


def write_apart(path: Path) -> None:
    """``y = a + b``, ``a: [n, 3]`` and ``b: [m, 3]``: their first axes are named apart,
    so the server cannot tell they must agree; ONNX Runtime's Add fails when they do not."""
    _save_graph(
        helper.make_graph(
            [helper.make_node("Add", ["a", "b"], ["y"])],
            "apart",
            [
                helper.make_tensor_value_info("a", TensorProto.FLOAT, ["n", 3]),
                helper.make_tensor_value_info("b", TensorProto.FLOAT, ["m", 3]),
            ],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 3])],
        ),
        path,
    )


def write_pairs(path: Path) -> None:
    """``x: [batch, 3]`` reshaped to ``[3]``: one row can be (the warm-up's), more cannot."""
    _save_graph(
        helper.make_graph(
            [helper.make_node("Reshape", ["x", "shape"], ["y"])],
            "pairs",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
            [helper.make_tensor("shape", TensorProto.INT64, [1], [3])],
        ),
        path,
    )


# the admin token the server fixtures (tests/server/conftest.py) configure
ADMIN_TOKEN = "test-admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
