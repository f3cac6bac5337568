"""The kubelet stand-in (``model_rollout_e2e.node_agent``) on the real control plane
(issue 28): the real controller-manager makes ReplicaSets, pods and EndpointSlices, the
real scheduler binds the pods to the stand-in's Node, and the stand-in runs them as
processes (or simulated ones), reports their status, probes readiness, projects tokens
and Downward API files and ends deleted pods gracefully."""

from __future__ import annotations

import asyncio
import json
import os
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from model_rollout_e2e.container_runtime import ProcessContainers
from model_rollout_e2e.control_plane import ControlPlane
from model_rollout_e2e.kubeconfig import write_kubeconfig
from model_rollout_e2e.kubectl import Kubectl
from model_rollout_e2e.node_agent import NodeAgent
from model_rollout_e2e.processes import wait_until

# a tiny HTTP server serving /shared (its readiness file among others); on SIGTERM it
# notes whether its preStop hook ran before, and exits
SERVER = """
import http.server, os, pathlib, signal, sys
shared, name = pathlib.Path(sys.argv[1]), os.environ["POD_NAME"]
def term(signum, frame):
    prestop = (shared / (name + ".prestop")).exists()
    (shared / (name + ".sigterm")).write_text("after preStop" if prestop else "no preStop")
    os._exit(0)
signal.signal(signal.SIGTERM, term)
os.chdir(shared)
address = (os.environ["POD_IP"], 8080)
http.server.ThreadingHTTPServer(address, http.server.SimpleHTTPRequestHandler).serve_forever()
"""
PRESTOP = (
    "import os, pathlib, sys;"
    " pathlib.Path(sys.argv[1], os.environ['POD_NAME'] + '.prestop').write_text('ran')"
)
SLEEPER = "import time; time.sleep(3600)"
WAIT_S = 120.0


def _pod_env() -> list[dict[str, Any]]:
    return [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]


def web_deployment(namespace: str, replicas: int) -> dict[str, Any]:
    container = {
        "name": "web",
        "image": "python:3.11-slim",  # not pulled: the command runs on the host
        "command": ["python", "-c", SERVER, "/shared"],
        "env": _pod_env(),
        "ports": [{"name": "http", "containerPort": 8080}],
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": "http"},
            "periodSeconds": 1,
            "failureThreshold": 1,
        },
        "lifecycle": {"preStop": {"exec": {"command": ["python", "-c", PRESTOP, "/shared"]}}},
        "volumeMounts": [{"name": "shared", "mountPath": "/shared"}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web", "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {
                    "terminationGracePeriodSeconds": 10,
                    "containers": [container],
                    "volumes": [{"name": "shared", "emptyDir": {}}],
                },
            },
        },
    }


def bare_pod(namespace: str, name: str, spec: dict[str, Any], **meta: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, **meta},
        "spec": spec,
    }


def sleeper(name: str = "main", code: str = SLEEPER, **extra: Any) -> dict[str, Any]:
    return {"name": name, "image": "python:3.11-slim", "command": ["python", "-c", code], **extra}


@pytest.fixture
def namespace(control_plane: ControlPlane) -> Iterator[str]:
    name = f"kubelet-{uuid.uuid4().hex[:8]}"
    admin = control_plane.kubectl
    admin("create", "namespace", name)
    wait_until(  # pods are refused until the controller-manager made its ServiceAccount
        lambda: admin.run("get", "serviceaccount", "default", "-n", name).code == 0,
        WAIT_S,
        0.2,
        "the namespace's default ServiceAccount",
    )
    yield name
    control_plane.kubectl.run("delete", "namespace", name, "--wait=false")


@pytest.fixture
def admin(control_plane: ControlPlane) -> Kubectl:
    return control_plane.kubectl


