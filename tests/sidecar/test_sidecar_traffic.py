"""Issue 11, the sidecar's half of the exact traffic share: the pod's traffic policy
sent to the real server over its control socket with the candidate's load (after the
stable version, when the server lacks it), written beside CURRENT (TRAFFIC) for a
restarted server, cleared at promotion or when the target moves on, given back (with the
stable version) to a server that lost it, a malformed one reported and ignored, and the
stable version kept on the volume while a policy names it.

The server's policy is read where the server shows it (``/v1/models/<m>/health``) and
seen in its answers: under ``trafficPercent`` 0 every request is answered by the
stable version, though the candidate is the one serving."""

from __future__ import annotations

import asyncio
import json
import shutil
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp.test_utils import TestClient

from model_rollout_contract.annotations import TARGET_VERSION
from model_rollout_contract.canary import TRAFFIC_POLICY, TrafficPolicy
from model_rollout_contract.control import (
    LoadRequest,
    Reply,
    Request,
    RollbackRequest,
    TrafficRequest,
)
from model_rollout_contract.layout import TRAFFIC_FILE
from model_rollout_e2e.control_plane import ControlPlane
from model_rollout_e2e.processes import ChildProcess, ServerProcess, wait_until
from model_sidecar.control_client import ServerControl
from model_sidecar.fetcher import Fetcher
from model_sidecar.init_mode import pre_pull
from model_sidecar.kube import PodApi
from model_sidecar.pod_watch import PodWatch
from model_sidecar.retry import Backoff
from model_sidecar.store import LocalStore
from model_sidecar.target import TargetSource
from model_sidecar.watch import Watcher
from tests.support.server import ask, infer_body
from tests.support.sidecar import (
    make_fetcher,
    make_keys,
    make_watcher,
    publish_versions,
    read_status,
    set_target,
    start_server,
)
from tests.support.sidecar_pod import SidecarPod, api_client, sidecar_pod

X = np.random.default_rng(11).standard_normal((1, 8)).astype(np.float32)
ALL_STABLE = TrafficPolicy("v1", "v2", traffic_percent=0)  # the stable one answers all


class RecordingControl(ServerControl):
    """The sidecar's real control client, noting every request it sends the server."""

    def __init__(self, socket_path: Path) -> None:
        super().__init__(socket_path, Backoff(attempts=3, base_s=0.05, max_s=0.1))
        self.sent: list[Request] = []

    async def request(self, request: Request) -> Reply:
        self.sent.append(request)
        return await super().request(request)

    def swaps(self) -> list[tuple[str, str | None, TrafficPolicy | None]]:
        """Each request that changes what the server serves or splits by:
        (op, version, policy)."""
        return [
            (r.op, r.version, r.policy)
            if isinstance(r, LoadRequest)
            else (r.op, r.version, None)
            if isinstance(r, RollbackRequest)
            else (r.op, None, r.policy)
            for r in self.sent
            if isinstance(r, LoadRequest | RollbackRequest)
            or (isinstance(r, TrafficRequest) and r.policy is not None)
        ]


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

    @property
    def traffic_file(self) -> Path:
        return self.volume / "mlp" / TRAFFIC_FILE

    def recording(self) -> RecordingControl:
        """From now on the watcher's requests to the server are noted."""
        control = RecordingControl(self.socket)
        self.watcher.control = control
        return control

    async def answers_during(self, work: Any) -> tuple[Any, set[str]]:
        """``work`` awaited while clients keep asking the server: its result and every
        version that answered meanwhile."""
        assert self.server is not None
        server, seen, done = self.server, set(), asyncio.Event()

        async def keep_asking() -> None:
            while not done.is_set():
                response = await server.post("/v2/models/mlp/infer", json=infer_body(X))
                assert response.status == 200, await response.text()
                seen.add((await response.json())["model_version"])

        askers = [asyncio.create_task(keep_asking()) for _ in range(4)]
        try:
            result = await work
        finally:
            done.set()
            await asyncio.gather(*askers)
        return result, seen

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

    assert not pod.traffic_file.exists()

    set_target(pod.podinfo, "v2", ALL_STABLE)  # the operator's canary stage
    control = pod.recording()
    outcome, answered = await pod.answers_during(pod.watcher.step())
    assert outcome == "ok"
    assert answered == {"v1"}  # not one answer of v2's, even across its swap
    assert control.swaps() == [("load", "v2", ALL_STABLE)]  # the policy goes with the load
    health = await pod.health()
    assert (health["version"], health["traffic"]) == ("v2", ALL_STABLE.to_json())
    assert await pod.answered_by() == {"v1"}  # the split is the server's, by the policy
    report = pod.report()
    assert (report["state"], report["serving"], report["code"]) == ("ok", "v2", None)
    assert report["retained"] == ["v1"]
    assert pod.traffic_file.read_text() == ALL_STABLE.to_annotation() + "\n"

    assert await pod.watcher.step() == "ok"  # nothing changed: not sent again
    assert pod.sent("set") == 1
    assert control.swaps() == [("load", "v2", ALL_STABLE)]

    set_target(pod.podinfo, "v2")  # promotion: the annotation is gone
    assert await pod.watcher.step() == "ok"
    assert (await pod.health())["traffic"] is None
    assert await pod.answered_by() == {"v2"}
    assert pod.sent("cleared") >= 1
    assert not pod.traffic_file.exists()


