"""The operator's pods on a simulated node (:mod:`.node_agent` without processes), with
what their sidecars do through the API faked faithfully: the real operator then rolls
out, promotes, aborts and retries on a real API server with hundreds of pods and no
model store, server or process.

:class:`SimulatedModelContainers` is the node agent's container runtime for them::

    behaviour = SidecarBehaviour(refuse={"v3": "bad_signature"})
    NodeAgent(kubeconfig, SimulatedModelContainers(kubeconfig, behaviour), name)

By container (read from its command line, as the operator writes it):

* ``model-sidecar init`` (the pre-pull): the track's target (the pod annotation when it
  names a valid version, else the ConfigMap's key, read as the kubelet reads a projected
  ConfigMap) is "fetched" for ``fetch_s`` and the container ends with 0; the server
  starts serving it (with a canary's stable version beside it). A target the behaviour
  refuses, or none, ends it with 1 (the node agent restarts it with back-off).
* ``model-sidecar watch``: a :class:`SimulatedSidecar` acts as the real one does with
  the API: as the pod's ServiceAccount, with a TokenRequest token bound to the pod
  (what the kubelet projects into the pod's api-access volume; renewed at 80 % of its
  life), it reads and watches its own pod and writes its track's report annotation
  (``SidecarReport``) with a merge patch, so RBAC and the chart's sidecar admission
  policy judge its writes as they judge a real sidecar's. Reports, as
  ``model_sidecar.watch`` makes them: ``fetching`` then, after ``fetch_s``, ``loading``
  then, after ``load_s``, ``ok`` for a new target; ``ok`` at once for a version the
  server still holds (a pointer swap); ``fetching`` then ``refused`` with the
  behaviour's code for a refused version, not tried again until the target changes or
  the sidecar's ``--backoff-max-seconds`` passed; ``error``/``no_target`` without a
  target; the ``bad_policy`` code beside ``ok`` for a traffic annotation that is not a
  policy. ``retained`` is what the server holds besides (``--retain`` of the server
  container, a canary's stable version), ``target_seen_at`` when the target was first
  seen; an unchanged report is not written again (the real sidecar heartbeats its status
  file only, and patches its pod's annotation for news), unless ``heartbeat_s`` is set.
* any other container (the server) runs until signalled; its probes pass at once.

Not simulated: the model store (any version but a refused one exists), signatures,
traffic (a canary's server answers nothing: no ``/metrics`` for the canary analysis),
start jitter, and the sidecar's fall-back to the Downward API file while the API is
unreachable (a failed write is retried on the next cycle instead).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.client.exceptions import ApiException

from model_rollout_contract import defaults
from model_rollout_contract.canary import InvalidPolicy, TrafficPolicy
from model_rollout_contract.names import is_valid_name
from model_rollout_contract.report import SidecarReport
from model_rollout_contract.states import SidecarState
from model_rollout_contract.tracks import TrackKeys, track_keys

from .container_runtime import SimulatedContainers
from .pod_runtime import Container
from .pod_sandbox import Sandbox
from .pod_volumes import DEFAULT_TOKEN_SECONDS, REFRESH_AT
from .raw_api import WatchGone, json_call, watch_events

log = logging.getLogger(__name__)
WATCH_TIMEOUT_S = 300  # the sidecar's pod watch, resumed when the server ends it
RETRY_S = 1.0  # after a failed API call: the next cycle
_TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)
# what the real sidecar says for the refusals a test is likely to ask for
REASONS = {
    "bad_signature": "manifest signature does not verify",
    "not_found": "the version is not in the model store",
    "size_mismatch": "the model file's size is not the manifest's",
    "digest_mismatch": "the model file's sha256 is not the manifest's",
    "server_refused": "the server could not load the model",
}


@dataclass(frozen=True)
class SidecarBehaviour:
    """How the simulated sidecars of a node behave (every pod alike)."""

    fetch_s: float = 0.1  # download and verification of a version
    load_s: float = 0.2  # the server's load and warm-up of it
    refuse: Mapping[str, str] = field(default_factory=dict)  # version -> refusal code
    heartbeat_s: float | None = None  # a period to rewrite an unchanged report (None: never)
    config_refresh_s: float = 60.0  # the kubelet's refresh of the projected ConfigMap

    def refusal(self, model: str, version: str) -> tuple[str, str] | None:
        """(code, reason as the real sidecar words it) when ``version`` is refused."""
        code = self.refuse.get(version)
        if code is None:
            return None
        return code, f"{code}: {model}:{version}: {REASONS.get(code, 'refused')}"


@dataclass(frozen=True)
class SidecarCommand:
    """A ``model-sidecar`` container's command line, as far as the simulation needs it."""

    mode: str  # init | watch
    model: str  # the model key: ``name``, or ``tenant/name`` for a tenant's track
    track: str | None
    configmap_key: str  # the key of the ConfigMap its --configmap-file projects
    refused_retry_s: float  # --backoff-max-seconds: a refused target is tried again after

    @property
    def keys(self) -> TrackKeys:
        return track_keys(self.track)


