"""The sidecar against a real API server when the API misbehaves (issue 29): an error
answer is an error, never a pod without annotations; the last good view of the pod is
kept through an outage, and a stale Downward API file does not override it; calls back
off (jittered, capped, never sooner than Retry-After); a bookmark only moves the watch on;
a refused status patch is counted and tried again after a pause.

The faults come from the real control plane where it makes them (API Priority and
Fairness' 429s, admission's 403s, bookmarks), else from a fault proxy in front of it
(:mod:`model_rollout_e2e.fault_proxy`: error answers, cut watches, dropped connections,
watches that end at once). Request counts during an outage are compared with the most a
client following the backoff policy could make in that window (each pause at its
shortest), never with a wall-clock expectation.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import ssl
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client as k8s

from model_rollout_contract.annotations import (
    SIDECAR_STATUS,
    TARGET_VERSION,
    format_downward_annotations,
)
from model_rollout_contract.report import SidecarReport
from model_rollout_contract.states import SidecarState
from model_rollout_e2e.control_plane import ControlPlane
from model_rollout_e2e.fault_proxy import Fault, FaultProxy
from model_rollout_e2e.identities import Identity
from model_sidecar.kube import PodApi
from model_sidecar.metrics import SidecarMetrics
from model_sidecar.pod_watch import PodWatch
from model_sidecar.retry import Backoff
from model_sidecar.status import StatusReporter
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
from tests.support.sidecar_pod import ACCOUNT, SidecarPod, api_client, token
from tests.support.sidecar_pod import sidecar_pod as sidecar_pod_on

POD = "mlp-7f9c5d-abcde"
# the tests' policy: as the sidecar's (a floor of half the cap), faster
BACKOFF = Backoff(base_s=0.1, max_s=0.8, floor=0.5)


def most_calls(
    policy: Backoff, window_s: float, retry_after_s: float = 0.0, failed_before: int = 0
) -> int:
    """The most calls a client following ``policy`` can make in ``window_s`` from its
    first failing call in it on, after ``failed_before`` failures in a row: every pause
    at its shortest (and no shorter than Retry-After)."""
    calls, spent = 1, 0.0
    while spent + max(policy.least(failed_before + calls - 1), retry_after_s) <= window_s:
        spent += max(policy.least(failed_before + calls - 1), retry_after_s)
        calls += 1
    return calls


def test_most_calls_counts_the_shortest_pauses() -> None:
    """The bound itself: pauses of at least 0.05, 0.1, 0.2, 0.4, 0.4 s between calls;
    Retry-After stretches each pause."""
    assert most_calls(BACKOFF, 0.0) == 1
    assert most_calls(BACKOFF, 0.75) == 5  # 0.05 + 0.1 + 0.2 + 0.4
    assert most_calls(BACKOFF, 1.14) == 5
    assert most_calls(BACKOFF, 1.16) == 6
    assert most_calls(BACKOFF, 3.0, retry_after_s=1.0) == 4
    assert most_calls(BACKOFF, 0.71, failed_before=1) == 4  # 0.1 + 0.2 + 0.4


@pytest.fixture(scope="module")
def sidecar_pod(control_plane: ControlPlane) -> Iterator[SidecarPod]:
    """A namespace with the operator's pod RBAC, one pod (never scheduled) that targets
    v2, the sidecar admission policy enforced, and the sidecar's tokens."""
    with sidecar_pod_on(control_plane, "sidecar-api", POD, {TARGET_VERSION: "v2"}) as pod:
        yield pod


