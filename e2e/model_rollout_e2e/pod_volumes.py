"""The volumes the node agent fills for a pod's processes, as a kubelet does: the
ServiceAccount token (TokenRequest bound to the pod, renewed at 80 % of its lifetime),
Downward API files, ConfigMap and Secret keys (``configMap``, ``secret`` and
``projected`` volumes); an ``emptyDir`` is the pod's directory for that volume. Each file
is written atomically and only when its content changed. Other volume kinds are left
empty directories. The Secrets the containers' ``env`` (``secretKeyRef``) and
``envFrom`` (``secretRef``) name are read too, for :meth:`.Sandbox.environment`.

A Secret volume mounted where the node was given a host directory (``mounts``, the
tests' stand-in for a Secret) is that directory and is not read from the API. A Secret
or ConfigMap that does not exist (and is not ``optional``) fails the projection, which
the pod worker retries with the pod ContainerCreating, as a kubelet's volume manager.
"""

from __future__ import annotations

import base64
import logging
import re
import time
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException

from model_rollout_contract.annotations import format_downward_annotations

from .pod_sandbox import Sandbox, atomic_write, containers
from .raw_api import json_call

log = logging.getLogger(__name__)
DEFAULT_TOKEN_SECONDS = 3607  # what the ServiceAccount admission plugin asks for
REFRESH_AT = 0.8  # a kubelet renews a token after 80 % of its lifetime
_SUBSCRIPT = re.compile(r"^metadata\.(annotations|labels)\['(.+)'\]$")


def field_value(pod: dict[str, Any], path: str) -> str:
    """A Downward API ``fieldRef`` as the kubelet writes it to a file."""
    meta = pod["metadata"]
    if path in ("metadata.annotations", "metadata.labels"):
        return format_downward_annotations(meta.get(path.split(".")[1]) or {})
    if match := _SUBSCRIPT.match(path):
        return str((meta.get(match[1]) or {}).get(match[2], ""))
    if path in ("metadata.name", "metadata.namespace", "metadata.uid"):
        return str(meta.get(path.split(".")[1], ""))
    if path == "spec.serviceAccountName":
        return str(pod["spec"].get("serviceAccountName", ""))
    raise ValueError(f"unsupported Downward API field {path!r}")


class PodVolumes:
    """One pod's projected files; :meth:`project` at start and on every sync."""

    def __init__(self, core: Any, sandbox: Sandbox, token_max_age_s: float | None = None) -> None:
        """``core``: a ``CoreV1Api`` as the node; ``token_max_age_s``: renew tokens at
        least this often (tests), besides at 80 % of their lifetime."""
        self.core = core
        self.sandbox = sandbox
        self.token_max_age_s = token_max_age_s
        self._written: dict[str, str] = {}
        self._tokens: dict[str, float] = {}  # file -> monotonic time to renew it

    def _write(self, volume: str, path: str, text: str) -> None:
        target = self.sandbox.volume_dir(volume) / path
        if self._written.get(str(target)) != text:
            atomic_write(target, text)
            self._written[str(target)] = text

    async def project(self, pod: dict[str, Any]) -> None:
        for volume in pod["spec"].get("volumes") or []:
            name = volume["name"]
            self.sandbox.volume_dir(name).mkdir(parents=True, exist_ok=True)
            sources: list[dict[str, Any]] = []
            if "projected" in volume:
                sources = volume["projected"].get("sources") or []
            elif "downwardAPI" in volume or "configMap" in volume or "secret" in volume:
                sources = [volume]
            for source in sources:
                if "downwardAPI" in source:
                    for item in source["downwardAPI"].get("items") or []:
                        if "fieldRef" in item:
                            self._write(
                                name, item["path"], field_value(pod, item["fieldRef"]["fieldPath"])
                            )
                if "configMap" in source:
                    await self._config_map(pod, name, source["configMap"])
                if "secret" in source and name not in self.sandbox.given:
                    await self._secret(pod, name, source["secret"])
                if "serviceAccountToken" in source:
                    await self._token(pod, name, source["serviceAccountToken"])

        await self._env_secrets(pod)

    async def _read_secret(self, pod: dict[str, Any], name: str, optional: bool) -> dict[str, str]:
        """A Secret's data, decoded; ``{}`` for an optional one that does not exist."""
        try:
            secret = await json_call(
                self.core.read_namespaced_secret(
                    name, pod["metadata"]["namespace"], _preload_content=False
                )
            )
        except ApiException as exc:
            if exc.status == 404 and optional:
                return {}
            raise
        data: dict[str, str] = secret.get("data") or {}
        return {key: base64.b64decode(value).decode() for key, value in data.items()}

    async def _secret(self, pod: dict[str, Any], volume: str, ref: dict[str, Any]) -> None:
        """A ``secret`` volume (``secretName``) or projected source (``name``)."""
        name = ref.get("secretName") or ref["name"]
        data = await self._read_secret(pod, name, bool(ref.get("optional")))
        items = ref.get("items") or [{"key": key, "path": key} for key in data]
        for item in items:
            if item["key"] in data:
                self._write(volume, item["path"], data[item["key"]])

    async def _env_secrets(self, pod: dict[str, Any]) -> None:
        """The Secrets the containers' environment names, into ``sandbox.secrets``."""
        wanted: dict[str, bool] = {}  # name -> optional (only if every reference is)
        for container in containers(pod["spec"]):
            refs = [
                (item.get("valueFrom") or {}).get("secretKeyRef")
                for item in container.get("env") or []
            ] + [source.get("secretRef") for source in container.get("envFrom") or []]
            for ref in filter(None, refs):
                wanted[ref["name"]] = wanted.get(ref["name"], True) and bool(ref.get("optional"))
        for name, optional in wanted.items():
            self.sandbox.secrets[name] = await self._read_secret(pod, name, optional)

    async def _config_map(self, pod: dict[str, Any], volume: str, ref: dict[str, Any]) -> None:
        try:
            config_map = await json_call(
                self.core.read_namespaced_config_map(
                    ref["name"], pod["metadata"]["namespace"], _preload_content=False
                )
            )
            data: dict[str, str] = config_map.get("data") or {}
        except ApiException as exc:
            if exc.status == 404 and ref.get("optional"):
                return
            raise
        items = ref.get("items") or [{"key": key, "path": key} for key in data]
        for item in items:
            if item["key"] in data:
                self._write(volume, item["path"], data[item["key"]])

    async def _token(self, pod: dict[str, Any], volume: str, source: dict[str, Any]) -> None:
        key = f"{volume}/{source['path']}"
        if time.monotonic() < self._tokens.get(key, 0.0):
            return
        seconds = int(source.get("expirationSeconds") or DEFAULT_TOKEN_SECONDS)
        meta = pod["metadata"]
        spec: dict[str, Any] = {
            "expirationSeconds": seconds,
            "boundObjectRef": {
                "apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"],
            },
        }  # fmt: skip
        if source.get("audience"):
            spec["audiences"] = [source["audience"]]
        answer = await json_call(
            self.core.create_namespaced_service_account_token(
                pod["spec"].get("serviceAccountName") or "default",
                meta["namespace"],
                {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
                _preload_content=False,
            )
        )
        token = answer["status"]["token"]
        self._write(volume, source["path"], token)
        renew_in = REFRESH_AT * seconds
        if self.token_max_age_s is not None:
            renew_in = min(renew_in, self.token_max_age_s)
        self._tokens[key] = time.monotonic() + renew_in
