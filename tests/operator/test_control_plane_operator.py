"""The operator against a real API server (issue 28), run as the Helm chart's
ServiceAccount with a kubeconfig: RBAC enforced by the API server, children collected by
the real controller-manager's garbage collector, status writes counted by the API server
itself. There is no kubelet: the Deployment's pods are created and stay Pending."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import kopf
import pytest
from kubernetes_asyncio.config import incluster_config

from model_operator import cluster, handlers, kube_client
from model_operator.config import OperatorConfig
from model_operator.constants import KOPF_FINALIZER
from model_operator.errors import ResourceGone
from model_operator.leader import LEASE_LOST_EXIT
from model_rollout_contract.annotations import ABORT, PROMOTE, TARGET_VERSION
from model_rollout_e2e.control_plane import ControlPlane
from model_rollout_e2e.identities import Identity
from model_rollout_e2e.processes import wait_until
from tests.support.control_plane_operator import (
    NAMESPACE,
    OPERATOR_ACCOUNT,
    RELEASE,
    Operator,
    ReportingSidecars,
    chart_role,
    described,
    get,
    model_deployment,
    received_at,
    replica_identity,
    role_without,
    settled_on,
    status_writes,
    wait_for,
    writes_of,
)

CHILDREN = (
    ("deployment", "mlp"),
    ("configmap", "mlp-rollout"),
    ("service", "mlp"),
    ("poddisruptionbudget", "mlp"),
    ("serviceaccount", "model-sidecar-mlp"),
)


@pytest.fixture
def operators(tmp_path: Path) -> Iterator[list[Operator]]:
    """Operators a test starts; stopped whatever the test did."""
    started: list[Operator] = []
    yield started
    for operator in started:
        operator.stop()


def _start(operators: list[Operator], operator: Operator) -> Operator:
    operators.append(operator)
    return operator.start()


def _apply_md(control_plane: ControlPlane, namespace: str, **spec: Any) -> dict[str, Any]:
    control_plane.kubectl.apply(model_deployment(namespace, **spec))
    md = get(control_plane.kubectl, "md", "mlp", "-n", namespace)
    assert md is not None
    return md


def _settled(control_plane: ControlPlane, namespace: str, replicas: int) -> Any:
    """The ModelDeployment's status once the operator has seen its generation and the
    Deployment's pods (Pending: nothing runs them)."""
    md = get(control_plane.kubectl, "md", "mlp", "-n", namespace) or {}
    status = md.get("status") or {}
    seen = status.get("observedGeneration") == md["metadata"]["generation"]
    return status if seen and status.get("replicas") == replicas else None


def test_a_create_settle_delete_cycle_as_the_charts_service_account(
    control_plane: ControlPlane,
    operator_identity: Identity,
    namespace: str,
    operators: list[Operator],
    tmp_path: Path,
) -> None:
    """With a kubeconfig (no ``--kube-api``), bound to exactly the chart's ClusterRole:
    every call allowed; deleting the ModelDeployment collects its children through their
    ownerReferences (the controller-manager's garbage collector, not the operator)."""
    admin = control_plane.kubectl
    operator = _start(
        operators, Operator(operator_identity.kubeconfig, namespace, tmp_path / "op.log")
    )
    md = _apply_md(control_plane, namespace)
    status = wait_for("the status", lambda: _settled(control_plane, namespace, 2), operator)
    # no node runs the pods: v1 is the target, and nothing claims it is served (issue 31)
    assert status["targetVersion"] == "v1" and "currentVersion" not in status
    for kind, name in CHILDREN:
        child = get(admin, kind, name, "-n", namespace)
        assert child is not None, (kind, name)
        [owner] = child["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["uid"], owner["controller"]) == (
            "ModelDeployment", md["metadata"]["uid"], True,
        )  # fmt: skip
    header, row = admin("get", "md", "-n", namespace).splitlines()
    assert header.split()[:7] == ["NAME", "MODEL", "VERSION", "TARGET", "READY", "UPDATED", "PHASE"]
    # VERSION (status.currentVersion) is blank: nothing serves v1 yet; TARGET is v1
    assert row.split()[:6] == ["mlp", "resnet50", "v1", "0", "0", status["phase"]]
    assert row[header.index("VERSION")] == " "

    admin("delete", "md", "mlp", "-n", namespace, "--wait=true", "--timeout=60s")
    wait_for(
        "the garbage collector",
        lambda: all(get(admin, kind, name, "-n", namespace) is None for kind, name in CHILDREN),
        operator,
    )
    assert operator.running(), operator.log_tail()
    log = operator.log_path.read_text()
    assert "forbidden" not in log.lower() and "Traceback" not in log, log[-3000:]


