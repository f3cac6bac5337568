"""The operator on a real control plane, as the Helm chart installs it: the chart's CRD
and RBAC applied, the operator run as its ServiceAccount (a TokenRequest token in a
kubeconfig of its own), ``python -m model_operator`` as a child process."""

from __future__ import annotations

import copy
import json
import re
import urllib.request
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from helm_chart import NAMESPACE, RELEASE, render_chart
from model_rollout_e2e.control_plane import ControlPlane
from model_rollout_e2e.identities import Identity
from model_rollout_e2e.kubectl import Kubectl
from model_rollout_e2e.processes import ChildProcess, free_port, http_ok, wait_until

ROOT = Path(__file__).parent.parent
CHART = ROOT / "deploy" / "helm" / "model-rollout"
CRD = ROOT / "deploy" / "crds" / "modeldeployment.yaml"
EXAMPLE = ROOT / "examples" / "modeldeployment.yaml"
OPERATOR_ACCOUNT = f"{RELEASE}-operator"
OPERATOR_ROLE = f"{RELEASE}-operator"  # the chart's ClusterRole for what the operator does
RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")


def chart_rbac() -> list[dict[str, Any]]:
    """The chart's ServiceAccount and RBAC objects, as ``helm install`` renders them."""
    return [o for o in render_chart(CHART) if o.get("kind") in RBAC_KINDS]


def install_chart(cluster: ControlPlane) -> Identity:
    """The CRD and the chart's RBAC applied; the operator's identity (its token)."""
    admin = cluster.kubectl
    admin("apply", "--server-side", "-f", str(CRD))
    admin("wait", "--for=condition=Established", "--timeout=60s", "-f", str(CRD))
    if admin.run("get", "namespace", NAMESPACE).code != 0:
        admin("create", "namespace", NAMESPACE)
    admin.apply(*chart_rbac())
    return cluster.service_account(NAMESPACE, OPERATOR_ACCOUNT)


def chart_role(name: str) -> dict[str, Any]:
    """A copy of the chart's operator ClusterRole under another name."""
    roles = [o for o in chart_rbac() if o["kind"] == "ClusterRole"]
    [role] = [o for o in roles if o["metadata"]["name"] == OPERATOR_ROLE]
    return {**copy.deepcopy(role), "metadata": {"name": name}}


def role_without(verb: str, resource: str, name: str) -> dict[str, Any]:
    """:func:`chart_role` with ``verb`` on ``resource`` (core or named group) removed."""
    role = chart_role(name)
    rules: list[dict[str, Any]] = []
    for rule in role["rules"]:
        if resource not in rule["resources"]:
            rules.append(rule)
            continue
        others = [r for r in rule["resources"] if r != resource]
        if others:
            rules.append({**rule, "resources": others})
        rules.append(
            {**rule, "resources": [resource], "verbs": [v for v in rule["verbs"] if v != verb]}
        )
    return {**role, "rules": rules}


def new_namespace(admin: Kubectl, prefix: str = "op") -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    admin("create", "namespace", name)
    return name


def model_deployment(namespace: str, name: str = "mlp", **spec: Any) -> dict[str, Any]:
    """The README's example on a volume store (which the operator does not check)."""
    [doc] = yaml.safe_load_all(EXAMPLE.read_text())
    doc = copy.deepcopy(doc)
    doc["metadata"] = {"name": name, "namespace": namespace}
    doc["spec"].update(
        {"version": "v1", "replicas": 2, "backend": "onnxruntime", "store": {"pvc": "models"}}
    )
    doc["spec"].pop("precision", None)
    doc["spec"]["resources"] = {"memory": "1Gi"}
    doc["spec"].update(spec)
    return dict(doc)


class Operator(ChildProcess):
    """``python -m model_operator`` with a kubeconfig (``KUBECONFIG``), as a user runs it
    outside a cluster; its /metrics on a port of its own."""

    def __init__(
        self, kubeconfig: Path, namespace: str, log_path: Path, interval_s: float = 1.0,
        extra: Sequence[str] = (),
    ) -> None:  # fmt: skip
        self.metrics_port = free_port()
        args = [
            "--namespace", namespace, "--interval", str(interval_s), "--liveness", "",
            "--metrics-port", str(self.metrics_port), *extra,
        ]  # fmt: skip
        super().__init__("model_operator", args, log_path, env={"KUBECONFIG": str(kubeconfig)})

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            return str(response.read().decode())

    def passes(self, namespace: str, name: str) -> int:
        """Reconcile passes run so far for one ModelDeployment."""
        pattern = (
            r"model_operator_reconcile_duration_seconds_count\{"
            rf'name="{name}",namespace="{namespace}"\}} (\d+)'
        )
        found = re.search(pattern, self.metrics())
        return int(float(found.group(1))) if found else 0

    def serving_metrics(self) -> bool:
        return http_ok(f"http://127.0.0.1:{self.metrics_port}/metrics")


def status_writes(cluster: ControlPlane) -> int:
    """Writes of ModelDeployments' status the API server has answered, all callers (its
    ``apiserver_request_total``; the admin's certificate may read /metrics)."""
    request = urllib.request.Request(f"{cluster.server}/metrics")
    with urllib.request.urlopen(request, timeout=10, context=cluster.ssl_context()) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels = line[line.index("{") + 1 : line.rindex("}")]
        if (
            'resource="modeldeployments"' in labels
            and 'subresource="status"' in labels
            and re.search(r'verb="(PATCH|UPDATE)"', labels)
        ):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def wait_for(what: str, predicate: Any, operator: ChildProcess, timeout_s: float = 60) -> Any:
    """``wait_until``, with the operator's log in the failure."""
    try:
        return wait_until(predicate, timeout_s, interval_s=0.3, what=what)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\noperator log:\n{operator.log_tail(40)}") from None


def get(admin: Kubectl, *args: str) -> dict[str, Any] | None:
    """The object, or ``None`` when there is none."""
    result = admin.run("get", *args, "-o", "json")
    if result.code != 0:
        if "NotFound" in result.err:
            return None
        raise AssertionError(str(result))
    loaded: dict[str, Any] = json.loads(result.out)
    return loaded
