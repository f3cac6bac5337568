"""The chart's alerts and dashboard read metrics the programs really export, in PromQL a
real Prometheus parses (``promtool check rules``), and the alerts fire when they should
(``promtool test rules`` on series as the operator and the sidecars write them)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from model_operator.metrics import OperatorMetrics
from model_server.app import ModelServer
from model_server.config import ServerConfig
from model_sidecar.metrics import SidecarMetrics
from tests.support.helm_chart import render_chart
from tests.support.server import add_version, infer_body

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "model-rollout"
DASHBOARD = json.loads((CHART / "files" / "dashboard.json").read_text())
METRIC = re.compile(r"\bmodel_(?:server|sidecar|operator)_[a-z0-9_]+")
SAMPLE_SUFFIXES = ("_bucket", "_count", "_sum")
# Grafana's variables, as a query would have them substituted
GRAFANA_VARIABLES = {"$namespace": ".*", "$__rate_interval": "1m"}

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool (Debian's prometheus package: make prometheus) is not installed",
)


def rules() -> list[dict[str, Any]]:
    docs = render_chart(CHART, {"prometheusRule": {"enabled": True}})
    [rule] = [d for d in docs if d["kind"] == "PrometheusRule"]
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups


def dashboard_queries() -> list[str]:
    queries = [t["expr"] for p in DASHBOARD["panels"] for t in p.get("targets", [])]
    for variable in DASHBOARD["templating"]["list"]:
        if variable["type"] == "query":
            queries.append(variable["query"]["query"].removeprefix("label_values(").split(",")[0])
    return queries


def promql(query: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        query = query.replace(variable, value)
    return query


def referenced() -> set[str]:
    texts = [r["expr"] for g in rules() for r in g["rules"]] + dashboard_queries()
    return {name for text in texts for name in METRIC.findall(text)}


async def server_exposition(tmp_path: Path) -> str:
    """A server that answered one request: its per-version series exist."""
    root = tmp_path / "models"
    add_version(root, "mlp", "v1", seed=11)
    app = ModelServer(ServerConfig(repository=root, cache_dir=tmp_path / "cache")).make_app()
    async with TestClient(TestServer(app)) as client:
        response = await client.post(
            "/v2/models/mlp/infer", json=infer_body(np.ones((1, 8), np.float32))
        )
        assert response.status == 200, await response.text()
        return await (await client.get("/metrics")).text()


def sample_names(exposition: str) -> set[str]:
    """Every name a query may use: the samples, and each family's own (a labelled family
    with no series yet is declared by its TYPE line: a counter's samples end in _total)."""
    families = list(text_string_to_metric_families(exposition))
    declared = {f.name + ("_total" if f.type == "counter" else "") for f in families}
    return {s.name for f in families for s in f.samples} | declared


async def test_every_metric_the_dashboard_and_alerts_read_is_exported(tmp_path: Path) -> None:
    operator = OperatorMetrics()
    operator.observe(
        "ml",
        "resnet",
        {
            "phase": "Progressing",
            "versions": {"v1": 1},
            "rollout": {"batch": 1},
            "analysis": {"checks": 1, "failures": 0, "lastResult": "Passed"},
            "conditions": [{"type": "Degraded", "status": "True", "reason": "AnalysisFailed"}],
        },
    )
    sidecar = SidecarMetrics()
    sidecar.refusals.labels("mlp", "signature")
    sidecar.fetches.labels("mlp", "ok")
    exported = set()
    for text in (
        generate_latest(operator.registry).decode(),
        generate_latest(sidecar.registry).decode(),
        await server_exposition(tmp_path),
    ):
        exported |= sample_names(text)
    names = referenced()
    assert len(names) >= 15, names  # the regular expression finds them
    missing = {n for n in names if n not in exported}
    assert not missing, f"not exported by any program: {sorted(missing)}"


