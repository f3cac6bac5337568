"""Issue 11, the sidecar's half of the exact traffic share: the pod's traffic policy
relayed to the real server over its control socket once the server serves the
candidate, cleared at promotion or when the target moves on, given back (with the stable
version) to a restarted server, a malformed one reported and ignored, and the stable
version kept on the volume while a policy names it.

The server's policy is read where the server shows it (``/v1/models/<m>/health``) and
seen in its answers: under ``trafficPercent`` 0 every request is answered by the
stable version, though the candidate is the one serving."""

from __future__ import annotations

import asyncio
import json
import shutil
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp.test_utils import TestClient

from helpers import ask, infer_body
from model_rollout_contract.annotations import TARGET_VERSION
from model_rollout_contract.canary import TRAFFIC_POLICY, TrafficPolicy
from model_rollout_e2e.kube_emulator import EmulatedCluster, kube_emulator
from model_rollout_e2e.processes import ChildProcess, ServerProcess, wait_until
from model_sidecar.fetcher import Fetcher
from model_sidecar.kube import PodApi
from model_sidecar.pod_watch import PodWatch
from model_sidecar.store import LocalStore
from model_sidecar.target import TargetSource
from model_sidecar.watch import Watcher
from sidecar_helpers import (
    make_fetcher,
    make_keys,
    make_watcher,
    publish_versions,
    read_status,
    set_target,
    start_server,
)

X = np.random.default_rng(11).standard_normal((1, 8)).astype(np.float32)
ALL_STABLE = TrafficPolicy("v1", "v2", traffic_percent=0)  # the stable one answers all


class Pod:
    """One pod's volume, annotations file, status file and control socket, with a real
    server and a watcher on them."""

    def __init__(self, tmp_path: Path, versions: dict[str, int]) -> None:
        keys = make_keys(tmp_path / "keys")
        self.store = LocalStore(tmp_path / "store")
        publish_versions(self.store, keys, tmp_path, versions)
        self.volume, self.podinfo = tmp_path / "volume", tmp_path / "annotations"
        self.status_file, self.socket = tmp_path / "status.json", tmp_path / "ctl.sock"
        self.fetcher: Fetcher = make_fetcher(self.store, keys, self.volume)
        self.watcher: Watcher = make_watcher(
            self.fetcher, self.socket, self.podinfo, self.status_file
        )
        self.server: TestClient | None = None

    async def start(self, serving: str, **settings: Any) -> None:
        """Pre-pull ``serving`` (as init does) and start the server on it."""
        await self.fetcher.fetch("mlp", serving)
        (self.volume / "mlp" / "CURRENT").write_text(f"{serving}\n")
        await self.restart(**settings)

    async def restart(self, **settings: Any) -> None:
        if self.server is not None:
            await self.server.close()
        self.server = await start_server(self.volume, self.socket, **settings)

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()

    async def health(self) -> dict[str, Any]:
        assert self.server is not None
        answer: dict[str, Any] = await (await self.server.get("/v1/models/mlp/health")).json()
        return answer

    async def answered_by(self, requests: int = 20) -> set[str]:
        assert self.server is not None
        versions = set()
        for _ in range(requests):
            response = await self.server.post("/v2/models/mlp/infer", json=infer_body(X))
            assert response.status == 200, await response.text()
            versions.add((await response.json())["model_version"])
        return versions

    def report(self) -> dict[str, Any]:
        return read_status(self.status_file)

    def sent(self, result: str) -> float:
        value: float = self.watcher.metrics.policies.labels("mlp", result)._value.get()
        return value


@pytest.fixture
async def pod(tmp_path: Path) -> AsyncIterator[Pod]:
    pod = Pod(tmp_path, {"v1": 1, "v2": 2, "v3": 3})
    yield pod
    await pod.close()


