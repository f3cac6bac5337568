"""Issue 13, "Supply chain": links planted in the shared volume (the server's container
writes to it too) never make the sidecar write, read or delete outside it. Each test
plants real symbolic links to a directory outside the volume, runs the real operation
and checks, byte for byte, that nothing outside changed and that the error is clear."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from model_rollout_contract.layout import ACCEPTED_FILE, CURRENT_FILE, INCOMING_DIR
from model_rollout_contract.report import SidecarReport
from model_rollout_contract.states import SidecarState
from model_sidecar.errors import UnsafeVolume
from model_sidecar.status import StatusReporter
from model_sidecar.store import LocalStore
from tests.support.sidecar import (
    Keys,
    downloads_left,
    make_fetcher,
    make_keys,
    publish_versions,
    sidecar_cli,
    snapshot,
)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """Somebody else's files, next to the volume."""
    root = tmp_path / "outside"
    for version in ("v1", "v2", "v3", "v4"):
        (root / version).mkdir(parents=True)
        (root / version / "model.onnx").write_bytes(f"not yours {version}".encode())
    (root / "victim.txt").write_text("precious\n")
    return root


@pytest.fixture
def published(tmp_path: Path) -> tuple[LocalStore, Keys]:
    keys = make_keys(tmp_path / "keys")
    store = LocalStore(tmp_path / "store")
    publish_versions(store, keys, tmp_path, {"v1": 1, "v2": 2, "v3": 3})
    return store, keys


def init(store: LocalStore, keys: Keys, volume: Path, version: str):  # type: ignore[no-untyped-def]
    return sidecar_cli(
        "init", "--store", f"file://{store.root}", "--volume", str(volume), "--model", "mlp",
        "--public-key", str(keys.public), "--version", version, "--previous", version,
        "--start-jitter-seconds", "0", "--retries", "1",
    )  # fmt: skip


def test_prune_never_deletes_through_a_linked_model_directory(
    tmp_path: Path, outside: Path, published: tuple[LocalStore, Keys]
) -> None:
    store, keys = published
    volume = tmp_path / "volume"
    volume.mkdir()
    (volume / "mlp").symlink_to(outside, target_is_directory=True)
    before = snapshot(outside)
    fetcher = make_fetcher(store, keys, volume)
    with pytest.raises(UnsafeVolume, match="refusing to follow the symbolic link"):
        fetcher.prune("mlp", keep=1, protect={"v4"})
    assert snapshot(outside) == before


def test_prune_skips_a_linked_version_and_deletes_only_real_ones(
    tmp_path: Path, outside: Path, published: tuple[LocalStore, Keys]
) -> None:
    store, keys = published
    volume = tmp_path / "volume"
    for version in ("v1", "v2", "v3"):
        (volume / "mlp" / version).mkdir(parents=True)
        (volume / "mlp" / version / "model.onnx").write_bytes(b"old")
    (volume / "mlp" / "v9").symlink_to(outside / "v4", target_is_directory=True)
    before = snapshot(outside)
    removed = make_fetcher(store, keys, volume).prune("mlp", keep=1, protect={"v3"})
    assert sorted(removed) == ["v1", "v2"]
    assert snapshot(outside) == before
    assert (volume / "mlp" / "v9").is_symlink()  # not ours to judge: left as it is


def test_init_refuses_to_write_through_a_linked_model_directory(
    tmp_path: Path, outside: Path, published: tuple[LocalStore, Keys]
) -> None:
    store, keys = published
    volume = tmp_path / "volume"
    volume.mkdir()
    (volume / "mlp").symlink_to(outside, target_is_directory=True)
    before = snapshot(outside)
    proc = init(store, keys, volume, "v2")
    assert proc.returncode == 1
    assert "refusing to follow the symbolic link" in proc.stderr and str(outside) in proc.stderr
    assert snapshot(outside) == before