@needs_promtool
def test_prometheus_parses_the_alerts(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rules()}))
    checked = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True)
    assert checked.returncode == 0, checked
    alerts = {r["alert"] for g in rules() for r in g["rules"]}
    assert alerts == {
        "ModelDeploymentDegraded",
        "ModelCanaryAnalysisFailed",
        "ModelSidecarRefusedVersion",
        "ModelRolloutStuck",
    }


@needs_promtool
def test_prometheus_parses_every_dashboard_query(tmp_path: Path) -> None:
    """Each query (Grafana's variables substituted) as a recording rule: promtool parses
    the expression as Prometheus does."""
    recorded = [
        {"record": f"dashboard:query{i}", "expr": promql(q)}
        for i, q in enumerate(dashboard_queries())
    ]
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": recorded}]}))
    checked = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True)
    assert checked.returncode == 0, checked


def test_the_dashboard_has_the_issues_panels() -> None:
    titles = {p["title"] for p in DASHBOARD["panels"]}
    for wanted in ("Phase", "Rollout batch", "Requests per version", "Errors (5xx) per version"):
        assert wanted in titles
    for wanted in ("Latency p99 per version", "Canary analysis: last verdict"):
        assert wanted in titles
    for wanted in ("Swaps and refused loads", "Memory held by loaded versions"):
        assert wanted in titles
    [configmap] = [
        d for d in render_chart(CHART, {"dashboard": {"enabled": True}}) if d["kind"] == "ConfigMap"
    ]
    assert json.loads(configmap["data"]["model-rollout.json"]) == DASHBOARD
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"


def series(metric: str, values: str, /, **labels: str) -> dict[str, str]:
    """One input series of ``promtool test rules``: ``values`` one sample a minute."""
    selector = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{metric}{{{selector}}}", "values": values}


def fired(at: str, alert: str, *labelled: dict[str, str]) -> dict[str, Any]:
    exp = [{"exp_labels": {"severity": "warning", **labels}} for labels in labelled]
    return {"eval_time": at, "alertname": alert, "exp_alerts": exp}


PHASE, PODS = "model_operator_deployment_phase", "model_operator_deployment_pods"
A, B, C = ({"namespace": "ml", "name": n} for n in "abc")
REFUSED = {"namespace": "ml", "model": "mlp", "reason": "signature"}
# series as the operator and a sidecar write them
ALERT_TESTS = {
    "rule_files": ["rules.yaml"],
    "evaluation_interval": "1m",
    "tests": [
        {
            "interval": "1m",
            "input_series": [
                # a: degraded by the canary analysis from minute 0
                series(PHASE, "1x20", **A, phase="Degraded"),
                series("model_operator_deployment_degraded", "1x20", **A, reason="AnalysisFailed"),
                # b: rolling forward, but no pod moves and no batch starts after minute 3
                series(PHASE, "1x60", **B, phase="Progressing"),
                series(PODS, "4 3 2 2 2 2+0x55", **B, version="v1"),
                series("model_operator_rollout_batch", "1 2 3 3 3 3+0x55", **B),
                # c: rolling forward, a pod moving every minute
                series(PHASE, "1x60", **C, phase="Progressing"),
                series(PODS, "0+1x60", **C, version="v2"),
                series("model_sidecar_refusals_total", "0 0 1 1 1", **REFUSED, pod="a-1"),
            ],
            "alert_rule_test": [
                fired("3m", "ModelDeploymentDegraded"),  # pending for 5m first
                fired("6m", "ModelDeploymentDegraded", A),
                fired("1m", "ModelCanaryAnalysisFailed", A),
                fired("3m", "ModelSidecarRefusedVersion", REFUSED),
                fired("20m", "ModelRolloutStuck"),
                # 30m (stuckFor) without a change, then 5m pending; never c
                fired("45m", "ModelRolloutStuck", B),
            ],
        }
    ],
}


@needs_promtool
def test_the_alerts_fire_when_they_should(tmp_path: Path) -> None:
    groups = rules()
    for rule in (r for g in groups for r in g["rules"]):
        del rule["annotations"]  # the expressions and labels are under test, not the text
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(ALERT_TESTS))
    tested = subprocess.run(
        ["promtool", "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr
