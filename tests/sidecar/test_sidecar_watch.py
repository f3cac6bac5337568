"""Watch mode's signal path without S3: the pod followed through a real API server (as the
pod's ServiceAccount, its token bound to the pod), the Downward API file only as the
fallback, the sidecar's report, and fast refusals."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from model_rollout_contract.annotations import TARGET_VERSION
from model_rollout_e2e.control_plane import ControlPlane
from model_rollout_e2e.fault_proxy import Fault, FaultProxy
from model_rollout_e2e.processes import free_port
from model_sidecar.cli import _watch
from model_sidecar.config import WatchConfig, parse_args
from model_sidecar.kube import PodApi, PodSnapshot
from model_sidecar.pod_watch import PodWatch
from model_sidecar.retry import Backoff
from model_sidecar.store import LocalStore
from model_sidecar.target import TargetSource
from tests.support.sidecar import (
    make_fetcher,
    make_keys,
    make_watcher,
    publish_versions,
    set_target,
    start_server,
)
from tests.support.sidecar_pod import SidecarPod, api_client, sidecar_pod

NS, POD = "ml", "mlp-000"


@pytest.fixture(scope="module")
def pod(control_plane: ControlPlane) -> Iterator[SidecarPod]:
    with sidecar_pod(control_plane, "sidecar-watch", POD) as created:
        yield created


async def until(predicate, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.02)


async def test_the_pod_watch_follows_the_api_and_relists_after_410(pod: SidecarPod) -> None:
    """The API server ends each watch after 2 s (many resumptions); then the watch open
    is cut and resuming it meets 410 Gone (the fault proxy answers as the API server does
    once etcd has compacted that resourceVersion away): the pod is read again."""
    cluster = pod.cluster
    async with FaultProxy(cluster.server, cluster.pki.ca.cert) as proxy:
        api = PodApi(await api_client(pod.sidecar, proxy.url), pod.namespace, pod.name)
        watch = PodWatch(api, watch_timeout_s=2)
        stop = asyncio.Event()
        following = asyncio.create_task(watch.run(stop))
        try:
            await until(lambda: watch.annotations is not None)
            for version in ("v2", "v3"):
                watch.changed.clear()
                await asyncio.to_thread(pod.set_target, version)
                await until(watch.changed.is_set)
                assert watch.annotations is not None
                assert watch.annotations[TARGET_VERSION] == version
            await until(lambda: proxy.open_watches == 1)
            proxy.fault = Fault("gone")  # the version the next watch resumes from is gone
            proxy.cut()
            await until(lambda: watch.relists >= 1)
            proxy.fault = None
            await asyncio.to_thread(pod.set_target, "v4")
            await until(lambda: (watch.annotations or {}).get(TARGET_VERSION) == "v4")
            assert watch.relists >= 1
        finally:
            stop.set()
            await following
            await api.close()


async def test_an_unexpected_failure_is_an_api_failure_and_following_goes_on(
    pod: SidecarPod, monkeypatch: pytest.MonkeyPatch
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
    api = PodApi(await api_client(pod.sidecar), pod.namespace, pod.name)
    watch = PodWatch(api, backoff=Backoff(base_s=0.05, max_s=0.1))
    stop = asyncio.Event()
    following = asyncio.create_task(watch.run(stop))
    try:
        await until(lambda: watch.current)
        [(current, stale_s, failures)] = between
        assert not current and stale_s > 0 and failures == 1
        await asyncio.to_thread(pod.set_target, "v5")
        await until(lambda: (watch.annotations or {}).get(TARGET_VERSION) == "v5")
        assert watch.current and watch.stale_seconds() == 0 and not following.done()
    finally:
        stop.set()
        await following
        await api.close()


async def test_the_sidecar_exits_non_zero_if_following_its_pod_ever_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
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
         "--start-jitter-seconds", "0", "--kube-api", f"http://127.0.0.1:{free_port()}",
         "--pod-namespace", NS,
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
    pod: SidecarPod, tmp_path: Path
) -> None:
    keys = make_keys(tmp_path / "keys")
    store = LocalStore(tmp_path / "store")
    publish_versions(store, keys, tmp_path, {"v1": 1, "v2": 2})
    volume, podinfo = tmp_path / "volume", tmp_path / "podinfo"
    set_target(podinfo, "v1")  # the kubelet wrote it at start and has not refreshed it since
    fetcher = make_fetcher(store, keys, volume)
    await fetcher.fetch("mlp", "v1")
    (volume / "mlp" / "CURRENT").write_text("v1\n")
    pod.set_target("v1")
    server = await start_server(volume, tmp_path / "ctl.sock")
    api = PodApi(await api_client(pod.sidecar), pod.namespace, pod.name)
    watch = PodWatch(api)
    watcher = make_watcher(fetcher, tmp_path / "ctl.sock", podinfo, tmp_path / "status.json")
    watcher.source = TargetSource(podinfo, None, watch.view)
    watcher.wake = watch.changed
    stop = asyncio.Event()
    tasks = [asyncio.create_task(watch.run(stop)), asyncio.create_task(watcher.run(stop))]
    try:
        await asyncio.to_thread(pod.set_target, "v2")
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
        await asyncio.to_thread(pod.set_target, "v1")  # a rollback to what the server holds
        await until(lambda: serving("v1"))
        assert json.loads(status_file.read_text())["retained"] == ["v2"]
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        await api.close()
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
