"""The operator on a real control plane, as the Helm chart installs it (the install and
the operator's process: :mod:`model_rollout_e2e.chart_install`), and what its tests ask
of the cluster."""

from __future__ import annotations

import copy
import json
import re
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import yaml

from model_rollout_e2e.chart_install import (
    CHART,
    CRD,
    OPERATOR_ACCOUNT,
    OPERATOR_ROLE,
    RBAC_KINDS,
    Operator,
    chart_rbac,
    install_chart,
)
from model_rollout_e2e.control_plane import ControlPlane
from model_rollout_e2e.helm_chart import NAMESPACE, RELEASE
from model_rollout_e2e.kubectl import Kubectl
from model_rollout_e2e.processes import ChildProcess, wait_until

__all__ = [
    "CHART", "CRD", "NAMESPACE", "OPERATOR_ACCOUNT", "OPERATOR_ROLE", "RBAC_KINDS", "RELEASE",
    "Operator", "chart_rbac", "chart_role", "get", "install_chart", "model_deployment",
    "new_namespace", "role_without", "status_writes", "wait_for",
]  # fmt: skip

ROOT = Path(__file__).parent.parent
EXAMPLE = ROOT / "examples" / "modeldeployment.yaml"


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
