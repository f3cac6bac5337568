"""What runs the containers of the kubelet stand-in: a :class:`ContainerRuntime` (one
container at a time: :mod:`.container_runtime`, :mod:`.simulated_sidecar`,
:mod:`.simulated_traffic`) serves the node agent on a real API server
(:mod:`.node_agent`), which owns the pod's lifecycle itself: init containers, probes,
hooks, restarts and graceful termination.
"""

from __future__ import annotations

from typing import Any, Protocol

from .pod_sandbox import Sandbox


class Container(Protocol):
    """One started container (a process, or a simulated one)."""

    @property
    def id(self) -> str:
        """``containerID`` in the pod's status."""
        ...

    async def wait(self) -> int:
        """Its exit status, once it has exited."""
        ...

    def signal(self, signum: int) -> None:
        """SIGTERM or SIGKILL to it (and whatever it started); nothing if it has exited."""
        ...


class ContainerRuntime(Protocol):
    #: True: containers have no processes, so probes and hooks pass at once and there
    #: are no files to project (the scale mode)
    simulated: bool

    def sandbox(self, pod: dict[str, Any]) -> Sandbox:
        """The pod's IP and, for processes, its directory with a folder per volume."""
        ...

    def release(self, sandbox: Sandbox) -> None:
        """The pod is gone: its IP may be handed out again (its files stay, for tests)."""
        ...

    async def start(
        self, pod: dict[str, Any], sandbox: Sandbox, container: dict[str, Any]
    ) -> Container: ...

    async def run_handler(
        self,
        pod: dict[str, Any],
        sandbox: Sandbox,
        container: dict[str, Any],
        handler: dict[str, Any],
        timeout_s: float,
    ) -> bool:
        """A probe's or hook's action (``exec``, ``httpGet``, ``tcpSocket``, ``sleep``)
        against the container: did it succeed?"""
        ...
