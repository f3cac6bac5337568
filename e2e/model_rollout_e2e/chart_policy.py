"""Write the Helm chart's admission-policy template from the one definition of the policy
(``model_operator.admission_policy``), so that the chart never holds a hand-kept copy::

    .venv/bin/python -m model_rollout_e2e.chart_policy

``tests/test_admission_policy.py`` fails while the template is not what this writes.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

from model_operator import admission_policy

TEMPLATE = (
    Path(__file__).resolve().parents[2]
    / "deploy"
    / "helm"
    / "model-rollout"
    / "templates"
    / "sidecar-admission-policy.yaml"
)
VALUE = "sidecarAdmissionPolicy"  # the chart value that turns it off (clusters < 1.30)

PREFIX = admission_policy.SIDECAR_SA_PREFIX
HEADER = f"""\
# GENERATED from operator/model_operator/admission_policy.py: do not edit; run
#   .venv/bin/python -m model_rollout_e2e.chart_policy
# (tests/test_admission_policy.py checks that this file is what that writes).
#
# The model pods' service accounts ({PREFIX}<ModelDeployment>) may patch only the
# pod their token is bound to, and only the sidecar's own annotation: RBAC cannot name
# pods created later, so their Role grants patch on every pod of the namespace. Needs
# Kubernetes >= 1.30 (admissionregistration.k8s.io/v1); {VALUE}: false
# turns it off.
"""


class _Dumper(yaml.SafeDumper):
    """Block style; multi-line strings (the longer CEL expressions) as literal blocks."""


def _string(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _string)


def _dump(obj: dict[str, Any]) -> str:
    # one expression or message a line, however long: folded, they would be harder to read
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=1000, default_flow_style=False)


def render() -> str:
    """The template's text: the policy and its binding, behind the chart value."""
    documents = "---\n".join(_dump(obj) for obj in admission_policy.objects())
    return f"{HEADER}{{{{- if .Values.{VALUE} }}}}\n{documents}{{{{- end }}}}\n"


def main() -> int:
    TEMPLATE.write_text(render())
    print(f"wrote {TEMPLATE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
