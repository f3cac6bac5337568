"""``model-server --processes N`` (issue 12): N server processes behind one port act as
one server. Real supervisor and worker processes on real sockets (the onnxruntime
backend, small MLPs): connections spread over the workers, a load through the pool's
control socket swaps every worker or none, /metrics and statistics are the pod's
whichever worker answers, a killed worker comes back serving what the others serve, and
SIGTERM drains every worker and exits 0."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from model_rollout_contract import control
from model_rollout_contract.canary import TrafficPolicy
from model_rollout_e2e.processes import ServerProcess, free_port
from model_server.app import SERVER, ModelServer
from model_server.backends.onnxruntime_backend import OnnxRuntimeBackend
from model_server.config import ModelSpec, ServerConfig, parse_args
from model_server.pool.metrics import GAUGE_MERGE, UNANSWERED, is_created, merge_expositions
from model_server.pool.relay import ControlRelay, WorkerLink, manifest_digests, merged_status
from model_server.pool.statistics import merge_statistics
from model_server.pool.worker import WORKER_HEADER, worker_rate_limits
from model_server.security.rate_limits import RateLimit, TenantRateLimits
from tests.support.server import (
    ADMIN,
    Version,
    add_version,
    ask,
    child_pids,
    command_line,
    infer_body,
    keep_sending,
    sample,
    samples,
    which_version,
)

PROCESSES = 3
CLIENTS = 16
X = np.ones((1, 8), np.float32)
BODY = infer_body(X)
SUCCESS = "model_server_inference_requests_total"


def pool_workers(supervisor: int) -> dict[int, int]:
    """{worker index: pid} of the workers a supervisor runs now (read from /proc)."""
    found: dict[int, int] = {}
    for pid in child_pids(supervisor):
        argv = command_line(pid)
        if b"--worker-index" in argv:
            found[int(argv[argv.index(b"--worker-index") + 1])] = pid
    return found


def pool_dir(supervisor: int) -> Path:
    pid = next(iter(pool_workers(supervisor).values()))
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return Path(argv[argv.index(b"--pool-dir") + 1].decode())


@pytest.fixture
def versions(tmp_path: Path) -> dict[str, Version]:
    root = tmp_path / "models"
    return {v: add_version(root, "mlp", v, seed=i) for i, v in enumerate(("v1", "v2"), 1)}


@contextlib.contextmanager
def running_pool(tmp_path: Path, drain_seconds: float = 1) -> Iterator[ServerProcess]:
    """A pool of PROCESSES workers serving mlp v1, with its control socket."""
    server = ServerProcess(
        tmp_path / "models", ["mlp=v1"], tmp_path / "server.log",
        extra=["--processes", str(PROCESSES), "--control-socket", str(tmp_path / "ctl.sock"),
               "--json-workers", "1", "--drain-seconds", str(drain_seconds),
               "--grpc-port", str(free_port())],
    ).start()  # fmt: skip
    assert server.proc is not None
    supervisor = server.proc.pid
    try:
        yield server
    finally:
        workers = pool_workers(supervisor) if server.running() else {}
        with contextlib.suppress(ProcessLookupError):
            os.kill(supervisor, signal.SIGCONT)  # a test may have stopped it
        server.kill()
        for pid in workers.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def pool(tmp_path: Path, versions: dict[str, Version]) -> Iterator[ServerProcess]:
    with running_pool(tmp_path) as server:
        yield server


async def status(socket: Path) -> dict[str, Any]:
    return await ask(socket, {"op": "status", "model": "mlp"})


async def load(socket: Path, version: Version) -> dict[str, Any]:
    """The reply to the sidecar's load of ``version`` (its file and digest)."""
    return await ask(
        socket,
        {"op": "load", "model": "mlp", "version": version.name, "path": str(version.path),
         "sha256": version.sha256},
    )  # fmt: skip


async def pool_ready(server: ServerProcess, socket: Path) -> None:
    """Every worker serves: the pool's status is ok and a scrape hears every worker."""
    await asyncio.to_thread(server.wait_ready)
    async with asyncio.timeout(60):  # a hang guard
        while True:
            if socket.exists() and (await status(socket)).get("ok"):
                text = await get_text(f"{server.url}/metrics")
                if sample(samples(text), UNANSWERED) == 0:
                    return
            await asyncio.sleep(0.1)


