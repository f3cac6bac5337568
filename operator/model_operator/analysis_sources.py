"""Where the canary's figures are read (the analysis' only I/O): each pod's server
``/metrics`` over HTTP at the pod's IP, or, with ``analysis.prometheus``, PromQL through
Prometheus' HTTP API. Either way the result is a :class:`~.analysis.Sample`; a source
that cannot be read gives a sample saying why (an inconclusive check, never a failed
one: an unreachable pod is not evidence against the candidate)."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import aiohttp

from model_rollout_contract import canary
from model_rollout_contract.defaults import SERVER_PORT
from model_rollout_contract.states import CanaryStep

from .analysis import Sample
from .canary_metrics import (
    Figures,
    MetricsFormatError,
    Snapshot,
    compares_engine_time,
    parse_metrics,
)
from .pods import PodView
from .spec import ModelDeploymentSpec, PrometheusSpec

READ_TIMEOUT_S = 5.0  # one pod's /metrics, or one PromQL query
# pods read per check, of the canary's and (for a canary of whole pods) of the stable
# version's: a sample of a large fleet is enough, and keeps .status small
MAX_PODS_READ = 16


def pods_to_read(
    spec: ModelDeploymentSpec,
    stable: str,
    candidate: str,
    pods: list[PodView],
    step: CanaryStep = CanaryStep.LIVE,
) -> list[PodView]:
    """The canary pods; for a canary of whole pods also stable pods, as the reference
    (an in-pod canary, or any in its shadow step, holds its own: the stable version
    answers beside the candidate)."""
    by_name = sorted(pods, key=lambda p: p.name)
    chosen = [p for p in by_name if p.target == candidate and p.serves(candidate)][:MAX_PODS_READ]
    if not spec.canary.holds_both(step):
        reference = [p for p in by_name if p.target != candidate and p.serves(stable)]
        chosen += reference[:MAX_PODS_READ]
    return chosen


async def scrape(
    pods: list[PodView],
    model: str,
    versions: tuple[str, str],
    at: float,
    port: int = SERVER_PORT,
) -> Sample:
    """One snapshot of the pods' series of ``model``'s two versions."""
    missing = [p.name for p in pods if not p.ip]
    if missing:
        return Sample(at, problem=f"pods without an IP yet: {missing}")
    timeout = aiohttp.ClientTimeout(total=READ_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(pod: PodView) -> tuple[str, Any]:
            url = f"http://{pod.ip}:{port}/metrics"
            try:
                async with session.get(url) as response:
                    if response.status != 200:
                        return pod.name, f"{url} answered {response.status}"
                    text = await response.text()
                return pod.name, parse_metrics(text, model, versions)
            except (aiohttp.ClientError, asyncio.TimeoutError, MetricsFormatError) as exc:
                return pod.name, f"{url}: {exc or type(exc).__name__}"

        results = await asyncio.gather(*(one(p) for p in pods))
    problems = [f"pod {name}: {r}" for name, r in results if isinstance(r, str)]
    if problems:
        return Sample(at, problem="; ".join(problems))
    snapshot: Snapshot = {name: r for name, r in results}
    return Sample(at, snapshot=snapshot)


# --- Prometheus --------------------------------------------------------------------------
# the series of this deployment's own pods only: another ModelDeployment serving the same
# model (and versions) in the namespace has other pods, whose traffic is not this canary's
_SELECT = '{namespace="{namespace}",pod=~"{pods}",model="{model}",version="{version}"'
# a Deployment's pods are named <deployment>-<pod-template-hash>-<5 characters>, and the
# hash has no "-": so "mlp" does not match the pods of a deployment "mlp-b" (PromQL
# anchors a regular expression at both ends). A ModelDeployment's Deployments are "mlp"
# and, after a change of its pod template, "mlp-<10 hex digits>" (template_rollout.py):
# the pods of each are its own
POD_NAME_TEMPLATE = "{deployment}(-[a-f0-9]{10})?-[a-z0-9]{1,10}-[a-z0-9]{5}"


def _increase(metric: str, extra: str = "") -> str:
    return f"sum(increase({metric}{_SELECT}{extra}}}[{{interval}}]))"


def _p99(histogram: str) -> str:
    return (
        f"histogram_quantile(0.99, sum by (le) (increase({histogram}_bucket{_SELECT}}}"
        "[{interval}])))"
    )


# the built-in templates, over the contract's metric names; spec.canary.analysis
# .prometheus.queries replaces any of them (a recording rule, other label names)
DEFAULT_QUERIES = {
    "requests": _increase(canary.REQUESTS),
    "errors": _increase(canary.REQUESTS, ',code=~"5.."'),
    "latencyP99": _p99(canary.LATENCY),
    "shadowRequests": _increase(canary.SHADOW_REQUESTS),
    "shadowLatencyP99": _p99(canary.SHADOW_LATENCY),
    "engineLatencyP99": _p99(canary.ENGINE_LATENCY),  # asked of the stable version
    "drift": _p99(canary.SHADOW_DRIFT),
    "argmaxAgreement": (
        f"{_increase(canary.SHADOW_ARGMAX_AGREED)} / {_increase(canary.SHADOW_ARGMAX_COMPARED)}"
    ),
    "nonFinite": _increase(canary.OUTPUT_NONFINITE),
}


class QueryError(Exception):
    """Prometheus could not answer a query, or answered it with several series."""


def pods_regex(deployment: str) -> str:
    """The PromQL regular expression (as written inside a string literal) of the names
    of the ModelDeployment's pods (those of each of its pod templates' Deployments); a "."
    of the name matches only itself."""
    return POD_NAME_TEMPLATE.replace("{deployment}", deployment.replace(".", "\\\\."))


def render(
    template: str, namespace: str, deployment: str, model: str, version: str, seconds: float
) -> str:
    """A template with its placeholders filled in (PromQL's own braces left alone; the
    values are names of a restricted alphabet, so nothing can be injected). ``{pods}``
    (before ``{deployment}``, which it contains) is :func:`pods_regex`."""
    values = {
        "{pods}": pods_regex(deployment),
        "{deployment}": deployment,
        "{namespace}": namespace,
        "{model}": model,
        "{version}": version,
        "{interval}": f"{max(1, math.ceil(seconds))}s",
    }
    for placeholder, value in values.items():
        template = template.replace(placeholder, value)
    return template


async def _query(session: aiohttp.ClientSession, url: str, promql: str) -> float | None:
    """One instant query: its single value, or ``None`` when it has none (no series, or
    NaN, as a quantile of an empty histogram is)."""
    try:
        async with session.get(f"{url.rstrip('/')}/api/v1/query", params={"query": promql}) as r:
            answer = await r.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        raise QueryError(f"{url}: {exc or type(exc).__name__}") from exc
    if not isinstance(answer, dict) or answer.get("status") != "success":
        error = answer.get("error") if isinstance(answer, dict) else answer
        raise QueryError(f"{promql!r}: {error}")
    data = answer.get("data") or {}
    result = data.get("result")
    if data.get("resultType") == "scalar" and isinstance(result, list) and len(result) == 2:
        value = result[1]
    elif data.get("resultType") == "vector" and isinstance(result, list):
        if not result:
            return None
        if len(result) > 1:
            raise QueryError(f"{promql!r} gave {len(result)} series; expected one (sum it)")
        value = result[0]["value"][1]
    else:
        raise QueryError(f"{promql!r} gave a {data.get('resultType')}, not a vector")
    number = float(value)
    return number if math.isfinite(number) else None


async def query_prometheus(
    prometheus: PrometheusSpec,
    namespace: str,
    deployment: str,
    model: str,
    versions: tuple[str, str],
    seconds: float,
    at: float,
) -> Sample:
    """The figures of the last ``seconds`` of ``deployment``'s pods, each a query of the
    stable or the candidate;
    latency as :func:`~.canary_metrics.figures` compares it (request time of live
    answers, or with none live engine time: shadow runs against the stable's engine)."""
    stable, candidate = versions
    asked = [
        ("requests", candidate),
        ("errors", candidate),
        ("shadowRequests", candidate),
        ("requests", stable),
        ("latencyP99", candidate),
        ("shadowLatencyP99", candidate),
        ("latencyP99", stable),
        ("engineLatencyP99", stable),
        ("drift", candidate),
        ("argmaxAgreement", candidate),
        ("nonFinite", candidate),
    ]
    timeout = aiohttp.ClientTimeout(total=READ_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        promql = [
            render(
                prometheus.query(name) or DEFAULT_QUERIES[name],
                namespace,
                deployment,
                model,
                version,
                seconds,
            )
            for name, version in asked
        ]
        try:
            values = await asyncio.gather(*(_query(session, prometheus.url, q) for q in promql))
        except QueryError as exc:
            return Sample(at, problem=f"Prometheus: {exc}")
    got = dict(zip((f"{n}:{v}" for n, v in asked), values, strict=True))

    def count(key: str) -> int:
        return round(got[key] or 0.0)

    shadowed = count(f"shadowRequests:{candidate}")
    live = max(0, count(f"requests:{candidate}") - shadowed)  # requests counts shadow runs
    engine_time = compares_engine_time(shadowed, live, got[f"latencyP99:{candidate}"])
    return Sample(
        at,
        figures=Figures(
            live_requests=live,
            errors=count(f"errors:{candidate}"),
            shadow_requests=shadowed,
            stable_requests=count(f"requests:{stable}"),
            candidate_p99=got[
                f"shadowLatencyP99:{candidate}" if engine_time else f"latencyP99:{candidate}"
            ],
            stable_p99=got[f"engineLatencyP99:{stable}" if engine_time else f"latencyP99:{stable}"],
            drift_p99=got[f"drift:{candidate}"],
            argmax_agreement=got[f"argmaxAgreement:{candidate}"],
            non_finite=count(f"nonFinite:{candidate}"),
            engine_time=engine_time,
        ),
    )


async def read_canary(
    spec: ModelDeploymentSpec,
    namespace: str,
    name: str,
    stable: str,
    pods: list[PodView],
    window_start: float,
    at: float,
    step: CanaryStep = CanaryStep.LIVE,
) -> Sample:
    """What the analysis reads at ``at`` of the canary of ``spec.version`` of the
    ModelDeployment ``name`` (its Deployment's name), in the canary's ``step``."""
    versions = (stable, spec.version)
    assert spec.canary.analysis is not None
    prometheus = spec.canary.analysis.prometheus
    if prometheus is not None:
        return await query_prometheus(
            prometheus, namespace, name, spec.model, versions, at - window_start, at
        )
    chosen = pods_to_read(spec, stable, spec.version, pods, step)
    if not chosen:
        return Sample(at, problem="no canary pod serves the candidate")
    return await scrape(chosen, spec.model, versions, at)