def pods(admin: Kubectl, namespace: str, selector: str = "app=web") -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = admin.get("pods", "-n", namespace, "-l", selector)["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def condition(obj: dict[str, Any], kind: str) -> str | None:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond["type"] == kind:
            return str(cond["status"])
    return None


def is_ready(pod: dict[str, Any]) -> bool:
    return condition(pod, "Ready") == "True"


def ready_pods(admin: Kubectl, namespace: str, count: int) -> list[dict[str, Any]]:
    def ready() -> list[dict[str, Any]] | None:
        found = pods(admin, namespace)
        return found if len(found) == count and all(map(is_ready, found)) else None

    result: list[dict[str, Any]] = wait_until(ready, WAIT_S, 0.5, f"{count} ready pods")
    return result


def ready_endpoints(admin: Kubectl, namespace: str, service: str) -> set[str]:
    slices = admin.get(
        "endpointslices", "-n", namespace, "-l", f"kubernetes.io/service-name={service}"
    )
    return {
        address
        for item in slices["items"]
        for endpoint in item.get("endpoints") or []
        if (endpoint.get("conditions") or {}).get("ready")
        for address in endpoint["addresses"]
    }


def gone(admin: Kubectl, namespace: str, name: str) -> bool:
    result = admin.run("get", "pod", name, "-n", namespace, "-o", "name")
    return result.code != 0 and "NotFound" in result.err


def test_the_node_registers_ready_and_renews_its_lease(node_agents: Any, admin: Kubectl) -> None:
    agent = node_agents(lease_renew_s=1.0)
    node = admin.get("node", agent.name)
    assert condition(node, "Ready") == "True"
    assert node["metadata"]["labels"]["kubernetes.io/hostname"] == agent.name
    for resource in ("cpu", "memory", "pods", "nvidia.com/gpu"):
        assert node["status"]["capacity"][resource] == node["status"]["allocatable"][resource]
    assert node["status"]["capacity"]["nvidia.com/gpu"] == "8"

    def untainted() -> bool:  # the admission's not-ready taint, lifted by the controller
        taints = admin.get("node", agent.name)["spec"].get("taints") or []
        return not [t for t in taints if t["effect"] in ("NoSchedule", "NoExecute")]

    wait_until(untainted, WAIT_S, 0.5, "the node untainted")
    first = admin.get("lease", agent.name, "-n", "kube-node-lease")["spec"]["renewTime"]
    wait_until(
        lambda: (
            admin.get("lease", agent.name, "-n", "kube-node-lease")["spec"]["renewTime"] != first
        ),
        WAIT_S,
        0.5,
        "the node's lease renewed",
    )


def service(namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web", "namespace": namespace},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": "http"}]},
    }