def test_a_model_deployment_is_deleted_while_the_operator_is_down(
    control_plane: ControlPlane,
    operator_identity: Identity,
    namespace: str,
    operators: list[Operator],
    tmp_path: Path,
) -> None:
    """The operator puts no finalizer on a ModelDeployment (nothing needs one: the
    children go by their ownerReferences) and removes the one kopf's daemon left on
    resources of its earlier versions; so deleting one while the operator is down takes
    effect at once, and the garbage collector removes its children."""
    admin = control_plane.kubectl
    md = model_deployment(namespace)
    md["metadata"]["finalizers"] = [KOPF_FINALIZER]  # as the earlier versions left it
    admin.apply(md)
    operator = _start(
        operators, Operator(operator_identity.kubeconfig, namespace, tmp_path / "op.log")
    )
    wait_for("the status", lambda: _settled(control_plane, namespace, 2), operator)

    def finalizers() -> list[str]:
        found = get(admin, "md", "mlp", "-n", namespace) or {}
        return list(found.get("metadata", {}).get("finalizers") or [])

    wait_for("the finalizer removed", lambda: finalizers() == [], operator)
    operator.stop()
    assert operator.run_to_end(30) == 0, operator.log_tail()
    deleted = admin.run("delete", "md", "mlp", "-n", namespace, "--wait=true", "--timeout=30s")
    assert deleted.code == 0, deleted
    assert get(admin, "md", "mlp", "-n", namespace) is None
    wait_for(
        "the garbage collector",
        lambda: all(get(admin, kind, name, "-n", namespace) is None for kind, name in CHILDREN),
        operator,
    )


async def test_a_status_never_lands_on_a_model_deployment_created_again(
    control_plane: ControlPlane, operator_identity: Identity, namespace: str
) -> None:
    """Issue 29: a status worked out for a ModelDeployment that was then deleted and
    created again under its name (its task's memory: a rollout under way) must not land
    on the new one. The operator writes the status as a JSON patch that tests
    ``metadata.uid`` first (``replace_status``): the API server refuses it, and the
    task learns that its resource is gone. A merge patch would have landed."""
    admin = control_plane.kubectl
    old_uid = _apply_md(control_plane, namespace)["metadata"]["uid"]
    admin("delete", "md", "mlp", "-n", namespace, "--wait=true")
    new_uid = _apply_md(control_plane, namespace)["metadata"]["uid"]
    stale = {"phase": "Canary", "targetVersion": "v2", "message": "the old object's"}
    api = kube_client.KubeClient(
        await kube_client.load_configuration(None, str(operator_identity.kubeconfig))
    )
    try:
        with pytest.raises(ResourceGone):
            await cluster.replace_status(api, namespace, "mlp", old_uid, stale)
        assert (get(admin, "md", "mlp", "-n", namespace) or {}).get("status") in (None, {})
        fresh = {"phase": "Progressing", "message": "the new object's"}
        assert await cluster.replace_status(api, namespace, "mlp", new_uid, fresh) == fresh
        admin("delete", "md", "mlp", "-n", namespace, "--wait=true")
        with pytest.raises(ResourceGone):  # deleted, nothing created again
            await cluster.replace_status(api, namespace, "mlp", new_uid, fresh)
    finally:
        await api.close()


async def test_annotations_acted_on_are_cleared_only_from_their_own_object(
    control_plane: ControlPlane, operator_identity: Identity, namespace: str
) -> None:
    """The promote/abort/retry annotations the operator acted on are removed from the
    object it acted for (its uid tested): the same annotation on a ModelDeployment
    created again under the name is the new object's command, and stays."""
    admin = control_plane.kubectl
    promote = {"metadata": {"annotations": {PROMOTE: "v2@1"}}}
    old = model_deployment(namespace)
    old["metadata"].update(promote["metadata"])
    admin.apply(old)
    old_uid = (get(admin, "md", "mlp", "-n", namespace) or {})["metadata"]["uid"]
    admin("delete", "md", "mlp", "-n", namespace, "--wait=true")
    admin.apply(old)  # created again, with the same command
    new_uid = (get(admin, "md", "mlp", "-n", namespace) or {})["metadata"]["uid"]
    api = kube_client.KubeClient(
        await kube_client.load_configuration(None, str(operator_identity.kubeconfig))
    )

    def annotations() -> dict[str, str]:
        md = get(admin, "md", "mlp", "-n", namespace) or {}
        return dict(md["metadata"].get("annotations") or {})

    try:
        with pytest.raises(ResourceGone):
            await cluster.clear_annotations(api, namespace, "mlp", old_uid, (PROMOTE,))
        assert annotations().get(PROMOTE) == "v2@1"
        await cluster.clear_annotations(api, namespace, "mlp", new_uid, (PROMOTE, ABORT))
        assert PROMOTE not in annotations()
        await cluster.clear_annotations(api, namespace, "mlp", new_uid, (PROMOTE,))  # none left
    finally:
        await api.close()


