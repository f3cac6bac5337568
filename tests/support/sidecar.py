"""Building blocks for sidecar tests: keys, a published store, a watcher wired to a server,
a real small filesystem, snapshots of directories that must stay untouched."""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from model_rollout_contract.annotations import TARGET_VERSION, format_downward_annotations
from model_rollout_contract.canary import TRAFFIC_POLICY, TrafficPolicy
from model_rollout_contract.layout import INCOMING_DIR
from model_rollout_e2e.onnx_models import write_mlp
from model_server.app import ModelServer
from model_server.config import ModelSpec, ServerConfig
from model_sidecar.control_client import ServerControl
from model_sidecar.fetcher import Fetcher
from model_sidecar.metrics import SidecarMetrics
from model_sidecar.publish import publish
from model_sidecar.publish_window import PUBLISH_WINDOW_S
from model_sidecar.retry import Backoff
from model_sidecar.signing import generate_keypair, load_public_key
from model_sidecar.status import StatusReporter
from model_sidecar.store import LocalStore, ModelStore
from model_sidecar.target import TargetSource
from model_sidecar.verify import Verifier
from model_sidecar.watch import Watcher, WatchSettings

FAST = Backoff(attempts=3, base_s=0.05, max_s=0.2)


@dataclass
class Keys:
    private: Path
    public: Path


def make_keys(directory: Path, name: str = "signing") -> Keys:
    directory.mkdir(parents=True, exist_ok=True)
    keys = Keys(directory / f"{name}.key", directory / f"{name}.pub")
    generate_keypair(keys.private, keys.public)
    return keys


def publish_versions(
    store: ModelStore,
    keys: Keys,
    work: Path,
    seeds: dict[str, int],
    model: str = "mlp",
    **dims: int,
) -> dict[str, Path]:
    files = {}
    for version, seed in seeds.items():
        path = work / "build" / model / version / "model.onnx"
        write_mlp(path, seed, in_dim=8, **dims)
        publish(store, model, version, path, keys.private)
        files[version] = path
    return files


def make_fetcher(
    store: ModelStore,
    keys: Keys,
    volume: Path,
    allowed: frozenset[str] | None = None,
    max_concurrent_downloads: int = 1,
    publish_window_s: float = PUBLISH_WINDOW_S,
) -> Fetcher:
    """``publish_window_s=0``: for tests that tamper with a version they just published,
    standing for a tamper long after its publish (within the window a mismatch may be a
    publish under way, and is retried instead of refused)."""
    verifier = Verifier((load_public_key(keys.public.read_bytes()),), store.scope, allowed)
    return Fetcher(store, verifier, volume, FAST, max_concurrent_downloads, publish_window_s)


def set_target(
    annotations_file: Path, version: str, policy: TrafficPolicy | str | None = None
) -> None:
    """The pod's annotations as the kubelet projects them: the target version and, for a
    canary pod, its traffic policy (a string: written as it is, malformed or not)."""
    annotations = {TARGET_VERSION: version, "other": "x"}
    if policy is not None:
        annotations[TRAFFIC_POLICY] = policy if isinstance(policy, str) else policy.to_annotation()
    annotations_file.write_text(format_downward_annotations(annotations))


def make_watcher(
    fetcher: Fetcher,
    socket: Path,
    annotations_file: Path,
    status_file: Path,
    model: str = "mlp",
    keep_versions: int = 2,
    load_timeout_s: float = 300.0,
) -> Watcher:
    return Watcher(
        WatchSettings(
            model,
            poll_s=0.05,
            jitter_s=0.05,
            keep_versions=keep_versions,
            backoff=Backoff(base_s=0.05, max_s=0.4),
            refused_retry_s=300.0,
        ),
        TargetSource(annotations_file),
        fetcher,
        ServerControl(
            socket, Backoff(attempts=3, base_s=0.05, max_s=0.1), load_timeout_s=load_timeout_s
        ),
        StatusReporter(status_file),
        SidecarMetrics(),
        rng=random.Random(7),
    )


def read_status(path: Path) -> dict[str, Any]:
    status: dict[str, Any] = json.loads(path.read_text())
    return status


async def start_server(
    volume: Path, socket: Path, model: str = "mlp", **settings: Any
) -> TestClient:
    """The real inference server on ``volume``, its control socket at ``socket``
    (``settings``: more of its ``ServerConfig``)."""
    config = ServerConfig(
        repository=volume, models=[ModelSpec(model)], control_socket=socket, **settings
    )
    client = TestClient(TestServer(ModelServer(config).make_app()))
    await client.start_server()
    return client


@contextlib.contextmanager
def small_filesystem(path: Path, mib: int) -> Iterator[Path]:
    """A real filesystem of ``mib`` MiB at ``path`` (tmpfs: writes past it fail with
    ENOSPC). Mounting needs root (CI runs as root); elsewhere the test is skipped."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a {mib} MiB tmpfs (needs root): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def snapshot(directory: Path) -> dict[str, bytes | str]:
    """Every entry under ``directory`` (links not followed) with its content or target:
    equal snapshots mean nothing there was written, replaced or deleted."""
    entries: dict[str, bytes | str] = {}
    for path in sorted(directory.rglob("*")):
        name = str(path.relative_to(directory))
        if path.is_symlink():
            entries[name] = f"-> {os.readlink(path)}"
        elif path.is_file():
            entries[name] = path.read_bytes()
        else:
            entries[name] = "dir"
    return entries


def sidecar_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``model-sidecar ARGS`` as a real process."""
    return subprocess.run(
        [sys.executable, "-m", "model_sidecar", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class PausedPublish(LocalStore):
    """A directory store whose writer stops before its n-th object write until told to
    go on: the state a fetch finds between the writes of one publish."""

    def __init__(self, root: Path, pause_before: int) -> None:
        super().__init__(root)
        self.pause_before = pause_before
        self.writes = 0
        self.paused, self.resume = threading.Event(), threading.Event()

    def _next(self) -> None:
        self.writes += 1
        if self.writes == self.pause_before:
            self.paused.set()
            assert self.resume.wait(120), "the test never let the publish go on"

    def upload(self, key: str, source: Path) -> None:
        self._next()
        super().upload(key, source)

    def write(self, key: str, data: bytes) -> None:
        self._next()
        super().write(key, data)


def downloads_left(volume: Path) -> list[str]:
    """What lies in ``.incoming`` beside the sidecars' (empty) download areas: downloads
    not finished or not cleaned up."""
    incoming = volume / INCOMING_DIR
    left = []
    for entry in sorted(incoming.iterdir()) if incoming.is_dir() else []:
        if entry.is_dir() and not entry.is_symlink() and "+" in entry.name:
            left += [f"{entry.name}/{name}" for name in sorted(os.listdir(entry))]
        else:
            left.append(entry.name)
    return left