async def test_a_restarted_server_gets_the_stable_version_and_the_policy_back(
    pod: Pod,
) -> None:
    await pod.start("v1")
    set_target(pod.podinfo, "v2", ALL_STABLE)
    assert await pod.watcher.step() == "ok"
    assert (await pod.health())["traffic"] == ALL_STABLE.to_json()

    await pod.restart()  # a crash: the new server resumes CURRENT (v2) and TRAFFIC
    fresh = await pod.health()
    assert (fresh["version"], fresh["retained"]) == ("v2", ["v1"])
    assert fresh["traffic"] == ALL_STABLE.to_json()
    assert await pod.answered_by() == {"v1"}  # from its first answer, before the sidecar

    control = pod.recording()
    assert await pod.watcher.step() == "ok"
    assert control.swaps() == []  # nothing to give back: the server has it all
    health = await pod.health()
    assert (health["version"], health["retained"]) == ("v2", ["v1"])
    assert health["traffic"] == ALL_STABLE.to_json()
    assert await pod.answered_by() == {"v1"}
    assert (pod.volume / "mlp" / "CURRENT").read_text() == "v2\n"  # still the candidate


async def test_a_server_that_lost_the_stable_version_gets_it_then_the_candidate_and_policy(
    pod: Pod,
) -> None:
    """A server restarted without TRAFFIC (removed behind the sidecar's back) serves v2
    alone: the sidecar loads v1, then v2 again with the policy in one step; never a
    swap back to v2 without it."""
    await pod.start("v1")
    set_target(pod.podinfo, "v2", ALL_STABLE)
    assert await pod.watcher.step() == "ok"
    pod.traffic_file.unlink()
    await pod.restart()
    fresh = await pod.health()
    assert (fresh["version"], fresh["retained"], fresh["traffic"]) == ("v2", [], None)

    control = pod.recording()
    assert await pod.watcher.step() == "ok"
    assert control.swaps() == [("load", "v1", None), ("load", "v2", ALL_STABLE)]
    health = await pod.health()
    assert (health["version"], health["retained"]) == ("v2", ["v1"])
    assert health["traffic"] == ALL_STABLE.to_json()
    assert await pod.answered_by() == {"v1"}
    assert pod.traffic_file.read_text() == ALL_STABLE.to_annotation() + "\n"
    assert await pod.watcher.step() == "ok"
    assert len(control.swaps()) == 2  # done: nothing sent again


