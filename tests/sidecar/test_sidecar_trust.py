"""Issue 29, keys and replays: what a running sidecar trusts follows the signing-key
Secret as the kubelet updates it (a removed key signs nothing more, not even a version
the server still holds), the publish sequence the operator pinned when a rollout started
holds on a pod whose volume remembers nothing, and a directory store is named by its
configured id, not by ``file:`` alone."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from prometheus_client import Metric

from model_rollout_contract.manifest import Manifest
from model_rollout_e2e.onnx_models import write_mlp
from model_sidecar.cli import _fetcher
from model_sidecar.config import FetchConfig, StoreConfig
from model_sidecar.control_client import ServerControl
from model_sidecar.init_mode import pre_pull
from model_sidecar.publish import publish
from model_sidecar.store import LocalStore, read_object
from tests.support.sidecar import (
    make_keys,
    make_watcher,
    publish_versions,
    read_status,
    set_target,
    sidecar_cli,
    start_server,
)

FILES = ("model.onnx", "manifest.sig", "manifest.json")
BIG = 1 << 26
PINS = "serving.model-rollout.io/pinned-sequences"  # the operator's pod annotation


class SecretVolume:
    """A Secret volume as the kubelet keeps it (its AtomicWriter): the files in a
    timestamped directory, ``..data`` a link to it, each key a link through ``..data``;
    an update writes a new directory and swaps ``..data`` in one rename."""

    def __init__(self, path: Path, files: dict[str, bytes]) -> None:
        self.path = path
        path.mkdir(parents=True)
        self.update(files)

    def update(self, files: dict[str, bytes]) -> None:
        old = os.readlink(self.path / "..data") if (self.path / "..data").is_symlink() else None
        stamp = f"..{time.strftime('%Y_%m_%d_%H_%M_%S')}.{time.monotonic_ns()}"
        (self.path / stamp).mkdir()
        for name, data in files.items():
            (self.path / stamp / name).write_bytes(data)
        (self.path / "..data_tmp").symlink_to(stamp)
        os.rename(self.path / "..data_tmp", self.path / "..data")
        for entry in self.path.iterdir():
            if entry.name.startswith(".."):
                continue
            if entry.name not in files:
                entry.unlink()
        for name in files:
            if not (self.path / name).is_symlink():
                (self.path / name).symlink_to(f"..data/{name}")
        if old is not None:
            shutil.rmtree(self.path / old)


def sample(metric: list[Metric], name: str, **labels: str) -> float | None:
    for family in metric:
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


def fetch_config(store: Path, volume: Path, keys: Path, **more: object) -> FetchConfig:
    return FetchConfig(
        store=StoreConfig(f"file://{store}"), volume=volume, model="mlp", public_key=keys,
        **more,  # type: ignore[arg-type]
    )  # fmt: skip


# --- a signing key removed from the Secret ------------------------------------------


async def test_a_key_removed_from_the_secret_signs_no_new_version(tmp_path: Path) -> None:
    """The sidecar read its keys once at start: v3, signed with a key removed from the
    Secret since, was fetched and served."""
    old, new = make_keys(tmp_path / "k", "old"), make_keys(tmp_path / "k", "new")
    store = LocalStore(tmp_path / "store")
    publish_versions(store, new, tmp_path, {"v1": 1})
    publish_versions(store, old, tmp_path, {"v2": 2, "v3": 3})
    secret = SecretVolume(
        tmp_path / "keys",
        {"old.pem": old.public.read_bytes(), "new.pem": new.public.read_bytes()},
    )
    volume, podinfo, sock = tmp_path / "volume", tmp_path / "podinfo", tmp_path / "ctl.sock"
    fetcher = _fetcher(fetch_config(store.root, volume, secret.path))
    fetcher.publish_window_s = 0  # v3 stands for a version published long ago
    assert await pre_pull(fetcher, "mlp", "v1", "v1") == 0
    server = await start_server(volume, sock)
    try:
        watcher = make_watcher(fetcher, sock, podinfo, tmp_path / "status.json")
        set_target(podinfo, "v2")
        assert await watcher.step() == "ok"  # signed with the old key: trusted still
        secret.update({"new.pem": new.public.read_bytes()})  # the old key is removed
        set_target(podinfo, "v3")
        assert await watcher.step() == "refused"
        report = read_status(tmp_path / "status.json")
        assert (report["code"], report["target"], report["serving"]) == (
            "bad_signature",
            "v3",
            "v2",
        )
        assert "any of the 1 trusted public key(s)" in report["reason"]
        assert (await ServerControl(sock).status("mlp")).version == "v2"
        assert not (volume / "mlp" / "v3").exists()
    finally:
        await server.close()


async def held_v1_signed_with_old_key(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A server serving v2 (signed with the new key) and holding v1 (the old key's), both
    keys in the Secret; the watcher, the Secret and the server's client."""
    old, new = make_keys(tmp_path / "k", "old"), make_keys(tmp_path / "k", "new")
    store = LocalStore(tmp_path / "store")
    publish_versions(store, old, tmp_path, {"v1": 1})
    publish_versions(store, new, tmp_path, {"v2": 2})
    secret = SecretVolume(
        tmp_path / "keys",
        {"old.pem": old.public.read_bytes(), "new.pem": new.public.read_bytes()},
    )
    volume, podinfo, sock = tmp_path / "volume", tmp_path / "podinfo", tmp_path / "ctl.sock"
    fetcher = _fetcher(fetch_config(store.root, volume, secret.path))
    assert await pre_pull(fetcher, "mlp", "v1", "v1") == 0
    server = await start_server(volume, sock)
    watcher = make_watcher(fetcher, sock, podinfo, tmp_path / "status.json")
    set_target(podinfo, "v1")
    assert await watcher.step() == "ok"
    set_target(podinfo, "v2")
    assert await watcher.step() == "ok"
    control = ServerControl(sock)
    assert (await control.status("mlp")).loaded == ("v1", "v2")
    return server, watcher, secret, control, old, new


