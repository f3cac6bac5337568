"""The analysis' PromQL against a real Prometheus (Debian's ``prometheus``, started on
loopback) scraping real model servers: two server processes, a canary pod (v2 with v1
beside it, under a traffic policy that splits and mirrors requests) and a stable pod,
take real requests; the figures the built-in queries read through Prometheus' HTTP API
agree with those the operator computes from the servers' own /metrics, and lead to the
same verdict; with live traffic and with shadowing only (engine time compared)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from model_operator.analysis import CANDIDATE_GROUP, STABLE_GROUP, Result, Sample, judge
from model_operator.analysis_sources import (
    as_groups,
    query_prometheus,
    read_template_canary,
    scrape,
)
from model_operator.canary_metrics import buckets, figures, increase, quantile
from model_operator.pods import PodView
from model_operator.spec import AnalysisSpec, PrometheusSpec, parse_spec
from model_rollout_contract import canary
from model_rollout_contract.canary import PIN_HEADER
from model_rollout_e2e.binaries import BinaryNotFound, prometheus_binary
from model_rollout_e2e.processes import ServerProcess, free_port
from model_rollout_e2e.prometheus import PrometheusServer
from tests.support.server import add_version, ask, infer_body

pytestmark = pytest.mark.slow
VERSIONS = ("v1", "v2")
# the pods' names as a Deployment "mlp" names them (the queries select its pods by name)
POD_NAMES = {"canary": "mlp-5f7c9d8b4-x2k9q", "stable": "mlp-5f7c9d8b4-p7wz4"}


@pytest.fixture
def prometheus_available() -> None:
    try:
        prometheus_binary()
    except BinaryNotFound as exc:  # .ci/run installs it: under CI=true this fails
        pytest.skip(str(exc))


async def send(url: str, count: int, pin: str | None = None) -> list[int]:
    """``count`` real inference requests, 8 at a time; their HTTP codes."""
    rng = np.random.default_rng(7)
    headers = {PIN_HEADER: pin} if pin else {}
    limit = asyncio.Semaphore(8)
    async with aiohttp.ClientSession() as session:

        async def one() -> int:
            body = infer_body(rng.standard_normal((2, 8)).astype(np.float32))
            async with (
                limit,
                session.post(f"{url}/v2/models/mlp/infer", json=body, headers=headers) as response,
            ):
                await response.read()
                return response.status

        return list(await asyncio.gather(*(one() for _ in range(count))))


async def read_pods(servers: dict[str, ServerProcess]) -> dict:
    snapshot = {}
    for name, server in servers.items():
        pod = PodView(name, ip="127.0.0.1")
        sample = await scrape([pod], "mlp", VERSIONS, time.time(), port=server.port)
        assert sample.snapshot is not None, sample.problem
        snapshot |= sample.snapshot
    return snapshot


async def scraping(tmp_path: Path, pods: dict[str, ServerProcess]) -> PrometheusServer:
    """A Prometheus scraping each pod's server (namespace "ml") every 0.5 s, returned once
    it has scraped them all 3 times (stopped if it never does)."""
    prometheus = PrometheusServer(
        tmp_path / "prometheus",
        [(f"127.0.0.1:{s.port}", {"namespace": "ml", "pod": n}) for n, s in pods.items()],
        scrape_interval_s=0.5,
    ).start()
    try:
        await asyncio.to_thread(prometheus.wait_for_scrapes, 3)
    except BaseException:
        prometheus.stop()
        raise
    return prometheus


def close(a: float | None, b: float | None, rel: float) -> bool:
    return a is not None and b is not None and abs(a - b) <= rel * max(abs(a), abs(b))


async def test_promql_figures_agree_with_the_pods_own_metrics(
    tmp_path: Path, prometheus_available: None
) -> None:
    root = tmp_path / "models"
    add_version(root, "mlp", "v1", seed=1)
    v2 = add_version(root, "mlp", "v2", seed=2)  # other weights: its outputs drift
    servers = {
        name: ServerProcess(
            root,
            ["mlp=v1"],
            tmp_path / f"{name}.log",
            extra=["--control-socket", str(tmp_path / f"{name}.sock"), "--retain", "2",
                   "--traffic-seed", "3", "--shadow-max-in-flight", "16"],  # none skipped
        ).start()
        for name in ("canary", "stable")
    }  # fmt: skip
    prometheus = None
    try:
        for server in servers.values():
            await asyncio.to_thread(server.wait_ready)
        sock = tmp_path / "canary.sock"
        load = {"op": "load", "model": "mlp", "version": "v2", "path": str(v2.path),
                "sha256": v2.sha256}  # fmt: skip
        assert (await ask(sock, load))["ok"]
        policy = {"op": "traffic", "model": "mlp", "stable": "v1", "candidate": "v2",
                  "traffic_percent": 30, "shadow_percent": 50}  # fmt: skip
        answer = await ask(sock, policy)
        assert "error" not in answer, answer
        canary_url, stable_url = servers["canary"].url, servers["stable"].url
        # one answer of each version first, so that every series exists before Prometheus
        # scrapes (increase() counts from a series' first sample)
        assert await send(canary_url, 1, "v1") == await send(canary_url, 1, "v2") == [200]
        assert await send(stable_url, 1) == [200]
        prometheus = await scraping(tmp_path, {POD_NAMES[n]: s for n, s in servers.items()})
        before, started = await read_pods(servers), time.time()
        codes = await send(canary_url, 400) + await send(stable_url, 200)
        assert set(codes) == {200}
        await asyncio.sleep(1)  # the last shadow runs finish after their answers
        after = await read_pods(servers)
        await asyncio.to_thread(prometheus.wait_for_scrapes, 3)
        pods = figures(increase(before, after), "v1", "v2")
        seconds = time.time() - started + 1.0  # the window reaches back before the traffic
        sample = await query_prometheus(
            PrometheusSpec(prometheus.url), "ml", "mlp", "mlp", VERSIONS, seconds, time.time()
        )
        assert sample.figures is not None, sample.problem
        promql = sample.figures

        # then shadowing only: the candidate's p99 is engine time, and so the stable's
        answer = await ask(sock, {**policy, "traffic_percent": 0})
        assert "error" not in answer, answer
        before, started = await read_pods(servers), time.time()
        assert set(await send(canary_url, 300)) == {200}
        await asyncio.sleep(1)
        after = await read_pods(servers)
        await asyncio.to_thread(prometheus.wait_for_scrapes, 3)
        shadow_window = increase(before, after)
        pods_shadow = figures(shadow_window, "v1", "v2")
        shadow_seconds = time.time() - started + 1.0
        sample = await query_prometheus(
            PrometheusSpec(prometheus.url),
            "ml",
            "mlp",
            "mlp",
            VERSIONS,
            shadow_seconds,
            time.time(),
        )
        assert sample.figures is not None, sample.problem
        promql_shadow = sample.figures
    finally:
        if prometheus is not None:
            prometheus.stop()
        for server in servers.values():
            server.stop()

    # the traffic, as the canary pod's own counters have it
    assert pods.live_requests + pods.shadow_requests == pods.requests
    assert 80 <= pods.live_requests <= 160  # ~30% of 400, drawn per request
    assert pods.shadow_requests > 60 and pods.stable_requests > 300  # canary's + stable pod's
    assert pods.errors == 0 and pods.non_finite == 0
    assert pods.argmax_agreement is not None and pods.argmax_agreement < 1.0  # other weights
    # Prometheus extrapolates increase() to the window's edges: counts agree roughly,
    # and quantiles and shares (ratios of series scraped together) closely
    for field in ("live_requests", "shadow_requests", "stable_requests"):
        assert close(getattr(pods, field), getattr(promql, field), 0.35), (field, pods, promql)
    assert (promql.errors, promql.non_finite) == (0, 0)
    assert close(pods.candidate_p99, promql.candidate_p99, 0.1), (pods, promql)
    assert close(pods.stable_p99, promql.stable_p99, 0.25), (pods, promql)
    assert close(pods.drift_p99, promql.drift_p99, 0.1), (pods, promql)
    assert close(pods.argmax_agreement, promql.argmax_agreement, 0.05), (pods, promql)
    # and the same verdict: v2's outputs are not v1's
    strict = AnalysisSpec(min_requests=50, max_output_drift=1e-3, max_latency_ratio=100)
    for measured in (pods, promql):
        check = judge(measured, strict, seconds)
        assert check.result is Result.FAILED and "drift p99" in check.message, check
    lenient = AnalysisSpec(min_requests=50, max_latency_ratio=100)
    assert judge(promql, lenient, seconds).result is Result.PASSED
    assert not pods.engine_time and not promql.engine_time

    # shadow runs only: both sources compare the candidate's shadow runs with the stable
    # version's engine runs, which are a part of its request time
    for measured in (pods_shadow, promql_shadow):
        assert (measured.live_requests, measured.engine_time) == (0, True), measured
        assert measured.shadow_requests > 60 and measured.latency_ratio is not None
        check = judge(measured, lenient, shadow_seconds)
        assert "engine time of its shadow runs" in check.message, check
    assert close(pods_shadow.candidate_p99, promql_shadow.candidate_p99, 0.1)
    assert close(pods_shadow.stable_p99, promql_shadow.stable_p99, 0.25)
    stable = shadow_window["v1"]
    engine = quantile(0.99, buckets(stable, canary.ENGINE_LATENCY))
    request = quantile(0.99, buckets(stable, canary.LATENCY))
    assert engine is not None and request is not None and engine <= request
    assert pods_shadow.stable_p99 == engine


async def test_an_unreachable_prometheus_is_inconclusive_not_a_failure() -> None:
    sample = await query_prometheus(
        PrometheusSpec(f"http://127.0.0.1:{free_port()}"), "ml", "mlp", "mlp", VERSIONS, 30, 0.0
    )
    assert sample.figures is None and sample.problem and "Prometheus" in sample.problem


async def test_two_deployments_of_the_same_model_judge_only_their_own_pods(
    tmp_path: Path, prometheus_available: None
) -> None:
    """Two ModelDeployments in one namespace, "mlp" and "mlp-b", both serving mlp:v2 (the
    latter to many clients, answering 5xx to none): each one's analysis counts only the
    requests of its own pods, with the built-in queries and with a custom one that names
    {pods}; an unfiltered query (as the built-in ones were) counts both."""
    root = tmp_path / "models"
    add_version(root, "mlp", "v1", seed=1)
    v2 = add_version(root, "mlp", "v2", seed=2)
    pods = {  # pod name -> the versions its server starts with
        "mlp-5f7c9d8b4-x2k9q": "mlp=v1",  # mlp's canary pod: v2 beside v1, 30% live
        "mlp-5f7c9d8b4-p7wz4": "mlp=v1",  # mlp's stable pod
        "mlp-b-6c8d9f7b5-m4n2s": "mlp=v2",  # mlp-b's pod, serving v2 for itself
    }
    servers = {
        name: ServerProcess(
            root, [models], tmp_path / f"{name}.log",
            extra=["--control-socket", str(tmp_path / f"{name}.sock"), "--retain", "2",
                   "--traffic-seed", "3"],
        ).start()
        for name, models in pods.items()
    }  # fmt: skip
    canary_pod, stable_pod, other_pod = pods
    prometheus = None
    try:
        for server in servers.values():
            await asyncio.to_thread(server.wait_ready)
        sock = tmp_path / f"{canary_pod}.sock"
        load = {"op": "load", "model": "mlp", "version": "v2", "path": str(v2.path),
                "sha256": v2.sha256}  # fmt: skip
        assert (await ask(sock, load))["ok"]
        policy = {"op": "traffic", "model": "mlp", "stable": "v1", "candidate": "v2",
                  "traffic_percent": 30, "shadow_percent": 0}  # fmt: skip
        answer = await ask(sock, policy)
        assert "error" not in answer, answer
        urls = {name: server.url for name, server in servers.items()}
        # every series exists before the first scrape (increase() counts from there)
        assert await send(urls[canary_pod], 1, "v1") == await send(urls[canary_pod], 1, "v2")
        assert await send(urls[stable_pod], 1) == await send(urls[other_pod], 1) == [200]
        prometheus = await scraping(tmp_path, servers)
        before, started = await read_pods({canary_pod: servers[canary_pod]}), time.time()
        codes = await send(urls[canary_pod], 200) + await send(urls[stable_pod], 100)
        codes += await send(urls[other_pod], 600)
        assert set(codes) == {200}
        after = await read_pods({canary_pod: servers[canary_pod]})
        await asyncio.to_thread(prometheus.wait_for_scrapes, 3)
        seconds = time.time() - started + 1.0
        own = PrometheusSpec(prometheus.url)

        async def figures_of(spec: PrometheusSpec, deployment: str):  # type: ignore[no-untyped-def]
            sample = await query_prometheus(
                spec, "ml", deployment, "mlp", VERSIONS, seconds, time.time()
            )
            assert sample.figures is not None, sample.problem
            return sample.figures

        mlp, mlp_b = await figures_of(own, "mlp"), await figures_of(own, "mlp-b")
        custom = PrometheusSpec(
            prometheus.url,
            (("requests", f'sum(increase({canary.REQUESTS}{{pod=~"{{pods}}",model="{{model}}",'
                          'version="{version}"}[{interval}]))'),),
        )  # fmt: skip
        mlp_custom = await figures_of(custom, "mlp")
        unfiltered = PrometheusSpec(
            prometheus.url,
            (("requests", f'sum(increase({canary.REQUESTS}{{model="{{model}}",'
                          'version="{version}"}[{interval}]))'),),
        )  # fmt: skip
        both = await figures_of(unfiltered, "mlp")
    finally:
        if prometheus is not None:
            prometheus.stop()
        for server in servers.values():
            server.stop()

    own_pods = figures(increase(before, after), "v1", "v2")
    assert 30 <= own_pods.live_requests <= 100  # ~30% of 200, drawn per request
    # mlp's canary: its own ~60 live answers of v2, never mlp-b's 600
    assert close(mlp.live_requests, own_pods.live_requests, 0.35), (mlp, own_pods)
    assert close(mlp_custom.live_requests, own_pods.live_requests, 0.35), mlp_custom
    assert mlp.stable_requests < 450  # mlp's v1 answers only (~240)
    # mlp-b's pod answered 600 of v2, none of v1
    assert mlp_b.live_requests > 400 and mlp_b.stable_requests == 0, mlp_b
    # and what the built-in queries did before: both deployments' requests as one's
    assert both.live_requests > 400, both


async def test_a_template_canary_asks_each_deployments_own_pods(
    tmp_path: Path, prometheus_available: None
) -> None:
    """An image change's canary: a pod of the stable template's Deployment "mlp" and one
    of the target's "mlp-0123456789", both serving v1. Prometheus is asked of each
    Deployment's pods exactly ("mlp"'s pattern matches none of the target's pods) and
    agrees with the pods' own /metrics relabelled into the two groups."""
    root = tmp_path / "models"
    add_version(root, "mlp", "v1", seed=1)
    stable_pod, candidate_pod = "mlp-5f7c9d8b4-p7wz4", "mlp-0123456789-6c8d7b9f5-x2k9q"
    servers = {
        name: ServerProcess(root, ["mlp=v1"], tmp_path / f"{name}.log").start()
        for name in (stable_pod, candidate_pod)
    }

    async def read() -> dict:
        sample = as_groups(Sample(0.0, snapshot=await read_pods(servers)), "v1", {candidate_pod})
        assert sample.snapshot is not None
        return sample.snapshot

    prometheus = None
    try:
        for server in servers.values():
            await asyncio.to_thread(server.wait_ready)
        urls = {name: server.url for name, server in servers.items()}
        assert await send(urls[stable_pod], 1) == await send(urls[candidate_pod], 1) == [200]
        prometheus = await scraping(tmp_path, servers)
        before, started = await read(), time.time()
        codes = await send(urls[candidate_pod], 300) + await send(urls[stable_pod], 100)
        assert set(codes) == {200}
        after = await read()
        await asyncio.to_thread(prometheus.wait_for_scrapes, 3)
        spec = parse_spec({
            "model": "mlp", "version": "v1", "image": "server:2", "replicas": 2,
            "store": {"pvc": "models"}, "allowUnsigned": True,
            "canary": {"percent": 50, "analysis": {"prometheus": {"url": prometheus.url}}},
        })  # fmt: skip
        sample = await read_template_canary(
            spec, "ml", "v1", ("mlp", []), ("mlp-0123456789", []), started - 1.0, time.time()
        )
    finally:
        if prometheus is not None:
            prometheus.stop()
        for server in servers.values():
            server.stop()

    pods = figures(increase(before, after), STABLE_GROUP, CANDIDATE_GROUP)
    assert (pods.live_requests, pods.stable_requests, pods.errors) == (300, 100, 0)
    promql = sample.figures
    assert promql is not None, sample.problem
    # each group's own pods: the stable Deployment's 100, not both pods' 400
    for field in ("live_requests", "stable_requests"):
        assert close(getattr(pods, field), getattr(promql, field), 0.35), (field, pods, promql)
    assert close(pods.candidate_p99, promql.candidate_p99, 0.25), (pods, promql)
    assert close(pods.stable_p99, promql.stable_p99, 0.25), (pods, promql)
    lenient = AnalysisSpec(min_requests=50, max_latency_ratio=100)
    assert judge(promql, lenient, 10.0).result is judge(pods, lenient, 10.0).result
