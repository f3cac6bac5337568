"""The Helm chart refuses mistakes and installs side by side (issue 32): values.schema.json
refuses unknown keys and wrong types in ``helm lint`` and ``helm install`` alike, naming
the field; every cluster-scoped name carries the release's; the version follows the
project's; and what it renders, every optional part on, is what a real API server takes
(server-side dry run)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import tomllib
import yaml

from model_operator import admission_policy, editor_policy
from model_operator.config import OperatorConfig, parse_args
from model_rollout_e2e.control_plane import ControlPlane
from model_rollout_flags.logs import LogSettings
from tests.support.helm_chart import NAMESPACE, RELEASE, lint_chart, render_chart, render_notes

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "model-rollout"
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
# the Prometheus Operator's kinds: rendered and checked here, but the tests' API server
# has no CRDs for them (a cluster without the Prometheus Operator refuses them too)
MONITORING = ("ServiceMonitor", "PodMonitor", "PrometheusRule")
DIGEST = "sha256:" + "a" * 64
EVERYTHING = {  # every optional part on
    "watchNamespaces": ["ml-a", "ml-b"],
    "storeCredentialsSecret": "model-store-credentials",
    "imagePullSecrets": [{"name": "regcred"}],
    "image": {"repository": "registry.internal/model-rollout-operator", "digest": DIGEST},
    "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
        "weight": 1, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname", "labelSelector": {
            "matchLabels": {"app.kubernetes.io/name": "model-rollout-operator"}}}}]}},
    "priorityClassName": "system-cluster-critical",
    "podAnnotations": {"example.com/team": "ml-platform"},
    "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
                "podMonitor": {"enabled": True}},
    "prometheusRule": {"enabled": True},
    "dashboard": {"enabled": True},
    "userRoles": {"create": True},
    "logging": {"format": "json", "level": "debug"},
}  # fmt: skip
CLUSTER_SCOPED = (
    "ClusterRole",
    "ClusterRoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
)

# the mistakes, and one at each level the schema defines: (values, what Helm says)
MISTAKES = [
    ({"watchNamespace": ["ml"]}, "at '': additional properties 'watchNamespace' not allowed"),
    ({"replicas": "two"}, "at '/replicas': got string, want integer"),
    ({"storeCheck": "false"}, "at '/storeCheck': got string, want boolean"),
    ({"image": {"tags": "1"}}, "at '/image': additional properties 'tags' not allowed"),
    ({"image": {"pullPolicy": "always"}}, "at '/image/pullPolicy'"),
    ({"watchNamespaces": ["ML_A"]}, "at '/watchNamespaces/0'"),
    ({"metricsPort": 8080}, "at '/metricsPort'"),  # the health port
    ({"metrics": {"serviceMonitor": {"enable": True}}}, "additional properties 'enable'"),
    ({"metrics": {"podMonitor": {"interval": "15 seconds"}}}, "at '/metrics/podMonitor/interval'"),
    ({"prometheusRule": {"enabled": "yes"}}, "at '/prometheusRule/enabled'"),
    ({"dashboard": {"lables": {}}}, "at '/dashboard': additional properties 'lables'"),
    ({"userRoles": {"create": 1}}, "at '/userRoles/create': got number, want boolean"),
    ({"imagePullSecrets": ["regcred"]}, "at '/imagePullSecrets/0': got string, want object"),
    ({"logging": {"format": "logfmt"}}, "at '/logging/format'"),
    ({"logging": {"levl": "debug"}}, "at '/logging': additional properties 'levl' not allowed"),
]


@pytest.mark.parametrize(("values", "said"), MISTAKES, ids=lambda v: json.dumps(v))
def test_helm_install_refuses_a_mistake_naming_the_field(values: dict[str, Any], said: str) -> None:
    with pytest.raises(helm.HelmValuesError) as refused:
        render_chart(CHART, values)
    assert said in str(refused.value)


@pytest.mark.parametrize(("values", "said"), MISTAKES, ids=lambda v: json.dumps(v))
def test_helm_lint_refuses_a_mistake_naming_the_field(values: dict[str, Any], said: str) -> None:
    findings = lint_chart(CHART, values)
    assert any(said in finding for finding in findings), findings


def test_every_object_the_schema_defines_refuses_unknown_keys() -> None:
    """additionalProperties false wherever the schema lists properties (Kubernetes' own
    types, resources or affinity, are the API server's to check)."""

    def objects(node: dict[str, Any], where: str) -> list[str]:
        open_ = "properties" in node and node.get("additionalProperties") is not False
        children = list(node.get("properties", {}).items())
        if "items" in node:
            children.append(("[]", node["items"]))
        found = [where] if open_ else []
        return found + [p for key, child in children for p in objects(child, f"{where}/{key}")]

    assert objects(SCHEMA, "") == []


def test_the_defaults_and_every_option_lint_clean() -> None:
    assert lint_chart(CHART) == []
    assert lint_chart(CHART, EVERYTHING) == []


def test_two_releases_share_no_cluster_scoped_name() -> None:
    """Only the CRD is shared (crds/: one per cluster, see the chart's README)."""
    names = {}
    for release in ("team-a", "team-b"):
        docs = render_chart(CHART, EVERYTHING, release=release)
        scoped = [d for d in docs if d["kind"] in CLUSTER_SCOPED]
        names[release] = {(d["kind"], d["metadata"]["name"]) for d in scoped}
        assert {kind for kind, _ in names[release]} == set(CLUSTER_SCOPED)
        assert all(name.startswith(f"{release}-") for _, name in names[release])
        bindings = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"]
        assert {b["spec"]["policyName"] for b in bindings} == {
            n for k, n in names[release] if k == "ValidatingAdmissionPolicy"
        }
        for binding in bindings:  # each release's policies where its operator watches
            [selector] = binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"]
            assert selector["values"] == EVERYTHING["watchNamespaces"]
    assert names["team-a"].isdisjoint(names["team-b"])


def test_the_default_release_names_the_policies_as_the_operator_does() -> None:
    """The tests, the docs and kubectl-model's messages name them so
    (``admission_policy.POLICY_NAME``, ``editor_policy.POLICY_NAME``)."""
    docs = render_chart(CHART)
    policies = {d["metadata"]["name"] for d in docs if d["kind"] == "ValidatingAdmissionPolicy"}
    assert policies == {admission_policy.POLICY_NAME, editor_policy.POLICY_NAME}
    for binding in [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"]:
        assert "matchResources" not in binding["spec"]  # every namespace, as the operator


def test_app_version_is_the_projects_version() -> None:
    """A release bumps pyproject's version; the chart's appVersion (the operator image's
    default tag) must follow, and the chart's own version with it."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert chart["appVersion"] == project
    assert chart["version"] == project
    [deployment] = [d for d in render_chart(CHART) if d["kind"] == "Deployment"]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"model-rollout-operator:{project}"
    [pinned] = [d for d in render_chart(CHART, EVERYTHING) if d["kind"] == "Deployment"]
    image = pinned["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == f"registry.internal/model-rollout-operator@{DIGEST}"


def test_kube_version_is_what_the_admission_policies_need() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == ">=1.30.0-0"  # admissionregistration.k8s.io/v1 VAPs: GA 1.30


def test_the_notes_say_how_to_upgrade_the_crd_and_warn_of_what_is_off() -> None:
    notes = render_notes(CHART)
    assert "kubectl apply --server-side --force-conflicts -f model-rollout/crds/" in notes
    assert f"deployment/{RELEASE}-operator" in notes and "WARNING" not in notes
    off = render_notes(CHART, {"sidecarAdmissionPolicy": False, "editorAdmissionPolicy": False})
    assert off.count("WARNING") == 2
    assert "the namespaces ml-a, ml-b." in render_notes(CHART, EVERYTHING)


def test_the_readme_documents_the_crd_upgrade_step() -> None:
    readme = (CHART / "README.md").read_text()
    assert "kubectl apply --server-side --force-conflicts -f model-rollout/crds/" in readme


def test_a_service_monitor_without_its_service_is_refused() -> None:
    values = {"metrics": {"service": {"enabled": False}, "serviceMonitor": {"enabled": True}}}
    with pytest.raises(helm.HelmRenderError, match=r"needs metrics\.service\.enabled"):
        render_chart(CHART, values)


def test_the_metrics_service_selects_this_releases_operator() -> None:
    docs = render_chart(CHART, EVERYTHING)
    [service] = [d for d in docs if d["kind"] == "Service"]
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    [port] = service["spec"]["ports"]
    ports = deployment["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert {"name": "metrics", "containerPort": port["port"]} in ports
    [monitor] = [d for d in docs if d["kind"] == "ServiceMonitor"]
    selected = monitor["spec"]["selector"]["matchLabels"]
    assert selected.items() <= service["metadata"]["labels"].items()
    assert monitor["metadata"]["labels"]["release"] == "prom"
    off = {d["kind"] for d in render_chart(CHART)}
    assert off.isdisjoint({*MONITORING, "ConfigMap"})  # the optional parts are off by default


def test_the_api_server_takes_everything_the_chart_renders(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    """Server-side dry run (admission, schemas, the policies' CEL type-checked) of every
    object but the Prometheus Operator's, for two releases side by side; the API server's
    version satisfies the chart's kubeVersion."""
    admin = control_plane.kubectl
    version = json.loads(admin("version", "-o", "json"))["serverVersion"]
    assert (int(version["major"]), int(version["minor"].rstrip("+"))) >= (1, 30)
    for namespace in (NAMESPACE, *EVERYTHING["watchNamespaces"]):
        if admin.run("get", "namespace", namespace).code != 0:
            admin("create", "namespace", namespace)
    for release, values in (("team-a", EVERYTHING), ("team-b", EVERYTHING), (RELEASE, {})):
        rendered = render_chart(CHART, values, release=release)
        docs = [d for d in rendered if d["kind"] not in MONITORING]
        path = tmp_path / f"{release}.yaml"
        path.write_text(yaml.safe_dump_all(docs))
        result = admin.run(
            "apply", "--server-side", "--dry-run=server", "--force-conflicts",
            "--field-manager=chart-test", "-f", str(path),
        )  # fmt: skip
        assert result.code == 0, result
        assert result.out.count("(server dry run)") == len(docs), result.out


def test_values_of_an_older_release_render_the_defaults() -> None:
    """`helm upgrade --reuse-values` from a release before these values existed gives no
    metrics, prometheusRule, dashboard or userRoles at all (null removes a key as that
    does): the templates fall back to the defaults rather than fail on a nil map."""
    older = {"metrics": None, "prometheusRule": None, "dashboard": None, "userRoles": None,
             "logging": None}  # fmt: skip
    rendered = render_chart(CHART, older)
    kinds = [d["kind"] for d in rendered]
    assert "Service" in kinds and not {*MONITORING, "ConfigMap"} & set(kinds)
    assert "port-forward service/" in render_notes(CHART, older)
    assert _operator_config(rendered).log == LogSettings()


def _operator_config(rendered: list[dict[str, Any]]) -> OperatorConfig:
    """What the operator makes of the args the chart gives it."""
    [deployment] = [d for d in rendered if d["kind"] == "Deployment"]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["args"][0] == "model-operator"
    return parse_args(container["args"][1:])


def test_the_operator_logs_as_the_values_say() -> None:
    assert _operator_config(render_chart(CHART)).log == LogSettings("text", "info")
    assert _operator_config(render_chart(CHART, EVERYTHING)).log == LogSettings("json", "debug")