def test_an_idle_model_deployment_gets_no_status_writes(
    control_plane: ControlPlane,
    operator_identity: Identity,
    namespace: str,
    operators: list[Operator],
    tmp_path: Path,
) -> None:
    """Settled, with its pods Pending: the resync passes find nothing new, and the API
    server counts no status write (PATCH or UPDATE of modeldeployments/status), nor any
    other write of the operator (its audit log: children compared with what the server
    stored, resource quantities in its canonical form included)."""
    interval_s = 0.5
    operator = _start(
        operators,
        Operator(operator_identity.kubeconfig, namespace, tmp_path / "op.log", interval_s),
    )
    _apply_md(control_plane, namespace)
    wait_for("the status", lambda: _settled(control_plane, namespace, 2), operator)
    time.sleep(4 * interval_s)  # the pods' last events (scheduling attempts) seen
    writes_before, passes_before = status_writes(control_plane), operator.passes(namespace, "mlp")
    own_before = len(writes_of(control_plane, operator_identity.username))
    started = time.monotonic()
    time.sleep(12 * interval_s)
    writes = status_writes(control_plane) - writes_before
    passes = operator.passes(namespace, "mlp") - passes_before
    own = [described(e) for e in writes_of(control_plane, operator_identity.username)]
    elapsed = time.monotonic() - started
    assert passes >= 2, operator.log_tail()  # the resync ran...
    assert writes == 0, f"{writes} status writes in {elapsed:.1f}s ({passes} passes)"
    assert own[own_before:] == [], f"{passes} passes wrote:\n" + "\n".join(own[own_before:])
    assert passes <= elapsed / interval_s + 2  # ...and nothing else woke it


def test_a_forbidden_call_is_a_condition_not_a_crash_loop(
    control_plane: ControlPlane,
    operator_identity: Identity,
    namespace: str,
    operators: list[Operator],
    tmp_path: Path,
) -> None:
    """The chart's ClusterRole without ``create`` on Services: the API server's refusal
    becomes a condition on the ModelDeployment with its message; what comes before it is
    done, and the operator keeps running (no daemon restarts). Given the verb back, it
    recovers."""
    admin = control_plane.kubectl
    role = f"{namespace}-no-service-create"
    admin.apply(role_without("create", "services", role))
    control_plane.service_account(namespace, "operator", cluster_role=f"{RELEASE}-discovery")
    restricted = control_plane.service_account(namespace, "operator", cluster_role=role)
    operator = _start(operators, Operator(restricted.kubeconfig, namespace, tmp_path / "op.log"))
    _apply_md(control_plane, namespace)

    def refused() -> dict[str, Any] | None:
        md = get(admin, "md", "mlp", "-n", namespace) or {}
        conditions = (md.get("status") or {}).get("conditions") or []
        ready = next((c for c in conditions if c["type"] == "Ready"), None)
        return ready if ready and ready["reason"] == "Forbidden" else None

    ready = wait_for("the refusal as a condition", refused, operator)
    assert ready["status"] == "False"
    assert 'services is forbidden: User "system:serviceaccount:' in ready["message"], ready
    assert 'cannot create resource "services"' in ready["message"], ready
    assert get(admin, "deployment", "mlp", "-n", namespace) is not None  # allowed: done
    assert get(admin, "service", "mlp", "-n", namespace) is None
    assert operator.running(), operator.log_tail()
    log = operator.log_path.read_text()
    assert "Traceback" not in log and "failed with an exception" not in log, log[-3000:]

    admin.apply(chart_role(role))  # the verb given back
    wait_for(
        "the Service once allowed",
        lambda: get(admin, "service", "mlp", "-n", namespace) is not None,
        operator,
    )
    wait_for("the condition cleared", lambda: refused() is None, operator)


LEASE = "model-rollout-operator"  # leader.LeaseSettings' default name


def _holder(control_plane: ControlPlane) -> str | None:
    lease = get(control_plane.kubectl, "lease", LEASE, "-n", NAMESPACE)
    return None if lease is None else lease["spec"].get("holderIdentity")


def _replicas_become(control_plane: ControlPlane, namespace: str, replicas: int) -> bool:
    deployment = get(control_plane.kubectl, "deployment", "mlp", "-n", namespace) or {}
    return bool((deployment.get("spec") or {}).get("replicas") == replicas)


