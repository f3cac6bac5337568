"""One model pod on the session's real control plane for the sidecar tests that drive a
sidecar (in the test's process or as a process) without the operator: a namespace of its
own with the pod RBAC the operator writes (:func:`model_operator.manifests.pod_rbac`),
the chart's sidecar admission policy enforced, the pod itself (never scheduled: nothing
runs it but the test), and the sidecar's tokens: one bound to the pod, as the kubelet
projects it, and one bound to nothing, which admission refuses."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config

from model_operator import admission_policy
from model_operator.manifests import pod_rbac
from model_operator.spec import ModelDeploymentSpec, parse_spec
from model_rollout_contract.annotations import SIDECAR_STATUS, TARGET_VERSION
from model_rollout_e2e.control_plane import ControlPlane
from model_rollout_e2e.identities import Identity
from model_rollout_e2e.processes import wait_until

ROOT = Path(__file__).resolve().parents[2]
MD = "mlp"  # the ModelDeployment the pod belongs to: its account is the sidecar's
ACCOUNT = admission_policy.sidecar_service_account(MD)
DENIED_BY_POLICY = f"ValidatingAdmissionPolicy '{admission_policy.POLICY_NAME}'"


@dataclass(frozen=True)
class SidecarPod:
    cluster: ControlPlane
    namespace: str
    name: str
    sidecar: Identity  # the sidecar's account, its token bound to the pod
    unbound: Identity  # the same account, a token bound to no pod: admission refuses it

    def annotate(self, annotations: Mapping[str, str | None]) -> None:
        """A merge patch of the pod's annotations as the admin (the operator's writes);
        ``None`` removes one."""
        patch = json.dumps({"metadata": {"annotations": dict(annotations)}})
        self.cluster.kubectl("patch", "pod", self.name, "-n", self.namespace, "--type=merge",
                             "-p", patch)  # fmt: skip

    def set_target(self, version: str) -> None:
        self.annotate({TARGET_VERSION: version})

    def annotations(self) -> dict[str, str]:
        pod = self.cluster.kubectl.get("pod", self.name, "-n", self.namespace)
        found: dict[str, str] = pod["metadata"].get("annotations") or {}
        return found

    def service_account_volume(self, directory: Path) -> Path:
        """What the kubelet projects into the pod's ServiceAccount volume: the pod-bound
        token and the cluster's CA (for :mod:`model_rollout_e2e.in_pod`)."""
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "token").write_text(token(self.sidecar))
        (directory / "ca.crt").write_bytes(self.cluster.pki.ca.cert.read_bytes())
        return directory

    def in_cluster_env(self) -> dict[str, str]:
        """``KUBERNETES_SERVICE_HOST``/``PORT`` as the kubelet gives a container (the API
        server's own address: there is no Service network)."""
        return {"KUBERNETES_SERVICE_HOST": "127.0.0.1",
                "KUBERNETES_SERVICE_PORT": str(self.cluster.port)}  # fmt: skip


def example_spec(**spec: Any) -> ModelDeploymentSpec:
    """The README's example spec, with ``spec`` merged over its top level."""
    [doc] = yaml.safe_load_all((ROOT / "examples" / "modeldeployment.yaml").read_text())
    return parse_spec({**doc["spec"], **spec})


def token(identity: Identity) -> str:
    """The bearer token in ``identity``'s kubeconfig."""
    config = yaml.safe_load(identity.kubeconfig.read_text())
    return str(config["users"][0]["user"]["token"])


@contextlib.contextmanager
def sidecar_pod(
    cluster: ControlPlane,
    prefix: str,
    name: str,
    annotations: Mapping[str, str] | None = None,
    spec: ModelDeploymentSpec | None = None,
) -> Iterator[SidecarPod]:
    """The pod ``name`` with ``annotations`` in a new namespace (deleted afterwards),
    once RBAC lets its bound token patch it and the admission policy refuses the
    unbound one (both take effect when the API server's informers have them)."""
    admin = cluster.kubectl
    admin.apply(*admission_policy.objects())
    namespace = f"{prefix}-{uuid.uuid4().hex[:8]}"
    admin("create", "namespace", namespace)
    try:
        admin.apply(*pod_rbac(MD, namespace, spec or example_spec()))
        admin.apply(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": name,
                    "namespace": namespace,
                    "annotations": dict(annotations or {}),
                },
                "spec": {
                    "serviceAccountName": ACCOUNT,
                    "automountServiceAccountToken": False,
                    "containers": [{"name": "sidecar", "image": "model-sidecar"}],
                },
            }
        )
        uid = admin.get("pod", name, "-n", namespace)["metadata"]["uid"]
        sidecar = cluster.service_account(namespace, ACCOUNT, pod=(name, uid))
        unbound = cluster.service_account(namespace, ACCOUNT)
        probe = ["patch", "pod", name, "--type=merge", "--dry-run=server", "-p",
                 json.dumps({"metadata": {"annotations": {SIDECAR_STATUS: "{}"}}})]  # fmt: skip
        wait_until(lambda: sidecar.kubectl.run(*probe).code == 0, 60, 0.5, "the sidecar's RBAC")
        wait_until(
            lambda: DENIED_BY_POLICY in unbound.kubectl.run(*probe).err,
            60,
            interval_s=0.5,
            what="the admission policy to be enforced",
        )
        yield SidecarPod(cluster, namespace, name, sidecar, unbound)
    finally:
        admin.run("delete", "namespace", namespace, "--wait=false")


async def api_client(identity: Identity, host: str | None = None) -> k8s.ApiClient:
    """A client with ``identity``'s credentials, to the API server or to ``host`` (the
    fault proxy, over plain HTTP: the proxy forwards the token)."""
    configuration = k8s.Configuration()
    await k8s_config.load_kube_config(
        config_file=str(identity.kubeconfig), client_configuration=configuration
    )
    if host is not None:
        configuration.host = host
    return k8s.ApiClient(configuration)