async def get_text(url: str) -> str:
    """A GET on a new connection (so the kernel picks a worker afresh)."""
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        assert response.status == 200, await response.text()
        return await response.text()


async def send(url: str, n: int) -> list[tuple[int, str, dict[str, Any]]]:
    """``n`` requests on one kept-alive connection: (status, worker, answer)."""
    answers = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
        for _ in range(n):
            async with session.post(url, json=BODY) as response:
                answers.append(
                    (response.status, response.headers[WORKER_HEADER], await response.json())
                )
    return answers


async def test_connections_spread_and_metrics_and_statistics_are_the_pods(
    tmp_path: Path, pool: ServerProcess
) -> None:
    await pool_ready(pool, tmp_path / "ctl.sock")
    infer = f"{pool.url}/v2/models/mlp/infer"
    per_client = 10
    results = await asyncio.gather(*(send(infer, per_client) for _ in range(CLIENTS)))
    answers = [a for client in results for a in client]
    assert {status for status, _, _ in answers} == {200}
    workers = {worker for _, worker, _ in answers}
    assert len(workers) > 1, workers  # 16 connections over 3 workers: never all on one
    k = CLIENTS * per_client
    scraped_by: set[str] = set()
    for _ in range(20):  # new connections: scrapes reach several workers
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{pool.url}/metrics") as response:
                scraped_by.add(response.headers[WORKER_HEADER])
                found = samples(await response.text())
            async with session.get(f"{pool.url}/v2/models/mlp/stats") as response:
                stats = (await response.json())["model_stats"]
        assert sample(found, SUCCESS, model="mlp", code="200") == k
        assert sample(found, UNANSWERED) == 0
        assert sample(found, "model_server_version_serving", model="mlp", version="v1") == 1
        assert sample(found, "model_server_versions_loaded", model="mlp") == 1
        assert [(s["version"], s["inference_stats"]["success"]["count"]) for s in stats] == [
            ("v1", k)
        ]
    assert len(scraped_by) > 1, scraped_by
    log = (tmp_path / "server.log").read_text()  # every worker bound the one gRPC port too
    assert log.count("model_server.frontends.grpc.api: serving gRPC on") == PROCESSES


async def test_a_load_swaps_every_worker_under_load(
    tmp_path: Path, pool: ServerProcess, versions: dict[str, Version]
) -> None:
    socket = tmp_path / "ctl.sock"
    await pool_ready(pool, socket)
    infer = f"{pool.url}/v2/models/mlp/infer"
    swapped = asyncio.Event()
    after: list[str] = []
    failures: list[str] = []

    async def client() -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
            while True:
                done = swapped.is_set()  # read before sending: this request follows the reply
                async with session.post(infer, json=BODY) as response:
                    if response.status != 200:
                        failures.append(await response.text())
                        continue
                    served = which_version(versions, X, await response.json())
                if done:
                    after.append(served)
                    if len(after) >= 20 * CLIENTS:
                        return

    clients = [asyncio.create_task(client()) for _ in range(CLIENTS)]
    await asyncio.sleep(0.5)
    reply = await load(socket, versions["v2"])
    swapped.set()
    assert reply["ok"] and reply["from"] == "v1" and reply["to"] == "v2", reply
    await asyncio.wait_for(asyncio.gather(*clients), 120)  # a hang guard
    assert failures == []
    assert set(after) == {"v2"}
    held = await status(socket)
    assert held["ok"] and held["version"] == "v2" and set(held["loaded"]) == {"v1", "v2"}