def test_a_deployment_runs_as_processes_ready_by_its_readiness_probe(
    node_agents: Any, admin: Kubectl, namespace: str, tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    agent = node_agents(processes=True, mounts={"/shared": shared})
    admin.apply(web_deployment(namespace, 2))

    def running() -> list[dict[str, Any]] | None:
        found = pods(admin, namespace)
        started = [
            p for p in found
            if (p.get("status") or {}).get("containerStatuses", [{}])[0].get("started")
        ]  # fmt: skip
        return found if len(started) == 2 else None

    started = wait_until(running, WAIT_S, 0.5, "2 running pods")
    for pod in started:  # running, but its readiness file is not there yet
        assert pod["status"]["phase"] == "Running"
        assert not is_ready(pod)
    (shared / "ready").write_text("yes")
    ready = ready_pods(admin, namespace, 2)
    assert len({p["status"]["podIP"] for p in ready}) == 2
    for pod in ready:
        status = pod["status"]
        assert pod["spec"]["nodeName"] == agent.name
        assert status["hostIP"] == "127.0.0.1" and status["startTime"]
        for kind in ("PodScheduled", "Initialized", "ContainersReady", "Ready"):
            assert condition(pod, kind) == "True", kind
        [container] = status["containerStatuses"]
        assert container["ready"] and container["started"] and container["restartCount"] == 0
        assert "running" in container["state"]
        url = f"http://{status['podIP']}:8080/ready"  # the pod's own process answers
        with urllib.request.urlopen(url, timeout=5) as response:
            assert response.read() == b"yes"
    (shared / "ready").unlink()  # the probe fails from now on: not ready any more
    wait_until(lambda: not any(map(is_ready, pods(admin, namespace))), WAIT_S, 0.5, "pods unready")


def test_exec_and_tcp_readiness_probes_gate_each_container(
    node_agents: Any, admin: Kubectl, namespace: str, tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    node_agents(processes=True, mounts={"/shared": shared})
    mount = [{"name": "shared", "mountPath": "/shared"}]
    exists = "import sys, os; sys.exit(0 if os.path.exists(sys.argv[1]) else 1)"
    web = web_deployment(namespace, 1)["spec"]["template"]["spec"]["containers"][0]
    web["readinessProbe"] = {"tcpSocket": {"port": 8080}, "periodSeconds": 1}
    gate = sleeper(
        "gate",
        volumeMounts=mount,
        readinessProbe={
            "exec": {"command": ["python", "-c", exists, "/shared/open"]},
            "periodSeconds": 1,
        },
    )
    spec = {"containers": [web, gate], "volumes": [{"name": "shared", "emptyDir": {}}]}
    admin.apply(bare_pod(namespace, "gated", spec, labels={"app": "web"}))

    def readiness() -> dict[str, bool]:
        status = admin.get("pod", "gated", "-n", namespace).get("status") or {}
        return {c["name"]: c["ready"] for c in status.get("containerStatuses") or []}

    wait_until(lambda: readiness() == {"web": True, "gate": False}, WAIT_S, 0.5, "web ready")
    assert not is_ready(admin.get("pod", "gated", "-n", namespace))
    (shared / "open").write_text("")
    ready_pods(admin, namespace, 1)
    assert readiness() == {"web": True, "gate": True}


def test_a_services_endpointslice_lists_the_ready_pods_of_a_simulated_node(
    node_agent: Any, admin: Kubectl, namespace: str
) -> None:
    """Simulated pods: an EndpointSlice may not hold the loopback addresses that process
    pods get (the API server refuses them), so only simulated pods join a Service."""
    admin.apply(web_deployment(namespace, 3), service(namespace))
    ready = ready_pods(admin, namespace, 3)
    addresses = {p["status"]["podIP"] for p in ready}
    wait_until(
        lambda: ready_endpoints(admin, namespace, "web") == addresses,
        WAIT_S,
        0.5,
        "the Service's EndpointSlice listing the 3 pods",
    )
    deleted = ready[0]["metadata"]["name"]
    admin("delete", "pod", deleted, "-n", namespace, "--wait=false")
    wait_until(lambda: gone(admin, namespace, deleted), WAIT_S, 0.5, f"pod {deleted} deleted")
    now = {p["status"]["podIP"] for p in ready_pods(admin, namespace, 3)}
    assert ready[0]["status"]["podIP"] not in now
    wait_until(
        lambda: ready_endpoints(admin, namespace, "web") == now,
        WAIT_S,
        0.5,
        "the EndpointSlice following the replacement",
    )


def test_a_node_evicts_a_pod_or_fails_its_readiness_when_a_test_asks(
    node_agent: NodeAgent, admin: Kubectl, namespace: str
) -> None:
    """What a kubelet does to a pod of its own accord, here on a test's request: an
    evicted pod (memory pressure) is killed and kept, Failed with reason Evicted, and its
    ReplicaSet replaces it (a Failed pod is no replica); a pod whose readiness probe
    starts failing stays Running, not Ready; the evicted pod goes once deleted."""
    admin.apply(web_deployment(namespace, 2))
    first, second = (p["metadata"]["name"] for p in ready_pods(admin, namespace, 2))
    node_agent.evict(namespace, first)

    def phase(name: str, wanted: str) -> dict[str, Any] | None:
        pod = admin.get("pod", name, "-n", namespace)
        return pod if pod["status"].get("phase") == wanted else None

    evicted = wait_until(lambda: phase(first, "Failed"), WAIT_S, 0.2, "the eviction")
    assert evicted["status"]["reason"] == "Evicted", evicted["status"]
    assert "low on resource: memory" in evicted["status"]["message"]
    assert condition(evicted, "Ready") == "False"
    assert all("terminated" in c["state"] for c in evicted["status"]["containerStatuses"])

    def replaced() -> set[str] | None:
        running = {
            p["metadata"]["name"] for p in pods(admin, namespace)
            if p["status"].get("phase") == "Running" and is_ready(p)
        }  # fmt: skip
        return running if len(running) == 2 else None

    running = wait_until(replaced, WAIT_S, 0.5, "a replacement of the evicted pod")
    assert first not in running and second in running
    node_agent.fail_readiness(namespace, second)

    def unready() -> dict[str, Any] | None:
        pod = admin.get("pod", second, "-n", namespace)
        return pod if condition(pod, "Ready") == "False" else None

    pod = wait_until(unready, WAIT_S, 0.2, "the failing readiness")
    assert pod["status"]["phase"] == "Running" and condition(pod, "ContainersReady") == "False"
    assert phase(first, "Failed") is not None  # kept until deleted
    admin("delete", "pod", first, "-n", namespace, "--wait=false")
    wait_until(lambda: gone(admin, namespace, first), WAIT_S, 0.5, f"pod {first} deleted")
    with pytest.raises(LookupError, match="runs no pod"):
        node_agent.evict(namespace, first)


def test_the_node_sets_a_ready_condition_flipped_by_the_node_controller_back(
    node_agent: NodeAgent, admin: Kubectl, namespace: str
) -> None:
    """A kubelet re-syncs pod status: when the node-lifecycle controller marked its pods
    not Ready (a late Lease renewal), the node writes what it believes again, so the
    pods do not stay not Ready for good."""
    admin.apply(web_deployment(namespace, 1))
    (pod,) = ready_pods(admin, namespace, 1)
    name = pod["metadata"]["name"]
    flipped = {"type": "Ready", "status": "False", "reason": "NodeNotReady",
               "lastTransitionTime": pod["metadata"]["creationTimestamp"]}  # fmt: skip
    admin(
        "patch", "pod", name, "-n", namespace, "--subresource=status", "--type=strategic",
        "-p", json.dumps({"status": {"conditions": [flipped]}}),
    )  # fmt: skip
    assert condition(admin.get("pod", name, "-n", namespace), "Ready") == "False"
    ready_pods(admin, namespace, 1)


def test_deleting_a_pod_runs_prestop_then_sigterm_and_the_deployment_replaces_it(
    node_agents: Any, admin: Kubectl, namespace: str, tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "ready").write_text("yes")
    node_agents(processes=True, mounts={"/shared": shared})
    admin.apply(web_deployment(namespace, 1))
    [pod] = ready_pods(admin, namespace, 1)
    name = pod["metadata"]["name"]
    admin("delete", "pod", name, "-n", namespace, "--wait=false")
    wait_until(lambda: gone(admin, namespace, name), WAIT_S, 0.5, f"pod {name} deleted")
    assert (shared / f"{name}.sigterm").read_text() == "after preStop"
    [replacement] = ready_pods(admin, namespace, 1)
    assert replacement["metadata"]["name"] != name


def test_a_container_ignoring_sigterm_is_killed_after_the_grace_period(
    node_agents: Any, admin: Kubectl, namespace: str
) -> None:
    node_agents(processes=True)
    stubborn = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(3600)"
    )
    spec = {"terminationGracePeriodSeconds": 1, "containers": [sleeper(code=stubborn)]}
    admin.apply(bare_pod(namespace, "stubborn", spec))

    def ready() -> dict[str, Any] | None:
        pod = admin.get("pod", "stubborn", "-n", namespace)
        return pod if is_ready(pod) else None

    pod = wait_until(ready, WAIT_S, 0.5, "the pod ready")
    pid = int(pod["status"]["containerStatuses"][0]["containerID"].removeprefix("process://"))
    os.kill(pid, 0)  # its process runs
    admin("delete", "pod", "stubborn", "-n", namespace, "--wait=false")
    wait_until(lambda: gone(admin, namespace, "stubborn"), WAIT_S, 0.5, "the pod deleted")
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def test_stopping_the_agent_kills_its_pods_processes(
    control_plane: ControlPlane, admin: Kubectl, namespace: str, tmp_path: Path
) -> None:
    """On this test's own loop, whose thread outlives the agent (an agent's thread that
    ends takes its children with it: ``PR_SET_PDEATHSIG``)."""
    name = f"node-{uuid.uuid4().hex[:8]}"
    agent = NodeAgent(control_plane.node_kubeconfig(name), ProcessContainers(tmp_path), name)
    await agent.start()
    try:
        await asyncio.to_thread(
            admin.apply, bare_pod(namespace, "long", {"containers": [sleeper()]})
        )

        def pid() -> int | None:
            status = admin.get("pod", "long", "-n", namespace).get("status") or {}
            found = (status.get("containerStatuses") or [{}])[0].get("containerID")
            return int(found.removeprefix("process://")) if found else None

        running = await asyncio.to_thread(wait_until, pid, WAIT_S, 0.5, "the pod's process")
        os.kill(running, 0)
    finally:
        await agent.stop()
        admin.run("delete", "node", name, "--wait=false")
    with pytest.raises(ProcessLookupError):
        os.kill(running, 0)


def test_exited_containers_end_the_pod_or_restart_by_restart_policy(
    node_agents: Any, admin: Kubectl, namespace: str
) -> None:
    node_agents(processes=True, restart_backoff_s=0.2)
    exits = "import sys; sys.exit(int(sys.argv[1]))"
    admin.apply(
        bare_pod(namespace, "done", {"restartPolicy": "Never",
                 "containers": [sleeper(code=exits, args=["0"])]}),
        bare_pod(namespace, "crashed", {"restartPolicy": "Never",
                 "containers": [sleeper(code=exits, args=["3"])]}),
        bare_pod(namespace, "bad-init", {"restartPolicy": "Never",
                 "initContainers": [sleeper("init", code=exits, args=["2"])],
                 "containers": [sleeper()]}),
        bare_pod(namespace, "restarts", {"restartPolicy": "Always",
                 "containers": [sleeper(code=exits, args=["1"])]}),
        bare_pod(namespace, "killed", {"restartPolicy": "Never", "containers": [sleeper(
                 code="import os, signal; os.kill(os.getpid(), signal.SIGKILL)")]}),
        bare_pod(namespace, "no-program", {"containers": [{"name": "main", "image": "x",
                 "command": ["no-such-program-on-this-host"]}]}),
    )  # fmt: skip

    def phase(name: str) -> str:
        return str(admin.get("pod", name, "-n", namespace).get("status", {}).get("phase"))

    wait_until(lambda: phase("done") == "Succeeded", WAIT_S, 0.5, "done Succeeded")
    wait_until(lambda: phase("crashed") == "Failed", WAIT_S, 0.5, "crashed Failed")
    wait_until(lambda: phase("bad-init") == "Failed", WAIT_S, 0.5, "bad-init Failed")
    wait_until(lambda: phase("killed") == "Failed", WAIT_S, 0.5, "killed Failed")
    crashed = admin.get("pod", "crashed", "-n", namespace)["status"]["containerStatuses"][0]
    assert crashed["state"]["terminated"]["exitCode"] == 3
    killed = admin.get("pod", "killed", "-n", namespace)["status"]["containerStatuses"][0]
    assert killed["state"]["terminated"]["exitCode"] == 128 + 9  # as runtimes report SIGKILL
    init = admin.get("pod", "bad-init", "-n", namespace)["status"]
    assert init["initContainerStatuses"][0]["state"]["terminated"]["exitCode"] == 2
    assert "running" not in init["containerStatuses"][0]["state"]  # never started

    def restarts() -> int:
        status = admin.get("pod", "restarts", "-n", namespace).get("status", {})
        return int((status.get("containerStatuses") or [{}])[0].get("restartCount", 0))

    wait_until(lambda: restarts() >= 2, WAIT_S, 0.5, "the crashing container restarted")
    assert phase("restarts") in ("Running", "Pending")

    def waiting() -> dict[str, Any]:
        status = admin.get("pod", "no-program", "-n", namespace).get("status") or {}
        state = (status.get("containerStatuses") or [{}])[0].get("state") or {}
        return dict(state.get("waiting") or {})

    wait_until(lambda: waiting().get("reason") == "RunContainerError", WAIT_S, 0.5, "an error")
    assert "no-such-program-on-this-host" in waiting()["message"]


def test_a_pod_waits_for_its_config_map_and_starts_once_it_exists(
    node_agents: Any, admin: Kubectl, namespace: str, tmp_path: Path
) -> None:
    """A volume the API does not give yet (a ConfigMap created after the pod; or, just
    after binding, the Node authorizer not yet knowing the pod) is retried, the pod
    ContainerCreating meanwhile, as a kubelet's volume manager does: not given up."""
    config = tmp_path / "config"
    node_agents(processes=True, mounts={"/etc/config": config})
    spec = {
        "containers": [sleeper(volumeMounts=[{"name": "config", "mountPath": "/etc/config"}])],
        "volumes": [{"name": "config", "configMap": {"name": "late"}}],
    }
    admin.apply(bare_pod(namespace, "waits", spec))

    def waiting() -> str | None:
        status = admin.get("pod", "waits", "-n", namespace).get("status") or {}
        state = (status.get("containerStatuses") or [{}])[0].get("state") or {}
        return (state.get("waiting") or {}).get("reason")

    wait_until(lambda: waiting() == "ContainerCreating", WAIT_S, 0.5, "the pod on the node")
    admin("create", "configmap", "late", "-n", namespace, "--from-literal=key=value")

    def ready() -> dict[str, Any] | None:
        pod = admin.get("pod", "waits", "-n", namespace)
        return pod if is_ready(pod) else None

    wait_until(ready, WAIT_S, 0.5, "the pod running once its ConfigMap exists")
    assert (config / "key").read_text() == "value"


# writes the environment it was given from Secrets into the folder its argument names
# (a container path: the sandbox maps it), then sleeps
SECRET_ENV = (
    "import json, os, pathlib, sys, time;"
    " seen = {k: v for k, v in os.environ.items() if k.startswith(('ID', 'S_'))};"
    " pathlib.Path(sys.argv[1], 'env.json').write_text(json.dumps(seen)); time.sleep(3600)"
)


def test_a_pods_secrets_reach_its_volumes_and_environment_once_they_exist(
    node_agents: Any, admin: Kubectl, namespace: str, tmp_path: Path
) -> None:
    """As a kubelet, with the node's own credentials (the Node authorizer lets a node
    read the Secrets its pods name): a ``secret`` volume (its items), a projected Secret,
    ``secretKeyRef`` and ``envFrom``; the pod waits ContainerCreating until they exist. A
    Secret volume the node was given a host directory for is that directory."""
    out, given = tmp_path / "out", tmp_path / "given"
    given.mkdir()
    (given / "public.pem").write_text("given")
    node_agents(processes=True, mounts={"/out": out, "/given": given})
    mounts = [{"name": name, "mountPath": f"/{name}"}
              for name in ("keys", "projected", "given", "out")]  # fmt: skip
    container = sleeper(
        code=SECRET_ENV,
        args=["/out"],
        volumeMounts=mounts,
        env=[{"name": "ID", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "id"}}}],
        envFrom=[{"secretRef": {"name": "creds"}, "prefix": "S_"}],
    )
    spec = {
        "containers": [container],
        "volumes": [
            {"name": "keys", "secret": {"secretName": "keys", "items": [
                {"key": "public.pem", "path": "trusted.pem"}]}},
            {"name": "projected", "projected": {"sources": [{"secret": {"name": "creds"}}]}},
            {"name": "given", "secret": {"secretName": "not-in-the-api"}},
            {"name": "out", "emptyDir": {}},
        ],
    }  # fmt: skip
    admin.apply(bare_pod(namespace, "secrets", spec))

    def waiting() -> str | None:
        status = admin.get("pod", "secrets", "-n", namespace).get("status") or {}
        state = (status.get("containerStatuses") or [{}])[0].get("state") or {}
        return (state.get("waiting") or {}).get("reason")

    wait_until(lambda: waiting() == "ContainerCreating", WAIT_S, 0.5, "the pod on the node")
    admin("create", "secret", "generic", "keys", "-n", namespace,
          "--from-literal=public.pem=key", "--from-literal=other=unlisted")  # fmt: skip
    admin("create", "secret", "generic", "creds", "-n", namespace,
          "--from-literal=id=k", "--from-literal=secret=s")  # fmt: skip
    wait_until(lambda: (out / "env.json").exists(), WAIT_S, 0.5, "the container's environment")
    assert json.loads((out / "env.json").read_text()) == {"ID": "k", "S_id": "k", "S_secret": "s"}
    [keys] = [p for p in tmp_path.rglob("keys") if p.is_dir()]
    assert {p.name: p.read_text() for p in keys.iterdir()} == {"trusted.pem": "key"}
    [projected] = [p for p in tmp_path.rglob("projected") if p.is_dir()]
    assert {p.name: p.read_text() for p in projected.iterdir()} == {"id": "k", "secret": "s"}
    assert {p.name: p.read_text() for p in given.iterdir()} == {"public.pem": "given"}