def _flags(words: list[str]) -> dict[str, str]:
    """``--flag value`` pairs (a flag followed by another flag has the value "")."""
    flags: dict[str, str] = {}
    for i, word in enumerate(words):
        if word.startswith("--"):
            following = words[i + 1] if i + 1 < len(words) else ""
            flags[word] = "" if following.startswith("--") else following
    return flags


def _words(container: Mapping[str, Any]) -> list[str]:
    return [*(container.get("command") or []), *(container.get("args") or [])]


def sidecar_command(container: Mapping[str, Any]) -> SidecarCommand | None:
    """The container's sidecar command, or ``None`` for another container."""
    words = _words(container)
    if len(words) < 2 or words[0] != "model-sidecar" or words[1] not in ("init", "watch"):
        return None
    flags = _flags(words[2:])
    if not flags.get("--model") or not flags.get("--configmap-file"):
        raise ValueError(f"container {container.get('name')!r}: no --model or --configmap-file")
    return SidecarCommand(
        words[1],
        flags["--model"],
        flags.get("--track") or None,
        Path(flags["--configmap-file"]).name,
        float(flags.get("--backoff-max-seconds") or defaults.BACKOFF_MAX_SECONDS),
    )


def server_retain(pod: Mapping[str, Any]) -> int:
    """How many versions the pod's server keeps loaded (its ``--retain``)."""
    for container in pod["spec"].get("containers") or []:
        words = _words(container)
        if words[:1] == ["model-server"]:
            return int(_flags(words[1:]).get("--retain") or defaults.RETAIN_VERSIONS)
    return defaults.RETAIN_VERSIONS


def _digest(model: str, version: str) -> str:
    """A stand-in for the version's sha256 (the report carries one once it is known)."""
    return hashlib.sha256(f"{model}:{version}".encode()).hexdigest()


def _policy(
    annotations: Mapping[str, str], keys: TrackKeys
) -> tuple[TrafficPolicy | None, str | None]:
    """The pod's traffic policy for the track, and why it was ignored (``bad_policy``)."""
    text = annotations.get(keys.traffic)
    if text is None:
        return None, None
    try:
        policy = TrafficPolicy.from_annotation(text)
    except InvalidPolicy as exc:
        return None, f"pod annotation {keys.traffic} ignored: {exc}"
    if policy.stable == policy.candidate:
        return (
            None,
            f"pod annotation {keys.traffic} ignored: "
            f"stable and candidate are both {policy.stable!r}",
        )
    return policy, None


@dataclass
class PodServer:
    """What one pod's server holds, per track (model): the versions it serves and keeps
    loaded besides, most recent first (``retain`` in all)."""

    retain: int
    serving: dict[str | None, str] = field(default_factory=dict)
    retained: dict[str | None, tuple[str, ...]] = field(default_factory=dict)

    def holds(self, track: str | None, version: str) -> bool:
        return self.serving.get(track) == version or version in self.retained.get(track, ())

    def swap(self, track: str | None, version: str, keep: tuple[str, ...] = ()) -> None:
        """Serve ``version``; the one served before (and ``keep``) stay loaded beside it
        while ``retain`` allows, the oldest evicted first."""
        before = self.serving.get(track)
        held = [*keep, *([before] if before else []), *self.retained.get(track, ())]
        kept = tuple(dict.fromkeys(v for v in held if v != version))
        self.serving[track] = version
        self.retained[track] = kept[: max(self.retain - 1, 0)]


