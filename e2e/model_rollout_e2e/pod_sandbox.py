"""What a pod's processes see instead of a container: a directory per pod holding its
volumes, an IP of its own (a loopback address, :mod:`.loopback`), and its command line
with container paths rewritten to those directories, for the node agent's process
runtime (:mod:`.container_runtime`).

There are no images and no mount namespaces: a container's command runs on the host, so
every argument naming a container path (a volume mount) is rewritten to its host
directory; ``python``/``python3`` and the project's programs (``model-server``,
``model-sidecar``) run on this interpreter. A project program whose container mounts the
ServiceAccount volume at Kubernetes' own path is started through :mod:`.in_pod`, which
shows the in-cluster client that volume's host directory.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .processes import free_port

# the project's container programs, run as ``python -m module`` on this interpreter
PROGRAMS = {
    "model-server": "model_server",
    "model-sidecar": "model_sidecar",
    "model-operator": "model_operator",
}
# a bind to every address inside a pod is a bind to the pod's own (its network namespace)
ALL_ADDRESSES = "0.0.0.0"
PYTHONS = ("python", "python3")
# where Kubernetes mounts a pod's API credentials (token, ca.crt, namespace), and where
# the in-cluster clients read them
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


@dataclass
class Sandbox:
    root: Path
    address: str  # the pod's IP
    mounts: dict[str, str] = field(default_factory=dict)  # container path -> host path
    volumes: dict[str, Path] = field(default_factory=dict)  # volume name -> host directory
    ports: dict[str, int] = field(default_factory=dict)  # container -> its --metrics-port
    given: set[str] = field(default_factory=set)  # volumes the node was given a directory for
    secrets: dict[str, dict[str, str]] = field(default_factory=dict)  # the env's, by name

    @classmethod
    def create(
        cls,
        root: Path,
        address: str,
        spec: dict[str, Any],
        extra_mounts: dict[str, Path] | None = None,
    ) -> Sandbox:
        """Every volume of ``spec`` as a directory ``root/<volume name>`` (or the host
        directory ``extra_mounts`` gives for its mount path)."""
        extra = extra_mounts or {}
        mounts: dict[str, str] = {}
        volumes: dict[str, Path] = {}
        given: set[str] = set()
        for container in containers(spec):
            for mount in container.get("volumeMounts") or []:
                path = mount["mountPath"]
                volume = Path(extra.get(path) or root / mount["name"])
                volumes[mount["name"]], mounts[path] = volume, str(volume)
                if path in extra:
                    given.add(mount["name"])
        for host in mounts.values():
            Path(host).mkdir(parents=True, exist_ok=True)
        return cls(root, address, mounts, volumes, given=given)

    def volume_dir(self, volume: str) -> Path:
        return self.volumes.get(volume, self.root / volume)

    def host_path(self, path: str) -> str:
        """``path`` (a container path) where it lies on the host; unchanged if it is on
        no volume. Also maps ``file://`` URLs."""
        for container_path in sorted(self.mounts, key=len, reverse=True):
            if (
                path == container_path
                or path.startswith(container_path + "/")
                or path.startswith(f"file://{container_path}")
            ):
                return path.replace(container_path, self.mounts[container_path], 1)
        return path

    def argv(self, container: dict[str, Any]) -> list[str]:
        """The container's ``command`` + ``args`` as a host command line. The project's
        pods give only ``args``, the program first; ``--host`` becomes the pod's IP and a
        sidecar's ``--metrics-port`` (it binds every address) a free port of its own; a
        project program with the ServiceAccount volume runs through :mod:`.in_pod`; an
        argument naming every address (``0.0.0.0``, as in ``http://0.0.0.0:8080/``)
        names the pod's IP, which is what it binds inside a pod's network namespace."""
        words = [*(container.get("command") or []), *(container.get("args") or [])]
        if not words:
            raise ValueError(f"container {container.get('name')!r} has no command: no images here")
        program, *args = words
        out: list[str] = []
        for i, arg in enumerate(args):
            flag = args[i - 1] if i else ""
            if flag == "--metrics-port":
                arg = str(self.ports.setdefault(container["name"], free_port()))
            elif flag == "--host":
                arg = self.address
            out.append(self.host_path(arg).replace(ALL_ADDRESSES, self.address))
        if program in PROGRAMS:
            account = self._mounted(container, SERVICE_ACCOUNT_DIR)
            if account is not None:
                module = [sys.executable, "-m", "model_rollout_e2e.in_pod", account]
                return [*module, PROGRAMS[program], *out]
            return [sys.executable, "-m", PROGRAMS[program], *out]
        if program in PYTHONS:
            return [sys.executable, *out]
        return [self.host_path(program), *out]

    def _mounted(self, container: dict[str, Any], path: str) -> str | None:
        """The host directory of the volume ``container`` mounts at ``path``, if it does."""
        for mount in container.get("volumeMounts") or []:
            if mount["mountPath"] == path:
                return str(self.volume_dir(mount["name"]))
        return None

    def environment(
        self, pod: dict[str, Any], container: dict[str, Any], base: dict[str, str] | None = None
    ) -> dict[str, str]:
        """``base``, the container's ``envFrom`` Secrets, then its ``env``: values, the
        Downward API fields a process can be given (name, namespace, uid, node, service
        account, IPs) and Secret keys (read by :class:`~.pod_volumes.PodVolumes`)."""
        meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
        fields = {
            "metadata.name": meta.get("name", ""),
            "metadata.namespace": meta.get("namespace", ""),
            "metadata.uid": meta.get("uid", ""),
            "spec.nodeName": spec.get("nodeName", ""),
            "spec.serviceAccountName": spec.get("serviceAccountName", ""),
            "status.podIP": self.address,
            "status.hostIP": "127.0.0.1",
        }
        env = dict(base or {})
        for source in container.get("envFrom") or []:
            if "secretRef" in source:
                secret = self.secrets.get(source["secretRef"]["name"]) or {}
                env.update({source.get("prefix", "") + k: v for k, v in secret.items()})
        for item in container.get("env") or []:
            value_from = item.get("valueFrom") or {}
            if "value" in item:
                env[item["name"]] = str(item["value"])
            elif (path := value_from.get("fieldRef", {}).get("fieldPath")) in fields:
                env[item["name"]] = fields[path]
            elif (ref := value_from.get("secretKeyRef")) is not None and ref["key"] in (
                secret := self.secrets.get(ref["name"]) or {}
            ):
                env[item["name"]] = secret[ref["key"]]
        return env


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]


def atomic_write(path: Path, text: str) -> None:
    """Readers see the old file or the new one, never half of it (as the kubelet's
    ``..data`` symlink swap gives)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
