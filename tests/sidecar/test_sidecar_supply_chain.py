"""Issue 13, "Supply chain": what a signed manifest binds (store, model, version, publish
sequence), publishing without overwriting, several trusted keys, downloads bounded by the
manifest's size, a full volume and permanent store errors told apart from outages."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time
import uuid
from pathlib import Path

import pytest

from model_rollout_contract.manifest import Manifest, ManifestError, sha256_file
from model_rollout_e2e.onnx_models import write_mlp
from model_rollout_e2e.seaweed import SeaweedFS
from model_sidecar.errors import PublishRefused, StoreError, VerificationError
from model_sidecar.init_mode import pre_pull
from model_sidecar.publish import publish
from model_sidecar.publish_window import PUBLISH_WINDOW_S
from model_sidecar.signing import load_private_key, load_trusted_keys, sign
from model_sidecar.store import LocalStore, ModelStore, S3Store, read_object
from model_sidecar.verify import Verifier
from tests.support.sidecar import (
    PausedPublish,
    downloads_left,
    make_fetcher,
    make_keys,
    make_watcher,
    publish_versions,
    read_status,
    set_target,
    sidecar_cli,
    small_filesystem,
    start_server,
)

FILES = ("model.onnx", "manifest.sig", "manifest.json")
BIG = 1 << 26


def copy_version(source: ModelStore, target: ModelStore, version: str, into: str = "") -> None:
    for name in FILES:
        target.write(
            f"mlp/{into or version}/{name}", read_object(source, f"mlp/{version}/{name}", BIG)
        )


# --- what a signature binds ---------------------------------------------------------


@pytest.mark.s3
async def test_a_version_signed_for_another_teams_prefix_is_refused(
    s3_env: SeaweedFS, tmp_path: Path
) -> None:
    s3_env.create_bucket("models")
    run = uuid.uuid4().hex[:8]
    ours = S3Store("models", f"team-a-{run}", endpoint_url=s3_env.endpoint)
    theirs = S3Store("models", f"team-b-{run}", endpoint_url=s3_env.endpoint)
    keys = make_keys(tmp_path / "keys")  # one signing key for both teams
    publish_versions(ours, keys, tmp_path / "a", {"v1": 1})
    publish_versions(theirs, keys, tmp_path / "b", {"v3": 3})
    copy_version(theirs, ours, "v3")  # their signed version, planted in our prefix
    volume = tmp_path / "volume"
    fetcher = make_fetcher(ours, keys, volume)
    assert (await fetcher.fetch("mlp", "v1")).downloaded_bytes > 0
    with pytest.raises(VerificationError) as info:
        await fetcher.fetch("mlp", "v3")
    assert info.value.reason == "wrong_store"
    assert f"team-b-{run}" in info.value.message and f"team-a-{run}" in info.value.message
    assert not (volume / "mlp" / "v3").exists()


@pytest.mark.s3
async def test_an_older_signed_build_of_a_version_is_not_accepted_again(
    bucket: S3Store, tmp_path: Path
) -> None:
    keys = make_keys(tmp_path / "keys")
    publish_versions(bucket, keys, tmp_path, {"v2": 2})
    old_build = {name: read_object(bucket, f"mlp/v2/{name}", BIG) for name in FILES}
    rebuilt = tmp_path / "rebuilt" / "model.onnx"
    write_mlp(rebuilt, 22, in_dim=8)
    newer = publish(bucket, "mlp", "v2", rebuilt, keys.private, force=True)
    old_sequence = Manifest.from_bytes(old_build["manifest.json"]).sequence
    assert old_sequence is not None and newer.sequence is not None
    assert newer.sequence > old_sequence

    volume = tmp_path / "volume"
    fetched = await make_fetcher(bucket, keys, volume).fetch("mlp", "v2")
    assert fetched.local.manifest.sha256 == sha256_file(rebuilt)
    for name, data in old_build.items():  # someone with write access replays the old build
        bucket.write(f"mlp/v2/{name}", data)
    shutil.rmtree(volume / "mlp" / "v2")  # the pod's copy is gone (pruned, say)

    restarted = make_fetcher(bucket, keys, volume)  # a new process: only the volume remembers
    with pytest.raises(VerificationError) as info:
        await restarted.fetch("mlp", "v2")
    assert info.value.reason == "stale_sequence"
    assert str(old_sequence) in info.value.message and str(newer.sequence) in info.value.message
    assert not (volume / "mlp" / "v2").exists()
    ledger = json.loads((volume / "mlp" / ".accepted-sequences.json").read_text())
    assert ledger == {"v2": newer.sequence}


def test_a_signed_manifest_without_the_binding_fields_is_refused(tmp_path: Path) -> None:
    """Signed before manifests bound store and sequence: replayable anywhere, refused."""
    keys = make_keys(tmp_path / "keys")
    store = LocalStore(tmp_path / "store")
    model = tmp_path / "build" / "model.onnx"
    write_mlp(model, 1, in_dim=8)
    legacy = Manifest("mlp", "v1", "model.onnx", sha256_file(model), model.stat().st_size)
    data = legacy.to_bytes()
    verifier = Verifier(load_trusted_keys(keys.public), store.scope)
    with pytest.raises(VerificationError) as info:
        verifier.manifest("mlp", "v1", data, sign(load_private_key(keys.private), data))
    assert info.value.reason == "unbound" and "store, sequence" in info.value.message
    assert Manifest.from_bytes(data).unbound() == ["store", "sequence"]  # the server reads it


@pytest.mark.parametrize(
    "field, value",
    [("sequence", "7"), ("sequence", -1), ("sequence", True), ("store", 3), ("size", "5")],
)
def test_binding_fields_of_the_wrong_type_are_not_a_manifest(field: str, value: object) -> None:
    raw = json.loads(Manifest("mlp", "v1", "model.onnx", "a" * 64, 5, store="file:").to_bytes())
    raw[field] = value
    with pytest.raises(ManifestError, match=field):
        Manifest.from_bytes(json.dumps(raw).encode())


def test_publish_refuses_to_overwrite_a_version_without_force(tmp_path: Path) -> None:
    keys = make_keys(tmp_path / "keys")
    store = tmp_path / "store"
    first, second = tmp_path / "a" / "model.onnx", tmp_path / "b" / "model.onnx"
    write_mlp(first, 1, in_dim=8)
    write_mlp(second, 2, in_dim=8)
    manifest_path = store / "mlp" / "v1" / "manifest.json"

    def cli_publish(path: Path, *extra: str):  # type: ignore[no-untyped-def]
        return sidecar_cli(
            "publish", "--store", f"file://{store}", "--model", "mlp", "--version", "v1",
            "--file", str(path), "--key", str(keys.private), *extra,
        )  # fmt: skip

    assert cli_publish(first).returncode == 0
    published = manifest_path.read_bytes()
    refused = cli_publish(second)
    assert refused.returncode == 1
    assert "published already" in refused.stderr and "--force" in refused.stderr
    assert manifest_path.read_bytes() == published  # nothing changed in the store
    assert sha256_file(store / "mlp" / "v1" / "model.onnx") == sha256_file(first)

    forced = cli_publish(second, "--force")
    assert forced.returncode == 0, forced.stderr
    before, after = Manifest.from_bytes(published), Manifest.from_bytes(manifest_path.read_bytes())
    assert after.sha256 == sha256_file(second) and after.store == "file:"
    assert before.sequence is not None and after.sequence is not None
    assert after.sequence > before.sequence


def test_the_publish_sequence_grows_even_when_the_clock_is_behind(tmp_path: Path) -> None:
    keys = make_keys(tmp_path / "keys")
    store = LocalStore(tmp_path / "store")
    model = tmp_path / "build" / "model.onnx"
    write_mlp(model, 1, in_dim=8)
    ahead = time.time_ns() + 10**18  # published from a machine whose clock is far ahead
    future = Manifest("mlp", "v1", "model.onnx", "a" * 64, 5, store="file:", sequence=ahead)
    store.write("mlp/v1/manifest.json", future.to_bytes())
    with pytest.raises(PublishRefused):
        publish(store, "mlp", "v1", model, keys.private)
    assert publish(store, "mlp", "v1", model, keys.private, force=True).sequence == ahead + 1


# --- several trusted keys (rotation) ------------------------------------------------


async def test_a_bundle_or_a_directory_of_keys_trusts_each_of_them(tmp_path: Path) -> None:
    old, new = make_keys(tmp_path / "k", "old"), make_keys(tmp_path / "k", "new")
    rogue = make_keys(tmp_path / "k", "rogue")
    store = LocalStore(tmp_path / "store")
    publish_versions(store, old, tmp_path, {"v1": 1})
    publish_versions(store, new, tmp_path, {"v2": 2})
    publish_versions(store, rogue, tmp_path, {"v3": 3})
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(old.public.read_bytes() + new.public.read_bytes())
    directory = tmp_path / "keys.d"  # as a mounted Secret: hidden entries, other files
    (directory / "..data").mkdir(parents=True)
    shutil.copy(old.public, directory / "2024.pem")
    shutil.copy(new.public, directory / "2025.pem")
    (directory / "README").write_text("rotation: add the new key, then drop the old one\n")
    for trusted in (bundle, directory):
        keys = load_trusted_keys(trusted)
        assert len(keys) == 2
        verifier = Verifier(keys, store.scope)
        for version, accepted in (("v1", True), ("v2", True), ("v3", False)):
            data = read_object(store, f"mlp/{version}/manifest.json", BIG)
            signature = read_object(store, f"mlp/{version}/manifest.sig", BIG)
            if accepted:
                assert verifier.manifest("mlp", version, data, signature).version == version
            else:
                with pytest.raises(VerificationError, match="any of the 2 trusted"):
                    verifier.manifest("mlp", version, data, signature)


def test_init_trusts_the_second_key_of_a_bundle_and_refuses_a_private_one(
    tmp_path: Path,
) -> None:
    old, new = make_keys(tmp_path / "k", "old"), make_keys(tmp_path / "k", "new")
    store = tmp_path / "store"
    publish_versions(LocalStore(store), new, tmp_path, {"v2": 2})
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(old.public.read_bytes() + new.public.read_bytes())

    def init(public_key: Path, volume: Path):  # type: ignore[no-untyped-def]
        return sidecar_cli(
            "init", "--store", f"file://{store}", "--volume", str(volume), "--model", "mlp",
            "--public-key", str(public_key), "--version", "v2", "--start-jitter-seconds", "0",
        )  # fmt: skip

    done = init(bundle, tmp_path / "volume")
    assert done.returncode == 0, done.stderr
    assert "trusting 2 signing key(s)" in done.stderr
    assert (tmp_path / "volume" / "mlp" / "v2" / "model.onnx").is_file()

    mistaken = tmp_path / "mistaken.pem"  # a private key pasted into the trusted bundle
    mistaken.write_bytes(old.public.read_bytes() + new.private.read_bytes())
    refused = init(mistaken, tmp_path / "volume2")
    assert refused.returncode != 0
    assert "PrivateKey block; only public keys are trusted" in refused.stderr
    assert not (tmp_path / "volume2" / "mlp").exists()


# --- downloads bounded by the manifest ----------------------------------------------


@pytest.mark.s3
async def test_an_object_larger_or_smaller_than_its_manifest_is_refused_unread(
    bucket: S3Store, tmp_path: Path
) -> None:
    keys = make_keys(tmp_path / "keys")
    publish_versions(bucket, keys, tmp_path, {"v1": 1, "v2": 2, "v3": 3})
    huge = tmp_path / "huge.bin"
    huge.write_bytes(os.urandom(1 << 20) * 24)  # 24 MiB where the manifest says a few KiB
    bucket.upload("mlp/v2/model.onnx", huge)
    bucket.write("mlp/v3/model.onnx", b"short")
    volume, podinfo = tmp_path / "volume", tmp_path / "annotations"
    set_target(podinfo, "v1")
    fetcher = make_fetcher(bucket, keys, volume, publish_window_s=0)  # tampered long after
    await fetcher.fetch("mlp", "v1")
    read_before = fetcher.received_bytes
    client = await start_server(volume, tmp_path / "ctl.sock")
    try:
        watcher = make_watcher(fetcher, tmp_path / "ctl.sock", podinfo, tmp_path / "status.json")
        assert await watcher.step() == "ok"
        for version, words in (("v2", "24"), ("v3", "5 bytes")):
            set_target(podinfo, version)
            assert await watcher.step() == "refused"
            status = read_status(tmp_path / "status.json")
            assert (status["state"], status["code"], status["serving"]) == (
                "refused",
                "size_mismatch",
                "v1",
            )
            assert words.split()[0] in status["reason"]
            assert not (volume / "mlp" / version).exists()
            assert downloads_left(volume) == []
            assert await watcher.step() == "refused"  # not tried again at once
        manifest_size = Manifest.from_bytes(read_object(bucket, "mlp/v2/manifest.json", BIG)).size
        assert fetcher.received_bytes - read_before <= manifest_size + 1
        assert watcher.metrics.fetches.labels("mlp", "refused")._value.get() == 2
    finally:
        await client.close()


@pytest.mark.parametrize("kind", ["s3", "local"])
async def test_a_full_volume_is_its_own_reason_and_leaves_nothing_behind(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A 3 MiB volume: a correct 5 MiB version does not fit (volume_full, retried with
    backoff); a 24 MiB object whose manifest says a few KiB is refused before a byte of
    it lands (size_mismatch), not reported as a store outage."""
    store: ModelStore = (
        request.getfixturevalue("bucket") if kind == "s3" else LocalStore(tmp_path / "store")
    )
    keys = make_keys(tmp_path / "keys")
    publish_versions(store, keys, tmp_path, {"v1": 1, "v3": 3})
    publish_versions(store, keys, tmp_path, {"v2": 2}, hidden=800, depth=4)  # about 5 MiB
    huge = tmp_path / "huge.bin"
    huge.write_bytes(os.urandom(1 << 20) * 24)
    store.upload("mlp/v3/model.onnx", huge)
    with small_filesystem(tmp_path / "volume", 3) as volume:
        podinfo = tmp_path / "annotations"
        set_target(podinfo, "v1")
        fetcher = make_fetcher(store, keys, volume, publish_window_s=0)  # tampered long after
        await fetcher.fetch("mlp", "v1")
        client = await start_server(volume, tmp_path / "ctl.sock")
        try:
            status_file = volume / ".sidecar-status.json"  # where the pod keeps it
            watcher = make_watcher(fetcher, tmp_path / "ctl.sock", podinfo, status_file)
            assert await watcher.step() == "ok"
            set_target(podinfo, "v2")
            for attempt in (1, 2):
                assert await watcher.step() == "error"
                status = read_status(status_file)
                assert (status["state"], status["code"], status["serving"]) == (
                    "error",
                    "volume_full",
                    "v1",
                ), status
                assert "no space left" in status["reason"]
                assert downloads_left(volume) == []  # the space is given back
                assert watcher.failures == attempt  # each failed cycle waits longer
            set_target(podinfo, "v3")
            assert await watcher.step() == "refused"
            assert read_status(status_file)["code"] == "size_mismatch"
            assert downloads_left(volume) == []
        finally:
            await client.close()