async def test_a_held_version_signed_with_a_removed_key_is_not_swapped_back_to(
    tmp_path: Path,
) -> None:
    """A rollback to a version the server still holds is a pointer swap with no file to
    verify: v1, signed with the removed key, came back into service."""
    server, watcher, secret, control, old, new = await held_v1_signed_with_old_key(tmp_path)
    podinfo, metrics = tmp_path / "podinfo", watcher.metrics.registry
    try:
        secret.update({"new.pem": new.public.read_bytes()})  # the old key is removed
        set_target(podinfo, "v1")  # a rollback to the held version
        assert await watcher.step() == "refused"
        report = read_status(tmp_path / "status.json")
        assert (report["code"], report["target"], report["serving"]) == ("untrusted", "v1", "v2")
        assert "no longer verifies" in report["reason"] and "v2 keeps serving" in report["reason"]
        assert (await control.status("mlp")).version == "v2"
        refusals = "model_sidecar_refusals_total"
        assert sample(list(metrics.collect()), refusals, reason="untrusted") == 1.0

        secret.update({"new.pem": new.public.read_bytes(), "old.pem": old.public.read_bytes()})
        assert await watcher.step() == "ok"  # the key is back: so is the swap, at once
        assert (await control.status("mlp")).version == "v1"
    finally:
        await server.close()