async def until(predicate: Callable[[], bool], timeout_s: float = 60.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def following(watch: PodWatch) -> AsyncIterator[None]:
    stop = asyncio.Event()
    task = asyncio.create_task(watch.run(stop))
    try:
        yield
    finally:
        stop.set()
        await task
        await watch.api.close()


def files(tmp_path: Path) -> tuple[Path, Path]:
    """The pod's Downward API file as the kubelet wrote it at start (target v1, never
    refreshed since) and the ConfigMap's default version (v1, the old stable one)."""
    podinfo, configmap = tmp_path / "annotations", tmp_path / "version"
    set_target(podinfo, "v1")
    configmap.write_text("v1\n")
    return podinfo, configmap


def modified(annotations: object) -> dict[str, object]:
    """A watch event for the pod whose annotations are ``annotations`` (as sent)."""
    meta = {"name": POD, "resourceVersion": "1", "annotations": annotations}
    return {"type": "MODIFIED", "object": {"metadata": meta}}


def watch_error(code: object) -> dict[str, object]:
    """A watch's ERROR event: a ``Status`` of ``code`` (as sent)."""
    status = {"kind": "Status", "status": "Failure", "message": "too old", "code": code}
    return {"type": "ERROR", "object": status}


# the fault, its Retry-After, and how many requests one attempt may make of the server:
# aiohttp (kubernetes_asyncio's HTTP client) sends an idempotent request once more when
# its connection is dropped without an answer
FAULTS = {
    "503": (Fault("status", 503), 0.0, 1),
    "403": (Fault("status", 403), 0.0, 1),
    "429 with Retry-After": (Fault("status", 429, retry_after="1"), 1.0, 1),
    # "²".isdigit() is true, float("²") fails: no Retry-After, not a crash
    "429 with a Retry-After that is no number": (Fault("status", 429, retry_after="²"), 0.0, 1),
    "connections dropped": (Fault("drop"), 0.0, 2),
    "watches that end at once": (Fault("events"), 0.0, 1),
    "annotations that are a list": (Fault("events", events=(modified(["x"]),)), 0.0, 1),
    "an annotation that is no string": (Fault("events", events=(modified({"a": 1}),)), 0.0, 1),
    "an ERROR event of code 'Gone'": (Fault("events", events=(watch_error("Gone"),)), 0.0, 1),
    "a line that is no JSON": (Fault("events", events=('{"type": "MODIF',)), 0.0, 1),
    "a line nested too deep for JSON": (Fault("events", events=("[" * 100_000,)), 0.0, 1),
}


@pytest.mark.parametrize("case", FAULTS.values(), ids=FAULTS.keys())
async def test_an_api_outage_keeps_the_last_view_and_backs_off(
    sidecar_pod: SidecarPod, tmp_path: Path, case: tuple[Fault, float, int]
) -> None:
    """The watch is cut (the first failure) and every call after it meets the fault:
    the target stays the API's last (not the stale file's, not the ConfigMap's), the view
    is stale and says so, and the calls are no more than the policy allows in that time.
    An answer no API server should give (garbage) is a failure like any other: the watch
    goes on following the pod, never stops on it."""
    fault, retry_after_s, requests_per_attempt = case
    sidecar_pod.set_target("v2")
    podinfo, configmap = files(tmp_path)
    cluster = sidecar_pod.cluster
    async with FaultProxy(cluster.server, cluster.pki.ca.cert) as proxy:
        metrics = SidecarMetrics()
        pod = PodApi(await api_client(sidecar_pod.sidecar, proxy.url), sidecar_pod.namespace,
                     POD, metrics)  # fmt: skip
        watch = PodWatch(pod, BACKOFF, 60, random.Random(1), fallback_file=podinfo)
        source = TargetSource(podinfo, configmap, watch.view)
        async with following(watch):
            await until(lambda: source.target() == "v2" and proxy.open_watches == 1)
            proxy.fault, started = fault, time.monotonic()
            proxy.cut()  # the watch open is cut; every call after it meets the fault
            targets = set()

            def failing() -> bool:
                targets.add(source.target())
                return proxy.count(faulted=True) >= 6

            await until(failing)
            window_s, failed = time.monotonic() - started, proxy.count(faulted=True)
            assert targets == {"v2"}, "the last view of the pod is kept through the outage"
            assert not watch.current and watch.stale_seconds() > 0, "the view is stale"
            most = most_calls(BACKOFF, window_s, retry_after_s, failed_before=1)  # the cut
            assert failed <= requests_per_attempt * most, (failed, window_s)
            errors = metrics.registry.get_sample_value(
                "model_sidecar_kube_api_errors_total",
                {"call": "watch", "status": str(fault.status if fault.kind == "status" else 0)},
            )  # each attempt, counted once (and the cut, for those counted as 0)
            # the proxy counts a call as it comes, the sidecar once it has the answer: the
            # last attempt may still be on its way back
            answered = failed - requests_per_attempt
            assert errors is not None and answered / requests_per_attempt <= errors <= failed + 1
            proxy.fault = None
            sidecar_pod.set_target("v3")
            await until(lambda: source.target() == "v3")
            assert watch.current and watch.stale_seconds() == 0
            await until(lambda: watch.failures == 0)  # once the watch has lived a while


async def test_a_bookmark_then_410_again_and_again_is_held_to_the_backoff(
    sidecar_pod: SidecarPod, tmp_path: Path
) -> None:
    """Every watch answers a bookmark, then 410 Gone: each 410 reads the pod again (the
    first at once), but one item is not a watch that lived, so the pauses grow as for any
    failures in a row: the watches are no more than the policy allows in that time (one
    item used to end the pauses: about 290 requests a second)."""
    sidecar_pod.set_target("v2")
    podinfo, configmap = files(tmp_path)
    cluster = sidecar_pod.cluster
    async with FaultProxy(cluster.server, cluster.pki.ca.cert) as proxy:
        pod = PodApi(await api_client(sidecar_pod.sidecar, proxy.url), sidecar_pod.namespace,
                     POD)  # fmt: skip
        watch = PodWatch(pod, BACKOFF, 60, random.Random(6), fallback_file=podinfo)
        source = TargetSource(podinfo, configmap, watch.view)
        async with following(watch):
            await until(lambda: source.target() == "v2" and proxy.open_watches == 1)
            bookmark = {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "1"}}}
            proxy.fault = Fault("events", events=(bookmark, watch_error(410)))
            first, started = len(proxy.calls), time.monotonic()
            proxy.cut()
            targets = set()

            def looping() -> bool:
                targets.add(source.target())
                return proxy.count("watch", faulted=True) >= 6

            await until(looping)
            window_s, watches = time.monotonic() - started, proxy.count("watch", faulted=True)
            reads = sum(1 for call in proxy.calls[first:] if call.kind == "read")
            assert watches <= most_calls(BACKOFF, window_s), (watches, window_s)
            assert reads <= watches and watch.relists >= 5
            assert targets == {"v2"}
            proxy.fault = None
            sidecar_pod.set_target("v3")
            await until(lambda: source.target() == "v3")


