"""Every metric the three programs expose follows Prometheus' naming rules
(https://prometheus.io/docs/practices/naming/), checked on the text each one serves: one
prefix per program, ``_total`` on counters and only there, base units (``_seconds``,
``_bytes``) in the names of times and sizes, a unit on every histogram, ``_info`` only on
info metrics, and no other type's name ending like a histogram's or counter's samples."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from model_operator.metrics import PREFIX as OPERATOR_PREFIX
from model_operator.metrics import OperatorMetrics
from model_rollout_contract import canary
from model_server.app import ModelServer
from model_server.config import ServerConfig
from model_server.observability.metrics import PREFIX as SERVER_PREFIX
from model_server.pool.metrics import merge_expositions
from model_sidecar.metrics import PREFIX as SIDECAR_PREFIX
from model_sidecar.metrics import SidecarMetrics
from tests.support.server import add_version, infer_body, write_tenants

# the units a histogram (or a time or size) may be measured in: base units, and the
# things counted (rows of a batch; a model's own output values, which have no unit
# Prometheus could name)
UNITS = ("seconds", "bytes", "rows", "ratio", "output_units")
# words that say a name is a time or a size: such a name ends in its base unit
MEASURES = ("duration", "latency", "time", "age", "delay", "timeout", "elapsed", "size", "memory")
# units that are not base units (Prometheus: seconds, bytes, ...)
NOT_BASE = ("ms", "us", "ns", "millis", "milliseconds", "microseconds", "minutes", "hours")
NOT_BASE += ("kb", "mb", "gb", "kib", "mib", "gib", "kilobytes", "megabytes")
# suffixes the exposition gives the samples of counters, histograms, summaries and infos
RESERVED = ("_total", "_created", "_count", "_sum", "_bucket", "_info")

TYPE_LINE = re.compile(r"^# TYPE (\S+) (\S+)$")


def naming_problems(exposition: str, prefix: str) -> list[str]:
    """What breaks the naming rules in one exposition (text format 0.0.4), one line per
    metric family; empty when every family follows them."""
    types = {m[1]: m[2] for m in map(TYPE_LINE.match, exposition.splitlines()) if m}
    values = {
        s.name: s.value for f in text_string_to_metric_families(exposition) for s in f.samples
    }
    problems = []
    for name, kind in sorted(types.items()):
        base = name.removesuffix("_created")
        if kind == "gauge" and base != name and ({base, base + "_total"} & types.keys()):
            continue  # a counter's or histogram's creation time, as the format writes it
        said = f"{name} ({kind})"
        if not name.startswith(prefix):
            problems.append(f"{said}: not prefixed {prefix!r}")
        if kind == "counter" and not name.endswith("_total"):
            problems.append(f"{said}: a counter's name ends in _total")
        if kind != "counter" and name.endswith("_total"):
            problems.append(f"{said}: only a counter's name ends in _total")
        if name.endswith("_info") and (kind != "gauge" or values.get(name, 1.0) != 1.0):
            problems.append(f"{said}: _info names an info metric (a gauge of 1)")
        if kind == "gauge" and name.endswith(RESERVED) and not name.endswith("_info"):
            problems.append(f"{said}: ends in a suffix reserved for other types' samples")
        if kind in ("histogram", "summary") and not name.endswith(UNITS):
            problems.append(f"{said}: a histogram's name ends in its unit {UNITS}")
        words = name.removesuffix("_total").split("_")
        if any(w in MEASURES for w in words) and not name.removesuffix("_total").endswith(UNITS):
            problems.append(f"{said}: a time or size ends in its base unit")
        if any(w in NOT_BASE for w in words):
            problems.append(f"{said}: not a base unit")
    return problems


def test_the_rules_catch_what_they_are_about() -> None:
    """The checker itself: each rule flags a name that breaks it, and passes its fix."""
    bad = (
        "# TYPE x_requests counter\n"  # a counter written without _total by hand
        "x_requests 1\n"
        "# TYPE x_sum_total gauge\n"
        "x_sum_total 1\n"
        "# TYPE x_batch_size histogram\n"
        'x_batch_size_bucket{le="+Inf"} 0\nx_batch_size_count 0\nx_batch_size_sum 0\n'
        "# TYPE x_load_time_ms gauge\n"
        "x_load_time_ms 1\n"
        "# TYPE y_memory gauge\n"
        "y_memory 1\n"
        "# TYPE x_output_sum gauge\n"
        "x_output_sum 1\n"
        "# TYPE x_build_info gauge\n"
        "x_build_info 2\n"
    )
    found = "\n".join(naming_problems(bad, "x_"))
    for name in ("x_requests", "x_sum_total", "x_batch_size", "x_load_time_ms", "y_memory"):
        assert name + " (" in found, (name, found)
    for name in ("x_output_sum", "x_build_info"):
        assert name + " (" in found, (name, found)
    good = (
        "# TYPE x_requests_total counter\nx_requests_total 1\n"
        "# TYPE x_requests_created gauge\nx_requests_created 1.7e9\n"
        "# TYPE x_batch_rows histogram\n"
        'x_batch_rows_bucket{le="+Inf"} 0\nx_batch_rows_count 0\nx_batch_rows_sum 0\n'
        "# TYPE x_load_duration_seconds gauge\nx_load_duration_seconds 1\n"
        "# TYPE x_build_info gauge\nx_build_info 1\n"
    )
    assert not (found := naming_problems(good, "x_")), "\n".join(found)


async def test_every_metric_the_server_serves_is_named_by_the_rules(
    tmp_path: Path,
) -> None:
    """A server with tenants (one rate-limited) serving a version that answered: every
    family it registers is in its ``/metrics``, and the pool's merge adds its own."""
    root = tmp_path / "models"
    add_version(root, "acme/mlp", "v1", seed=11)
    tenants = write_tenants(
        tmp_path / "tenants.yaml", rate_limits={"acme": {"requests_per_second": 5, "burst": 5}}
    )
    config = ServerConfig(repository=root, tenants_file=tenants, cache_dir=tmp_path / "cache")
    app = ModelServer(config).make_app()
    async with TestClient(TestServer(app)) as client:
        body = infer_body(np.ones((1, 8), np.float32))
        response = await client.post(
            "/v2/models/mlp/infer", json=body, headers={"X-API-Key": "key-acme"}
        )
        assert response.status == 200, await response.text()
        text = await (await client.get("/metrics")).text()
    assert canary.REQUESTS in text and "_in_flight" in text  # the per-version ones and others
    assert not (found := naming_problems(text, SERVER_PREFIX)), "\n".join(found)
    assert not (
        found := naming_problems(merge_expositions([text, text]).decode(), SERVER_PREFIX)
    ), "\n".join(found)


def test_the_contract_names_carry_the_server_prefix() -> None:
    names = [v for k, v in vars(canary).items() if k.isupper() and isinstance(v, str)]
    metric_names = [n for n in names if n.islower() and "_" in n and "/" not in n]
    assert canary.REQUESTS in metric_names
    assert all(n.startswith(SERVER_PREFIX) for n in metric_names), metric_names


def test_every_metric_of_the_sidecar_is_named_by_the_rules() -> None:
    text = generate_latest(SidecarMetrics().registry).decode()
    assert not (found := naming_problems(text, SIDECAR_PREFIX)), "\n".join(found)


def test_every_metric_of_the_operator_is_named_by_the_rules() -> None:
    text = generate_latest(OperatorMetrics().registry).decode()
    assert not (found := naming_problems(text, OPERATOR_PREFIX)), "\n".join(found)
