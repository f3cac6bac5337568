"""One pod's life on the node agent (:mod:`.node_agent`), as a kubelet's pod worker
lives it: init containers one after another to their end, then the containers; readiness
from each container's ``readinessProbe`` (``initialDelaySeconds``, ``periodSeconds``,
``successThreshold``, ``failureThreshold``, ``timeoutSeconds``; none: ready once
running); exits handled by ``restartPolicy`` (Always / OnFailure restart with a doubling
back-off, else the pod ends Succeeded or Failed); on graceful deletion each running
container's ``preStop`` hook, SIGTERM, SIGKILL at the end of the grace period, then the
pod's deletion with grace period 0. Status is written (a merge patch of ``status``) only
when it differs from what was last written, and again when the API shows other
conditions than were written (:meth:`PodWorker.resync`, the node's periodic status
sync). For tests, what a node does to a pod of its own accord: :meth:`PodWorker.evict`
(node-pressure eviction) and :meth:`PodWorker.fail_readiness` (the containers' readiness
probes failing from then on).

It waits on events, never polls: a simulated pod costs a few idle tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException

from .pod_runtime import Container, ContainerRuntime
from .pod_sandbox import Sandbox
from .pod_volumes import PodVolumes
from .raw_api import json_call

log = logging.getLogger(__name__)
MAX_BACKOFF_S = 300.0  # a kubelet's cap on the restart back-off
HOST_IP = "127.0.0.1"
MOUNT_RETRY_S, MAX_MOUNT_RETRY_S = 0.5, 8.0  # the back-off while a volume cannot be projected
TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class WorkerSettings:
    """What every pod worker of one node agent shares."""

    core: Any  # CoreV1Api, as the node
    runtime: ContainerRuntime
    volume_refresh_s: float
    token_max_age_s: float | None
    restart_backoff_s: float


@dataclass
class ContainerRun:
    spec: dict[str, Any]
    handle: Container | None = None
    state: dict[str, Any] = field(
        default_factory=lambda: {"waiting": {"reason": "PodInitializing"}}
    )
    last_state: dict[str, Any] = field(default_factory=dict)
    ready: bool = False
    restart_count: int = 0

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    @property
    def running(self) -> bool:
        return "running" in self.state

    def terminated(self, code: int) -> None:
        started = self.state.get("running", {}).get("startedAt", now())
        self.state = {
            "terminated": {
                "exitCode": code,
                "reason": "Completed" if code == 0 else "Error",
                "startedAt": started,
                "finishedAt": now(),
                **({"containerID": self.handle.id} if self.handle else {}),
            }
        }
        self.ready = False

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": "",
            "ready": self.ready,
            "started": self.running,
            "restartCount": self.restart_count,
            "state": self.state,
            "lastState": self.last_state,
        }
        if self.handle is not None:
            status["containerID"] = self.handle.id
        return status


class PodWorker:
    def __init__(self, settings: WorkerSettings, pod: dict[str, Any]) -> None:
        self.settings = settings
        self.runtime = settings.runtime
        self.pod = pod
        self.uid = str(pod["metadata"]["uid"])
        spec = pod["spec"]
        self.inits = [ContainerRun(c) for c in spec.get("initContainers") or []]
        self.containers = [ContainerRun(c) for c in spec.get("containers") or []]
        self.restart_policy = spec.get("restartPolicy", "Always")
        self.phase = "Pending"
        self.initialized = not self.inits
        self.sandbox: Sandbox | None = None
        self.volumes: PodVolumes | None = None
        self.terminating = False
        self._deleting = asyncio.Event()
        self._ended = asyncio.Event()  # every container exited for good
        self._lock = asyncio.Lock()
        self._written: dict[str, Any] | None = None
        self._written_version: str | None = None  # the pod's resourceVersion after the write
        self._transitions: dict[str, tuple[str, str]] = {}
        self._start_time = now()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._probes: dict[str, asyncio.Task[Any]] = {}
        self._evicted = asyncio.Event()
        self.reason: str | None = None  # the pod's status.reason and .message (eviction)
        self.message: str | None = None
        self.readiness_fails = False
        self.update(pod)

    @property
    def name(self) -> str:
        return str(self.pod["metadata"]["name"])

    @property
    def namespace(self) -> str:
        return str(self.pod["metadata"]["namespace"])

    def update(self, pod: dict[str, Any]) -> None:
        """The pod's latest object from the watch."""
        self.pod = pod
        if pod["metadata"].get("deletionTimestamp"):
            self._deleting.set()

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- the whole life ------------------------------------------------------------------

    async def run(self) -> None:
        try:
            if self._deleting.is_set():  # deleted before this node ran it: nothing to start
                await self._terminate()
                return
            life = self._spawn(self._live())
            deleting = self._spawn(self._deleting.wait())
            evicted = self._spawn(self._evicted.wait())
            await asyncio.wait({life, deleting, evicted}, return_when=asyncio.FIRST_COMPLETED)
            if life.done() and not life.cancelled() and life.exception() is not None:
                log.error(
                    "pod %s/%s: cannot run it", self.namespace, self.name,
                    exc_info=life.exception(),
                )  # fmt: skip
            if evicted.done() and not deleting.done():
                await self._evict(keep={deleting, evicted})
            if not deleting.done():  # ended (Succeeded / Failed): kept until deleted
                await deleting
            life.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await life
            await self._terminate()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("pod %s/%s: worker failed", self.namespace, self.name)
        finally:
            await self._kill_all()

    async def _live(self) -> None:
        self.sandbox = self.runtime.sandbox(self.pod)
        for run in self.containers:
            run.state = {"waiting": {"reason": "ContainerCreating"}}
        await self.publish()
        if not self.runtime.simulated:
            self.volumes = PodVolumes(
                self.settings.core, self.sandbox, self.settings.token_max_age_s
            )
            await self._mount_volumes()  # before any container runs
            self._spawn(self._refresh_volumes())
        for run in self.inits:
            if not await self._run_init(run):
                await self._end()
                return
        self.initialized = True
        for run in self.containers:
            await self._launch(run)
            self._spawn(self._supervise(run))
        self.phase = "Running"
        await self.publish()
        await self._ended.wait()
        await self._end()

    async def _end(self) -> None:
        every = self.inits + self.containers
        failed = any(r.state.get("terminated", {}).get("exitCode", 0) != 0 for r in every)
        self.phase = "Failed" if failed else "Succeeded"
        await self.publish()

    def _backoff(self, run: ContainerRun) -> float:
        return min(self.settings.restart_backoff_s * 2 ** min(run.restart_count - 1, 10),
                   MAX_BACKOFF_S)  # fmt: skip

    async def _back_off(self, run: ContainerRun) -> None:
        run.last_state, run.state = run.state, {}
        run.restart_count += 1
        delay = self._backoff(run)
        run.state = {
            "waiting": {
                "reason": "CrashLoopBackOff",
                "message": f"back-off {delay:g}s restarting failed container={run.name}",
            }
        }
        await self.publish()
        await asyncio.sleep(delay)

    async def _run_init(self, run: ContainerRun) -> bool:
        """The init container to its end, again after a back-off while it fails (unless
        restartPolicy is Never): did it succeed?"""
        while True:
            await self._launch(run)
            await self.publish()
            assert run.handle is not None
            code = await run.handle.wait()
            run.terminated(code)
            if code == 0:
                return True
            if self.restart_policy == "Never":
                return False
            await self._back_off(run)

    async def _launch(self, run: ContainerRun) -> None:
        assert self.sandbox is not None
        try:
            run.handle = await self.runtime.start(self.pod, self.sandbox, run.spec)
        except (OSError, ValueError) as exc:  # no such program, no command: as a kubelet says
            run.state = {"waiting": {"reason": "RunContainerError", "message": str(exc)}}
            await self.publish()
            raise
        run.state = {"running": {"startedAt": now()}}
        if run in self.containers:
            probe = run.spec.get("readinessProbe")
            if probe is None or self.runtime.simulated:
                run.ready = not self.readiness_fails
            else:
                self._probes[run.name] = self._spawn(self._probe(run, probe))

    async def _supervise(self, run: ContainerRun) -> None:
        while True:
            assert run.handle is not None
            code = await run.handle.wait()
            if self.terminating:
                return
            probe = self._probes.pop(run.name, None)
            if probe is not None:
                probe.cancel()
            run.terminated(code)
            policy = self.restart_policy
            if policy == "Always" or (policy == "OnFailure" and code != 0):
                while True:
                    await self._back_off(run)
                    with contextlib.suppress(OSError, ValueError):  # RunContainerError
                        await self._launch(run)
                        break
                await self.publish()
                continue
            await self.publish()
            if not any(r.running for r in self.containers):
                self._ended.set()
            return

    async def _probe(self, run: ContainerRun, probe: dict[str, Any]) -> None:
        assert self.sandbox is not None
        await asyncio.sleep(float(probe.get("initialDelaySeconds", 0)))
        period = float(probe.get("periodSeconds", 10))
        timeout = float(probe.get("timeoutSeconds", 1))
        needed_ok = int(probe.get("successThreshold", 1))
        needed_fail = int(probe.get("failureThreshold", 3))
        successes = failures = 0
        while True:
            try:
                ok = await self.runtime.run_handler(
                    self.pod, self.sandbox, run.spec, probe, timeout
                )
            except (ValueError, OSError) as exc:  # a probe that cannot run: a failure
                log.error("pod %s: readiness probe of %s: %s", self.name, run.name, exc)
                ok = False
            ok = ok and not self.readiness_fails
            successes, failures = (successes + 1, 0) if ok else (0, failures + 1)
            if ok and successes >= needed_ok and not run.ready:
                run.ready = True
                await self.publish()
            elif not ok and failures >= needed_fail and run.ready:
                run.ready = False
                await self.publish()
            await asyncio.sleep(period)

    async def _mount_volumes(self) -> None:
        """Project the volumes, again after a back-off while the API refuses (a ConfigMap
        not there yet; just after binding, the Node authorizer not yet knowing the pod),
        as a kubelet's volume manager retries a mount: the pod stays ContainerCreating."""
        assert self.volumes is not None
        delay = MOUNT_RETRY_S
        while True:
            try:
                await self.volumes.project(self.pod)
                return
            except (ApiException, *TRANSPORT_ERRORS) as exc:
                reason = getattr(exc, "reason", None) or repr(exc)
                log.warning("pod %s/%s: volumes not ready: %s", self.namespace, self.name, reason)
            await asyncio.sleep(delay)
            delay = min(2 * delay, MAX_MOUNT_RETRY_S)

    async def _refresh_volumes(self) -> None:
        """The kubelet's periodic sync of the pod's volumes, each after the period and a
        random half of it more (a kubelet's resync jitter), so pods started together do
        not refresh together."""
        assert self.volumes is not None
        while True:
            await asyncio.sleep(self.settings.volume_refresh_s * random.uniform(1.0, 1.5))
            try:
                await self.volumes.project(self.pod)
            except Exception:
                log.exception("pod %s/%s: projecting volumes", self.namespace, self.name)

    # -- what the node does of its own accord ---------------------------------------------

    def evict(self, message: str) -> None:
        """Node-pressure eviction, as a kubelet's eviction manager does it at a hard
        threshold: every container killed at once (no grace period), the pod ``Failed``
        with reason ``Evicted`` and ``message``, and kept: its controller replaces it
        (a Failed pod is no replica), the object stays until deleted."""
        self.message = message
        self._evicted.set()

    def fail_readiness(self) -> None:
        """From now on every container's readiness probe fails (a simulated pod's, which
        runs none, too): the pod stays Running, not Ready."""
        self.readiness_fails = True
        for run in self.containers:
            run.ready = False
        if self.sandbox is not None:
            self._spawn(self.publish())

    async def _evict(self, keep: set[asyncio.Task[Any]]) -> None:
        self.terminating = True  # no restart of what is killed
        others = [t for t in self._tasks if t not in keep]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        for run in self.inits + self.containers:
            if run.handle is not None and run.running:
                run.handle.signal(signal.SIGKILL)
                run.terminated(await run.handle.wait())
        self.phase, self.reason = "Failed", "Evicted"
        log.info("pod %s/%s: evicted: %s", self.namespace, self.name, self.message)
        if self.sandbox is not None:
            await self.publish()

    # -- deletion ------------------------------------------------------------------------

    async def _terminate(self) -> None:
        """preStop, SIGTERM, SIGKILL at the end of the grace period; then the final
        status and the deletion with grace period 0, as a kubelet ends a pod."""
        self.terminating = True
        for task in list(self._tasks):  # probes, restarts, volume syncs: no new process
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        meta = self.pod["metadata"]
        grace = meta.get("deletionGracePeriodSeconds")
        if grace is None:
            grace = self.pod["spec"].get("terminationGracePeriodSeconds", 30)
        deadline = asyncio.get_running_loop().time() + float(grace)
        await asyncio.gather(
            *(self._stop(run, deadline) for run in self.inits + self.containers if run.running)
        )
        if self.sandbox is not None and self.phase not in ("Succeeded", "Failed"):
            await self._end()
        try:
            await json_call(
                self.settings.core.delete_namespaced_pod(
                    self.name,
                    self.namespace,
                    body={"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}},
                    _preload_content=False,
                )
            )
        except ApiException as exc:
            if exc.status not in (404, 409):  # gone, or a new pod of that name
                raise

    async def _stop(self, run: ContainerRun, deadline: float) -> None:
        assert run.handle is not None and self.sandbox is not None
        loop = asyncio.get_running_loop()
        hook = (run.spec.get("lifecycle") or {}).get("preStop")
        if hook is not None and deadline > loop.time():
            try:
                remaining = deadline - loop.time()
                await asyncio.wait_for(
                    self.runtime.run_handler(self.pod, self.sandbox, run.spec, hook, remaining),
                    remaining,
                )
            except (asyncio.TimeoutError, ValueError, OSError) as exc:
                log.warning("pod %s: preStop of %s: %r", self.name, run.name, exc)
        run.handle.signal(signal.SIGTERM)
        try:
            code = await asyncio.wait_for(run.handle.wait(), max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            run.handle.signal(signal.SIGKILL)
            code = await run.handle.wait()
        run.terminated(code)

    async def _kill_all(self) -> None:
        """Whatever still runs is killed (the agent stops, or the pod vanished)."""
        for task in list(self._tasks):
            task.cancel()
        for run in self.inits + self.containers:
            if run.handle is not None and run.running:
                run.handle.signal(signal.SIGKILL)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(run.handle.wait(), 10)
        if self.sandbox is not None:
            self.runtime.release(self.sandbox)

    # -- status --------------------------------------------------------------------------

    def _condition(self, kind: str, true: bool) -> dict[str, str]:
        value = "True" if true else "False"
        seen = self._transitions.get(kind)
        if seen is None or seen[0] != value:
            self._transitions[kind] = seen = (value, now())
        return {"type": kind, "status": value, "lastTransitionTime": seen[1]}

    def status(self) -> dict[str, Any]:
        assert self.sandbox is not None
        ready = self.phase == "Running" and all(r.ready for r in self.containers)
        status: dict[str, Any] = {
            "phase": self.phase,
            "conditions": [
                self._condition("PodReadyToStartContainers", True),
                self._condition("PodScheduled", True),
                self._condition("Initialized", self.initialized),
                self._condition("ContainersReady", ready),
                self._condition("Ready", ready),
            ],
            "hostIP": HOST_IP,
            "hostIPs": [{"ip": HOST_IP}],
            "podIP": self.sandbox.address,
            "podIPs": [{"ip": self.sandbox.address}],
            "startTime": self._start_time,
            "containerStatuses": [r.status() for r in self.containers],
        }
        if self.reason is not None:
            status["reason"], status["message"] = self.reason, self.message or ""
        if self.inits:
            status["initContainerStatuses"] = [r.status() for r in self.inits]
        return status

    def drifted(self) -> bool:
        """The watch's latest pod, no older than this worker's last status write, shows
        another phase or status of a condition that write set (the node-lifecycle
        controller's ``Ready=False``). Older objects are skipped: the watch not yet caught
        up with the write is no drift."""
        written, version = self._written, self._written_version
        if written is None or version is None:
            return False
        seen = self.pod["metadata"].get("resourceVersion")
        if seen is None or not _at_least(str(seen), version):
            return False
        status = self.pod.get("status") or {}
        conditions = {c["type"]: c.get("status") for c in status.get("conditions") or []}
        return status.get("phase") != written["phase"] or any(
            conditions.get(c["type"]) != c["status"] for c in written["conditions"]
        )

    def resync(self) -> None:
        """Write the status again even though it did not change here."""

        async def rewrite() -> None:
            async with self._lock:
                self._written = None
            await self.publish()

        self._spawn(rewrite())

    async def publish(self, attempts: int = 5) -> None:
        """Write the status if it changed since the last write (retried a few times)."""
        async with self._lock:
            status = self.status()
            for attempt in range(attempts):
                if status == self._written:
                    return
                try:
                    written = await json_call(
                        self.settings.core.patch_namespaced_pod_status(
                            self.name,
                            self.namespace,
                            {"status": status},
                            _content_type="application/merge-patch+json",
                            _preload_content=False,
                        )
                    )
                    self._written = status
                    self._written_version = (written.get("metadata") or {}).get("resourceVersion")
                    return
                except ApiException as exc:
                    if exc.status == 404:
                        return
                    log.warning("pod %s: status write failed: %s", self.name, exc.reason)
                await asyncio.sleep(0.5 * 2**attempt)


def _at_least(version: str, other: str) -> bool:
    """``version`` is ``other`` or later: one etcd's resourceVersions are its revisions,
    increasing integers (an API server backed by something else: equal only)."""
    try:
        return int(version) >= int(other)
    except ValueError:
        return version == other