class TaskContainer:
    """A simulated container whose life is a coroutine: its exit status is the
    coroutine's result; SIGTERM ends it cleanly (0), SIGKILL with 137."""

    def __init__(self, number: int, life: Awaitable[int]) -> None:
        self.number = number
        self._task: asyncio.Task[int] = asyncio.ensure_future(life)
        self._signalled: int | None = None

    @property
    def id(self) -> str:
        return f"simulated://model-{self.number}"

    async def wait(self) -> int:
        try:
            return await asyncio.shield(self._task)
        except asyncio.CancelledError:
            if self._task.cancelled():  # ended by a signal
                return 0 if self._signalled == signal.SIGTERM else 128 + signal.SIGKILL
            raise
        except Exception:  # a crash of the simulation: the container failed
            log.exception("simulated container %s failed", self.id)
            return 1

    def signal(self, signum: int) -> None:
        if not self._task.done():
            self._signalled = signum
            self._task.cancel()


class _NodeApi:
    """The node's own client (its kubeconfig), open while a container needs it: for
    ServiceAccount tokens and projected ConfigMaps, as the kubelet gets them."""

    def __init__(self, kubeconfig: Path) -> None:
        self.kubeconfig = kubeconfig
        self.host = ""
        self.ca: str | None = None
        self._api: k8s.ApiClient | None = None
        self._core: Any = None
        self._users = 0
        self._lock = asyncio.Lock()

    async def endpoint(self) -> tuple[str, str | None]:
        """The API server's URL and the CA file that verifies it."""
        if not self.host:
            async with self.core():
                pass
        return self.host, self.ca

    @contextlib.asynccontextmanager
    async def core(self) -> AsyncIterator[Any]:
        async with self._lock:
            self._users += 1
            if self._api is None:
                configuration = k8s.Configuration()
                await k8s_config.load_kube_config(
                    config_file=str(self.kubeconfig), client_configuration=configuration
                )
                self.host, self.ca = str(configuration.host), configuration.ssl_ca_cert
                self._api = k8s.ApiClient(configuration)
                self._core = k8s.CoreV1Api(self._api)
        try:
            yield self._core
        finally:
            async with self._lock:
                self._users -= 1
                if self._users == 0 and self._api is not None:
                    await self._api.close()
                    self._api = self._core = None

    async def config_map_value(self, pod: Mapping[str, Any], key: str) -> str | None:
        """``key`` of the pod's ConfigMap volume (the deployment's default version)."""
        names = [
            v["configMap"]["name"] for v in pod["spec"].get("volumes") or [] if "configMap" in v
        ]
        async with self.core() as core:
            for name in names:
                try:
                    config_map = await json_call(
                        core.read_namespaced_config_map(
                            name, pod["metadata"]["namespace"], _preload_content=False
                        )
                    )
                except ApiException as exc:
                    if exc.status == 404:
                        continue
                    raise
                value = (config_map.get("data") or {}).get(key)
                if value is not None:
                    return str(value).strip()
        return None

    async def token(self, pod: Mapping[str, Any]) -> tuple[str, float]:
        """A token of the pod's ServiceAccount bound to the pod, with the lifetime its
        api-access volume asks for; (token, seconds)."""
        seconds = DEFAULT_TOKEN_SECONDS
        for volume in pod["spec"].get("volumes") or []:
            for source in (volume.get("projected") or {}).get("sources") or []:
                if "serviceAccountToken" in source:
                    seconds = int(source["serviceAccountToken"].get("expirationSeconds") or seconds)
        meta = pod["metadata"]
        request = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": seconds,
                "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                                   "uid": meta["uid"]},
            },
        }  # fmt: skip
        async with self.core() as core:
            answer = await json_call(
                core.create_namespaced_service_account_token(
                    pod["spec"].get("serviceAccountName") or "default",
                    meta["namespace"],
                    request,
                    _preload_content=False,
                )
            )
        return str(answer["status"]["token"]), float(seconds)