def another_annotation(podinfo: Path) -> None:
    """The kubelet refreshes the file for a change this track does not read (the
    sidecar's own report), its target as stale as before."""
    podinfo.write_text(
        format_downward_annotations({TARGET_VERSION: "v1", "other": "y", SIDECAR_STATUS: "{}"})
    )


FILE_EVENTS: dict[str, Callable[[Path], None]] = {
    "the file goes missing": Path.unlink,  # the kubelet swapping its ..data link, say
    "another annotation changes": another_annotation,
}


@pytest.mark.parametrize("event", FILE_EVENTS.values(), ids=FILE_EVENTS.keys())
async def test_the_downward_file_is_news_only_when_what_the_track_reads_changes(
    sidecar_pod: SidecarPod, tmp_path: Path, event: Callable[[Path], None]
) -> None:
    """The API lost after it said v2, the file stale (v1): a file that cannot be read, or
    one in which only annotations this track does not read changed, is no news, and the
    API's last view is kept (neither the ConfigMap's v1 nor the file's). The file's
    target moving is news: followed."""
    sidecar_pod.set_target("v2")
    podinfo, configmap = files(tmp_path)
    cluster = sidecar_pod.cluster
    async with FaultProxy(cluster.server, cluster.pki.ca.cert) as proxy:
        pod = PodApi(await api_client(sidecar_pod.sidecar, proxy.url), sidecar_pod.namespace,
                     POD)  # fmt: skip
        watch = PodWatch(pod, BACKOFF, 60, random.Random(7), fallback_file=podinfo)
        source = TargetSource(podinfo, configmap, watch.view)
        async with following(watch):
            await until(lambda: source.target() == "v2" and proxy.open_watches == 1)
            proxy.fault = Fault("drop")
            proxy.cut()
            await until(lambda: not watch.current)
            event(podinfo)
            assert source.target() == "v2"
            set_target(podinfo, "v3")  # the kubelet saw the pod's newer target
            assert source.target() == "v3"