def test_a_downward_api_annotation_change_reaches_the_file_on_the_next_refresh(
    node_agents: Any, admin: Kubectl, namespace: str, tmp_path: Path
) -> None:
    podinfo = tmp_path / "podinfo"
    node_agents(processes=True, mounts={"/etc/podinfo": podinfo}, volume_refresh_s=1.0)
    fields = ("metadata.annotations", "metadata.labels", "metadata.name", "metadata.namespace")
    spec = {
        "containers": [sleeper(volumeMounts=[{"name": "podinfo", "mountPath": "/etc/podinfo"}])],
        "volumes": [
            {
                "name": "podinfo",
                "downwardAPI": {
                    "items": [
                        {"path": f.split(".")[1], "fieldRef": {"fieldPath": f}} for f in fields
                    ]
                },
            }
        ],
    }
    admin.apply(
        bare_pod(namespace, "info", spec, labels={"app": "info"},
                 annotations={"example.com/target": "v1"})
    )  # fmt: skip
    wait_until(lambda: (podinfo / "annotations").exists(), WAIT_S, 0.5, "the annotations file")
    assert 'example.com/target="v1"' in (podinfo / "annotations").read_text()
    assert (podinfo / "labels").read_text() == 'app="info"\n'
    assert (podinfo / "name").read_text() == "info"
    assert (podinfo / "namespace").read_text() == namespace
    admin("annotate", "pod", "info", "-n", namespace, "--overwrite", "example.com/target=v2")
    wait_until(
        lambda: 'example.com/target="v2"' in (podinfo / "annotations").read_text(),
        WAIT_S,
        0.5,
        "the new annotation in the file",
    )