# --- permanent store errors ---------------------------------------------------------


@pytest.mark.s3
async def test_bad_credentials_and_a_missing_version_are_refused_not_hammered(
    s3_env: SeaweedFS, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3_env.create_bucket("models")
    prefix = f"team-{uuid.uuid4().hex[:10]}"
    good = S3Store("models", prefix, endpoint_url=s3_env.endpoint)
    keys = make_keys(tmp_path / "keys")
    publish_versions(good, keys, tmp_path, {"v1": 1})
    secret = os.environ["AWS_SECRET_ACCESS_KEY"]
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    wrong = S3Store("models", prefix, endpoint_url=s3_env.endpoint)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    volume, podinfo = tmp_path / "volume", tmp_path / "annotations"
    set_target(podinfo, "v1")
    client = await start_server(volume, tmp_path / "ctl.sock")
    try:
        for store, version, code in ((wrong, "v1", "bad_credentials"), (good, "v404", "not_found")):
            set_target(podinfo, version)
            watcher = make_watcher(
                make_fetcher(store, keys, volume), tmp_path / "ctl.sock", podinfo, tmp_path / "s"
            )
            assert await watcher.step() == "refused"
            status = read_status(tmp_path / "s")
            assert (status["state"], status["code"]) == ("refused", code), status
            assert await watcher.step() == "refused"  # the store is not asked again
            assert watcher.metrics.fetches.labels("mlp", "refused")._value.get() == 1
            assert watcher.failures == 0
    finally:
        await client.close()


@pytest.mark.s3
async def test_init_with_bad_credentials_fails_at_once_with_the_reason(
    s3_env: SeaweedFS,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    s3_env.create_bucket("models")
    store = S3Store("models", f"team-{uuid.uuid4().hex[:10]}", endpoint_url=s3_env.endpoint)
    keys = make_keys(tmp_path / "keys")
    publish_versions(store, keys, tmp_path, {"v1": 1})
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    wrong = S3Store(store.bucket, store.prefix, endpoint_url=s3_env.endpoint)
    fetcher = make_fetcher(wrong, keys, tmp_path / "volume")
    assert await pre_pull(fetcher, "mlp", "v1", "v1") == 1
    assert "cannot pre-pull mlp:v1: bad_credentials:" in caplog.text
    assert "retry" not in caplog.text  # a permanent error is not retried
    assert not (tmp_path / "volume" / "mlp" / "v1").exists()


def test_publisher_and_sidecar_name_a_store_alike(tmp_path: Path) -> None:
    """The scope a manifest binds is what the pod's store URL parses to: the same bucket
    and prefix whatever the endpoint or slashes, and any directory store alike (the
    publisher's path and the pod's mount differ)."""
    from model_rollout_contract.layout import StoreUrl

    assert StoreUrl.parse("s3://models/team-a/").scope == "s3://models/team-a"
    assert StoreUrl.parse("s3://models").scope == "s3://models"
    assert S3Store("models", "/team-a/", endpoint_url="http://127.0.0.1:1").scope == (
        StoreUrl.parse("s3://models/team-a").scope
    )
    assert LocalStore(tmp_path).scope == StoreUrl.parse("file:///store").scope == "file:"


# --- publish --force while sidecars fetch (issue 13 follow-up) ----------------------


@pytest.mark.parametrize("pause_before", [2, 3], ids=["after one write", "after two writes"])
async def test_a_fetch_during_publish_force_is_tried_again_not_refused(
    tmp_path: Path, pause_before: int
) -> None:
    """``publish --force`` replaces three objects one at a time. A sidecar fetching in
    between used to refuse the version (digest or signature mismatch) for a backoff
    period; now it finds a manifest written moments ago that does not match yet, says
    publish_in_progress (transient), and the fetch after the publish takes the new build."""
    keys = make_keys(tmp_path / "keys")
    store = LocalStore(tmp_path / "store")
    first, second = tmp_path / "a" / "model.onnx", tmp_path / "b" / "model.onnx"
    write_mlp(first, 1, in_dim=8)
    write_mlp(second, 2, in_dim=8, hidden=24)  # another size too
    publish(store, "mlp", "v1", first, keys.private)
    writer = PausedPublish(tmp_path / "store", pause_before)
    publishing = threading.Thread(
        target=publish, args=(writer, "mlp", "v1", second, keys.private), kwargs={"force": True}
    )
    publishing.start()
    try:
        assert await asyncio.to_thread(writer.paused.wait, 60)
        volume = tmp_path / "volume"
        fetcher = make_fetcher(store, keys, volume)  # a pod starting now
        with pytest.raises(StoreError) as caught:
            await fetcher.fetch("mlp", "v1")
        assert (caught.value.transient, caught.value.code) == (True, "publish_in_progress")
        assert not (volume / "mlp" / "v1").exists()  # nothing unverified, nothing refused
    finally:
        writer.resume.set()
        await asyncio.to_thread(publishing.join, 60)
    fetched = await fetcher.fetch("mlp", "v1")
    assert fetched.local.manifest.sha256 == sha256_file(second)


def _sign_as_published(
    store: LocalStore, keys_private: Path, file: Path, seconds_ago: float
) -> None:
    """Publish ``file`` as mlp:v1 with a manifest that says it was written that long ago."""
    created = time.gmtime(time.time() - seconds_ago)
    manifest = Manifest(
        "mlp", "v1", "model.onnx", sha256_file(file), file.stat().st_size,
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", created),
        store=store.scope, sequence=time.time_ns(),
    )  # fmt: skip
    data = manifest.to_bytes()
    store.upload("mlp/v1/model.onnx", file)
    store.write("mlp/v1/manifest.sig", sign(load_private_key(keys_private), data))
    store.write("mlp/v1/manifest.json", data)


async def test_a_mismatch_under_an_old_unchanged_manifest_is_still_refused(
    tmp_path: Path,
) -> None:
    keys = make_keys(tmp_path / "keys")
    store = LocalStore(tmp_path / "store")
    model, other = tmp_path / "a" / "model.onnx", tmp_path / "b" / "model.onnx"
    write_mlp(model, 1, in_dim=8)
    write_mlp(other, 2, in_dim=8)  # the same size, other bytes
    _sign_as_published(store, keys.private, model, seconds_ago=3 * PUBLISH_WINDOW_S)
    store.upload("mlp/v1/model.onnx", other)  # tampered long after its publish
    with pytest.raises(VerificationError) as caught:
        await make_fetcher(store, keys, tmp_path / "volume").fetch("mlp", "v1")
    assert caught.value.reason == "digest_mismatch"
    _sign_as_published(store, keys.private, model, seconds_ago=60)  # published a minute ago
    store.upload("mlp/v1/model.onnx", other)
    with pytest.raises(StoreError) as transient:
        await make_fetcher(store, keys, tmp_path / "volume").fetch("mlp", "v1")
    assert transient.value.code == "publish_in_progress" and "s ago" in transient.value.message
