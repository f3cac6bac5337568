"""The kubelet stand-ins' process runtime without a cluster: how a container's command
line and environment are mapped onto the host (``pod_sandbox``), and the probe and hook
actions (``container_runtime``)."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from model_rollout_e2e.container_runtime import ProcessContainers, SimulatedContainers
from model_rollout_e2e.pod_sandbox import Sandbox


def pod(containers: list[dict[str, Any]], volumes: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "namespace": "ns", "uid": "0123456789abcdef"},
        "spec": {
            "nodeName": "n",
            "containers": containers,
            "volumes": [{"name": v, "emptyDir": {}} for v in volumes],
        },
    }


def test_a_command_line_runs_on_the_host_with_container_paths_mapped(tmp_path: Path) -> None:
    container = {
        "name": "main",
        "command": ["python", "-c", "pass"],
        "args": ["/data/x", "file:///data/y", "--host", "0.0.0.0", "/elsewhere"],
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    sandbox = Sandbox.create(tmp_path, "127.0.3.4", pod([container], ("data",))["spec"])
    data = tmp_path / "data"
    assert data.is_dir()
    assert sandbox.argv(container) == [
        sys.executable, "-c", "pass", f"{data}/x", f"file://{data}/y", "--host", "127.0.3.4",
        "/elsewhere",
    ]  # fmt: skip
    project = {"name": "server", "args": ["model-server", "--port", "8000"]}
    assert sandbox.argv(project) == [sys.executable, "-m", "model_server", "--port", "8000"]
    with pytest.raises(ValueError, match="no command"):
        sandbox.argv({"name": "empty"})


def test_the_environment_gets_values_and_downward_api_fields(tmp_path: Path) -> None:
    env = [
        {"name": "A", "value": "1"},
        {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    container = {"name": "main", "command": ["true"], "env": env}
    obj = pod([container])
    sandbox = Sandbox.create(tmp_path, "127.0.3.4", obj["spec"])
    assert sandbox.environment(obj, container, {"BASE": "b"}) == {
        "BASE": "b", "A": "1", "IP": "127.0.3.4", "NODE": "n", "NAME": "p",
    }  # fmt: skip


def test_the_operator_runs_in_its_pod_binding_the_pods_address_for_every_address(
    tmp_path: Path,
) -> None:
    """The chart's operator container (``model-operator`` with the ServiceAccount volume)
    runs on this interpreter through in_pod; a bind to every address (its liveness URL)
    is a bind to the pod's own IP, as in the pod's network namespace, so two replicas on
    one host do not collide."""
    account = "/var/run/secrets/kubernetes.io/serviceaccount"
    container = {
        "name": "operator",
        "args": ["model-operator", "--liveness", "http://0.0.0.0:8080/healthz"],
        "volumeMounts": [{"name": "kube-api-access", "mountPath": account}],
    }
    obj = pod([container], ("kube-api-access",))
    sandbox = Sandbox.create(tmp_path, "127.0.3.4", obj["spec"])
    assert sandbox.argv(container) == [
        sys.executable, "-m", "model_rollout_e2e.in_pod", str(tmp_path / "kube-api-access"),
        "model_operator", "--liveness", "http://127.0.3.4:8080/healthz",
    ]  # fmt: skip


def test_the_environment_takes_secret_keys_and_whole_secrets(tmp_path: Path) -> None:
    """``secretKeyRef`` and ``envFrom: secretRef`` (with its prefix), from the Secrets
    the pod's volumes read; ``env`` wins over ``envFrom``; a key or Secret not read
    (optional, absent) sets nothing."""
    env = [
        {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "id"}}},
        {"name": "A", "value": "1"},
        {"name": "GONE", "valueFrom": {"secretKeyRef": {"name": "absent", "key": "x"}}},
    ]
    from_ = [{"secretRef": {"name": "creds"}, "prefix": "S_"}, {"secretRef": {"name": "more"}}]
    container = {"name": "main", "command": ["true"], "env": env, "envFrom": from_}
    obj = pod([container])
    sandbox = Sandbox.create(tmp_path, "127.0.3.4", obj["spec"])
    sandbox.secrets.update({"creds": {"id": "k", "secret": "s"}, "more": {"A": "0", "B": "2"}})
    assert sandbox.environment(obj, container) == {
        "S_id": "k", "S_secret": "s", "A": "1", "B": "2", "KEY": "k",
    }  # fmt: skip


async def test_probe_and_hook_actions(tmp_path: Path) -> None:
    async def ok(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def bad(_: web.Request) -> web.Response:
        return web.Response(status=503)

    app = web.Application()
    app.router.add_get("/ok", ok)
    app.router.add_get("/bad", bad)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    container = {
        "name": "main",
        "command": ["true"],
        "ports": [{"name": "http", "containerPort": port}],
    }
    obj = pod([container])
    runtime = ProcessContainers(tmp_path)
    sandbox = Sandbox.create(tmp_path, "127.0.0.1", obj["spec"])

    async def run(handler: dict[str, Any]) -> bool:
        return await runtime.run_handler(obj, sandbox, container, handler, 5.0)

    try:
        assert await run({"httpGet": {"path": "/ok", "port": "http"}})
        assert not await run({"httpGet": {"path": "/bad", "port": port}})
        assert await run({"tcpSocket": {"port": port}})
        assert await run({"exec": {"command": ["python", "-c", "import sys; sys.exit(0)"]}})
        assert not await run({"exec": {"command": ["python", "-c", "import sys; sys.exit(1)"]}})
        assert await run({"sleep": {"seconds": 0}})
        with pytest.raises(ValueError, match="no port named"):
            await run({"httpGet": {"path": "/", "port": "nope"}})
        with pytest.raises(ValueError, match="unsupported"):
            await run({"grpc": {"port": port}})
    finally:
        await runner.cleanup()
    assert not await run({"tcpSocket": {"port": port}})  # nothing listens any more


async def test_a_container_is_a_process_and_a_signal_ends_it(tmp_path: Path) -> None:
    container = {"name": "main", "command": ["python", "-c", "import time; time.sleep(60)"]}
    obj = pod([container])
    runtime = ProcessContainers(tmp_path)
    sandbox = runtime.sandbox(obj)
    try:
        process = await runtime.start(obj, sandbox, container)
        assert process.id.startswith("process://")
        process.signal(signal.SIGKILL)
        assert await asyncio.wait_for(process.wait(), 30) == 128 + signal.SIGKILL
        assert (sandbox.root / "main.log").exists()
    finally:
        runtime.release(sandbox)


async def test_a_simulated_container_runs_until_signalled() -> None:
    runtime = SimulatedContainers()
    obj = pod([{"name": "main"}])
    sandbox = runtime.sandbox(obj)
    assert sandbox.address.startswith("10.244.")
    container = await runtime.start(obj, sandbox, {"name": "main"})
    assert await runtime.run_handler(obj, sandbox, {}, {"exec": {"command": ["x"]}}, 1.0)
    waiting = asyncio.create_task(container.wait())
    await asyncio.sleep(0)
    assert not waiting.done()
    container.signal(signal.SIGTERM)
    assert await waiting == 0


async def test_a_simulated_init_container_is_done_at_once() -> None:
    """A pod with an init container (the ModelDeployment's pre-pull) gets to its
    containers on a simulated node: the init container exits 0 when started."""
    runtime = SimulatedContainers()
    obj = pod([{"name": "main"}])
    obj["spec"]["initContainers"] = [{"name": "pre-pull"}]
    sandbox = runtime.sandbox(obj)
    init = await runtime.start(obj, sandbox, {"name": "pre-pull"})
    assert await asyncio.wait_for(init.wait(), 5) == 0
    main = await runtime.start(obj, sandbox, {"name": "main"})
    waiting = asyncio.create_task(main.wait())
    await asyncio.sleep(0)
    assert not waiting.done()
    main.signal(signal.SIGKILL)
    assert await waiting == 128 + signal.SIGKILL