async def test_a_canary_of_a_pod_without_the_stable_version_loads_it_before_the_candidate(
    pod: Pod,
) -> None:
    """The pod serves v3 and becomes a canary of v2 against the stable v1 it does not
    hold: v1 is loaded first (the server serves it meanwhile, within the policy), then
    v2 with the policy; v2 answers nothing on the way."""
    await pod.start("v3")
    set_target(pod.podinfo, "v3")
    assert await pod.watcher.step() == "ok"
    set_target(pod.podinfo, "v2", ALL_STABLE)
    control = pod.recording()
    outcome, answered = await pod.answers_during(pod.watcher.step())
    assert outcome == "ok", pod.report()
    assert answered <= {"v3", "v1"} and "v2" not in answered
    assert control.swaps() == [("load", "v1", None), ("load", "v2", ALL_STABLE)]
    health = await pod.health()
    assert (health["version"], health["traffic"]) == ("v2", ALL_STABLE.to_json())
    assert "v1" in health["retained"]
    assert await pod.answered_by() == {"v1"}
    assert (pod.volume / "mlp" / "CURRENT").read_text() == "v2\n"


async def test_the_traffic_file_is_written_past_a_planted_link_never_through_it(
    pod: Pod, tmp_path: Path
) -> None:
    await pod.start("v1")
    set_target(pod.podinfo, "v2", ALL_STABLE)
    assert await pod.watcher.step() == "ok"
    outside = tmp_path / "outside"
    outside.write_text("keep me")
    pod.traffic_file.unlink()
    pod.traffic_file.symlink_to(outside)
    assert await pod.watcher.step() == "ok"
    assert not pod.traffic_file.is_symlink()
    assert pod.traffic_file.read_text() == ALL_STABLE.to_annotation() + "\n"
    pod.traffic_file.unlink()
    pod.traffic_file.symlink_to(outside)
    set_target(pod.podinfo, "v2")  # promotion: the link is removed, not what it points to
    assert await pod.watcher.step() == "ok"
    assert not pod.traffic_file.exists() and not pod.traffic_file.is_symlink()
    assert outside.read_text() == "keep me"


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

    assert not pod.traffic_file.exists()
    set_target(pod.podinfo, "v2", ALL_STABLE)  # the canary again: the policy is back
    control = pod.recording()
    assert await pod.watcher.step() == "ok"
    assert (await pod.health())["traffic"] == ALL_STABLE.to_json()
    assert control.swaps() == [("traffic", None, ALL_STABLE)]  # v2 serves: no swap

    assert pod.traffic_file.exists()
    set_target(pod.podinfo, "v1")  # rollback: a pointer swap, then the policy goes
    assert await pod.watcher.step() == "ok"
    health = await pod.health()
    assert (health["version"], health["traffic"]) == ("v1", None)
    assert not pod.traffic_file.exists()

    set_target(pod.podinfo, "v2", ALL_STABLE)  # the canary once more: v2 is still held
    control = pod.recording()
    outcome, answered = await pod.answers_during(pod.watcher.step())
    assert (outcome, answered) == ("ok", {"v1"})
    assert control.swaps() == [("load", "v2", ALL_STABLE)]  # a pointer swap with the policy
    assert (await pod.health())["traffic"] == ALL_STABLE.to_json()


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


async def test_a_policy_lost_is_sent_again_when_the_status_shows_it_or_each_heartbeat(
    pod: Pod,
) -> None:
    await pod.start("v1")
    set_target(pod.podinfo, "v2", ALL_STABLE)
    assert await pod.watcher.step() == "ok"
    clear = {"op": "traffic", "model": "mlp", "stable": None, "candidate": None}
    assert (await ask(pod.socket, clear))["ok"] is True  # behind the sidecar's back
    assert await pod.watcher.step() == "ok"  # the status shows no policy: sent at once
    assert (await pod.health())["traffic"] == ALL_STABLE.to_json()
    # a loss the status cannot show (a server older than its policy field): the heartbeat
    older = await relay_as_an_older_server(pod.socket, pod.socket.with_name("older.sock"))
    pod.watcher.control = RecordingControl(pod.socket.with_name("older.sock"))
    assert (await ask(pod.socket, clear))["ok"] is True
    assert await pod.watcher.step() == "ok"  # the status shows nothing: not due yet
    assert (await pod.health())["traffic"] is None
    pod.watcher.relay.resend_s = 0.0  # the heartbeat period has passed
    assert await pod.watcher.step() == "ok"
    assert (await pod.health())["traffic"] == ALL_STABLE.to_json()
    older.close()
    await older.wait_closed()