async def test_the_policy_reaches_the_server_once_it_serves_the_candidate_and_goes_at_promotion(
    pod: Pod,
) -> None:
    await pod.start("v1")
    set_target(pod.podinfo, "v1")
    assert await pod.watcher.step() == "ok"
    assert (await pod.health())["traffic"] is None

    set_target(pod.podinfo, "v2", ALL_STABLE)  # the operator's canary stage
    assert await pod.watcher.step() == "ok"
    health = await pod.health()
    assert (health["version"], health["traffic"]) == ("v2", ALL_STABLE.to_json())
    assert await pod.answered_by() == {"v1"}  # the split is the server's, by the policy
    report = pod.report()
    assert (report["state"], report["serving"], report["code"]) == ("ok", "v2", None)
    assert report["retained"] == ["v1"]

    assert await pod.watcher.step() == "ok"  # nothing changed: not sent again
    assert pod.sent("set") == 1

    set_target(pod.podinfo, "v2")  # promotion: the annotation is gone
    assert await pod.watcher.step() == "ok"
    assert (await pod.health())["traffic"] is None
    assert await pod.answered_by() == {"v2"}
    assert pod.sent("cleared") >= 1


async def test_a_restarted_server_gets_the_stable_version_and_the_policy_back(
    pod: Pod,
) -> None:
    await pod.start("v1")
    set_target(pod.podinfo, "v2", ALL_STABLE)
    assert await pod.watcher.step() == "ok"
    assert (await pod.health())["traffic"] == ALL_STABLE.to_json()

    await pod.restart()  # a crash: the new server loads CURRENT (v2) alone, no policy
    fresh = await pod.health()
    assert (fresh["version"], fresh["retained"], fresh["traffic"]) == ("v2", [], None)
    assert await pod.answered_by() == {"v2"}

    assert await pod.watcher.step() == "ok"
    health = await pod.health()
    assert (health["version"], health["retained"]) == ("v2", ["v1"])
    assert health["traffic"] == ALL_STABLE.to_json()
    assert await pod.answered_by() == {"v1"}
    assert (pod.volume / "mlp" / "CURRENT").read_text() == "v2\n"  # still the candidate


async def test_the_policy_is_cleared_once_the_target_is_not_its_candidate(pod: Pod) -> None:
    await pod.start("v1")
    set_target(pod.podinfo, "v2", ALL_STABLE)
    assert await pod.watcher.step() == "ok"
    assert (await pod.health())["traffic"] == ALL_STABLE.to_json()

    # a new target the pod cannot have (not in the store) while the old annotation
    # lingers: the server goes on serving v2, and without the policy
    set_target(pod.podinfo, "v404", ALL_STABLE)
    assert await pod.watcher.step() == "refused"
    health = await pod.health()
    assert (health["version"], health["traffic"]) == ("v2", None)
    assert await pod.answered_by() == {"v2"}

    set_target(pod.podinfo, "v2", ALL_STABLE)  # the canary again: the policy is back
    assert await pod.watcher.step() == "ok"
    assert (await pod.health())["traffic"] == ALL_STABLE.to_json()

    set_target(pod.podinfo, "v1")  # rollback: a pointer swap, then the policy goes
    assert await pod.watcher.step() == "ok"
    health = await pod.health()
    assert (health["version"], health["traffic"]) == ("v1", None)


@pytest.mark.parametrize(
    "annotation, why",
    [
        ("{not json", "not JSON"),
        ('["v1", "v2"]', "JSON object"),
        ('{"stable": "v1"}', "names its stable and candidate"),
        ('{"stable": "v1", "candidate": "v2", "trafficPercent": 101}', "trafficPercent"),
        ('{"stable": "v1", "candidate": "v2", "shadowPercent": "10"}', "shadowPercent"),
        ('{"stable": "../v1", "candidate": "v2"}', "invalid version"),
        ('{"stable": "v2", "candidate": "v2"}', "both 'v2'"),
    ],
)
async def test_a_malformed_policy_is_reported_and_ignored(
    pod: Pod, annotation: str, why: str
) -> None:
    await pod.start("v1")
    set_target(pod.podinfo, "v2", ALL_STABLE)
    assert await pod.watcher.step() == "ok"
    assert (await pod.health())["traffic"] == ALL_STABLE.to_json()

    set_target(pod.podinfo, "v2", annotation)
    for _ in range(3):  # the loop goes on, every cycle
        assert await pod.watcher.step() == "ok"
        report = pod.report()
        assert (report["state"], report["serving"], report["code"]) == ("ok", "v2", "bad_policy")
        assert TRAFFIC_POLICY in report["reason"] and why in report["reason"], report["reason"]
    assert (await pod.health())["traffic"] is None  # ignored: as if there were none
    assert await pod.answered_by() == {"v2"}

    set_target(pod.podinfo, "v2", ALL_STABLE)  # put right
    assert await pod.watcher.step() == "ok"
    assert pod.report()["code"] is None
    assert (await pod.health())["traffic"] == ALL_STABLE.to_json()


