"""A real Kubernetes control plane for tests: etcd, kube-apiserver, kube-controller-manager
and kube-scheduler, built by ``make install`` from the Go modules pinned in
``e2e/controlplane/go.mod``, started on loopback with free ports in a temporary directory.

It validates against the real CRD schema, runs admission (ValidatingAdmissionPolicy's CEL
included) and authorizes with RBAC, so a test sees what a cluster would answer; the
faults it does not make on demand come from a proxy in front of it (:mod:`.fault_proxy`).
There is no kubelet of its own: pods are created and scheduled, and run once a node agent
(:mod:`.node_agent`, the kubelet stand-in, with :meth:`ControlPlane.node_kubeconfig`) has
registered a Node.

The API server keeps an audit log of every write (:meth:`ControlPlane.audit_writes`: who
wrote what, and when the server received it), so a test can tell which client wrote, and
a benchmark can count the writes of a window (:meth:`ControlPlane.audit_mark`,
:meth:`ControlPlane.audit_counts`).

Every process is started in a session of its own and stopped by its process id (its
process group), newest first; the kernel kills them too if the test process dies
(``PR_SET_PDEATHSIG``), so no run leaves an etcd or API server behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from model_rollout_e2e.api_counts import WRITE_VERBS, WriteCounts, now_utc, writes_between
from model_rollout_e2e.binaries import BinaryNotFound
from model_rollout_e2e.cluster_pki import SERVICE_RANGE, CertPair, ClusterPKI
from model_rollout_e2e.identities import Identity, service_account
from model_rollout_e2e.kubeconfig import write_kubeconfig
from model_rollout_e2e.kubectl import Kubectl
from model_rollout_e2e.processes import die_with_parent, free_port, wait_until

COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
# the audit policy: each write once, when answered (who, what, when; no bodies); no reads
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived", "ResponseStarted"],
    "rules": [{"level": "Metadata", "verbs": list(WRITE_VERBS)}, {"level": "None"}],
}


def control_plane_bin() -> Path:
    """Where ``make install`` puts the binaries: beside the venv's interpreter's bin/."""
    return Path(sys.executable).parent.parent / "controlplane" / "bin"


def control_plane_binary(name: str) -> str:
    path = control_plane_bin() / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise BinaryNotFound(
            f"{name!r} not found in {path.parent}: `make install` builds it from"
            " e2e/controlplane/go.mod (needs Go)"
        )
    return str(path)


@dataclass
class Component:
    name: str
    args: list[str]
    log_path: Path
    health_url: str
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [control_plane_binary(self.name), *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM to its process group, SIGKILL after ``timeout_s``."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class ControlPlane:
    """``with ControlPlane(tmp) as cluster:``; ``cluster.kubeconfig`` is cluster-admin."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.pki = ClusterPKI(self.dir / "pki")
        self.etcd_port, self.etcd_peer_port, self.port = free_port(), free_port(), free_port()
        self.server = f"https://127.0.0.1:{self.port}"
        self.kubeconfig = self.dir / "admin.kubeconfig"
        self.audit_log = self.dir / "audit.log"
        self._admin = self.pki.client("admin", "model-rollout-test-admin", "system:masters")
        self.components: list[Component] = []

    # -- lifecycle -------------------------------------------------------------------

    def __enter__(self) -> ControlPlane:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout_s: float = 180.0) -> ControlPlane:
        for name in COMPONENTS:
            control_plane_binary(name)  # every binary there before anything starts
        write_kubeconfig(self.kubeconfig, self.server, self.pki.ca.cert, client=self._admin)
        # one after another: each needs the one before it answering
        for name, (args, health_url) in (
            ("etcd", self._etcd_args()),
            ("kube-apiserver", self._apiserver_args()),
            ("kube-controller-manager", self._controller_manager_args()),
            ("kube-scheduler", self._scheduler_args()),
        ):
            component = Component(name, args, self.dir / f"{name}.log", health_url)
            self.components.append(component)
            component.start()
            wait_until(
                lambda c=component: self._alive(c) and self._get(c.health_url),  # type: ignore[misc]
                timeout_s,
                interval_s=0.3,
                what=f"{name} at {health_url}",
            )
        return self

    def stop(self) -> None:
        """Newest first, each by its own process id; safe to call twice."""
        for component in reversed(self.components):
            component.stop()

    def logs(self) -> str:
        return "\n".join(f"--- {c.name} ---\n{c.log_tail()}" for c in self.components)

    def audit_writes(
        self, since: datetime | None = None, until: datetime | None = None
    ) -> list[dict[str, Any]]:
        """Every write the API server has answered so far (received in ``[since,
        until)`` when given, marks from :meth:`audit_mark`), oldest first:
        audit.k8s.io/v1 Events at Metadata level (``user.username``, ``verb``,
        ``objectRef``, ``requestReceivedTimestamp``, ``responseStatus.code``). The log is
        written before each answer is sent (the log backend's default, blocking mode)."""
        try:
            lines = self.audit_log.read_text().splitlines()
        except FileNotFoundError:
            return []
        entries = [json.loads(line) for line in lines if line.strip()]
        if since is None and until is None:
            return entries
        return [dict(e) for e in writes_between(entries, since, until)]

    @staticmethod
    def audit_mark() -> datetime:
        """Now, as a bound of a window of :meth:`audit_writes` and :meth:`audit_counts`."""
        return now_utc()

    def audit_counts(
        self, since: datetime | None, until: datetime | None = None, namespace: str | None = None
    ) -> WriteCounts:
        """The writes received in ``[since, until)`` (to objects of ``namespace`` only,
        when given), counted by user and resource."""
        entries = self.audit_writes(since, until)
        if namespace is not None:
            entries = [
                e for e in entries if (e.get("objectRef") or {}).get("namespace") == namespace
            ]
        return WriteCounts.of(entries)

    # -- clients ---------------------------------------------------------------------

    @property
    def kubectl(self) -> Kubectl:
        """kubectl as the cluster's admin (system:masters)."""
        return Kubectl(self.kubeconfig)

    def service_account(
        self,
        namespace: str,
        name: str,
        cluster_role: str | None = None,
        role: str | None = None,
        pod: tuple[str, str] | None = None,
    ) -> Identity:
        """See :func:`model_rollout_e2e.identities.service_account`."""
        return service_account(
            self.kubectl, self.server, self.pki.ca.cert, self.dir, namespace, name,
            cluster_role=cluster_role, role=role, pod=pod,
        )  # fmt: skip

    def admin_kubeconfig(self, path: Path, namespace: str) -> Path:
        """The admin's credentials with ``namespace`` as the default, for a user's own
        kubectl (the demo's ``export KUBECONFIG=...``)."""
        return write_kubeconfig(
            path, self.server, self.pki.ca.cert, client=self._admin, namespace=namespace
        )

    def node_kubeconfig(self, node: str) -> Path:
        """A kubelet's credentials for ``node`` (``system:node:<node>`` in
        ``system:nodes``): the Node authorizer and NodeRestriction limit it to that node
        and its pods, as they limit a real kubelet."""
        return self._component_kubeconfig(f"node-{node}", f"system:node:{node}", "system:nodes")

    def ssl_context(self, client: CertPair | None = None) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.pki.ca.cert))
        pair = client or self._admin
        context.load_cert_chain(str(pair.cert), str(pair.key))
        return context

    def _get(self, url: str) -> bool:
        """200 from ``url``: the API server's with this cluster's CA and the admin's
        certificate; the controller manager's and scheduler's serve a certificate they
        made themselves (their health paths need no authentication)."""
        context: ssl.SSLContext | None = None
        if url.startswith(self.server):
            context = self.ssl_context()
        elif url.startswith("https://"):
            context = ssl._create_unverified_context()
        try:
            with urllib.request.urlopen(url, timeout=5, context=context) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def _alive(self, component: Component) -> bool:
        if not component.running():
            raise RuntimeError(f"{component.name} exited:\n{component.log_tail()}")
        return True

    # -- the components --------------------------------------------------------------

    def _etcd_args(self) -> tuple[list[str], str]:
        client = f"http://127.0.0.1:{self.etcd_port}"
        peer = f"http://127.0.0.1:{self.etcd_peer_port}"
        return [
            "--name=test",
            f"--data-dir={self.dir / 'etcd'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=test={peer}",
            "--listen-metrics-urls=",
            "--unsafe-no-fsync=true",  # a throw-away cluster: no fsync on each write
            "--log-level=warn",
        ], f"{client}/health"

    def _apiserver_args(self) -> tuple[list[str], str]:
        serving = self.pki.serving()
        policy = self.dir / "audit-policy.json"
        policy.write_text(json.dumps(AUDIT_POLICY))
        return [
            f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            # the `kubernetes` Service's endpoints may not name a loopback address (as envtest)
            "--endpoint-reconciler-type=none",
            f"--secure-port={self.port}",
            f"--cert-dir={self.dir / 'apiserver-certs'}",
            f"--tls-cert-file={serving.cert}",
            f"--tls-private-key-file={serving.key}",
            f"--client-ca-file={self.pki.ca.cert}",
            f"--service-account-key-file={self.pki.service_account_pub}",
            f"--service-account-signing-key-file={self.pki.service_account_key}",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-cluster-ip-range={SERVICE_RANGE}",
            "--authorization-mode=Node,RBAC",
            # on top of the default set (NamespaceLifecycle, ServiceAccount, LimitRanger,
            # ResourceQuota, PodSecurity, ValidatingAdmissionPolicy, the webhooks, ...)
            "--enable-admission-plugins=NodeRestriction",
            "--allow-privileged=true",
            "--profiling=false",
            f"--audit-policy-file={policy}",
            f"--audit-log-path={self.audit_log}",
            "--audit-log-maxsize=0",  # one file, never rotated
            "--v=1",
        ], f"{self.server}/readyz"

    def _component_kubeconfig(self, name: str, user: str, group: str | None = None) -> Path:
        path = self.dir / f"{name}.kubeconfig"
        pair = self.pki.client(name, user, group)
        write_kubeconfig(path, self.server, self.pki.ca.cert, client=pair)
        return path

    def _served_component_args(self, name: str, user: str) -> tuple[list[str], str]:
        kubeconfig = self._component_kubeconfig(name, user)
        port = free_port()
        return [
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            "--leader-elect=false",
            "--profiling=false",
            "--v=1",
        ], f"https://127.0.0.1:{port}/healthz"

    def _controller_manager_args(self) -> tuple[list[str], str]:
        args, health_url = self._served_component_args(
            "kube-controller-manager", "system:kube-controller-manager"
        )
        signer = self.pki.ca
        return [
            *args,
            f"--service-account-private-key-file={self.pki.service_account_key}",
            f"--root-ca-file={self.pki.ca.cert}",
            f"--cluster-signing-cert-file={signer.cert}",
            f"--cluster-signing-key-file={signer.key}",
            "--use-service-account-credentials=true",
            f"--service-cluster-ip-range={SERVICE_RANGE}",
        ], health_url

    def _scheduler_args(self) -> tuple[list[str], str]:
        return self._served_component_args("kube-scheduler", "system:kube-scheduler")


@contextlib.contextmanager
def control_plane(directory: Path) -> Iterator[ControlPlane]:
    with ControlPlane(directory) as cluster:
        yield cluster