async def test_killed_worker_is_restarted_and_given_the_pools_version(
    tmp_path: Path, pool: ServerProcess, versions: dict[str, Version]
) -> None:
    socket = tmp_path / "ctl.sock"
    await pool_ready(pool, socket)
    reply = await load(socket, versions["v2"])
    assert reply["ok"], reply
    assert pool.proc is not None
    before = pool_workers(pool.proc.pid)
    directory = pool_dir(pool.proc.pid)
    os.kill(before[1], signal.SIGKILL)  # it comes back on v1: the volume's CURRENT
    infer = f"{pool.url}/v2/models/mlp/infer"
    async with asyncio.timeout(60):  # a hang guard
        while _state(before[1]) != b"Z":
            await asyncio.sleep(0.01)
        answered = resets = 0
        while pool_workers(pool.proc.pid).get(1) in (None, before[1]):
            try:
                answers = await send(infer, 3)  # new connections meanwhile
            except aiohttp.ClientOSError:
                # the kernel may still reset a connection that raced the listener's close
                # (SO_REUSEPORT moves none unless net.ipv4.tcp_migrate_req=1): no answer
                resets += 1
                continue
            for status_code, _, answer in answers:
                assert status_code == 200 and answer["model_version"] == "v2"
                answered += 1
        assert answered > resets, (answered, resets)  # the other workers serve
        while not (await status(socket)).get("ok"):  # busy while they disagree
            await asyncio.sleep(0.1)
    restarted = await ask(directory / "worker-1.sock", {"op": "status", "model": "mlp"})
    assert restarted["ok"] and restarted["version"] == "v2", restarted
    held = await status(socket)
    assert held["version"] == "v2" and held["sha256"] == versions["v2"].sha256
    assert "v2" in held["loaded"]  # the versions every worker holds
    log = (tmp_path / "server.log").read_text()
    assert "pool: worker 1 exited with -9; restarting" in log
    assert "pool: worker 1 given mlp v2" in log


async def test_sigterm_drains_every_worker_and_exits_zero(
    tmp_path: Path, pool: ServerProcess
) -> None:
    await pool_ready(pool, tmp_path / "ctl.sock")
    assert pool.proc is not None
    workers = pool_workers(pool.proc.pid)
    assert sorted(workers) == list(range(PROCESSES))
    infer = f"{pool.url}/v2/models/mlp/infer"
    statuses: list[int] = []
    errors: list[str] = []

    # each until an answer closes its connection (draining)
    clients = [
        asyncio.create_task(keep_sending(infer, BODY, statuses, errors)) for _ in range(CLIENTS)
    ]
    while len(statuses) < 5 * CLIENTS:
        await asyncio.sleep(0.01)
    pool.proc.send_signal(signal.SIGTERM)
    await asyncio.wait_for(asyncio.gather(*clients), 60)  # a hang guard
    assert errors == [] and set(statuses) == {200}, (errors, set(statuses))
    assert await asyncio.to_thread(pool.run_to_end, 60) == 0, pool.log_tail()
    for pid in workers.values():
        assert not Path(f"/proc/{pid}").exists() or b"Z" in _state(pid)
    log = (tmp_path / "server.log").read_text()
    assert log.count("model_server.serving: stopped") == PROCESSES
    assert "pool: every worker stopped" in log


async def killed_and_restarted(server: ServerProcess, index: int) -> int:
    """SIGKILL worker ``index`` and wait until its supervisor has started another: its
    pid (not yet caught up)."""
    assert server.proc is not None
    old = pool_workers(server.proc.pid)[index]
    os.kill(old, signal.SIGKILL)
    async with asyncio.timeout(60):  # a hang guard
        while pool_workers(server.proc.pid).get(index) in (None, old):
            await asyncio.sleep(0.01)
    return pool_workers(server.proc.pid)[index]


async def caught_up(socket: Path) -> dict[str, Any]:
    """The pool's status once every worker agrees again (busy while one catches up)."""
    async with asyncio.timeout(60):  # a hang guard
        while not (held := await status(socket)).get("ok"):
            await asyncio.sleep(0.1)
    return held


async def every_worker(directory: Path) -> dict[int, dict[str, Any]]:
    """Each worker's own status of mlp, asked on its own control socket."""
    return {
        i: await ask(directory / f"worker-{i}.sock", {"op": "status", "model": "mlp"})
        for i in range(PROCESSES)
    }


async def test_a_versionless_rollback_after_a_restart_takes_every_worker_to_one_version(
    tmp_path: Path, pool: ServerProcess, versions: dict[str, Version]
) -> None:
    """v1, v2, v3 through the pool, then worker 2 restarts (on v1, the flag's version) and
    is given v3: a rollback naming no version takes every worker to v2, the version the
    pod served before v3."""
    socket = tmp_path / "ctl.sock"
    versions["v3"] = add_version(tmp_path / "models", "mlp", "v3", seed=3)
    await pool_ready(pool, socket)
    for name in ("v2", "v3"):
        assert (await load(socket, versions[name]))["ok"]
    assert pool.proc is not None
    directory = pool_dir(pool.proc.pid)
    await killed_and_restarted(pool, 2)
    assert (await caught_up(socket))["version"] == "v3"
    reply = await ask(socket, {"op": "rollback", "model": "mlp"})
    assert reply["ok"] and (reply["from"], reply["to"]) == ("v3", "v2"), reply
    held = await every_worker(directory)
    assert {i: h["version"] for i, h in held.items()} == dict.fromkeys(range(PROCESSES), "v2")
    assert (await status(socket))["version"] == "v2"