class SimulatedSidecar:
    """One ``model-sidecar watch`` container of one pod (see the module's docstring)."""

    def __init__(
        self,
        node: _NodeApi,
        behaviour: SidecarBehaviour,
        pod: Mapping[str, Any],
        command: SidecarCommand,
        server: PodServer,
    ) -> None:
        self.node, self.behaviour, self.command, self.server = node, behaviour, command, server
        self.pod = pod
        self.name, self.namespace = pod["metadata"]["name"], pod["metadata"]["namespace"]
        self.keys = command.keys
        self.annotations: dict[str, str] = dict(pod["metadata"].get("annotations") or {})
        self.changed = asyncio.Event()
        self.last: SidecarReport | None = None
        self._written_at = 0.0  # monotonic time of the last write of ``last``
        self._dirty = False  # the last report was not written
        self._target: str | None = None
        self._target_seen_at: float | None = None
        self._refused: dict[str, float] = {}  # version -> monotonic time it was refused
        self._config: tuple[str | None, float] = (None, float("-inf"))  # value, read at
        self._token: tuple[str, float] = ("", 0.0)  # token, monotonic time to renew it
        self._core: Any = None

    # -- its life ------------------------------------------------------------------------

    async def run(self) -> int:
        configuration = k8s.Configuration()
        # the API server's address and CA, as the kubelet gives them to a pod
        configuration.host, configuration.ssl_ca_cert = await self.node.endpoint()
        configuration.refresh_api_key_hook = self._refresh_token
        configuration.api_key["BearerToken"] = ""
        configuration.connection_pool_maxsize = 4  # its watch, its reads and writes
        api = k8s.ApiClient(configuration)
        self._core = k8s.CoreV1Api(api)
        watch = asyncio.create_task(self._follow())
        try:
            while True:
                self.changed.clear()
                try:
                    await self._cycle()
                    delay = self._idle_for()
                except (ApiException, *_TRANSPORT_ERRORS) as exc:
                    log.warning(
                        "simulated sidecar of %s/%s: %s", self.namespace, self.name, _why(exc)
                    )
                    delay = RETRY_S
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), delay)
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
            await api.close()

    async def _refresh_token(self, configuration: k8s.Configuration) -> None:
        """As the kubelet rotates the projected token: renewed at 80 % of its life."""
        token, renew_at = self._token
        if token and time.monotonic() < renew_at:
            return
        token, seconds = await self.node.token(self.pod)
        self._token = (token, time.monotonic() + REFRESH_AT * seconds)
        configuration.api_key["BearerToken"] = f"Bearer {token}"

    def _idle_for(self) -> float:
        """Until the next heartbeat, refused version's retry or ConfigMap refresh."""
        waits = [self.behaviour.config_refresh_s]
        if self.behaviour.heartbeat_s is not None:
            waits.append(self.behaviour.heartbeat_s - (time.monotonic() - self._written_at))
        if self._dirty:
            waits.append(RETRY_S)
        now = time.monotonic()
        waits += [at + self.command.refused_retry_s - now for at in self._refused.values()]
        return max(min(waits), 0.05)

    # -- following its pod ---------------------------------------------------------------

    async def _follow(self) -> None:
        """Read the pod, then watch it (a watch by name: the verb ``watch``); resume when
        the server ends the watch, read it again after 410 Gone or a failure."""
        version: str | None = None
        while True:
            try:
                if version is None:
                    pod = await json_call(
                        self._core.read_namespaced_pod(
                            self.name, self.namespace, _preload_content=False
                        )
                    )
                    self._seen(pod)
                    version = str(pod["metadata"]["resourceVersion"])
                async for kind, pod in watch_events(await self._watch(version)):
                    if kind not in ("ADDED", "MODIFIED", "BOOKMARK"):
                        continue  # a deletion is no change to follow
                    version = str(pod["metadata"].get("resourceVersion") or version)
                    if kind != "BOOKMARK":
                        self._seen(pod)
            except WatchGone:
                version = None
            except (ApiException, *_TRANSPORT_ERRORS, json.JSONDecodeError) as exc:
                log.warning(
                    "simulated sidecar of %s/%s: pod watch: %s",
                    self.namespace,
                    self.name,
                    _why(exc),
                )
                version = None
                await asyncio.sleep(RETRY_S)

    async def _watch(self, resource_version: str) -> Any:
        """The watch's response, for :func:`~.raw_api.watch_events`."""
        return await self._core.list_namespaced_pod(
            self.namespace,
            field_selector=f"metadata.name={self.name}",
            watch="true",
            resource_version=resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=WATCH_TIMEOUT_S,
            _preload_content=False,
            _request_timeout=WATCH_TIMEOUT_S + 30,
        )

    def _seen(self, pod: Mapping[str, Any]) -> None:
        """The pod as the API shows it now: a new cycle when the track's target,
        previous version or traffic policy changed (not for its own report)."""
        before = self.annotations
        self.annotations = dict((pod.get("metadata") or {}).get("annotations") or {})
        if any(before.get(key) != self.annotations.get(key) for key in self.keys.followed):
            self.changed.set()

    # -- one cycle, as model_sidecar.watch.Watcher._step ---------------------------------

    async def _target_now(self) -> str | None:
        value = self.annotations.get(self.keys.target)
        if is_valid_name(value):
            return value
        config, read_at = self._config
        if time.monotonic() - read_at >= self.behaviour.config_refresh_s:
            config = await self.node.config_map_value(self.pod, self.command.configmap_key)
            self._config = (config, time.monotonic())
        return config if is_valid_name(config) else None

    async def _cycle(self) -> None:
        track, model = self.command.track, self.command.model
        policy, problem = _policy(self.annotations, self.keys)
        target = await self._target_now()
        if target != self._target or self._target_seen_at is None:
            self._refused.pop(target or "", None)  # a new target deserves a fresh attempt
            self._target, self._target_seen_at = target, time.time()
        serving = self.server.serving.get(track)
        if target is None:
            state = SidecarState.OK if serving else SidecarState.ERROR
            code = None if serving else "no_target"
            await self._report(
                None,
                serving,
                state,
                None if serving else "no target version set",
                code=code,
                problem=problem,
            )
            return
        if serving == target:
            await self._report(
                target, serving, SidecarState.OK, sha256=_digest(model, target), problem=problem
            )
            return
        refused_at = self._refused.get(target)
        if refused_at is not None and time.monotonic() - refused_at < self.command.refused_retry_s:
            await self._heartbeat()
            return
        carries = policy is not None and policy.candidate == target
        if self.server.holds(track, target) and not carries:  # a pointer swap
            self.server.swap(track, target)
            await self._report(  # with the digest, as the real sidecar's swap reports it
                target, target, SidecarState.OK, sha256=_digest(model, target), problem=problem
            )
            return
        await self._report(target, serving, SidecarState.FETCHING, problem=problem)
        await asyncio.sleep(self.behaviour.fetch_s)
        refusal = self.behaviour.refusal(model, target)
        if refusal is not None:
            self._refused[target] = time.monotonic()
            code, reason = refusal
            await self._report(target, serving, SidecarState.REFUSED, reason, code=code)
            return
        sha256 = _digest(model, target)
        await self._report(target, serving, SidecarState.LOADING, sha256=sha256, problem=problem)
        await asyncio.sleep(self.behaviour.load_s)
        keep = (policy.stable,) if carries and policy is not None else ()
        self.server.swap(track, target, keep)
        await self._report(target, target, SidecarState.OK, sha256=sha256, problem=problem)

    # -- reporting, as model_sidecar.status.StatusReporter -------------------------------

    async def _report(
        self,
        target: str | None,
        serving: str | None,
        state: SidecarState,
        reason: str | None = None,
        sha256: str | None = None,
        code: str | None = None,
        problem: str | None = None,
    ) -> None:
        if code is None and problem is not None:  # reported beside ok, not a failure
            code, reason = "bad_policy", f"bad_policy: {problem}"
        report = SidecarReport(
            self.command.model, target, serving, state, reason, sha256,
            retained=self.server.retained.get(self.command.track, ()),
            target_seen_at=self._target_seen_at, code=code,
        )  # fmt: skip
        due = self._due()
        if report.same_as(self.last) and not self._dirty and not due:
            return
        await self._write(replace(report, updated_at=time.time()))

    def _due(self) -> bool:
        heartbeat = self.behaviour.heartbeat_s
        return heartbeat is not None and time.monotonic() - self._written_at >= heartbeat

    async def _heartbeat(self) -> None:
        if self.last is not None and (self._dirty or self._due()):
            await self._write(replace(self.last, updated_at=time.time()))

    async def _write(self, report: SidecarReport) -> None:
        self.last, self._dirty = report, True
        patch = {"metadata": {"annotations": {self.keys.sidecar_status: report.to_json()}}}
        await json_call(
            self._core.patch_namespaced_pod(
                self.name, self.namespace, patch,
                _content_type="application/merge-patch+json", _preload_content=False,
            )
        )  # fmt: skip
        self._dirty, self._written_at = False, time.monotonic()


