"""Building blocks for sidecar tests: keys, a published store, a watcher wired to a server."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from model_rollout_contract.annotations import TARGET_VERSION, format_downward_annotations
from model_rollout_e2e.onnx_models import write_mlp
from model_sidecar.control_client import ServerControl
from model_sidecar.fetcher import Fetcher
from model_sidecar.metrics import SidecarMetrics
from model_sidecar.publish import publish
from model_sidecar.retry import Backoff
from model_sidecar.signing import generate_keypair, load_public_key
from model_sidecar.status import StatusReporter
from model_sidecar.store import ModelStore
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
    store: ModelStore, keys: Keys, volume: Path, allowed: frozenset[str] | None = None
) -> Fetcher:
    verifier = Verifier(load_public_key(keys.public.read_bytes()), volume, allowed)
    return Fetcher(store, verifier, volume, FAST)


def set_target(annotations_file: Path, version: str) -> None:
    annotations_file.write_text(
        format_downward_annotations({TARGET_VERSION: version, "other": "x"})
    )


def make_watcher(
    fetcher: Fetcher, socket: Path, annotations_file: Path, status_file: Path, model: str = "mlp"
) -> Watcher:
    return Watcher(
        WatchSettings(model, poll_s=0.05, jitter_s=0.05, keep_versions=2),
        TargetSource(annotations_file),
        fetcher,
        ServerControl(socket, Backoff(attempts=3, base_s=0.05, max_s=0.1)),
        StatusReporter(status_file),
        SidecarMetrics(),
        rng=random.Random(7),
    )