async def test_retention_keeps_the_stable_version_a_policy_names(pod: Pod) -> None:
    """The canary's candidate changes from v2 to v3 while v1 stays stable: the server
    holds v3 and v2 after the load, and retention (2 versions) used to delete v1 — the
    version the policy needs — from the volume. The store has lost v1 meanwhile, so only
    the volume's copy can give it back to the server."""
    await pod.start("v1")
    set_target(pod.podinfo, "v2", ALL_STABLE)
    assert await pod.watcher.step() == "ok"
    shutil.rmtree(pod.store.root / "mlp" / "v1")

    v3_canary = TrafficPolicy("v1", "v3", traffic_percent=0)
    set_target(pod.podinfo, "v3", v3_canary)
    assert await pod.watcher.step() == "ok", pod.report()
    assert (pod.volume / "mlp" / "v1" / "model.onnx").is_file()
    health = await pod.health()
    assert (health["version"], health["traffic"]) == ("v3", v3_canary.to_json())
    assert "v1" in health["retained"]
    assert await pod.answered_by() == {"v1"}


async def test_a_policy_lost_without_a_sign_in_the_status_is_sent_again_each_heartbeat(
    pod: Pod,
) -> None:
    await pod.start("v1")
    set_target(pod.podinfo, "v2", ALL_STABLE)
    assert await pod.watcher.step() == "ok"
    clear = {"op": "traffic", "model": "mlp", "stable": None, "candidate": None}
    assert (await ask(pod.socket, clear))["ok"] is True  # behind the sidecar's back
    assert await pod.watcher.step() == "ok"  # the status shows nothing: not due yet
    assert (await pod.health())["traffic"] is None
    pod.watcher.relay.resend_s = 0.0  # the heartbeat period has passed
    assert await pod.watcher.step() == "ok"
    assert (await pod.health())["traffic"] == ALL_STABLE.to_json()


async def test_a_server_that_cannot_hold_both_versions_is_an_error_not_a_swap_loop(
    pod: Pod,
) -> None:
    """A server that keeps one version: giving it the stable one back evicts the
    candidate. Reported with its code; the next cycles serve the candidate and do
    not load the stable one again."""
    await pod.start("v1", retain=1)
    set_target(pod.podinfo, "v2", ALL_STABLE)
    assert await pod.watcher.step() == "error"
    report = pod.report()
    assert (report["state"], report["code"]) == ("error", "policy_cannot_hold_both"), report
    assert "fewer versions" in report["reason"]
    loads_before = pod.watcher.metrics.swaps.labels("mlp", "ok")._value.get()
    for _ in range(2):
        assert await pod.watcher.step() == "error"
        assert pod.report()["code"] == "policy_cannot_hold_both"
    health = await pod.health()
    assert (health["version"], health["traffic"]) == ("v2", None)
    # one more swap back to the candidate, then none: the stable one is not reloaded
    assert pod.watcher.metrics.swaps.labels("mlp", "ok")._value.get() <= loads_before + 1


# --- the policy arrives through the pod watch, as the target does ----------------------

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


async def until(predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.02)