async def test_held_versions_are_checked_again_when_the_keys_change(tmp_path: Path) -> None:
    """Before any rollback is asked for, the metric says which held version a key change
    left untrusted."""
    server, watcher, secret, _, old, new = await held_v1_signed_with_old_key(tmp_path)
    metrics, untrusted = watcher.metrics.registry, "model_sidecar_untrusted_versions"
    try:
        assert sample(list(metrics.collect()), untrusted, version="v1") in (None, 0.0)
        secret.update({"new.pem": new.public.read_bytes()})  # the old key is removed
        assert await watcher.step() == "ok"  # v2 serves on; what it holds is checked again
        assert sample(list(metrics.collect()), untrusted, version="v1") == 1.0
        assert sample(list(metrics.collect()), untrusted, version="v2") == 0.0
        secret.update({"new.pem": new.public.read_bytes(), "old.pem": old.public.read_bytes()})
        assert await watcher.step() == "ok"
        assert sample(list(metrics.collect()), untrusted, version="v1") == 0.0
    finally:
        await server.close()


async def test_a_secret_that_holds_no_key_any_more_trusts_nothing(tmp_path: Path) -> None:
    """Emptied or broken, the Secret is no reason to go on trusting the keys it held."""
    keys = make_keys(tmp_path / "k")
    store = LocalStore(tmp_path / "store")
    publish_versions(store, keys, tmp_path, {"v1": 1, "v2": 2})
    secret = SecretVolume(tmp_path / "keys", {"signing.pem": keys.public.read_bytes()})
    volume, podinfo, sock = tmp_path / "volume", tmp_path / "podinfo", tmp_path / "ctl.sock"
    fetcher = _fetcher(fetch_config(store.root, volume, secret.path))
    assert await pre_pull(fetcher, "mlp", "v1", "v1") == 0
    server = await start_server(volume, sock)
    try:
        watcher = make_watcher(fetcher, sock, podinfo, tmp_path / "status.json")
        set_target(podinfo, "v1")
        assert await watcher.step() == "ok"
        secret.update({"signing.pem": b"-----BEGIN PUBLIC KEY-----\nnot a key\n"})
        set_target(podinfo, "v2")
        assert await watcher.step() == "error"  # tried again with backoff: not refused
        report = read_status(tmp_path / "status.json")
        assert (report["code"], report["serving"]) == ("keys_unreadable", "v1")
        assert str(secret.path) in report["reason"]
        assert (await ServerControl(sock).status("mlp")).version == "v1"
        secret.update({"signing.pem": keys.public.read_bytes()})  # put right
        assert await watcher.step() == "ok"
        assert (await ServerControl(sock).status("mlp")).version == "v2"
    finally:
        await server.close()


# --- the publish sequence pinned by the operator -------------------------------------


def replayable(tmp_path: Path) -> tuple[LocalStore, Path, dict[str, bytes], Manifest]:
    """v2 published, then published again (--force): the first build's objects, kept
    to be written back (a replay), and the newer manifest."""
    keys = make_keys(tmp_path / "keys")
    store = LocalStore(tmp_path / "store")
    publish_versions(store, keys, tmp_path, {"v2": 2})
    old_build = {name: read_object(store, f"mlp/v2/{name}", BIG) for name in FILES}
    rebuilt = tmp_path / "rebuilt" / "model.onnx"
    write_mlp(rebuilt, 22, in_dim=8)
    newer = publish(store, "mlp", "v2", rebuilt, keys.private, force=True)
    for name, data in old_build.items():  # someone with write access replays the old build
        store.write(f"mlp/v2/{name}", data)
    return store, keys.public, old_build, newer


def init_argv(store: LocalStore, volume: Path, public: Path, *extra: str) -> list[str]:
    return [
        "init", "--store", f"file://{store.root}", "--volume", str(volume), "--model", "mlp",
        "--public-key", str(public), "--start-jitter-seconds", "0", *extra,
    ]  # fmt: skip