async def test_a_refused_patch_with_a_retry_after_that_is_no_number_is_a_refusal(
    sidecar_pod: SidecarPod,
) -> None:
    """A 429 whose Retry-After is "²" (a digit to ``str.isdigit``, not to ``float``):
    the report is refused and counted like any other, never an exception out of the
    report (which the watch loop's own error report would raise again)."""
    cluster = sidecar_pod.cluster
    async with FaultProxy(cluster.server, cluster.pki.ca.cert) as proxy:
        proxy.fault = Fault("status", 429, retry_after="²")
        metrics = SidecarMetrics()
        client = await api_client(sidecar_pod.sidecar, proxy.url)
        reporter = StatusReporter(
            None,
            PodApi(client, sidecar_pod.namespace, POD, metrics),
            backoff=BACKOFF,
            rng=random.Random(8),
        )
        try:
            await reporter.report(SidecarReport("mlp", "v2", "v2", SidecarState.OK))
            assert reporter.patch_failures == 1 and proxy.count("patch") == 1
            errors = metrics.registry.get_sample_value(
                "model_sidecar_kube_api_errors_total", {"call": "annotate", "status": "429"}
            )
            assert errors == 1
        finally:
            await client.close()


@contextlib.asynccontextmanager
async def seat_taken(
    cluster: ControlPlane, identity: Identity, namespace: str
) -> AsyncIterator[None]:
    """A PATCH of the pod as ``identity`` whose body never comes: the API server admits
    it and waits for the body, holding one seat of the priority level until the
    connection closes."""
    host, port = cluster.server.removeprefix("https://").split(":")
    context = ssl.create_default_context(cafile=str(cluster.pki.ca.cert))
    _, writer = await asyncio.open_connection(host, int(port), ssl=context)
    writer.write(
        (
            f"PATCH /api/v1/namespaces/{namespace}/pods/{POD} HTTP/1.1\r\nHost: {host}\r\n"
            f"Authorization: Bearer {token(identity)}\r\n"
            "Content-Type: application/merge-patch+json\r\nContent-Length: 100\r\n\r\n"
        ).encode()
    )
    await writer.drain()
    try:
        yield
    finally:
        writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await writer.wait_closed()


def flow_control(namespace: str, level: str) -> list[dict[str, Any]]:
    """A priority level of no seats of its own (one request at a time gets in; the rest
    are rejected with 429, not queued) and a FlowSchema that puts the sidecar's account
    in it."""
    return [
        {
            "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
            "kind": "PriorityLevelConfiguration",
            "metadata": {"name": level},
            "spec": {
                "type": "Limited",
                "limited": {
                    "nominalConcurrencyShares": 0,
                    "lendablePercent": 0,
                    "borrowingLimitPercent": 0,
                    "limitResponse": {"type": "Reject"},
                },
            },
        },
        {
            "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
            "kind": "FlowSchema",
            "metadata": {"name": level},
            "spec": {
                "priorityLevelConfiguration": {"name": level},
                "matchingPrecedence": 100,
                "distinguisherMethod": {"type": "ByUser"},
                "rules": [
                    {
                        "subjects": [
                            {
                                "kind": "ServiceAccount",
                                "serviceAccount": {"name": ACCOUNT, "namespace": namespace},
                            }
                        ],
                        "resourceRules": [
                            {
                                "verbs": ["*"],
                                "apiGroups": ["*"],
                                "resources": ["*"],
                                "namespaces": ["*"],
                            }
                        ],
                    }
                ],
            },
        },
    ]


