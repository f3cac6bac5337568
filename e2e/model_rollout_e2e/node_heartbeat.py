"""The node's heartbeat (:mod:`.node_agent`): its Lease in ``kube-node-lease`` renewed
every ``renew_s`` and its Ready condition set True again whenever the API shows
otherwise (the node-lifecycle controller sets it Unknown after a late renewal), as a
kubelet's node-lease and node-status loops do.

It runs on a thread with an event loop and API client of its own, as a kubelet renews
from a goroutine of its own: the pods' work on the agent's loop (a thousand simulated
pods on an overloaded machine) cannot hold a renewal back past the Lease's duration.
:attr:`NodeHeartbeat.max_gap_s` is the longest time between two renewals, to show it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.client.exceptions import ApiException

from .loop_thread import LoopThread
from .raw_api import json_call

log = logging.getLogger(__name__)
LEASE_NAMESPACE = "kube-node-lease"
LEASE_DURATION_S = 40  # a kubelet's
NODE_STATUS_REPORT_S = 300.0  # a kubelet's nodeStatusReportFrequency
_TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)
_PRESSURE = (("MemoryPressure", "Memory"), ("DiskPressure", "Disk"), ("PIDPressure", "PID"))


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _micro_time() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def node_conditions(since: dict[str, tuple[str, str]] | None = None) -> list[dict[str, str]]:
    """A healthy node's conditions; ``since``: each type's current (status,
    lastTransitionTime) on the API, kept where the status stays the same."""
    wanted = [(kind, "False", f"KubeletHasSufficient{what}", "") for kind, what in _PRESSURE]
    wanted.append(("Ready", "True", "KubeletReady", "the model-rollout node agent is running pods"))
    conditions = []
    for kind, status, reason, message in wanted:
        seen = (since or {}).get(kind)
        transition = seen[1] if seen is not None and seen[0] == status else now()
        condition = {"type": kind, "status": status, "reason": reason,
                     "lastHeartbeatTime": now(), "lastTransitionTime": transition}  # fmt: skip
        if message:
            condition["message"] = message
        conditions.append(condition)
    return conditions


class NodeHeartbeat:
    """``start()`` returns once the first renewal is done; ``stop()`` ends the thread."""

    def __init__(self, kubeconfig: Path, name: str, node_uid: str, renew_s: float) -> None:
        self.kubeconfig, self.name, self.node_uid = kubeconfig, name, node_uid
        self.renew_s = renew_s
        self.max_gap_s = 0.0
        self._last_renewal: float | None = None
        self._last_report = time.monotonic()  # the agent reported the node at registration
        self._thread = LoopThread(f"lease-{name}", self._serve)

    def start(self, timeout_s: float = 60.0) -> None:
        self._thread.start(
            timeout_s,
            late=f"node {self.name}: no first Lease renewal",
            failed=f"node {self.name}: Lease renewal failed",
        )

    def stop(self, timeout_s: float = 30.0) -> None:
        self._thread.stop(timeout_s)
        if self.max_gap_s:
            log.info("node %s: longest gap between Lease renewals %.1f s", self.name,
                     self.max_gap_s)  # fmt: skip

    async def _serve(self, ready: Callable[[], None], stopping: asyncio.Event) -> None:
        configuration = k8s.Configuration()
        await k8s_config.load_kube_config(
            config_file=str(self.kubeconfig), client_configuration=configuration
        )
        async with k8s.ApiClient(configuration) as api:
            coordination, core = k8s.CoordinationV1Api(api), k8s.CoreV1Api(api)
            await self._renew(coordination)
            ready()
            while True:
                try:
                    await asyncio.wait_for(stopping.wait(), self.renew_s)
                    return
                except asyncio.TimeoutError:
                    pass
                try:
                    await self._renew(coordination)
                    await self._report(core)
                except (ApiException, *_TRANSPORT_ERRORS) as exc:
                    log.warning("node %s: heartbeat failed: %r", self.name, exc)

    async def _renew(self, coordination: Any) -> None:
        spec = {"holderIdentity": self.name, "leaseDurationSeconds": LEASE_DURATION_S,
                "renewTime": _micro_time()}  # fmt: skip
        try:
            await json_call(
                coordination.patch_namespaced_lease(
                    self.name,
                    LEASE_NAMESPACE,
                    {"spec": spec},
                    _content_type="application/merge-patch+json",
                    _preload_content=False,
                )
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            owner = {"apiVersion": "v1", "kind": "Node", "name": self.name, "uid": self.node_uid}
            lease = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {
                    "name": self.name,
                    "namespace": LEASE_NAMESPACE,
                    "ownerReferences": [owner],
                },
                "spec": spec,
            }
            await json_call(
                coordination.create_namespaced_lease(LEASE_NAMESPACE, lease, _preload_content=False)
            )
        renewed = time.monotonic()
        if self._last_renewal is not None:
            self.max_gap_s = max(self.max_gap_s, renewed - self._last_renewal)
        self._last_renewal = renewed

    async def _report(self, core: Any) -> None:
        """Write the node's conditions when Ready is not True on the API, or every
        :data:`NODE_STATUS_REPORT_S` (its heartbeat)."""
        node = await json_call(core.read_node(self.name, _preload_content=False))
        seen = {
            c["type"]: (c["status"], c.get("lastTransitionTime", ""))
            for c in (node.get("status") or {}).get("conditions") or []
        }
        ready = seen.get("Ready", ("", ""))[0] == "True"
        if ready and time.monotonic() - self._last_report < NODE_STATUS_REPORT_S:
            return
        await json_call(
            core.patch_node_status(
                self.name,
                {"status": {"conditions": node_conditions(seen)}},
                _content_type="application/merge-patch+json",
                _preload_content=False,
            )
        )
        self._last_report = time.monotonic()
        if not ready:
            log.warning("node %s: Ready was %s on the API, set True again", self.name,
                        seen.get("Ready", ("absent",))[0])  # fmt: skip