async def answered(socket: Path) -> dict[str, Any]:
    """A worker's status of mlp on its own control socket; empty while nobody listens."""
    try:
        return await ask(socket, {"op": "status", "model": "mlp"})
    except OSError:
        return {}


def listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a TCP socket listening on ``port`` (from /proc)."""
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
    held = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            held.add(os.readlink(fd))
    return any(f"socket:[{inode}]" in held for inode in inodes)


async def test_a_restarted_worker_takes_no_connection_before_it_has_caught_up(
    tmp_path: Path, pool: ServerProcess, versions: dict[str, Version]
) -> None:
    """Worker 1 restarts on v1 while the pod serves v2; its supervisor is stopped
    (SIGSTOP) before it can give it v2, so the worker is never caught up: it must not
    listen on the pod's port meanwhile, nor answer a request."""
    socket = tmp_path / "ctl.sock"
    await pool_ready(pool, socket)
    assert (await load(socket, versions["v2"]))["ok"]
    assert pool.proc is not None
    supervisor = pool.proc.pid
    directory = pool_dir(supervisor)
    control_file = directory / "worker-1.sock"
    for _ in range(5):  # until the supervisor is stopped before the catch-up could begin
        before = control_file.stat().st_ino
        restarted = await killed_and_restarted(pool, 1)
        os.kill(restarted, signal.SIGSTOP)
        if control_file.stat().st_ino == before:  # its control socket is not up: no catch-up
            break
        os.kill(restarted, signal.SIGCONT)  # it started too fast to catch: once more
        await caught_up(socket)
    else:
        pytest.fail("the restarted worker always had its control socket before SIGSTOP")
    os.kill(supervisor, signal.SIGSTOP)
    os.kill(restarted, signal.SIGCONT)
    log = tmp_path / "server.log"
    bound = log.read_text().count("[worker 1] model_server.serving: serving on")
    async with asyncio.timeout(60):  # a hang guard: its startup loads done, then either
        while (await answered(control_file)).get("version") != "v1":
            await asyncio.sleep(0.05)
        while not (
            log.read_text().count("[worker 1] model_server.serving: serving on") > bound
            or "[worker 1] model_server.serving: loaded: listening once" in log.read_text()
        ):
            await asyncio.sleep(0.05)
    assert not listens(restarted, pool.port)
    infer = f"{pool.url}/v2/models/mlp/infer"
    answers = [a for _ in range(30) for a in await send(infer, 1)]  # new connections
    assert {(code, answer["model_version"]) for code, _, answer in answers} == {(200, "v2")}
    assert "1" not in {worker for _, worker, _ in answers}
    os.kill(supervisor, signal.SIGCONT)
    assert (await caught_up(socket))["version"] == "v2"
    async with asyncio.timeout(60):  # a hang guard
        while not listens(restarted, pool.port):
            await asyncio.sleep(0.05)


async def test_a_restarted_worker_is_given_a_version_loaded_from_another_path(
    tmp_path: Path, pool: ServerProcess, versions: dict[str, Version]
) -> None:
    """The sidecar may announce a version's file anywhere in the repository, not only in
    ``<model>/<version>/``: the catch-up loads it from the same path."""
    socket = tmp_path / "ctl.sock"
    staged = add_version(tmp_path / "models", "mlp", "staged-v3", seed=3)
    versions["v3"] = Version("v3", staged.path, staged.weights, staged.sha256)
    await pool_ready(pool, socket)
    assert (await load(socket, versions["v3"]))["ok"]
    assert pool.proc is not None
    await killed_and_restarted(pool, 1)
    log = tmp_path / "server.log"
    async with asyncio.timeout(60):  # a hang guard
        while not any(
            line in log.read_text()
            for line in ("pool: worker 1 given mlp v3", "pool: worker 1 could not catch up")
        ):
            await asyncio.sleep(0.05)
    assert "pool: worker 1 could not catch up" not in log.read_text()
    held = await caught_up(socket)
    assert (held["version"], held["sha256"]) == ("v3", staged.sha256)


