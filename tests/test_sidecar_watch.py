"""Watch mode's signal path without S3: the pod followed through the (emulated) API, the
Downward API file only as the fallback, the sidecar's report, and fast refusals."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from model_rollout_contract.annotations import TARGET_VERSION
from model_rollout_e2e.kube_emulator import EmulatedCluster, kube_emulator
from model_rollout_e2e.processes import free_port
from model_server.app import ModelServer
from model_server.config import ModelSpec, ServerConfig
from model_sidecar.cli import _watch
from model_sidecar.config import WatchConfig, parse_args
from model_sidecar.kube import PodApi, PodSnapshot
from model_sidecar.pod_watch import PodWatch
from model_sidecar.retry import Backoff
from model_sidecar.store import LocalStore
from model_sidecar.target import TargetSource
from sidecar_helpers import make_fetcher, make_keys, make_watcher, publish_versions, set_target

NS, POD = "ml", "mlp-000"
POD_PATH = f"/api/v1/namespaces/{NS}/pods/{POD}"


@pytest.fixture
async def cluster() -> AsyncIterator[EmulatedCluster]:
    async with kube_emulator() as api:
        await api.request(
            "POST",
            f"/api/v1/namespaces/{NS}/pods",
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": POD, "namespace": NS}},
        )
        yield api


async def set_pod_target(api: EmulatedCluster, version: str) -> None:
    await api.merge_patch(POD_PATH, {"metadata": {"annotations": {TARGET_VERSION: version}}})


async def until(predicate, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.02)


async def start_server(volume: Path, socket: Path, model: str = "mlp") -> TestClient:
    config = ServerConfig(repository=volume, models=[ModelSpec(model)], control_socket=socket)
    client = TestClient(TestServer(ModelServer(config).make_app()))
    await client.start_server()
    return client


async def test_the_pod_watch_follows_the_api_and_relists_after_410(
    cluster: EmulatedCluster,
) -> None:
    pod = PodApi.connect(cluster.url, NS, POD)
    assert pod is not None
    watch = PodWatch(pod, watch_timeout_s=1)  # short server-side timeouts: many resumptions
    stop = asyncio.Event()
    following = asyncio.create_task(watch.run(stop))
    try:
        await until(lambda: watch.annotations is not None)
        for version in ("v2", "v3"):
            watch.changed.clear()
            await set_pod_target(cluster, version)
            await until(watch.changed.is_set)
            assert watch.annotations is not None and watch.annotations[TARGET_VERSION] == version
        assert cluster.emulator is not None
        cluster.emulator.compact()  # the version the next watch resumes from is gone
        await asyncio.sleep(1.5)  # the server ends the open watch; resuming gets 410 Gone
        await set_pod_target(cluster, "v4")
        await until(lambda: (watch.annotations or {}).get(TARGET_VERSION) == "v4")
        assert watch.relists >= 1
    finally:
        stop.set()
        await following
        await pod.close()


async def test_an_unexpected_failure_is_an_api_failure_and_following_goes_on(
    cluster: EmulatedCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever goes wrong in following the pod, foreseen or not (here a defect in
    reading it, twice), is logged, paused for and retried like any API failure; the view
    is stale meanwhile, and the pod's new target is followed once it works again."""
    read, defects = PodApi.read, [RuntimeError("a defect"), TypeError("another")]
    between: list[tuple[bool, float, int]] = []  # the view as the second read began

    async def flaky(self: PodApi) -> PodSnapshot:
        if len(defects) == 1:
            between.append((watch.current, watch.stale_seconds(), watch.failures))
        if defects:
            raise defects.pop(0)
        return await read(self)

    monkeypatch.setattr(PodApi, "read", flaky)
    pod = PodApi.connect(cluster.url, NS, POD)
    assert pod is not None
    watch = PodWatch(pod, backoff=Backoff(base_s=0.05, max_s=0.1))
    stop = asyncio.Event()
    following = asyncio.create_task(watch.run(stop))
    try:
        await until(lambda: watch.current)
        [(current, stale_s, failures)] = between
        assert not current and stale_s > 0 and failures == 1
        await set_pod_target(cluster, "v5")
        await until(lambda: (watch.annotations or {}).get(TARGET_VERSION) == "v5")
        assert watch.current and watch.stale_seconds() == 0 and not following.done()
    finally:
        stop.set()
        await following
        await pod.close()


