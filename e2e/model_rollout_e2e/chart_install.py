"""The operator on a real control plane (:mod:`.control_plane`) as the Helm chart installs
it: the chart's CRD, RBAC and sidecar admission policy applied, the operator run as its
ServiceAccount (a TokenRequest token in a kubeconfig of its own), ``python -m
model_operator`` as a child process. Shared by the operator tests, the end-to-end
scenario (:mod:`.scenario`), the benchmarks and the demo."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from model_rollout_e2e.control_plane import ControlPlane
from model_rollout_e2e.helm_chart import NAMESPACE, RELEASE, render_chart
from model_rollout_e2e.identities import Identity
from model_rollout_e2e.processes import ChildProcess, free_port, http_ok, wait_until

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "model-rollout"
CRD = ROOT / "deploy" / "crds" / "modeldeployment.yaml"
OPERATOR_ACCOUNT = f"{RELEASE}-operator"
OPERATOR_ROLE = f"{RELEASE}-operator"  # the chart's ClusterRole for what the operator does
RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
POLICY_KINDS = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")


def chart_objects(kinds: Sequence[str]) -> list[dict[str, Any]]:
    """The chart's objects of these kinds, as ``helm install`` renders them."""
    return [o for o in render_chart(CHART) if o.get("kind") in kinds]


def chart_rbac() -> list[dict[str, Any]]:
    """The chart's ServiceAccount and RBAC objects."""
    return chart_objects(RBAC_KINDS)


def install_chart(cluster: ControlPlane) -> Identity:
    """The CRD, the chart's RBAC and its sidecar admission policy applied (again: each
    apply is idempotent); the operator's identity (a fresh token)."""
    admin = cluster.kubectl
    admin("apply", "--server-side", "-f", str(CRD))
    # kubectl wait fails at once on a CRD whose status has no conditions yet (a large
    # schema takes the API server a moment): asked again until it has them
    wait_until(
        lambda: admin.run("wait", "--for=condition=Established", "--timeout=60s", "-f",
                          str(CRD)).code == 0,
        90, interval_s=0.5, what="the CRD established",
    )  # fmt: skip
    if admin.run("get", "namespace", NAMESPACE).code != 0:
        admin("create", "namespace", NAMESPACE)
    admin.apply(*chart_rbac(), *chart_objects(POLICY_KINDS))
    return cluster.service_account(NAMESPACE, OPERATOR_ACCOUNT)


class Operator(ChildProcess):
    """``python -m model_operator`` with a kubeconfig (``KUBECONFIG``), as a user runs it
    outside a cluster; its /metrics on a port of its own. ``env``: more environment (the
    model store's credentials)."""

    def __init__(
        self, kubeconfig: Path, namespace: str, log_path: Path, interval_s: float = 1.0,
        extra: Sequence[str] = (), env: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.metrics_port = free_port()
        args = [
            "--namespace", namespace, "--interval", str(interval_s), "--liveness", "",
            "--metrics-port", str(self.metrics_port), *extra,
        ]  # fmt: skip
        environment = {**(env or {}), "KUBECONFIG": str(kubeconfig)}
        super().__init__("model_operator", args, log_path, env=environment)

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