async def test_a_second_sigterm_does_not_cut_the_pools_drain_short(
    tmp_path: Path, versions: dict[str, Version]
) -> None:
    """SIGTERM to the pool's process group twice (as a runtime forwarding a signal to the
    group, then once more): every worker drains as for one SIGTERM, accepting new
    connections for its drain seconds; SIGINT then ends the drains at once."""
    with running_pool(tmp_path, drain_seconds=300) as server:
        await pool_ready(server, tmp_path / "ctl.sock")
        assert server.proc is not None
        group = os.getpgid(server.proc.pid)
        log = tmp_path / "server.log"
        os.killpg(group, signal.SIGTERM)
        async with asyncio.timeout(60):  # a hang guard
            while log.read_text().count("model_server.serving: draining") < PROCESSES:
                await asyncio.sleep(0.05)
        os.killpg(group, signal.SIGTERM)
        infer = f"{server.url}/v2/models/mlp/infer"
        answers = []
        for _ in range(10 * PROCESSES):  # new connections, as from clients not yet told
            try:
                answers += await send(infer, 1)
            except aiohttp.ClientError as exc:
                pytest.fail(f"{len(answers)} answers, then {exc!r}")
        assert {(code, answer["model_version"]) for code, _, answer in answers} == {(200, "v1")}
        os.kill(server.proc.pid, signal.SIGINT)
        assert await asyncio.to_thread(server.run_to_end, 60) == 0, server.log_tail()
        assert log.read_text().count("model_server.serving: stopped") == PROCESSES


def _state(pid: int) -> bytes:
    with contextlib.suppress(FileNotFoundError):
        return Path(f"/proc/{pid}/stat").read_bytes().split(b") ", 1)[1][:1]
    return b"Z"


# -- the relay with one worker that refuses ------------------------------------------


@contextlib.asynccontextmanager
async def in_process_server(config: ServerConfig) -> AsyncIterator[TestClient]:
    async with TestClient(TestServer(ModelServer(config).make_app())) as client:
        yield client


async def test_a_load_one_worker_refuses_leaves_every_worker_on_the_old_version(
    tmp_path: Path,
) -> None:
    """Two servers behind a relay, on v1 under a canary policy (stable v0); the second's
    memory budget holds v0 and v1 but not v1 and the larger v2, so it refuses v2: the
    first is put back on v1 with its policy, and the reply is the refusal."""
    root = tmp_path / "models"
    add_version(root, "mlp", "v0", seed=3)
    v1 = add_version(root, "mlp", "v1", seed=1)
    v2 = add_version(root, "mlp", "v2", seed=2, hidden=512)
    factor = OnnxRuntimeBackend.memory_factor  # the backend's estimate per file byte
    small = 2.5 * factor * v1.path.stat().st_size / 2**20  # MB: v0 and v1, not v2
    configs = [
        ServerConfig(
            repository=root,
            models=[ModelSpec("mlp", "v0")],
            control_socket=tmp_path / f"w{i}.sock",
            memory_budget_mb=budget,
        )
        for i, budget in enumerate((None, small))
    ]
    async with in_process_server(configs[0]), in_process_server(configs[1]):
        links = [WorkerLink(i, Path(str(c.control_socket))) for i, c in enumerate(configs)]
        for link in links:
            link.healthy.set()
        relay = ControlRelay(links, manifest_digests(root))
        policy = TrafficPolicy("v0", "v1", 10, 0)
        canary = await relay.handle(control.LoadRequest("mlp", "v1", None, v1.sha256, policy))
        assert isinstance(canary, control.SwapReply), canary
        refused = await relay.handle(control.LoadRequest("mlp", "v2", str(v2.path), v2.sha256))
        assert isinstance(refused, control.ErrorReply)
        assert refused.code == "memory_budget_exceeded", refused
        for link in links:
            held = await link.ask(control.StatusRequest("mlp"))
            assert isinstance(held, control.StatusReply), held
            assert (held.version, held.policy) == ("v1", policy), (link.index, held)
        after = await relay.handle(control.StatusRequest("mlp"))
        assert isinstance(after, control.StatusReply) and after.version == "v1", after