async def test_a_server_that_cannot_hold_both_versions_is_an_error_and_keeps_the_stable(
    pod: Pod,
) -> None:
    """A server that keeps one version cannot split: the load of the candidate with the
    policy is refused before any work, reported with the server's reason each cycle,
    and the stable version goes on answering everything; nothing is swapped."""
    await pod.start("v1", retain=1)
    set_target(pod.podinfo, "v2", ALL_STABLE)
    control = pod.recording()
    for _ in range(3):
        assert await pod.watcher.step() == "error"
        report = pod.report()
        assert (report["state"], report["code"]) == ("error", "server_conflict"), report
        assert "keeps 1 version" in report["reason"] and "beside" in report["reason"]
    health = await pod.health()
    assert (health["version"], health["traffic"]) == ("v1", None)
    assert await pod.answered_by() == {"v1"}
    assert pod.watcher.metrics.swaps.labels("mlp", "ok")._value.get() == 0
    assert control.swaps() == [("load", "v2", ALL_STABLE)] * 3
    assert not pod.traffic_file.exists()


async def test_init_pre_pulls_the_stable_version_and_the_policy_so_the_server_starts_split(
    pod: Pod,
) -> None:
    """A canary pod (re)started: init fetches its target v3, the previous v2 and the
    policy's stable v1, and writes TRAFFIC; the server's first answers are v1's."""
    canary_of_v3 = TrafficPolicy("v1", "v3", traffic_percent=0)
    assert await pre_pull(pod.fetcher, "mlp", "v3", None, policy=canary_of_v3) == 0
    assert sorted(p.name for p in (pod.volume / "mlp").iterdir() if p.is_dir()) == [
        "v1", "v2", "v3"
    ]  # fmt: skip
    assert pod.traffic_file.read_text() == canary_of_v3.to_annotation() + "\n"
    await pod.restart()
    health = await pod.health()
    assert (health["version"], health["retained"]) == ("v3", ["v1"])
    assert health["traffic"] == canary_of_v3.to_json()
    assert await pod.answered_by() == {"v1"}

    assert await pre_pull(pod.fetcher, "mlp", "v3", None) == 0  # promoted: no policy
    assert not pod.traffic_file.exists()
    other = TrafficPolicy("v1", "v2")  # for another target: not this pod's
    assert await pre_pull(pod.fetcher, "mlp", "v3", None, policy=other) == 0
    assert not pod.traffic_file.exists()


# --- the policy arrives through the pod watch, as the target does ----------------------


@pytest.fixture
def api_pod(control_plane: ControlPlane) -> Iterator[SidecarPod]:
    """The pod on a real API server, followed as its ServiceAccount."""
    with sidecar_pod(control_plane, "sidecar-traffic", "mlp-000") as created:
        yield created


async def until(predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.02)


