"""The tests' name for :mod:`model_rollout_e2e.helm_chart` (the chart rendered by real
Helm), which the demo and the end-to-end scenario use too."""

from model_rollout_e2e.helm_chart import NAMESPACE, RELEASE, lint_chart, render_chart, render_notes

__all__ = ["NAMESPACE", "RELEASE", "lint_chart", "render_chart", "render_notes"]