async def test_a_versionless_rollback_is_one_version_for_every_worker(tmp_path: Path) -> None:
    """Two servers behind a relay that hold different versions to roll back to (the
    first served v1, v2, v3; the second, restarted, v1 then v3): a rollback naming no
    version is resolved to one version for both, and the second, which does not hold
    the first's v2, refuses it: nobody moves, the reply is the refusal."""
    root = tmp_path / "models"
    found = {v: add_version(root, "mlp", v, seed=i) for i, v in enumerate(("v1", "v2", "v3"))}
    configs = [
        ServerConfig(
            repository=root, models=[ModelSpec("mlp", "v1")], control_socket=tmp_path / f"w{i}.sock"
        )
        for i in range(2)
    ]
    async with in_process_server(configs[0]), in_process_server(configs[1]):
        links = [WorkerLink(i, Path(str(c.control_socket))) for i, c in enumerate(configs)]
        for link, history in zip(links, (("v2", "v3"), ("v3",)), strict=True):
            for name in history:
                v = found[name]
                swap = await link.ask(control.LoadRequest("mlp", name, str(v.path), v.sha256))
                assert isinstance(swap, control.SwapReply), swap
            link.healthy.set()
        relay = ControlRelay(links, manifest_digests(root))
        reply = await relay.handle(control.RollbackRequest("mlp"))
        assert isinstance(reply, control.ErrorReply) and reply.code == "conflict", reply
        for link in links:
            held = await link.ask(control.StatusRequest("mlp"))
            assert isinstance(held, control.StatusReply) and held.version == "v3", held


def test_status_of_workers_that_disagree_is_busy() -> None:
    policy = TrafficPolicy("v1", "v2", 10, 0)
    a = control.StatusReply("mlp", "v2", "aa", ("v1", "v2"), policy, True)
    b = control.StatusReply("mlp", "v2", "aa", ("v2", "v1"), policy, True)
    assert merged_status([a, b]) == a
    c = control.StatusReply("mlp", "v2", "aa", ("v2",), policy, True)
    merged = merged_status([a, c])
    assert isinstance(merged, control.StatusReply) and merged.loaded == ("v2",)
    for other in (
        control.StatusReply("mlp", "v1", "bb", ("v1", "v2"), None, True),
        control.StatusReply("mlp", "v2", "aa", ("v1", "v2"), None, True),
        control.ErrorReply("down", "unavailable"),
    ):
        merged = merged_status([a, other])
        assert isinstance(merged, control.ErrorReply) and merged.code == control.BUSY


# -- merging what the workers count ---------------------------------------------------


async def test_every_gauge_a_server_registers_has_a_merge_rule(
    server_config: ServerConfig,
) -> None:
    server_config.tenants_file = None
    async with in_process_server(server_config) as client:
        response = await client.post("/v2/models/mlp/infer", json=BODY)
        assert response.status == 200
        text = generate_latest(client.app[SERVER].metrics.registry).decode()
    families = text_string_to_metric_families(text)
    gauges = {f.name for f in families if f.type == "gauge" and not is_created(f.name)}
    assert gauges and gauges <= set(GAUGE_MERGE), gauges - set(GAUGE_MERGE)


def test_merged_exposition_sums_counts_and_takes_the_max_of_flags() -> None:
    latency = "model_server_inference_request_duration_seconds"

    def worker(requests: int, in_flight: int, memory: int) -> str:
        return (
            "# TYPE model_server_inference_requests counter\n"
            f'model_server_inference_requests_total{{code="200",model="m"}} {requests}\n'
            'model_server_inference_requests_created{code="200",model="m"} 1.7e9\n'
            f"# TYPE {latency} histogram\n"
            f'{latency}_bucket{{le="0.1",model="m"}} {requests}\n'
            f'{latency}_bucket{{le="+Inf",model="m"}} {requests}\n'
            f'{latency}_sum{{model="m"}} {requests / 100}\n'
            f'{latency}_count{{model="m"}} {requests}\n'
            "# TYPE model_server_inference_requests_in_flight gauge\n"
            f'model_server_inference_requests_in_flight{{model="m"}} {in_flight}\n'
            "# TYPE model_server_version_serving gauge\n"
            'model_server_version_serving{model="m",version="v2"} 1\n'
            "# TYPE model_server_memory_bytes gauge\n"
            f'model_server_memory_bytes{{model="m"}} {memory}\n'
        )

    merged = merge_expositions([worker(3, 1, 100), worker(4, 2, 100)], unanswered=1).decode()
    found = samples(merged)
    assert sample(found, SUCCESS, code="200", model="m") == 7
    assert "_created" not in merged
    assert sample(found, f"{latency}_bucket", le="0.1", model="m") == 7
    assert sample(found, f"{latency}_count", model="m") == 7
    assert sample(found, f"{latency}_sum", model="m") == pytest.approx(0.07)
    assert sample(found, "model_server_inference_requests_in_flight", model="m") == 3
    assert sample(found, "model_server_version_serving", model="m", version="v2") == 1
    assert sample(found, "model_server_memory_bytes", model="m") == 200
    assert sample(found, UNANSWERED) == 1