def test_init_refuses_a_linked_version_directory_and_a_linked_incoming(
    tmp_path: Path, outside: Path, published: tuple[LocalStore, Keys]
) -> None:
    store, keys = published
    before = snapshot(outside)
    linked_version = tmp_path / "volume-a"
    (linked_version / "mlp").mkdir(parents=True)
    (linked_version / "mlp" / "v2").symlink_to(outside / "v2", target_is_directory=True)
    proc = init(store, keys, linked_version, "v2")
    assert proc.returncode == 1 and "refusing to follow the symbolic link" in proc.stderr
    linked_incoming = tmp_path / "volume-b"
    linked_incoming.mkdir()
    (linked_incoming / INCOMING_DIR).symlink_to(outside, target_is_directory=True)
    proc = init(store, keys, linked_incoming, "v2")
    assert proc.returncode == 1 and "refusing to follow the symbolic link" in proc.stderr
    assert snapshot(outside) == before


def test_planted_temporary_file_links_are_never_written_through(
    tmp_path: Path, outside: Path, published: tuple[LocalStore, Keys]
) -> None:
    """``.CURRENT.tmp``, ``CURRENT`` itself and the status file's temporary name, each a
    link to somebody's file: the sidecar writes its files, and theirs stay as they were."""
    store, keys = published
    volume = tmp_path / "volume"
    (volume / "mlp").mkdir(parents=True)
    for name in (f".{CURRENT_FILE}.tmp", CURRENT_FILE, ACCEPTED_FILE + ".tmp"):
        (volume / "mlp" / name).symlink_to(outside / "victim.txt")
    status = volume / ".sidecar-status.json"
    (volume / ".sidecar-status.json.tmp").symlink_to(outside / "victim.txt")
    (volume / f".{status.name}.tmp").symlink_to(outside / "v1" / "model.onnx")
    before = snapshot(outside)

    proc = init(store, keys, volume, "v2")
    assert proc.returncode == 0, proc.stderr
    current = volume / "mlp" / CURRENT_FILE
    assert not current.is_symlink() and current.read_text() == "v2\n"  # the link replaced

    asyncio.run(StatusReporter(status).report(SidecarReport("mlp", "v2", "v2", SidecarState.OK)))
    assert not status.is_symlink() and '"state": "ok"' in status.read_text()
    assert snapshot(outside) == before


def test_a_linked_sequence_file_is_refused_not_followed(
    tmp_path: Path, outside: Path, published: tuple[LocalStore, Keys]
) -> None:
    store, keys = published
    volume = tmp_path / "volume"
    (volume / "mlp").mkdir(parents=True)
    (volume / "mlp" / ACCEPTED_FILE).symlink_to(outside / "victim.txt")
    before = snapshot(outside)
    proc = init(store, keys, volume, "v1")
    assert proc.returncode == 1 and "refusing to follow the symbolic link" in proc.stderr
    assert ACCEPTED_FILE in proc.stderr
    assert snapshot(outside) == before
    assert not (volume / "mlp" / "v1").exists()


def test_leftovers_in_incoming_are_swept_at_start_without_following_links(
    tmp_path: Path, outside: Path, published: tuple[LocalStore, Keys]
) -> None:
    store, keys = published
    volume = tmp_path / "volume"
    incoming = volume / INCOMING_DIR
    (incoming / "mlp-v2-dead1234").mkdir(parents=True)
    (incoming / "mlp-v2-dead1234" / "model.onnx").write_bytes(b"half a download")
    (incoming / "mlp-v2-dead1234" / "escape").symlink_to(outside, target_is_directory=True)
    (incoming / "stray-file").write_bytes(b"x" * 100)
    (incoming / "link").symlink_to(outside / "victim.txt")
    before = snapshot(outside)
    proc = init(store, keys, volume, "v2")
    assert proc.returncode == 0, proc.stderr
    assert "swept 3 leftover download(s)" in proc.stderr
    assert downloads_left(volume) == []
    assert snapshot(outside) == before
    assert sorted(os.listdir(volume / "mlp" / "v2")) == [
        "manifest.json",
        "manifest.sig",
        "model.onnx",
    ]