def _replica(
    operators: list[Operator], identity: Identity, name: str, namespace: str, log: Path,
    *extra: str,
) -> Operator:  # fmt: skip
    """One operator replica with leader election on the chart's Lease (3 s)."""
    election = ["--leader-election", "--lease-namespace", NAMESPACE, "--lease-seconds", "3"]
    args = [*election, "--identity", name, *extra]
    return _start(operators, Operator(identity.kubeconfig, namespace, log, extra=args))


def test_two_operators_elect_one_leader_on_a_real_lease(
    control_plane: ControlPlane,
    operator_identity: Identity,
    namespace: str,
    operators: list[Operator],
    tmp_path: Path,
) -> None:
    """Two replicas on the chart's Lease (its Role in the release namespace): one leads
    and reconciles, the other waits; stopped, the leader is replaced once its Lease
    expires. (A paused leader: the next test.)"""
    admin = control_plane.kubectl
    replicas = {
        name: _replica(operators, operator_identity, name, namespace, tmp_path / f"{name}.log")
        for name in ("op-a", "op-b")
    }
    any_op = replicas["op-a"]
    _apply_md(control_plane, namespace)
    wait_for("the status", lambda: _settled(control_plane, namespace, 2), any_op)
    leader = _holder(control_plane)
    assert leader in replicas
    standby = next(name for name in replicas if name != leader)
    assert replicas[leader].serving_metrics()
    assert not replicas[standby].serving_metrics()  # kopf not started: no pass runs there
    assert replicas[standby].running()

    replicas[leader].stop()  # SIGTERM
    wait_for("the standby to lead", lambda: _holder(control_plane) == standby, any_op)
    admin("patch", "md", "mlp", "-n", namespace, "--type=merge", "-p", '{"spec": {"replicas": 3}}')
    wait_for("the new leader's pass", lambda: _replicas_become(control_plane, namespace, 3),
             replicas[standby])  # fmt: skip


def _status(control_plane: ControlPlane, namespace: str) -> dict[str, Any]:
    md = get(control_plane.kubectl, "md", "mlp", "-n", namespace) or {}
    return dict(md.get("status") or {})


def _canary_held(control_plane: ControlPlane, namespace: str, version: str) -> bool:
    """The canary of ``version`` serves it, and the rollout holds it (its pause)."""
    status = _status(control_plane, namespace)
    rollout = status.get("rollout") or {}
    return rollout.get("toVersion") == version and rollout.get("canaryHealthyAt") is not None


def test_a_paused_leader_that_lost_its_lease_writes_nothing_when_it_wakes(
    control_plane: ControlPlane,
    operator_identity: Identity,
    namespace: str,
    node_agent: Any,
    operators: list[Operator],
    tmp_path: Path,
) -> None:
    """Fencing (issue 29): the leader paused (SIGSTOP) while the canary of v2 is held,
    the standby takes over, the user sets v3 and the new leader starts its canary; woken
    (SIGCONT), the old leader still has the old spec, status and pods in memory and its
    timers are due. It must not write anything once the standby holds the Lease: the API
    server's audit log (each replica a ServiceAccount of its own) shows no write of it
    received after the standby's first write of the Lease. It exits (status
    ``LEASE_LOST_EXIT``) rather than stopping gracefully."""
    admin = control_plane.kubectl
    names = (f"{namespace}-a", f"{namespace}-b")  # new holders: no Lease of an earlier test
    identities = {name: replica_identity(control_plane, name) for name in names}
    logs = {name: tmp_path / f"{name}.log" for name in names}
    replicas = {
        name: _replica(operators, identities[name], name, namespace, logs[name], "--no-store-check")
        for name in names
    }
    sidecars = ReportingSidecars(control_plane, namespace, "v1").start()
    try:  # an S3 store, not a PVC (none exists here): the pods run on the simulated node
        _apply_md(control_plane, namespace, replicas=4, store={"url": "s3://models/resnet50"},
                  canary={"percent": 50, "pauseSeconds": 3600})  # fmt: skip
        any_op = replicas[names[0]]
        wait_for("v1 everywhere", lambda: settled_on(_status(control_plane, namespace), "v1", 4)
                 and _holder(control_plane) in replicas, any_op)  # fmt: skip
        leader = str(_holder(control_plane))
        standby = next(name for name in names if name != leader)
        old = replicas[leader]
        admin("patch", "md", "mlp", "-n", namespace, "--type=merge", "-p",
              '{"spec": {"version": "v2"}}')  # fmt: skip
        wait_for("the canary of v2 held", lambda: _canary_held(control_plane, namespace, "v2"),
                 old)  # fmt: skip
        assert old.proc is not None
        os.kill(old.proc.pid, signal.SIGSTOP)
        try:
            wait_for("the standby to lead", lambda: _holder(control_plane) == standby,
                     replicas[standby])  # fmt: skip
            admin("patch", "md", "mlp", "-n", namespace, "--type=merge", "-p",
                  '{"spec": {"version": "v3"}}')  # fmt: skip
            wait_for(
                "the new leader's canary of v3",
                lambda: _canary_held(control_plane, namespace, "v3"),
                replicas[standby],
            )
        finally:
            os.kill(old.proc.pid, signal.SIGCONT)
        code = old.run_to_end(60)
    finally:
        sidecars.stop()

    lease_writes = [
        e for e in writes_of(control_plane, identities[standby].username)
        if (e.get("objectRef") or {}).get("resource") == "leases"
        and (e.get("responseStatus") or {}).get("code", 500) < 300
    ]  # fmt: skip
    taken_at = received_at(lease_writes[0])  # the standby's first: it took the Lease
    writes = writes_of(control_plane, identities[leader].username)
    before = [e for e in writes if received_at(e) < taken_at]
    after = [described(e) for e in writes if received_at(e) >= taken_at]
    assert any("pods" in described(e) for e in before), before  # it did write while leading
    assert after == [], f"{len(after)} writes after losing the Lease:\n" + "\n".join(after)
    assert code == LEASE_LOST_EXIT, old.log_tail()
    assert "lease" in old.log_tail().lower(), old.log_tail()
    assert replicas[standby].running(), replicas[standby].log_tail()
    pods = admin("get", "pods", "-n", namespace, "-o", "json")
    targets = {
        (p["metadata"].get("annotations") or {}).get(TARGET_VERSION)
        for p in json.loads(pods)["items"]
    }
    assert targets <= {"v1", "v3"}, targets  # nothing left pointed at the abandoned v2