async def test_the_sidecar_exits_non_zero_if_following_its_pod_ever_ends(
    cluster: EmulatedCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Following the pod retries every failure and never ends by itself; should it end
    all the same (a defect), the view would freeze on the old target for good: the
    sidecar exits non-zero instead, so that the pod restarts."""

    async def defect(self: PodWatch) -> None:
        raise RuntimeError("a defect in following the pod")

    monkeypatch.setattr(PodWatch, "_follow", defect)
    config = parse_args(
        ["watch", "--store", (tmp_path / "store").as_uri(), "--volume", str(tmp_path / "volume"),
         "--model", "mlp", "--allow-unsigned", "--control-socket", str(tmp_path / "ctl.sock"),
         "--start-jitter-seconds", "0", "--kube-api", cluster.url, "--pod-namespace", NS,
         "--pod-name", POD]
    )  # fmt: skip
    assert isinstance(config, WatchConfig)
    async with asyncio.timeout(60):
        assert await _watch(config) == 1


async def test_while_the_api_is_unreachable_the_downward_file_is_used(tmp_path: Path) -> None:
    pod = PodApi.connect(f"http://127.0.0.1:{free_port()}", NS, POD)  # nothing listens
    assert pod is not None
    watch = PodWatch(pod, backoff=Backoff(base_s=0.05, max_s=0.1))
    podinfo = tmp_path / "annotations"
    set_target(podinfo, "v7")
    source = TargetSource(podinfo, None, watch.view)
    stop = asyncio.Event()
    following = asyncio.create_task(watch.run(stop))
    try:
        await until(lambda: watch.failures >= 2)  # it tried, and again after a pause
        assert watch.view() is None and source.target() == "v7"
    finally:
        stop.set()
        await following
        await pod.close()


async def test_a_target_from_the_api_is_served_though_the_file_is_stale(
    cluster: EmulatedCluster, tmp_path: Path
) -> None:
    keys = make_keys(tmp_path / "keys")
    store = LocalStore(tmp_path / "store")
    publish_versions(store, keys, tmp_path, {"v1": 1, "v2": 2})
    volume, podinfo = tmp_path / "volume", tmp_path / "podinfo"
    set_target(podinfo, "v1")  # the kubelet wrote it at start and has not refreshed it since
    fetcher = make_fetcher(store, keys, volume)
    await fetcher.fetch("mlp", "v1")
    (volume / "mlp" / "CURRENT").write_text("v1\n")
    server = await start_server(volume, tmp_path / "ctl.sock")
    pod = PodApi.connect(cluster.url, NS, POD)
    assert pod is not None
    watch = PodWatch(pod)
    watcher = make_watcher(fetcher, tmp_path / "ctl.sock", podinfo, tmp_path / "status.json")
    watcher.source = TargetSource(podinfo, None, watch.view)
    watcher.wake = watch.changed
    stop = asyncio.Event()
    tasks = [asyncio.create_task(watch.run(stop)), asyncio.create_task(watcher.run(stop))]
    try:
        await set_pod_target(cluster, "v2")
        status_file = tmp_path / "status.json"

        def serving(version: str) -> bool:
            if not status_file.exists():
                return False
            report = json.loads(status_file.read_text())
            return bool(report["serving"] == version and report["state"] == "ok")

        await until(lambda: serving("v2"))
        report = json.loads(status_file.read_text())
        assert report["retained"] == ["v1"] and report["target_seen_at"] > 0
        assert "v1" in podinfo.read_text()  # the file never said v2
        await set_pod_target(cluster, "v1")  # a rollback to what the server still holds
        await until(lambda: serving("v1"))
        assert json.loads(status_file.read_text())["retained"] == ["v2"]
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        await pod.close()
        await server.close()


async def test_a_server_that_does_not_serve_the_model_is_a_refusal_not_a_wait(
    tmp_path: Path,
) -> None:
    keys = make_keys(tmp_path / "keys")
    store = LocalStore(tmp_path / "store")
    publish_versions(store, keys, tmp_path, {"v1": 1})
    volume, podinfo = tmp_path / "volume", tmp_path / "podinfo"
    set_target(podinfo, "v1")
    server = await start_server(volume, tmp_path / "ctl.sock", model="another")
    try:
        watcher = make_watcher(
            make_fetcher(store, keys, volume), tmp_path / "ctl.sock", podinfo, tmp_path / "s.json"
        )
        assert await watcher.step() == "refused"
        report = json.loads((tmp_path / "s.json").read_text())
        assert report["state"] == "refused" and "not served" in report["reason"], report
    finally:
        await server.close()
