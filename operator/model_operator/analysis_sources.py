"""Where the canary's figures are read (the analysis' only I/O): each pod's server
``/metrics`` over HTTP at the pod's IP, or, with ``analysis.prometheus``, PromQL through
Prometheus' HTTP API. Either way the result is a :class:`~.analysis.Sample`; a source
that cannot be read gives a sample saying why (an inconclusive check, never a failed
one: an unreachable pod is not evidence against the candidate)."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any

import aiohttp

from model_rollout_contract import canary
from model_rollout_contract.defaults import SERVER_PORT
from model_rollout_contract.states import CanaryStep

from .analysis import CANDIDATE_GROUP, STABLE_GROUP, Sample
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
    versions: tuple[str, ...],
    at: float,
    port: int = SERVER_PORT,
) -> Sample:
    """One snapshot of the pods' series of ``model``'s ``versions``."""
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


def template_pods_to_read(
    version: str, stable: list[PodView], candidate: list[PodView]
) -> tuple[list[PodView], list[PodView]]:
    """A template canary's reference (the stable template's pods) and candidate (the
    target template's), each the ready pods serving ``version``, at most
    :data:`MAX_PODS_READ` of each."""

    def chosen(pods: list[PodView]) -> list[PodView]:
        return sorted((p for p in pods if p.serves(version)), key=lambda p: p.name)[:MAX_PODS_READ]

    return chosen(stable), chosen(candidate)


def as_groups(sample: Sample, version: str, candidate: set[str]) -> Sample:
    """A scrape of one ``version``'s pods with each pod's series relabelled by its group
    (:data:`~.analysis.CANDIDATE_GROUP` for the pods named in ``candidate``, else
    :data:`~.analysis.STABLE_GROUP`), so that the figures of two pod templates on one
    version are those of a version canary's two versions."""
    if sample.snapshot is None:
        return sample
    snapshot: Snapshot = {
        pod: {CANDIDATE_GROUP if pod in candidate else STABLE_GROUP: series[version]}
        for pod, series in sample.snapshot.items()
        if version in series
    }
    return Sample(sample.at, snapshot=snapshot)


# --- Prometheus --------------------------------------------------------------------------
# the series of this deployment's own pods only: another ModelDeployment serving the same
# model (and versions) in the namespace has other pods, whose traffic is not this canary's
_SELECT = '{namespace="{namespace}",pod=~"{pods}",model="{model}",version="{version}"'
# a Deployment's pods are named <deployment>-<pod-template-hash>-<5 characters>, and the
# hash has no "-": so "mlp" does not match the pods of a deployment "mlp-b" (PromQL
# anchors a regular expression at both ends). A ModelDeployment's Deployments are "mlp"
# and, after a change of its pod template, "mlp-<10 hex digits>" (template_rollout.py):
# the pods of each are its own
_POD_SUFFIX = "-[a-z0-9]{1,10}-[a-z0-9]{5}"
POD_NAME_TEMPLATE = "{deployment}(-[a-f0-9]{10})?" + _POD_SUFFIX


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


def _escaped(deployment: str) -> str:
    """A name inside a PromQL regular expression (a string literal): "." matches itself."""
    return deployment.replace(".", "\\\\.")


def pods_regex(deployment: str) -> str:
    """The PromQL regular expression (as written inside a string literal) of the names
    of the ModelDeployment's pods (those of each of its pod templates' Deployments); a "."
    of the name matches only itself."""
    return POD_NAME_TEMPLATE.replace("{deployment}", _escaped(deployment))


# Kubernetes names a pod after the first 58 characters of "<replicaset>-" (63 with the 5
# random ones): a long Deployment name leaves room for only part of the hash and its "-"
_POD_PREFIX_MAX = 58
_HASH_MAX = 10


def deployment_pods_regex(deployment: str) -> str:
    """That of the pods of the one Deployment ``deployment`` (a template canary's two
    groups): "mlp" matches none of "mlp-<10 hex digits>"'s pods; a long name's pods are
    named with what of "<hash>-" fits (a ModelDeployment name of up to 45 characters
    keeps its template Deployments' pods apart from the first one's)."""
    prefix = f"{deployment}-"
    room = _POD_PREFIX_MAX - len(prefix)  # characters of "<hash>-" in the pod's name
    if room > _HASH_MAX:
        return _escaped(deployment) + _POD_SUFFIX
    if room <= 0:
        return _escaped(prefix[:_POD_PREFIX_MAX]) + "[a-z0-9]{5}"
    cut = f"[a-z0-9]{{{room}}}" + (f"|[a-z0-9]{{1,{room - 1}}}-" if room > 1 else "")
    return f"{_escaped(prefix)}({cut})[a-z0-9]{{5}}"


@dataclass(frozen=True)
class Group:
    """One side of a comparison, as the queries select it: the series of ``version``
    of the pods whose names ``pods`` matches (``deployment``: the placeholder's value)."""

    version: str
    pods: str
    deployment: str


def render(template: str, namespace: str, group: Group, model: str, seconds: float) -> str:
    """A template with its placeholders filled in for ``group`` (PromQL's own braces left
    alone; the values are names of a restricted alphabet, so nothing can be injected).
    ``{pods}`` goes before ``{deployment}``, which it contains."""
    values = {
        "{pods}": group.pods,
        "{deployment}": group.deployment,
        "{namespace}": namespace,
        "{model}": model,
        "{version}": group.version,
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
    """The figures of the last ``seconds`` of ``deployment``'s pods (every template's),
    the stable version's against the candidate's."""
    stable, candidate = versions
    pods = pods_regex(deployment)
    return await query_groups(
        prometheus,
        namespace,
        model,
        Group(stable, pods, deployment),
        Group(candidate, pods, deployment),
        seconds,
        at,
    )


async def query_groups(
    prometheus: PrometheusSpec,
    namespace: str,
    model: str,
    stable: Group,
    candidate: Group,
    seconds: float,
    at: float,
) -> Sample:
    """The figures of the last ``seconds``, each a query of the stable or the candidate
    group (two versions of the same pods, or one version of two pod templates' pods);
    latency as :func:`~.canary_metrics.figures` compares it (request time of live
    answers, or with none live engine time: shadow runs against the stable's engine)."""
    groups = {STABLE_GROUP: stable, CANDIDATE_GROUP: candidate}
    cand, base = CANDIDATE_GROUP, STABLE_GROUP
    asked = [
        ("requests", cand),
        ("errors", cand),
        ("shadowRequests", cand),
        ("requests", base),
        ("latencyP99", cand),
        ("shadowLatencyP99", cand),
        ("latencyP99", base),
        ("engineLatencyP99", base),
        ("drift", cand),
        ("argmaxAgreement", cand),
        ("nonFinite", cand),
    ]
    timeout = aiohttp.ClientTimeout(total=READ_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        promql = [
            render(
                prometheus.query(name) or DEFAULT_QUERIES[name],
                namespace,
                groups[group],
                model,
                seconds,
            )
            for name, group in asked
        ]
        try:
            values = await asyncio.gather(*(_query(session, prometheus.url, q) for q in promql))
        except QueryError as exc:
            return Sample(at, problem=f"Prometheus: {exc}")
    got = dict(zip((f"{n}:{g}" for n, g in asked), values, strict=True))

    def count(key: str) -> int:
        return round(got[key] or 0.0)

    shadowed = count(f"shadowRequests:{cand}")
    live = max(0, count(f"requests:{cand}") - shadowed)  # requests counts shadow runs
    engine_time = compares_engine_time(shadowed, live, got[f"latencyP99:{cand}"])
    return Sample(
        at,
        figures=Figures(
            live_requests=live,
            errors=count(f"errors:{cand}"),
            shadow_requests=shadowed,
            stable_requests=count(f"requests:{base}"),
            candidate_p99=got[f"shadowLatencyP99:{cand}" if engine_time else f"latencyP99:{cand}"],
            stable_p99=got[f"engineLatencyP99:{base}" if engine_time else f"latencyP99:{base}"],
            drift_p99=got[f"drift:{cand}"],
            argmax_agreement=got[f"argmaxAgreement:{cand}"],
            non_finite=count(f"nonFinite:{cand}"),
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


async def read_template_canary(
    spec: ModelDeploymentSpec,
    namespace: str,
    version: str,
    stable: tuple[str, list[PodView]],
    candidate: tuple[str, list[PodView]],
    window_start: float,
    at: float,
) -> Sample:
    """What the analysis of a template canary reads at ``at``: the pods of the target
    template's Deployment (``candidate``: its name and pods) against those of the stable
    template's (``stable``), both serving ``version``, as the groups
    :data:`~.analysis.STABLE_GROUP` and :data:`~.analysis.CANDIDATE_GROUP`."""
    assert spec.canary.analysis is not None
    prometheus = spec.canary.analysis.prometheus
    (stable_name, stable_pods), (candidate_name, candidate_pods) = stable, candidate
    if prometheus is not None:
        return await query_groups(
            prometheus,
            namespace,
            spec.model,
            Group(version, deployment_pods_regex(stable_name), stable_name),
            Group(version, deployment_pods_regex(candidate_name), candidate_name),
            at - window_start,
            at,
        )
    reference, chosen = template_pods_to_read(version, stable_pods, candidate_pods)
    if not chosen:
        return Sample(at, problem=f"no ready pod of {candidate_name} serves {version}")
    if not reference:
        return Sample(at, problem=f"no ready pod of {stable_name} serves {version}")
    sample = await scrape([*chosen, *reference], spec.model, (version,), at)
    return as_groups(sample, version, {p.name for p in chosen})