def rejected(cluster: ControlPlane, level: str) -> float:
    """The API server's own count of requests it rejected at ``level``."""
    with urllib.request.urlopen(f"{cluster.server}/metrics", context=cluster.ssl_context()) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("apiserver_flowcontrol_rejected_requests_total{") and (
            f'priority_level="{level}"' in line
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_api_priority_and_fairness_429s_are_waited_out(
    sidecar_pod: SidecarPod, tmp_path: Path
) -> None:
    """Real 429s: the sidecar's account in a priority level whose one seat another
    request holds. The API server counts the rejections itself; each pause is at least
    its Retry-After (1 s or more), far longer than the policy's own shortest pauses."""
    sidecar_pod.set_target("v2")
    podinfo, configmap = files(tmp_path)
    cluster, namespace = sidecar_pod.cluster, sidecar_pod.namespace
    level = f"tiny-{namespace}"
    fast = Backoff(base_s=0.02, max_s=0.2, floor=0.5)  # 0.01-0.2 s: Retry-After is longer
    pod = PodApi(await api_client(sidecar_pod.sidecar), namespace, POD)
    watch = PodWatch(pod, fast, 2, random.Random(2), fallback_file=podinfo)
    source = TargetSource(podinfo, configmap, watch.view)
    probe = await api_client(sidecar_pod.sidecar)
    cluster.kubectl.apply(*flow_control(namespace, level))
    try:
        async with following(watch):
            await until(lambda: source.target() == "v2")

            async def level_full() -> bool:
                answer = await k8s.CoreV1Api(probe).read_namespaced_pod(
                    POD, namespace, _preload_content=False
                )
                answer.release()
                return bool(answer.status == 429)

            async with contextlib.AsyncExitStack() as held:
                async with asyncio.timeout(60):  # the FlowSchema is in force, the seat held
                    while True:
                        await held.enter_async_context(
                            seat_taken(cluster, sidecar_pod.sidecar, namespace)
                        )
                        if await level_full():
                            break
                        await held.aclose()
                        await asyncio.sleep(0.5)
                before, started = rejected(cluster, level), time.monotonic()
                failures_before = watch.failures
                targets = set()

                def failing() -> bool:
                    targets.add(source.target())
                    return watch.failures >= failures_before + 4

                await until(failing)  # the open watch ends (2 s), and each new one is refused
                window_s, refused = time.monotonic() - started, rejected(cluster, level) - before
            assert targets == {"v2"}
            assert 3 <= refused <= most_calls(fast, window_s, retry_after_s=1.0), (
                refused,
                window_s,
            )
            cluster.kubectl.run("delete", "flowschema", level)
            sidecar_pod.set_target("v3")
            await until(lambda: source.target() == "v3")
    finally:
        cluster.kubectl.run("delete", "flowschema,prioritylevelconfiguration", level)
        await probe.close()


async def test_a_bookmark_only_moves_the_watch_on(sidecar_pod: SidecarPod, tmp_path: Path) -> None:
    """The API server sends a bookmark 2 s before a watch's timeout when its pods' watch
    cache moved on past the watch (another pod is created to make sure: a write of
    anything else, a ConfigMap, moves that cache only at etcd's next progress
    notification, and under load not in time); the next watch resumes from it, and the
    pod's view is untouched."""
    sidecar_pod.set_target("v2")
    podinfo, configmap = files(tmp_path)
    cluster, namespace = sidecar_pod.cluster, sidecar_pod.namespace
    async with FaultProxy(cluster.server, cluster.pki.ca.cert) as proxy:
        pod = PodApi(await api_client(sidecar_pod.sidecar, proxy.url), namespace, POD)
        watch = PodWatch(pod, BACKOFF, 4, random.Random(3), fallback_file=podinfo)
        source = TargetSource(podinfo, configmap, watch.view)
        async with following(watch):
            await until(lambda: source.target() == "v2")
            watch.changed.clear()
            targets = set()

            def resumed_from_a_bookmark() -> bool:
                targets.add(source.target())
                resumed = {c.query.get("resourceVersion") for c in proxy.calls if c.kind == "watch"}
                return bool(set(proxy.bookmarks) & resumed)

            async with asyncio.timeout(60):
                for n in range(1000):
                    await asyncio.to_thread(
                        cluster.kubectl.run, "run", f"tick-{n}", "--image=tick",
                        "--restart=Never", "-n", namespace,
                    )  # fmt: skip
                    with contextlib.suppress(TimeoutError):  # a watch's length, and more
                        await until(resumed_from_a_bookmark, timeout_s=10.0)
                        break
            assert targets == {"v2"}, "a bookmark is not the pod"
            assert not watch.changed.is_set()
            assert watch.bookmarks >= 1 and watch.current


async def test_after_a_cut_a_stale_downward_file_does_not_override_the_api(
    sidecar_pod: SidecarPod, tmp_path: Path
) -> None:
    """The whole sidecar: the server serves v2 as the API says, though the kubelet's
    file still says v1. The watch is cut and the API stays out of reach: v2 keeps
    serving (no swap back to v1). The kubelet then writes a newer file (v3, as the API
    says meanwhile): followed at once. The API back, its view rules again."""
    sidecar_pod.set_target("v2")
    keys = make_keys(tmp_path / "keys")
    store = LocalStore(tmp_path / "store")
    publish_versions(store, keys, tmp_path, {"v1": 1, "v2": 2, "v3": 3})
    volume, (podinfo, _) = tmp_path / "volume", files(tmp_path)
    fetcher = make_fetcher(store, keys, volume)
    await fetcher.fetch("mlp", "v1")
    (volume / "mlp" / "CURRENT").write_text("v1\n")
    server = await start_server(volume, tmp_path / "ctl.sock")
    cluster, status_file = sidecar_pod.cluster, tmp_path / "status.json"
    try:
        async with FaultProxy(cluster.server, cluster.pki.ca.cert) as proxy:
            pod = PodApi(await api_client(sidecar_pod.sidecar, proxy.url),
                         sidecar_pod.namespace, POD)  # fmt: skip
            watch = PodWatch(pod, BACKOFF, 60, random.Random(4), fallback_file=podinfo)
            watcher = make_watcher(fetcher, tmp_path / "ctl.sock", podinfo, status_file)
            watcher.source = TargetSource(podinfo, None, watch.view)
            watcher.wake = watch.changed
            served: list[str] = []

            def serving(version: str) -> bool:
                if status_file.exists():
                    report = json.loads(status_file.read_text())
                    if report["state"] == "ok" and served[-1:] != [report["serving"]]:
                        served.append(report["serving"])
                return served[-1:] == [version]

            stop = asyncio.Event()
            async with following(watch):
                await until(lambda: watch.view() is not None)
                watching = asyncio.create_task(watcher.run(stop))
                try:
                    await until(lambda: serving("v2"))
                    proxy.fault = Fault("drop")
                    proxy.cut()
                    await until(lambda: serving("v2") and proxy.count(faulted=True) >= 4)
                    await asyncio.to_thread(sidecar_pod.set_target, "v3")  # unseen: no API
                    await until(lambda: serving("v2") and proxy.count(faulted=True) >= 5)
                    set_target(podinfo, "v3")  # the kubelet's next refresh
                    await until(lambda: serving("v3"))
                    proxy.fault = None
                    await until(lambda: watch.current and serving("v3"))
                finally:
                    stop.set()
                    await watching
            assert served == ["v2", "v3"], served
            swaps = watcher.metrics.registry.get_sample_value(
                "model_sidecar_swaps_total", {"model": "mlp", "result": "ok"}
            )
            assert swaps == 2
    finally:
        await server.close()


async def test_a_refused_status_patch_is_counted_and_tried_again_after_a_pause(
    sidecar_pod: SidecarPod,
) -> None:
    """Admission refuses the report (403: the token is bound to no pod); each refusal is
    counted and the report stays due, tried again after growing pauses, and delivered
    once the kubelet has mounted a token bound to the pod."""
    cluster = sidecar_pod.cluster
    async with FaultProxy(cluster.server, cluster.pki.ca.cert) as proxy:
        metrics = SidecarMetrics()
        client = await api_client(sidecar_pod.unbound, proxy.url)
        reporter = StatusReporter(
            None,
            PodApi(client, sidecar_pod.namespace, POD, metrics),
            heartbeat_s=3600.0,
            backoff=BACKOFF,
            rng=random.Random(5),
        )
        report = SidecarReport("mlp", "v2", "v2", SidecarState.OK, target_seen_at=1.0)
        try:
            started = time.monotonic()
            await reporter.report(report)

            async def beat_until(done: Callable[[], bool]) -> None:
                async with asyncio.timeout(60):
                    while not done():
                        await reporter.heartbeat()  # as the watch loop does between cycles
                        await asyncio.sleep(0.01)

            await beat_until(lambda: proxy.count("patch") >= 6)
            window_s, patches = time.monotonic() - started, proxy.count("patch")
            assert {c.status for c in proxy.calls if c.kind == "patch"} == {403}
            assert patches <= most_calls(BACKOFF, window_s), (patches, window_s)
            assert (
                metrics.registry.get_sample_value(
                    "model_sidecar_kube_api_errors_total", {"call": "annotate", "status": "403"}
                )
                == patches
            )
            assert SIDECAR_STATUS not in sidecar_pod.annotations()
            # the kubelet mounts a token bound to the pod; the client reads it as it rotates
            client.configuration.api_key["BearerToken"] = f"Bearer {token(sidecar_pod.sidecar)}"
            await beat_until(lambda: SIDECAR_STATUS in sidecar_pod.annotations())
            delivered = SidecarReport.from_json(sidecar_pod.annotations()[SIDECAR_STATUS])
            assert delivered is not None and delivered.same_as(report)
            assert reporter.patch_failures == 0
        finally:
            await client.close()
