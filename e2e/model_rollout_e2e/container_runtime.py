"""The node agent's two container runtimes (:class:`~.pod_runtime.ContainerRuntime`).

:class:`ProcessContainers` runs each container's command as a process on this machine in
the pod's :class:`~.pod_sandbox.Sandbox` (its own session, so a signal reaches whatever
it started; its output in ``<pod dir>/<container>.log``), and runs probes and hooks for
real. :class:`SimulatedContainers` starts nothing: a container runs until it is signalled
and every probe and hook passes at once, so a thousand pods cost no processes, no probe
loops and no files (the scale mode).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import urllib.parse
from pathlib import Path
from typing import Any

import aiohttp

from . import loopback
from .pod_sandbox import Sandbox
from .processes import die_with_parent

DEFAULT_PORT = 8080  # the port a pod's address is checked free for when it declares none


def _pod_dir(pod: dict[str, Any]) -> str:
    meta = pod["metadata"]
    return f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"


def _first_port(spec: dict[str, Any]) -> int:
    for container in spec.get("containers") or []:
        for port in container.get("ports") or []:
            return int(port["containerPort"])
    return DEFAULT_PORT


def resolve_port(container: dict[str, Any], port: int | str) -> int:
    """A probe's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for declared in container.get("ports") or []:
        if declared.get("name") == port:
            return int(declared["containerPort"])
    raise ValueError(f"container {container.get('name')!r} has no port named {port!r}")


class ProcessContainer:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @property
    def id(self) -> str:
        return f"process://{self.process.pid}"

    async def wait(self) -> int:
        """Its exit status; 128 + N when signal N ended it, as a container runtime says."""
        code = await self.process.wait()
        return 128 - code if code < 0 else code

    def signal(self, signum: int) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signum)


class ProcessContainers:
    simulated = False

    def __init__(
        self,
        work: Path,
        env: dict[str, str] | None = None,
        mounts: dict[str, Path] | None = None,
        api_server: str | None = None,
    ) -> None:
        """``env``: added to every container's environment (over this process's own);
        ``mounts``: container paths given host directories (secrets, PVCs);
        ``api_server``: the API server's URL, given to every container as
        ``KUBERNETES_SERVICE_HOST``/``PORT``, as a kubelet gives the ``kubernetes``
        Service's address (here the server's own: there is no Service network)."""
        self.work = work
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        if api_server is not None:
            address = urllib.parse.urlsplit(api_server)
            if address.scheme != "https" or not address.hostname or not address.port:
                raise ValueError(f"api_server must be https://host:port, not {api_server!r}")
            self.env["KUBERNETES_SERVICE_HOST"] = address.hostname
            self.env["KUBERNETES_SERVICE_PORT"] = str(address.port)
        self.mounts = mounts or {}

    def sandbox(self, pod: dict[str, Any]) -> Sandbox:
        spec = pod["spec"]
        address = loopback.allocate(_first_port(spec))
        return Sandbox.create(self.work / _pod_dir(pod), address, spec, self.mounts)

    def release(self, sandbox: Sandbox) -> None:
        loopback.release(sandbox.address)

    async def _spawn(
        self, pod: dict[str, Any], sandbox: Sandbox, container: dict[str, Any], log_name: str
    ) -> asyncio.subprocess.Process:
        sandbox.root.mkdir(parents=True, exist_ok=True)
        working_dir = container.get("workingDir")
        with (sandbox.root / log_name).open("ab") as log:
            return await asyncio.create_subprocess_exec(
                *sandbox.argv(container),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                env=sandbox.environment(pod, container, self.env),
                cwd=sandbox.host_path(working_dir) if working_dir else sandbox.root,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )

    async def start(
        self, pod: dict[str, Any], sandbox: Sandbox, container: dict[str, Any]
    ) -> ProcessContainer:
        return ProcessContainer(await self._spawn(pod, sandbox, container, log_name(container)))

    async def run_handler(
        self,
        pod: dict[str, Any],
        sandbox: Sandbox,
        container: dict[str, Any],
        handler: dict[str, Any],
        timeout_s: float,
    ) -> bool:
        if "sleep" in handler:
            await asyncio.sleep(float(handler["sleep"].get("seconds", 0)))
            return True
        if "exec" in handler:
            command = {**container, "command": handler["exec"]["command"], "args": []}
            process = await self._spawn(pod, sandbox, command, f"{container['name']}.exec.log")
            try:
                return await asyncio.wait_for(process.wait(), timeout_s) == 0
            except asyncio.TimeoutError:
                ProcessContainer(process).signal(signal.SIGKILL)
                await process.wait()
                return False
        if "httpGet" in handler:
            get = handler["httpGet"]
            host = get.get("host") or sandbox.address
            port = resolve_port(container, get["port"])
            url = f"{get.get('scheme', 'HTTP').lower()}://{host}:{port}{get.get('path', '/')}"
            headers = {h["name"]: h["value"] for h in get.get("httpHeaders") or []}
            try:
                async with (
                    aiohttp.ClientSession(
                        timeout=aiohttp.ClientTimeout(total=timeout_s)
                    ) as session,
                    session.get(url, headers=headers, ssl=False) as response,
                ):
                    return 200 <= response.status < 400  # as the kubelet judges it
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                return False
        if "tcpSocket" in handler:
            tcp = handler["tcpSocket"]
            port = resolve_port(container, tcp["port"])
            try:
                _, writer = await asyncio.wait_for(
                    asyncio.open_connection(tcp.get("host") or sandbox.address, port), timeout_s
                )
            except (asyncio.TimeoutError, OSError):
                return False
            writer.close()
            return True
        raise ValueError(f"unsupported probe or hook action: {sorted(handler)}")


def log_name(container: dict[str, Any]) -> str:
    return f"{container['name']}.log"


class SimulatedContainer:
    def __init__(self, number: int) -> None:
        self.number = number
        self._exited = asyncio.Event()
        self._status = 0

    @property
    def id(self) -> str:
        return f"simulated://{self.number}"

    async def wait(self) -> int:
        await self._exited.wait()
        return self._status

    def signal(self, signum: int) -> None:
        if not self._exited.is_set():  # SIGTERM: a clean exit; SIGKILL: 128 + 9
            self._status = 0 if signum == signal.SIGTERM else 128 + signum
            self._exited.set()


class SimulatedContainers:
    simulated = True

    def __init__(self) -> None:
        self._numbers = itertools.count(1)
        self._addresses = itertools.count(1)

    def sandbox(self, pod: dict[str, Any]) -> Sandbox:
        """An address of 10.244.0.0/16, as a cluster's pod network hands out (nothing
        listens on it)."""
        n = next(self._addresses) % (1 << 16)
        return Sandbox(Path(os.devnull), f"10.244.{n >> 8}.{n & 0xFF}")

    def release(self, sandbox: Sandbox) -> None:
        pass

    async def start(
        self, pod: dict[str, Any], sandbox: Sandbox, container: dict[str, Any]
    ) -> SimulatedContainer:
        """A container that runs until signalled; an init container's work is done at
        once (it exits 0), so the pod's containers start after it as they would."""
        started = SimulatedContainer(next(self._numbers))
        inits = (pod.get("spec") or {}).get("initContainers") or []
        if any(c.get("name") == container.get("name") for c in inits):
            started.signal(signal.SIGTERM)  # a clean exit: status 0
        return started

    async def run_handler(
        self,
        pod: dict[str, Any],
        sandbox: Sandbox,
        container: dict[str, Any],
        handler: dict[str, Any],
        timeout_s: float,
    ) -> bool:
        return True