def test_an_older_build_is_refused_on_an_empty_volume_by_the_pinned_sequence(
    tmp_path: Path,
) -> None:
    """A new pod's volume has no ledger of accepted sequences: the replayed older build
    was accepted. The operator's pin (in the pod's annotations) refuses it."""
    store, public, old_build, newer = replayable(tmp_path)
    old_sequence = Manifest.from_bytes(old_build["manifest.json"]).sequence
    assert newer.sequence is not None and old_sequence is not None
    podinfo = tmp_path / "podinfo"
    set_target(podinfo, "v2")
    annotations = podinfo.read_text() + f"{PINS}={json.dumps(json.dumps({'v2': newer.sequence}))}\n"
    podinfo.write_text(annotations)
    volume = tmp_path / "volume"
    done = sidecar_cli(*init_argv(store, volume, public, "--annotations-file", str(podinfo)))
    assert done.returncode != 0, done.stderr
    assert "stale_sequence" in done.stderr
    assert str(old_sequence) in done.stderr and str(newer.sequence) in done.stderr
    assert "pinned" in done.stderr
    assert not (volume / "mlp" / "v2").exists()


def test_the_configmap_carries_the_pin_for_a_pod_not_yet_annotated(tmp_path: Path) -> None:
    """A pod starts on the ConfigMap's version before the operator annotates it: the
    ConfigMap carries the pins too."""
    store, public, _, newer = replayable(tmp_path)
    config = tmp_path / "config"
    config.mkdir()
    (config / "target-version").write_text("v2")
    (config / "pinned-sequences").write_text(json.dumps({"v2": newer.sequence}))
    volume = tmp_path / "volume"
    done = sidecar_cli(
        *init_argv(store, volume, public, "--configmap-file", str(config / "target-version")),
        "--pins-file", str(config / "pinned-sequences"),
    )  # fmt: skip
    assert done.returncode != 0, done.stderr
    assert "stale_sequence" in done.stderr and "pinned" in done.stderr
    assert not (volume / "mlp" / "v2").exists()
    republished = tmp_path / "again" / "model.onnx"  # the store put right: a newer build
    write_mlp(republished, 23, in_dim=8)
    publish(store, "mlp", "v2", republished, tmp_path / "keys" / "signing.key", force=True)
    done = sidecar_cli(
        *init_argv(store, volume, public, "--configmap-file", str(config / "target-version")),
        "--pins-file", str(config / "pinned-sequences"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (volume / "mlp" / "v2" / "model.onnx").is_file()


# --- a directory store's identity ---------------------------------------------------


def test_a_version_signed_for_another_directory_store_is_refused(tmp_path: Path) -> None:
    """Every directory store bound the scope ``file:``: another team's signed version,
    copied into this store, was accepted."""
    keys = make_keys(tmp_path / "keys")  # one signing key for both teams
    ours, theirs = tmp_path / "team-a", tmp_path / "team-b"
    for store, store_id, version, seed in ((ours, "team-a", "v1", 1), (theirs, "team-b", "v3", 3)):
        model = tmp_path / "build" / version / "model.onnx"
        write_mlp(model, seed, in_dim=8)
        done = sidecar_cli(
            "publish", "--store", f"file://{store}", "--store-id", store_id, "--model", "mlp",
            "--version", version, "--file", str(model), "--key", str(keys.private),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    shutil.copytree(theirs / "mlp" / "v3", ours / "mlp" / "v3")  # planted in our store
    volume = tmp_path / "volume"

    def init(version: str) -> object:
        return sidecar_cli(
            "init", "--store", f"file://{ours}", "--store-id", "team-a", "--volume", str(volume),
            "--model", "mlp", "--public-key", str(keys.public), "--version", version,
            "--start-jitter-seconds", "0",
        )  # fmt: skip

    accepted = init("v1")
    assert accepted.returncode == 0, accepted.stderr  # type: ignore[attr-defined]
    refused = init("v3")
    assert refused.returncode != 0  # type: ignore[attr-defined]
    assert "wrong_store" in refused.stderr  # type: ignore[attr-defined]
    assert "file:team-b" in refused.stderr and "file:team-a" in refused.stderr  # type: ignore[attr-defined]
    assert not (volume / "mlp" / "v3").exists()