def whoami(control_plane: ControlPlane, token: str, path: Path) -> dict[str, Any]:
    write_kubeconfig(path, control_plane.server, control_plane.pki.ca.cert, token=token)
    review: dict[str, Any] = json.loads(Kubectl(path)("auth", "whoami", "-o", "json"))
    return dict(review["status"]["userInfo"])


def test_the_projected_token_authenticates_as_the_pods_service_account_and_is_rotated(
    node_agents: Any, admin: Kubectl, namespace: str, tmp_path: Path, control_plane: ControlPlane
) -> None:
    tokens = tmp_path / "tokens"
    node_agents(
        processes=True,
        mounts={"/var/run/secrets/tokens": tokens},
        volume_refresh_s=1.0,
        token_max_age_s=2.0,
    )
    admin("create", "serviceaccount", "reader", "-n", namespace)
    source = {"serviceAccountToken": {"path": "token", "expirationSeconds": 600}}
    spec = {
        "serviceAccountName": "reader",
        "containers": [
            sleeper(volumeMounts=[{"name": "token", "mountPath": "/var/run/secrets/tokens"}])
        ],
        "volumes": [{"name": "token", "projected": {"sources": [source]}}],
    }
    admin.apply(bare_pod(namespace, "client", spec))
    token_file = tokens / "token"
    first = wait_until(
        lambda: token_file.read_text() if token_file.exists() else None,
        WAIT_S,
        0.5,
        "the projected token",
    )
    user = whoami(control_plane, first, tmp_path / "first.kubeconfig")
    assert user["username"] == f"system:serviceaccount:{namespace}:reader"
    assert user["extra"]["authentication.kubernetes.io/pod-name"] == ["client"]
    second = wait_until(
        lambda: (text := token_file.read_text()) != first and text,
        WAIT_S,
        0.5,
        "the token rotated",
    )
    renewed = whoami(control_plane, second, tmp_path / "second.kubeconfig")
    assert renewed["username"] == user["username"]
    assert renewed["extra"]["authentication.kubernetes.io/pod-name"] == ["client"]
    credential = "authentication.kubernetes.io/credential-id"
    assert renewed["extra"][credential] != user["extra"][credential]  # a new token


def test_a_simulated_node_runs_200_pods_to_ready(
    node_agent: Any, admin: Kubectl, namespace: str
) -> None:
    deployment = web_deployment(namespace, 200)
    deployment["spec"]["template"]["spec"]["containers"][0].pop("lifecycle")
    admin.apply(deployment)
    ready = ready_pods(admin, namespace, 200)
    assert {p["spec"]["nodeName"] for p in ready} == {node_agent.name}
    assert len({p["status"]["podIP"] for p in ready}) == 200
