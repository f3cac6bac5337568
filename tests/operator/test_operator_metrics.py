"""The operator's gauges of a ModelDeployment, read from the status a pass wrote: the
chart's dashboard and alerts (deploy/helm/model-rollout) read the rollout's batch, the
canary analysis' verdicts and why it is Degraded from them."""

from __future__ import annotations

from typing import Any

from prometheus_client import generate_latest

from model_operator.metrics import OperatorMetrics

LABELS = 'name="resnet",namespace="ml"'


def exposition(*statuses: dict[str, Any]) -> str:
    metrics = OperatorMetrics()
    for status in statuses:
        metrics.observe("ml", "resnet", status)
    return generate_latest(metrics.registry).decode()


def degraded(reason: str) -> dict[str, Any]:
    return {
        "phase": "Degraded",
        "versions": {"v1": 3},
        "conditions": [
            {"type": "Available", "status": "True", "reason": "Available"},
            {"type": "Degraded", "status": "True", "reason": reason},
        ],
    }


def test_the_batch_and_the_analysis_are_gauges() -> None:
    text = exposition(
        {
            "phase": "Progressing",
            "versions": {"v1": 2, "v2": 1},
            "rollout": {"toVersion": "v2", "stage": "batches", "batch": 2},
            "analysis": {"checks": 4, "failures": 1, "lastResult": "Inconclusive"},
            "conditions": [{"type": "Degraded", "status": "False", "reason": "Progressing"}],
        }
    )
    assert f"model_operator_rollout_batch{{{LABELS}}} 2.0" in text
    assert f"model_operator_analysis_checks{{{LABELS}}} 4.0" in text
    assert f"model_operator_analysis_failures{{{LABELS}}} 1.0" in text
    assert f'model_operator_analysis_last_result{{{LABELS},result="Inconclusive"}} 1.0' in text
    assert f'model_operator_analysis_last_result{{{LABELS},result="Passed"}} 0.0' in text
    assert f'model_operator_deployment_pods{{{LABELS},version="v2"}} 1.0' in text
    assert f'model_operator_deployment_phase{{{LABELS},phase="Progressing"}} 1.0' in text
    assert "model_operator_deployment_degraded{" not in text  # not Degraded: no series


def test_degraded_says_why_and_only_the_latest_reason() -> None:
    text = exposition(degraded("Aborted"), degraded("AnalysisFailed"))
    assert f'model_operator_deployment_degraded{{{LABELS},reason="AnalysisFailed"}} 1.0' in text
    assert 'reason="Aborted"' not in text
    recovered = exposition(degraded("AnalysisFailed"), {"phase": "Available", "versions": {}})
    assert "model_operator_deployment_degraded{" not in recovered
    assert f"model_operator_rollout_batch{{{LABELS}}} 0.0" in recovered


def test_a_deleted_deployment_leaves_no_series() -> None:
    """A ModelDeployment deleted while Degraded: its series go with it, or the chart's
    alert on the Degraded gauge would fire for a resource that no longer exists."""
    metrics = OperatorMetrics()
    metrics.observe("ml", "resnet", degraded("AnalysisFailed"))
    metrics.observe("ml", "other", degraded("Aborted"))
    metrics.pass_seconds.labels("ml", "resnet").observe(0.01)
    metrics.forget("ml", "resnet")
    metrics.forget("ml", "never-seen")  # nothing to remove: no error
    text = generate_latest(metrics.registry).decode()
    assert 'name="resnet"' not in text
    assert (
        'model_operator_deployment_degraded{name="other",namespace="ml",reason="Aborted"} 1.0'
        in text
    )