def _refused(server: str, ca: Path, token: str) -> bool:
    """Does the API server refuse ``token`` (401)?"""
    request = urllib.request.Request(f"{server}/api", headers={"Authorization": f"Bearer {token}"})
    context = ssl.create_default_context(cafile=str(ca))
    try:
        with urllib.request.urlopen(request, timeout=5, context=context):
            return False
    except urllib.error.HTTPError as exc:
        return exc.code == 401


async def test_the_operator_follows_a_rotated_service_account_token(
    control_plane: ControlPlane,
    operator_identity: Identity,
    namespace: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In a cluster the kubelet rotates the projected token in place; the old one stops
    working (here: bound to a Secret that is then deleted). The operator's calls and
    kopf's login read the file anew (the in-cluster loader's period, made 0 here)."""
    admin = control_plane.kubectl
    mount = tmp_path / "serviceaccount"
    mount.mkdir()
    (mount / "ca.crt").write_bytes(control_plane.pki.ca.cert.read_bytes())

    def token(secret: str) -> str:
        admin("create", "secret", "generic", secret, "-n", NAMESPACE)
        bound = ["--bound-object-kind=Secret", f"--bound-object-name={secret}"]
        return admin("create", "token", OPERATOR_ACCOUNT, "-n", NAMESPACE, *bound).strip()

    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(control_plane.port))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setattr(kube_client, "SERVICE_ACCOUNT", mount)
    monkeypatch.setattr(kube_client, "DEFAULT_KUBECONFIG", tmp_path / "no-kubeconfig")
    monkeypatch.setattr(incluster_config, "TOKEN_REFRESH_PERIOD", timedelta(0))
    first, second = f"{namespace}-first", f"{namespace}-second"
    first_token = token(first)
    (mount / "token").write_text(first_token)
    memo = kopf.Memo(config=OperatorConfig())
    await handlers.configure(kopf.OperatorSettings(), memo)
    api: kube_client.KubeClient = memo.api
    absent = f"/api/v1/namespaces/{namespace}/configmaps/absent"
    try:
        assert await api.request("GET", absent) is None  # allowed, and not there
        rotated = token(second)
        (mount / "token").write_text(rotated)
        admin("delete", "secret", first, "-n", NAMESPACE)
        await asyncio.to_thread(
            wait_until, lambda: _refused(control_plane.server, mount / "ca.crt", first_token),
            30, 0.3, "the first token to be refused",
        )  # fmt: skip
        assert await api.request("GET", absent) is None
        login = await handlers.login(memo)
        assert (login.scheme, login.token, login.server) == (
            "Bearer",
            rotated,
            control_plane.server,
        )
    finally:
        await api.close()
