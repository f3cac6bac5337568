"""The operator on a real control plane, as the Helm chart installs it (the install and
the operator's process: :mod:`model_rollout_e2e.chart_install`), and what its tests ask
of the cluster."""

from __future__ import annotations

import copy
import json
import re
import threading
import time
import urllib.parse
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from model_rollout_contract.annotations import DEPLOYMENT_LABEL, SIDECAR_STATUS, TARGET_VERSION
from model_rollout_contract.report import SidecarReport
from model_rollout_contract.states import SidecarState
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
from model_rollout_e2e.control_plane import WRITE_VERBS, ControlPlane
from model_rollout_e2e.helm_chart import NAMESPACE, RELEASE
from model_rollout_e2e.identities import Identity
from model_rollout_e2e.kubectl import Kubectl
from model_rollout_e2e.processes import ChildProcess, wait_until

__all__ = [
    "CHART", "CRD", "NAMESPACE", "OPERATOR_ACCOUNT", "OPERATOR_ROLE", "RBAC_KINDS", "RELEASE",
    "Operator", "chart_rbac", "chart_role", "get", "install_chart", "model_deployment",
    "role_without", "settled_on", "status_writes", "wait_for",
]  # fmt: skip

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "modeldeployment.yaml"
DISCOVERY_ROLE = f"{RELEASE}-discovery"  # the chart's ClusterRole for kopf's scanning
LEASE_ROLE = f"{RELEASE}-leader-election"  # the chart's Role on the Lease, in NAMESPACE


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


def settled_on(status: dict[str, Any], version: str, pods: int) -> bool:
    """The rollout to ``version`` is complete on ``pods`` pods: they serve it and it is the
    stable version (pods serving it before the rollout completes do not make it stable: a
    version edit then is a first deployment, with no canary)."""
    return (
        status.get("currentVersion") == version
        and status.get("phase") == "Available"
        and status.get("versions") == {version: pods}
    )


def get(admin: Kubectl, *args: str) -> dict[str, Any] | None:
    """The object, or ``None`` when there is none."""
    result = admin.run("get", *args, "-o", "json")
    if result.code != 0:
        if "NotFound" in result.err:
            return None
        raise AssertionError(str(result))
    loaded: dict[str, Any] = json.loads(result.out)
    return loaded


def replica_identity(cluster: ControlPlane, name: str) -> Identity:
    """A ServiceAccount of its own for one operator replica, bound to the chart's roles
    (its ClusterRoles, and its Role on the Lease), so that the API server's audit log
    tells the replicas apart."""
    cluster.service_account(NAMESPACE, name, cluster_role=DISCOVERY_ROLE)
    cluster.service_account(NAMESPACE, name, cluster_role=OPERATOR_ROLE)
    return cluster.service_account(NAMESPACE, name, role=LEASE_ROLE)


def received_at(entry: dict[str, Any]) -> datetime:
    """When the API server received the request of an audit log entry."""
    return datetime.fromisoformat(entry["requestReceivedTimestamp"])


def writes_of(cluster: ControlPlane, username: str) -> list[dict[str, Any]]:
    """The writes ``username`` made (answered, whatever the answer), oldest first."""
    return [
        e for e in cluster.audit_writes()
        if e["user"]["username"] == username and e["verb"] in WRITE_VERBS
    ]  # fmt: skip


def described(entry: dict[str, Any]) -> str:
    ref = entry.get("objectRef") or {}
    what = "/".join(filter(None, (ref.get("resource"), ref.get("name"), ref.get("subresource"))))
    code = (entry.get("responseStatus") or {}).get("code")
    return f"{entry['requestReceivedTimestamp']} {entry['verb']} {what} -> {code}"


class ReportingSidecars:
    """The pods' sidecars, as far as the operator sees them (the node agent's simulated
    pods run none): each pod reports serving its target at once, keeping the version it
    left (a pointer swap back, as with ``retainVersions: 2``); a pod without a target
    serves ``initial``. A thread, acting as the cluster's admin, until :meth:`stop`."""

    def __init__(self, cluster: ControlPlane, namespace: str, initial: str) -> None:
        self.cluster, self.namespace, self.initial = cluster, namespace, initial
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sidecars", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> ReportingSidecars:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"{self.cluster.server}{path}", data=data, method=method,
            headers={"Content-Type": "application/merge-patch+json"},
        )  # fmt: skip
        context = self.cluster.ssl_context()
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return json.loads(response.read())

    def _run(self) -> None:
        selector = urllib.parse.quote(DEPLOYMENT_LABEL)
        pods = f"/api/v1/namespaces/{self.namespace}/pods"
        while not self._stop.wait(0.2):
            try:
                for pod in self._call("GET", f"{pods}?labelSelector={selector}")["items"]:
                    self._report(pods, pod)
            except (OSError, ValueError) as exc:  # a pod deleted meanwhile: the next round
                self.error = exc

    def _report(self, pods: str, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        annotations = meta.get("annotations") or {}
        target = annotations.get(TARGET_VERSION) or self.initial
        report = SidecarReport.from_json(annotations.get(SIDECAR_STATUS))
        if report is not None and report.serving == target and report.target == target:
            return
        left = report.serving if report is not None else None
        retained = (left,) if left and left != target else ()
        new = SidecarReport(
            "resnet50", target, target, SidecarState.OK, retained=retained,
            target_seen_at=time.time(), updated_at=time.time(),
        )  # fmt: skip
        patch = {"metadata": {"annotations": {SIDECAR_STATUS: new.to_json()}}}
        self._call("PATCH", f"{pods}/{meta['name']}", patch)