def test_merged_statistics_sum_per_version() -> None:
    def stat(version: str, n: int, last: int, batch: int) -> dict[str, Any]:
        d = {"count": n, "ns": 10 * n}
        return {
            "name": "m", "version": version, "last_inference": last,
            "inference_count": n, "execution_count": n,
            "inference_stats": {"success": dict(d), "fail": {"count": 0, "ns": 0}},
            "batch_stats": [{"batch_size": batch, "compute_infer": dict(d)}],
        }  # fmt: skip

    a = {"model_stats": [stat("v1", 2, 5, 1), stat("v2", 1, 9, 1)]}
    b = {"model_stats": [stat("v1", 3, 7, 2)]}
    merged = merge_statistics([a, b])["model_stats"]
    assert [(s["version"], s["inference_count"], s["last_inference"]) for s in merged] == [
        ("v1", 5, 7), ("v2", 1, 9)
    ]  # fmt: skip
    assert merged[0]["inference_stats"]["success"] == {"count": 5, "ns": 50}
    assert [b["batch_size"] for b in merged[0]["batch_stats"]] == [1, 2]
    assert a["model_stats"][0]["inference_count"] == 2  # the inputs are left as they were


async def test_a_pool_worker_refuses_admin_swaps_over_http(
    tmp_path: Path, server_config: ServerConfig
) -> None:
    server_config.worker_index, server_config.pool_size = 0, 2
    server_config.pool_dir = tmp_path / "pool"
    async with in_process_server(server_config) as client:
        for path in ("/v1/reload?target_version=v2", "/v2/repository/models/mlp/unload"):
            response = await client.post(path, headers=ADMIN)
            assert response.status == 409, await response.text()
            answer = await response.json()
            assert answer["code"] == "conflict" and "control socket" in answer["error"]
        assert (await client.get("/v2/health/ready")).headers[WORKER_HEADER] == "0"


def test_each_worker_gets_its_share_of_every_tenants_rate_limit() -> None:
    limits = TenantRateLimits({"a": RateLimit(10.0, 5), "b": RateLimit(3.0, 1)})
    shared = worker_rate_limits(limits, 3)
    assert {t: b.limit for t, b in shared.buckets.items()} == {
        "a": RateLimit(10.0 / 3, 2),  # burst 5/3 rounded up
        "b": RateLimit(1.0, 1),
    }
    assert shared.on_limited is limits.on_limited


def test_a_pool_needs_fixed_ports(tmp_path: Path) -> None:
    for ports in (["--port", "0"], ["--grpc-port", "0"]):
        with pytest.raises(SystemExit):
            parse_args(["--repository", str(tmp_path), "--processes", "2", *ports])
    config = parse_args(["--repository", str(tmp_path), "--processes", "2", "--port", "8000"])
    assert (config.processes, config.in_pool) == (2, False)  # the supervisor


def test_each_worker_keeps_its_share_of_the_spare_copies(tmp_path: Path) -> None:
    """--spare-copy-mb is the pod's, as --memory-budget-mb is: each of N workers keeps
    1/N of it (N workers each keeping all of it would hold N times what was asked)."""
    config = ServerConfig(repository=tmp_path, spare_copy_mb=1024, pool_size=4, worker_index=0)
    config.pool_dir = tmp_path / "pool"
    server = ModelServer(config, OnnxRuntimeBackend())
    try:
        assert server.repository.spares is not None
        assert server.repository.spares.budget_bytes == 256 * 2**20
    finally:
        server.repository.close()
