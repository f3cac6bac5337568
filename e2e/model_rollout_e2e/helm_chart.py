"""The project's Helm chart through real Helm: ``helm-python-sdk`` loads Helm v4's own Go
SDK (through ctypes), so rendering and linting are exactly what ``helm template`` and
``helm lint`` do, with no helm binary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

RELEASE = "model-rollout"
NAMESPACE = "model-rollout-system"


def render_chart(
    chart: Path, values: dict[str, Any] | None = None, release: str = RELEASE
) -> list[dict[str, Any]]:
    """Every object ``helm install`` would send: the CRDs under ``crds/``, then the
    rendered templates, parsed (values.schema.json refuses bad values first)."""
    with helm.Chart.load(chart) as loaded:
        crds = [crd["data"] for crd in loaded.crds]
        rendered = loaded.render(values or {}, name=release, namespace=NAMESPACE, is_install=True)
    manifests = [  # as `helm template`: no NOTES.txt, no partials (_helpers.tpl)
        rendered[path]
        for path in sorted(rendered)
        if not path.endswith("NOTES.txt") and not Path(path).name.startswith("_")
    ]
    texts = [*crds, *manifests]
    return [doc for text in texts for doc in yaml.safe_load_all(text) if doc]


def render_notes(chart: Path, values: dict[str, Any] | None = None, release: str = RELEASE) -> str:
    """What ``helm install`` prints after installing: the chart's NOTES.txt."""
    with helm.Chart.load(chart) as loaded:
        rendered = loaded.render(values or {}, name=release, namespace=NAMESPACE, is_install=True)
    [notes] = [text for path, text in rendered.items() if path.endswith("/NOTES.txt")]
    return str(notes)


def lint_chart(chart: Path, values: dict[str, Any] | None = None) -> list[str]:
    """``helm lint --strict``: every finding at warning level or above, as text."""
    report = helm.lint(chart, values or {}, strict=True, namespace=NAMESPACE)
    findings = [f"{m['path']}: {m['error']}" for m in report["messages"] if m["severity"] >= 2]
    return [*findings, *report["errors"]]