async def test_a_policy_set_through_the_api_reaches_the_server_though_the_file_is_stale(
    pod: Pod, api_pod: SidecarPod
) -> None:
    await pod.start("v1")
    set_target(pod.podinfo, "v1")  # the kubelet's file, never refreshed in this test
    api = PodApi(await api_client(api_pod.sidecar), api_pod.namespace, api_pod.name)
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
        await asyncio.to_thread(api_pod.annotate, annotations)
        await until(lambda: has_policy(ALL_STABLE.to_json()))
        await asyncio.to_thread(api_pod.annotate, {TRAFFIC_POLICY: None})
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

    def first_answer() -> str:
        request = urllib.request.Request(
            f"{server.url}/v2/models/mlp/infer",
            json.dumps(infer_body(X)).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=5) as r:
            version: str = json.loads(r.read())["model_version"]
            return version

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

    def persisted() -> bool:
        """The sidecar wrote CURRENT and TRAFFIC after the server's reply: a kill before
        that restarts the server on v1 (correctly: TRAFFIC's candidate is not CURRENT)."""
        model_dir = volume / "mlp"
        current = (model_dir / "CURRENT").read_text().strip()
        return current == "v2" and (model_dir / TRAFFIC_FILE).exists()

    try:
        server.wait_ready()
        wait_until(server_shows("v2", ALL_STABLE.to_json()), 60, what="the policy")
        wait_until(persisted, 30, what="the sidecar's CURRENT and TRAFFIC")
        server.kill()
        server.start()
        server.wait_ready()
        resumed = health()  # ready: the policy is there already, from TRAFFIC
        assert (resumed["traffic"], resumed["retained"]) == (ALL_STABLE.to_json(), ["v1"])
        assert first_answer() == "v1"
        wait_until(server_shows("v2", ALL_STABLE.to_json()), 60, what="the policy again")
        assert health()["retained"] == ["v1"]
        set_target(podinfo, "v2")
        wait_until(server_shows("v2", None), 60, what="the policy cleared")
        assert read_status(status_file)["state"] == "ok"
    finally:
        sidecar.stop()
        server.stop()
    assert "Traceback" not in sidecar.log_path.read_text()


async def relay_as_an_older_server(real: Path, listen: Path) -> asyncio.AbstractServer:
    """A control socket at ``listen`` that speaks the protocol of the release before the
    load carried a policy and the status showed one, in front of the real server at
    ``real``: a load's policy fields are dropped (as that server ignored them) and the
    replies lose ``policy``; everything else passes through unchanged."""
    policy_fields = ("stable", "candidate", "traffic_percent", "shadow_percent")

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_unix_connection(str(real))
        try:
            while line := await reader.readline():
                request = json.loads(line)
                if request.get("op") == "load":
                    request = {k: v for k, v in request.items() if k not in policy_fields}
                up_writer.write(json.dumps(request).encode() + b"\n")
                reply = json.loads(await up_reader.readline())
                reply.pop("policy", None)
                writer.write(json.dumps(reply).encode() + b"\n")
                await writer.drain()
        finally:
            up_writer.close()
            writer.close()

    return await asyncio.start_unix_server(serve, path=str(listen))


async def test_a_server_that_ignores_the_loads_policy_gets_it_with_the_traffic_op_at_once(
    pod: Pod, tmp_path: Path
) -> None:
    """Review 11 #3: a new sidecar beside a server of the previous release, which ignores
    the policy a canary's load carries: the sidecar does not take the load's answer for
    the policy set (that server's status does not show it), and sends it with the
    ``traffic`` op in the same cycle, so the candidate does not answer outside its share
    until a heartbeat resend."""
    await pod.start("v1")
    older = await relay_as_an_older_server(pod.socket, tmp_path / "older.sock")
    try:
        control = RecordingControl(tmp_path / "older.sock")
        pod.watcher.control = control
        set_target(pod.podinfo, "v1")
        assert await pod.watcher.step() == "ok"
        set_target(pod.podinfo, "v2", ALL_STABLE)
        assert await pod.watcher.step() == "ok"
        assert control.swaps() == [("load", "v2", ALL_STABLE), ("traffic", None, ALL_STABLE)]
        health = await pod.health()
        assert (health["version"], health["traffic"]) == ("v2", ALL_STABLE.to_json())
        assert await pod.answered_by() == {"v1"}
        assert await pod.watcher.step() == "ok"  # taken now: not sent again
        assert control.swaps() == [("load", "v2", ALL_STABLE), ("traffic", None, ALL_STABLE)]
    finally:
        older.close()
        await older.wait_closed()