async def test_a_policy_set_through_the_api_reaches_the_server_though_the_file_is_stale(
    pod: Pod, cluster: EmulatedCluster
) -> None:
    await pod.start("v1")
    set_target(pod.podinfo, "v1")  # the kubelet's file, never refreshed in this test
    api = PodApi.connect(cluster.url, NS, POD)
    assert api is not None
    watch = PodWatch(api)
    pod.watcher.source = TargetSource(pod.podinfo, None, lambda: watch.annotations)
    pod.watcher.wake = watch.changed
    stop = asyncio.Event()
    tasks = [asyncio.create_task(watch.run(stop)), asyncio.create_task(pod.watcher.run(stop))]
    policies: list[object] = []

    def has_policy(expected: object) -> bool:
        return bool(policies) and policies[-1] == expected

    async def follow_health() -> None:
        while True:
            policies.append((await pod.health())["traffic"])
            await asyncio.sleep(0.05)

    following = asyncio.create_task(follow_health())
    try:
        annotations = {TARGET_VERSION: "v2", TRAFFIC_POLICY: ALL_STABLE.to_annotation()}
        await cluster.merge_patch(POD_PATH, {"metadata": {"annotations": annotations}})
        await until(lambda: has_policy(ALL_STABLE.to_json()))
        await cluster.merge_patch(POD_PATH, {"metadata": {"annotations": {TRAFFIC_POLICY: None}}})
        await until(lambda: has_policy(None))
        assert json.loads(pod.status_file.read_text())["serving"] == "v2"
        assert TRAFFIC_POLICY not in pod.podinfo.read_text()
    finally:
        following.cancel()
        stop.set()
        await asyncio.gather(*tasks, following, return_exceptions=True)
        await api.close()


# --- real processes ---------------------------------------------------------------------


def test_the_sidecar_process_relays_the_policy_to_a_server_process_across_its_crash(
    tmp_path: Path,
) -> None:
    """``model-sidecar watch`` and ``model-server`` as the pod runs them: the policy in
    the Downward API file reaches the server; the server is killed (SIGKILL) and started
    again on the same volume and socket, and gets the stable version and the policy
    back; the annotation goes, and so does the policy."""
    keys = make_keys(tmp_path / "keys")
    store = LocalStore(tmp_path / "store")
    publish_versions(store, keys, tmp_path, {"v1": 1, "v2": 2})
    volume, podinfo = tmp_path / "volume", tmp_path / "annotations"
    socket, status_file = tmp_path / "run" / "control.sock", tmp_path / "status.json"
    socket.parent.mkdir()
    asyncio.run(make_fetcher(store, keys, volume).fetch("mlp", "v1"))
    (volume / "mlp" / "CURRENT").write_text("v1\n")
    set_target(podinfo, "v2", ALL_STABLE)
    extra = ["--control-socket", str(socket), "--cache-dir", str(tmp_path / "cache")]
    server = ServerProcess(volume, ["mlp"], tmp_path / "server.log", extra=extra).start()
    sidecar = ChildProcess(
        "model_sidecar",
        [
            "watch", "--store", f"file://{store.root}", "--volume", str(volume),
            "--model", "mlp", "--public-key", str(keys.public),
            "--annotations-file", str(podinfo), "--control-socket", str(socket),
            "--status-file", str(status_file), "--poll-seconds", "0.1",
            "--jitter-seconds", "0", "--start-jitter-seconds", "0",
            "--backoff-base-seconds", "0.1", "--backoff-max-seconds", "0.5",
        ],
        tmp_path / "sidecar.log",
    ).start()  # fmt: skip
    assert isinstance(server, ServerProcess)

    def health() -> dict[str, Any]:
        with urllib.request.urlopen(f"{server.url}/v1/models/mlp/health", timeout=5) as r:
            answer: dict[str, Any] = json.loads(r.read())
            return answer

    def server_shows(version: str, policy: object) -> Callable[[], bool]:
        def check() -> bool:
            if not (server.running() and sidecar.running()):
                raise RuntimeError(f"{server.log_tail()}\n{sidecar.log_tail()}")
            try:
                now = health()
            except OSError:
                return False
            return bool(now.get("version") == version and now.get("traffic") == policy)

        return check

    try:
        server.wait_ready()
        wait_until(server_shows("v2", ALL_STABLE.to_json()), 60, what="the policy")
        server.kill()
        server.start()
        server.wait_ready()
        wait_until(server_shows("v2", ALL_STABLE.to_json()), 60, what="the policy again")
        assert health()["retained"] == ["v1"]
        set_target(podinfo, "v2")
        wait_until(server_shows("v2", None), 60, what="the policy cleared")
        assert read_status(status_file)["state"] == "ok"
    finally:
        sidecar.stop()
        server.stop()
    assert "Traceback" not in sidecar.log_path.read_text()
