"""SIGTERM (issue 13): readiness turns 503 at once while the server keeps serving for
``--drain-seconds`` (answers close their kept-alive connections), then it stops
listening, lets the requests in flight finish, and exits with status 0. A real server
process, real keep-alive clients sending throughout."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from pathlib import Path

import aiohttp
import numpy as np

from model_rollout_e2e.processes import ServerProcess
from tests.support.server import add_version, infer_body, keep_sending, output_of, worker_processes

CLIENTS = 8
JSON = {"Content-Type": "application/json"}


async def get_status(url: str) -> int | None:
    """The status of a GET on a new connection; ``None`` if no connection is accepted."""
    try:
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            return response.status
    except aiohttp.ClientConnectionError:
        return None


async def test_sigterm_drains_then_finishes_in_flight_requests(tmp_path: Path) -> None:
    root = tmp_path / "models"
    v1 = add_version(root, "mlp", "v1", seed=1)
    server = ServerProcess(
        root, ["mlp=v1"], tmp_path / "server.log",
        extra=["--drain-seconds", "3", "--json-workers", "1"],
    ).start()  # fmt: skip
    try:
        await asyncio.to_thread(server.wait_ready)
        infer = f"{server.url}/v2/models/mlp/infer"
        x = np.random.default_rng(2).standard_normal((40_000, 8)).astype(np.float32)
        big = json.dumps(infer_body(x)).encode()  # decoded in the JSON worker
        async with (
            aiohttp.ClientSession() as session,
            session.post(infer, data=big, headers=JSON) as response,
        ):
            assert response.status == 200
        assert server.proc is not None
        workers = worker_processes(server.proc.pid)
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)  # so the next large request stays in flight
        slow_session = aiohttp.ClientSession()
        slow = asyncio.create_task(slow_session.post(infer, data=big, headers=JSON))
        await _until_in_flight(server.url, 1)  # its body read, its decode held: before SIGTERM
        statuses: list[int] = []
        errors: list[str] = []
        small = infer_body(np.ones((1, 8), np.float32))
        clients = [
            asyncio.create_task(keep_sending(infer, small, statuses, errors))
            for _ in range(CLIENTS)
        ]
        while len(statuses) < 5 * CLIENTS:  # every connection is kept alive by now
            await asyncio.sleep(0.01)
            assert not errors, errors

        server.proc.send_signal(signal.SIGTERM)
        ready = await get_status(f"{server.url}/v2/health/ready")
        while ready == 200:  # the signal is handled on the server's event loop
            ready = await get_status(f"{server.url}/v2/health/ready")
        assert ready == 503  # unready, and still accepting connections
        assert await get_status(f"{server.url}/v2/health/live") == 200
        await asyncio.gather(*clients)  # each told, by Connection: close, to go elsewhere
        assert errors == [] and set(statuses) == {200}, (errors, set(statuses))

        while await get_status(f"{server.url}/v2/health/live") is not None:
            await asyncio.sleep(0.05)  # the drain is over: no new connections
        assert server.running() and not slow.done()  # the large request is still in flight
        assert workers, "no JSON worker process to hold a request in flight"
        for pid in workers:
            os.kill(pid, signal.SIGCONT)
        response = await slow
        assert response.status == 200, await response.text()
        np.testing.assert_allclose(output_of(await response.json()), v1.expected(x), atol=1e-4)
        await slow_session.close()
        assert await asyncio.to_thread(server.run_to_end, 60) == 0, server.log_tail()
    finally:
        server.kill()


async def test_requests_in_flight_get_the_grace_the_pod_leaves_then_are_cancelled(
    tmp_path: Path,
) -> None:
    """After the drain the pod's grace leaves ``--inflight-grace-seconds`` (the contract's
    INFLIGHT_GRACE_SECONDS unless told) before the kubelet's SIGKILL: a request still
    running then is cancelled, the server says so and exits 0 (it used to wait 60 s,
    three times what the pod allows)."""
    root = tmp_path / "models"
    add_version(root, "mlp", "v1", seed=1)
    server = ServerProcess(
        root, ["mlp=v1"], tmp_path / "server.log",
        extra=["--drain-seconds", "0", "--inflight-grace-seconds", "1", "--json-workers", "1"],
    ).start()  # fmt: skip
    workers: list[int] = []
    try:
        await asyncio.to_thread(server.wait_ready)
        infer = f"{server.url}/v2/models/mlp/infer"
        x = np.random.default_rng(5).standard_normal((40_000, 8)).astype(np.float32)
        big = json.dumps(infer_body(x)).encode()
        async with aiohttp.ClientSession() as session:
            async with session.post(infer, data=big, headers=JSON) as response:
                assert response.status == 200
            assert server.proc is not None
            workers = worker_processes(server.proc.pid)
            for pid in workers:
                os.kill(pid, signal.SIGSTOP)  # the next large request never finishes
            stuck = asyncio.create_task(session.post(infer, data=big, headers=JSON))
            await _until_in_flight(server.url, 1)
            server.proc.send_signal(signal.SIGTERM)
            # a hang guard, far beyond the grace: the assertion is on what the log says
            assert await asyncio.to_thread(server.run_to_end, 120) == 0, server.log_tail()
            log = (tmp_path / "server.log").read_text()
            assert "1 request(s) still in flight after the 1 s grace: cancelling them" in log
            try:
                answer = await stuck
                assert answer.status >= 500  # cut short, never a made-up answer
            except aiohttp.ClientError:
                pass  # or the connection closed without an answer
    finally:
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        server.kill()


async def _until_in_flight(url: str, requests: int) -> None:
    """Wait until the server's gauge says ``requests`` inference requests are in flight."""
    gauge = f'model_server_inference_requests_in_flight{{model="mlp"}} {float(requests)}'
    while gauge not in await _text(f"{url}/metrics"):
        await asyncio.sleep(0.05)


async def _text(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return await response.text()