def _why(exc: BaseException) -> str:
    """An API refusal as its status and the server's message; anything else as itself."""
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status}: {exc.reason}"
    return repr(exc)


def model_store_claim(namespace: str, claim: str = "models") -> list[dict[str, Any]]:
    """A PersistentVolume and the claim ``claim`` bound to it: the volume store a
    ModelDeployment's ``store: {pvc: <claim>}`` names, which the real scheduler wants
    bound before it places a pod (nothing on a simulated node reads it)."""
    volume = f"{namespace}-{claim}"
    size = {"storage": "1Gi"}
    return [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": volume},
            "spec": {
                "capacity": size,
                "accessModes": ["ReadOnlyMany"],
                "persistentVolumeReclaimPolicy": "Delete",
                "storageClassName": "",
                "hostPath": {"path": f"/nonexistent/{volume}"},
                "claimRef": {"namespace": namespace, "name": claim},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim, "namespace": namespace},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "resources": {"requests": size},
                "storageClassName": "",
                "volumeName": volume,
            },
        },
    ]


class SimulatedModelContainers:
    """The node agent's runtime for the operator's pods without processes (see the
    module's docstring); other containers run as :class:`SimulatedContainers` runs them."""

    simulated = True

    def __init__(self, kubeconfig: Path, behaviour: SidecarBehaviour | None = None) -> None:
        """``kubeconfig``: the node's (``ControlPlane.node_kubeconfig``), as the
        :class:`~.node_agent.NodeAgent` is given it."""
        self.plain = SimulatedContainers()
        self.node = _NodeApi(kubeconfig)
        self.behaviour = behaviour or SidecarBehaviour()
        self.servers: dict[str, PodServer] = {}  # by pod uid
        self.sidecars: dict[tuple[str, str | None], SimulatedSidecar] = {}  # (uid, track)
        self._uids: dict[str, str] = {}  # pod address -> uid
        self._numbers = itertools.count(1)

    def sandbox(self, pod: dict[str, Any]) -> Sandbox:
        sandbox = self.plain.sandbox(pod)
        self._uids[sandbox.address] = str(pod["metadata"]["uid"])
        return sandbox

    def release(self, sandbox: Sandbox) -> None:
        uid = self._uids.pop(sandbox.address, None)
        if uid is not None:
            self.servers.pop(uid, None)
            for key in [k for k in self.sidecars if k[0] == uid]:
                del self.sidecars[key]
        self.plain.release(sandbox)

    async def run_handler(
        self,
        pod: dict[str, Any],
        sandbox: Sandbox,
        container: dict[str, Any],
        handler: dict[str, Any],
        timeout_s: float,
    ) -> bool:
        return await self.plain.run_handler(pod, sandbox, container, handler, timeout_s)

    def serving(self, track: str | None = None) -> dict[str, str | None]:
        """What each pod's server serves on ``track``, by ``namespace/name``."""
        return {
            f"{s.namespace}/{s.name}": self.servers[uid].serving.get(track)
            for (uid, t), s in self.sidecars.items()
            if t == track and uid in self.servers
        }

    async def start(
        self, pod: dict[str, Any], sandbox: Sandbox, container: dict[str, Any]
    ) -> Container:
        command = sidecar_command(container)
        if command is None:
            return await self.plain.start(pod, sandbox, container)
        uid = str(pod["metadata"]["uid"])
        server = self.servers.setdefault(uid, PodServer(server_retain(pod)))
        number = next(self._numbers)
        if command.mode == "init":
            return TaskContainer(number, self._pre_pull(pod, command, server))
        sidecar = SimulatedSidecar(self.node, self.behaviour, pod, command, server)
        self.sidecars[(uid, command.track)] = sidecar
        return TaskContainer(number, sidecar.run())

    async def _pre_pull(
        self, pod: Mapping[str, Any], command: SidecarCommand, server: PodServer
    ) -> int:
        """The init container: the target fetched, the server's start on it (with a
        canary's stable version beside it); 1 for a refused target or none."""
        keys = command.keys
        annotations = pod["metadata"].get("annotations") or {}
        target = annotations.get(keys.target)
        if not is_valid_name(target):
            target = await self.node.config_map_value(pod, command.configmap_key)
        await asyncio.sleep(self.behaviour.fetch_s)
        if target is None or not is_valid_name(target):
            log.error("pod %s: no target version for %s", pod["metadata"]["name"], command.model)
            return 1
        refusal = self.behaviour.refusal(command.model, target)
        if refusal is not None:
            log.error("pod %s: cannot pre-pull %s: %s", pod["metadata"]["name"], target, refusal[1])
            return 1
        policy, _ = _policy(annotations, keys)
        stable = policy.stable if policy is not None and policy.candidate == target else None
        server.serving.pop(command.track, None)
        server.retained.pop(command.track, None)
        if stable is not None and self.behaviour.refusal(command.model, stable) is None:
            server.swap(command.track, stable)
        server.swap(command.track, target)
        return 0
