"""Write the Helm chart's admission-policy templates from the one definition of each policy
(``model_operator.admission_policy``: the model pods' service accounts;
``model_operator.editor_policy``: the rollout editors), so that the chart never holds a
hand-kept copy::

    .venv/bin/python -m model_rollout_e2e.chart_policy

``tests/operator/test_admission_policy.py`` fails while a template is not what this writes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from model_operator import admission_policy, editor_policy

TEMPLATES = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "model-rollout" / "templates"
GENERATED = """\
# GENERATED from operator/model_operator/{module}.py: do not edit; run
#   .venv/bin/python -m model_rollout_e2e.chart_policy
# (tests/operator/test_admission_policy.py checks that this file is what that writes).
#
"""


@dataclass(frozen=True)
class ChartPolicy:
    """One policy's template: where, behind which chart value, what its header says."""

    objects: Callable[[], list[dict[str, Any]]]  # the module's objects()
    module: str
    template: Path
    value: str  # the chart value that turns it off (clusters < 1.30)
    about: str  # the header's explanation, after the GENERATED lines

    def header(self) -> str:
        return GENERATED.format(module=self.module) + self.about


PREFIX = admission_policy.SIDECAR_SA_PREFIX
SIDECAR = ChartPolicy(
    admission_policy.objects,
    "admission_policy",
    TEMPLATES / "sidecar-admission-policy.yaml",
    "sidecarAdmissionPolicy",
    f"""\
# The model pods' service accounts ({PREFIX}<ModelDeployment>) may patch only the
# pod their token is bound to, and only the sidecar's own annotation: RBAC cannot name
# pods created later, so their Role grants patch on every pod of the namespace. Needs
# Kubernetes >= 1.30 (admissionregistration.k8s.io/v1); sidecarAdmissionPolicy: false
# turns it off.
""",
)
VERB = editor_policy.CONFIGURE_VERB
EDITOR = ChartPolicy(
    editor_policy.objects,
    "editor_policy",
    TEMPLATES / "editor-admission-policy.yaml",
    "editorAdmissionPolicy",
    f"""\
# Whoever may update a ModelDeployment but not '{VERB}' it (the rollout-editor role,
# and through it the built-in edit role) may change only spec.version, spec.paused and
# the rollout annotations (promote, abort, retry, change-cause): RBAC grants patch on the whole
# resource. The owner role and the operator are granted '{VERB}'. Needs Kubernetes
# >= 1.30; editorAdmissionPolicy: false turns it off (and gives every editor full edit).
""",
)
POLICIES = (SIDECAR, EDITOR)


class _Dumper(yaml.SafeDumper):
    """Block style; multi-line strings (the longer CEL expressions) as literal blocks."""


def _string(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _string)


def _dump(obj: dict[str, Any]) -> str:
    # one expression or message a line, however long: folded, they would be harder to read
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=1000, default_flow_style=False)


# the project's prefix of a policy's name, which the chart replaces with the release's name
# (two releases' cluster-scoped policies must not collide; the default release,
# model-rollout, renders exactly the module's name)
NAME_PREFIX = "model-rollout-"
RELEASE_NAME = "{{ .Release.Name }}-"
# a binding applies where its release's operator watches (every namespace by default)
WATCHED_NAMESPACES = """\
{{- with .Values.watchNamespaces }}
  matchResources:
    namespaceSelector:
      matchExpressions:
      - key: kubernetes.io/metadata.name
        operator: In
        values: {{ toJson . }}
{{- end }}
"""


def _release_scoped(obj: dict[str, Any]) -> str:
    """The object's YAML with its name (and a binding's policy name) the release's own."""
    name = obj["metadata"]["name"]
    assert name.startswith(NAME_PREFIX), name
    scoped = f"{RELEASE_NAME}{name.removeprefix(NAME_PREFIX)}"
    text = _dump(obj).replace(f"ame: {name}\n", f"ame: {scoped}\n")  # name:, policyName:
    if obj["kind"].endswith("Binding"):
        text += WATCHED_NAMESPACES
    return text


def render(policy: ChartPolicy) -> str:
    """The template's text: the policy and its binding, behind the chart value."""
    documents = "---\n".join(_release_scoped(obj) for obj in policy.objects())
    return f"{policy.header()}{{{{- if .Values.{policy.value} }}}}\n{documents}{{{{- end }}}}\n"


def main() -> int:
    for policy in POLICIES:
        policy.template.write_text(render(policy))
        print(f"wrote {policy.template}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
