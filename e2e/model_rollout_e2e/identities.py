"""Who a test acts as on a real control plane: a ServiceAccount bound to a (Cluster)Role,
with a token from the TokenRequest API (optionally bound to a pod, as the kubelet's
projected token is), written into a kubeconfig of its own."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from model_rollout_e2e.kubeconfig import write_kubeconfig
from model_rollout_e2e.kubectl import Kubectl, KubectlError


@dataclass(frozen=True)
class Identity:
    namespace: str
    name: str
    kubeconfig: Path

    @property
    def username(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.name}"

    @property
    def kubectl(self) -> Kubectl:
        return Kubectl(self.kubeconfig)


def service_account(
    admin: Kubectl,
    server: str,
    ca: Path,
    directory: Path,
    namespace: str,
    name: str,
    cluster_role: str | None = None,
    role: str | None = None,
    pod: tuple[str, str] | None = None,
) -> Identity:
    """Create ``namespace/name`` (or take the one there, left as it is), bind it to
    ``cluster_role`` (cluster-wide) or ``role`` (in its namespace), and request a token;
    ``pod=(name, uid)`` binds the token to that pod, so the API server adds the pod's
    name and uid to the user's extra."""
    if cluster_role and role:
        raise ValueError("bind a ClusterRole or a Role, not both")
    created = admin.run("create", "serviceaccount", name, "-n", namespace)
    if created.code != 0 and "already exists" not in created.err:  # e.g. the operator's
        raise KubectlError(f"creating ServiceAccount {namespace}/{name}: {created}")
    subject = [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]
    if cluster_role:
        admin.apply(
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": f"{namespace}-{name}-{cluster_role}"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": cluster_role,
                },
                "subjects": subject,
            }
        )
    if role:
        admin.apply(
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": f"{name}-{role}", "namespace": namespace},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
                "subjects": subject,
            }
        )
    args = ["create", "token", name, "-n", namespace, "--duration=1h"]
    if pod is not None:
        pod_name, pod_uid = pod
        args += ["--bound-object-kind=Pod", f"--bound-object-name={pod_name}",
                 f"--bound-object-uid={pod_uid}"]  # fmt: skip
    token = admin(*args).strip()
    suffix = f"-{pod[0]}" if pod else ""
    path = directory / f"{namespace}-{name}{suffix}.kubeconfig"
    write_kubeconfig(path, server, ca, token=token, namespace=namespace)
    return Identity(namespace, name, path)
