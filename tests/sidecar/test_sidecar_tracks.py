"""Tenant models on one pod: a sidecar per track (model_rollout_contract.tracks), each
following only its own track's annotations, fetching from its tenant's prefix in the
store, verifying with its tenant's keys and writing its tenant's part of the volume,
while the others keep serving."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from model_rollout_contract import argv
from model_rollout_contract.layout import INCOMING_DIR
from model_rollout_contract.tracks import DEFAULT_TRACK, InvalidTrack, track_keys
from model_rollout_e2e.control_plane import ControlPlane
from model_rollout_e2e.onnx_models import write_mlp
from model_rollout_e2e.processes import ChildProcess
from model_server.app import ModelServer
from model_server.config import ServerConfig
from model_sidecar.config import FetchConfig, WatchConfig, parse_args
from model_sidecar.errors import UnsafeVolume, VerificationError
from model_sidecar.fetcher import incoming_area
from model_sidecar.kube import PodSnapshot
from model_sidecar.pod_watch import PodWatch
from model_sidecar.publish import publish
from model_sidecar.store import LocalStore
from model_sidecar.volume import SafeDir
from tests.support.server import write_tenants
from tests.support.sidecar import Keys, downloads_left, make_fetcher, make_keys, sidecar_cli
from tests.support.sidecar_pod import SidecarPod, sidecar_pod

POD = "shared-000"
ACME, GLOBEX = track_keys("acme-mlp"), track_keys("globex-mlp")
UNTRUSTED = ("bad_signature", "publish_in_progress")


def test_a_named_track_has_keys_of_its_own_and_the_default_track_keeps_its_keys() -> None:
    assert DEFAULT_TRACK.target == "serving.model-rollout.io/target-version"
    assert DEFAULT_TRACK.sidecar_status == "serving.model-rollout.io/sidecar-status"
    assert DEFAULT_TRACK.configmap_key == argv.CONFIGMAP_TARGET.rsplit("/", 1)[1]
    assert ACME.target == "serving.model-rollout.io/target-version.acme-mlp"
    assert ACME.traffic == "serving.model-rollout.io/traffic.acme-mlp"
    assert ACME.configmap_key == "target-version.acme-mlp"
    every = [*DEFAULT_TRACK.followed, DEFAULT_TRACK.sidecar_status]
    assert not set(every) & {*ACME.followed, ACME.sidecar_status}
    longest = track_keys("a" * 40)  # an annotation's name part is at most 63 characters
    for key in (longest.target, longest.previous, longest.traffic, longest.sidecar_status):
        assert len(key.split("/", 1)[1]) <= 63
    for bad in ("", "Acme", "a" * 41, "-acme", "acme-", "a.b", "a/b", "a_b"):
        with pytest.raises(InvalidTrack):
            track_keys(bad)


def test_a_tracks_sidecar_flags_are_parsed_by_the_sidecar_itself() -> None:
    args = argv.SidecarArgs(
        "acme/mlp", "s3://bucket/models", track="acme-mlp", own_keys=True, metrics_port=9101
    )
    watch = parse_args(argv.sidecar_argv("watch", args)[1:])
    assert isinstance(watch, WatchConfig)
    assert (watch.fetch.model, watch.fetch.track) == ("acme/mlp", "acme-mlp")
    assert watch.fetch.configmap_file == Path(argv.CONFIG_DIR) / "target-version.acme-mlp"
    assert watch.fetch.public_key == Path(f"{argv.KEYS_DIR}-acme-mlp")
    assert watch.status_file != Path(argv.STATUS_FILE) and watch.metrics_port == 9101
    default = parse_args(argv.sidecar_argv("watch", argv.SidecarArgs("mlp", "s3://b/m"))[1:])
    assert isinstance(default, WatchConfig) and default.fetch.track is None
    assert default.fetch.configmap_file == Path(argv.CONFIGMAP_TARGET)
    assert default.status_file == Path(argv.STATUS_FILE)
    tenant = argv.SidecarArgs("acme/mlp", "s3://b/m", track="acme-mlp")
    shared = parse_args(argv.sidecar_argv("init", tenant)[1:])
    assert not isinstance(shared, WatchConfig) and hasattr(shared, "fetch")
    fetch: FetchConfig = shared.fetch  # type: ignore[union-attr]
    assert fetch.public_key == Path(argv.KEYS_DIR)  # no keys of its own: the deployment's


def test_a_pod_watch_wakes_only_for_its_own_tracks_annotations() -> None:
    watch = PodWatch(None, keys=ACME)  # type: ignore[arg-type]  # _update needs no API
    watch._update(PodSnapshot({ACME.target: "a1"}, "1"))
    watch.changed.clear()
    watch._update(PodSnapshot({ACME.target: "a1", DEFAULT_TRACK.target: "v9"}, "2"))
    watch._update(PodSnapshot({ACME.target: "a1", GLOBEX.target: "g9"}, "3"))
    assert not watch.changed.is_set()
    watch._update(PodSnapshot({ACME.target: "a2"}, "4"))
    assert watch.changed.is_set()


def test_a_restarted_sidecar_sweeps_only_its_own_downloads(tmp_path: Path) -> None:
    keys = make_keys(tmp_path / "keys")
    volume = tmp_path / "volume"
    fetcher = make_fetcher(LocalStore(tmp_path / "store"), keys, volume)
    incoming = volume / INCOMING_DIR
    for model in ("acme/mlp", "globex/mlp", "mlp"):
        (incoming / incoming_area(model) / "v1-0000").mkdir(parents=True)
        (incoming / incoming_area(model) / "v1-0000" / "model.onnx").write_bytes(b"half")
    (incoming / "mlp-v1-dead").mkdir()  # a sidecar of the previous release's layout
    swept = fetcher.sweep_incoming("acme/mlp")
    assert sorted(swept) == ["mlp-v1-dead", "v1-0000"]
    assert downloads_left(volume) == ["+mlp/v1-0000", "globex+mlp/v1-0000"]
    assert incoming_area("mlp") != incoming_area("acme/mlp")


def test_a_link_at_the_tenants_directory_is_refused(tmp_path: Path) -> None:
    volume, outside = tmp_path / "volume", tmp_path / "outside"
    (outside / "mlp").mkdir(parents=True)
    volume.mkdir()
    (volume / "acme").symlink_to(outside, target_is_directory=True)
    with SafeDir.open(volume) as root, pytest.raises(UnsafeVolume, match="symbolic link"):
        root.model_dir("acme/mlp", create=True)
    assert list((outside / "mlp").iterdir()) == []


async def test_another_tenants_manifest_is_refused_though_its_signature_verifies(
    tmp_path: Path,
) -> None:
    """Tenants that share the deployment's key: the signed manifest binds the model, so
    globex's version copied into acme's prefix is not acme's."""
    keys = make_keys(tmp_path / "keys")
    store = LocalStore(tmp_path / "store")
    publish_tenant(store, keys, tmp_path, "globex/mlp", {"g1": 3})
    copy_version(tmp_path / "store", "globex/mlp", "acme/mlp", "g1")
    fetcher = make_fetcher(store, keys, tmp_path / "volume")
    with pytest.raises(VerificationError, match="manifest is for globex/mlp:g1") as refused:
        await fetcher.fetch("acme/mlp", "g1")
    assert refused.value.code == "bad_manifest"
    assert (await fetcher.fetch("globex/mlp", "g1")).local.directory == (
        tmp_path / "volume" / "globex" / "mlp" / "g1"
    )
    assert not (tmp_path / "volume" / "acme" / "mlp" / "g1").exists()


def test_a_tenant_model_is_published_under_its_tenants_prefix(tmp_path: Path) -> None:
    keys = make_keys(tmp_path / "keys")
    store = LocalStore(tmp_path / "store")
    model = tmp_path / "model.onnx"
    write_mlp(model, 1, in_dim=8)
    manifest = publish(store, "acme/mlp", "a1", model, keys.private)
    assert manifest.model == "acme/mlp"
    assert sorted(p.name for p in (tmp_path / "store" / "acme" / "mlp" / "a1").iterdir()) == [
        "manifest.json",
        "manifest.sig",
        "model.onnx",
    ]


# --- two tenants' sidecars on one pod, as real processes ---------------------------------


@pytest.fixture
def pod(control_plane: ControlPlane) -> Iterator[SidecarPod]:
    """The shared pod on a real API server; its sidecars act as its ServiceAccount."""
    with sidecar_pod(control_plane, "tracks", POD) as created:
        yield created


def publish_tenant(store: LocalStore, keys: Keys, work: Path, model: str, seeds: dict) -> None:
    for version, seed in seeds.items():
        path = work / "build" / model / version / "model.onnx"
        write_mlp(path, seed, in_dim=8)
        publish(store, model, version, path, keys.private)


def copy_version(store: Path, source: str, target: str, version: str) -> None:
    shutil.copytree(store / source / version, store / target / version)


def sidecar(tmp: Path, pod: SidecarPod, tenant: str, track: str, keys: Path) -> ChildProcess:
    """``model-sidecar watch`` for one tenant's track, as the pod runs it: the in-cluster
    client with the pod's projected ServiceAccount volume (a token bound to the pod)."""
    account = pod.service_account_volume(tmp / f"serviceaccount-{track}")
    return ChildProcess(
        "model_rollout_e2e.in_pod",
        [
            str(account),
            "model_sidecar",
            "watch",
            "--store",
            f"file://{tmp / 'store'}",
            "--volume",
            str(tmp / "volume"),
            "--model",
            f"{tenant}/mlp",
            "--track",
            track,
            "--public-key",
            str(keys),
            "--control-socket",
            str(tmp / "ctl.sock"),
            "--status-file",
            str(tmp / "volume" / f".sidecar-status.{track}.json"),
            "--pod-name",
            pod.name,
            "--pod-namespace",
            pod.namespace,
            "--poll-seconds",
            "0.2",
            "--jitter-seconds",
            "0.05",
            "--start-jitter-seconds",
            "0",
            "--backoff-base-seconds",
            "0.1",
            "--backoff-max-seconds",
            "0.5",
        ],
        tmp / f"sidecar-{track}.log",
        env=pod.in_cluster_env(),
    ).start()


async def served(client: TestClient, key: str) -> str:
    body = {"inputs": [{"name": "input", "shape": [1, 8], "datatype": "FP32", "data": [1.0] * 8}]}
    response = await client.post(
        "/v2/models/mlp/infer", json=body, headers={"Authorization": f"Bearer {key}"}
    )
    answer: dict[str, Any] = await response.json()
    assert response.status == 200, answer
    return str(answer["model_version"])


async def report(pod: SidecarPod, annotation: str) -> dict[str, Any]:
    text = (await asyncio.to_thread(pod.annotations)).get(annotation)
    return json.loads(text) if text else {}


async def until(check: Any, what: str, timeout_s: float = 60.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not await check():
            await asyncio.sleep(0.1)


async def test_each_tenants_sidecar_rolls_its_own_model_while_the_other_keeps_serving(
    pod: SidecarPod, tmp_path: Path
) -> None:
    store = LocalStore(tmp_path / "store")
    acme_keys, globex_keys = make_keys(tmp_path / "acme"), make_keys(tmp_path / "globex")
    publish_tenant(store, acme_keys, tmp_path, "acme/mlp", {"a1": 1, "a2": 2})
    publish_tenant(store, globex_keys, tmp_path, "globex/mlp", {"g1": 3})
    # in acme's prefix, a version signed by globex's key, and globex's g1 copied there:
    # acme's sidecar trusts acme's key only
    publish_tenant(store, globex_keys, tmp_path, "acme/mlp", {"a3": 4})
    copy_version(tmp_path / "store", "globex/mlp", "acme/mlp", "g1")
    tenants = write_tenants(tmp_path / "tenants.yaml")
    volume = tmp_path / "volume"
    volume.mkdir()
    config = ServerConfig(
        repository=volume, tenants_file=tenants, control_socket=tmp_path / "ctl.sock"
    )
    pod.annotate({ACME.target: "a1", GLOBEX.target: "g1"})
    async with TestClient(TestServer(ModelServer(config).make_app())) as client:
        procs = [
            sidecar(tmp_path, pod, "acme", "acme-mlp", acme_keys.public),
            sidecar(tmp_path, pod, "globex", "globex-mlp", globex_keys.public),
        ]
        globex_answers: list[str] = []
        stop = asyncio.Event()

        async def globex_load() -> None:
            while not stop.is_set():
                globex_answers.append(await served(client, "key-globex"))
                await asyncio.sleep(0.005)

        async def serving(annotation: str, version: str) -> bool:
            r = await report(pod, annotation)
            return r.get("serving") == version and r.get("state") == "ok"

        try:
            await until(lambda: serving(ACME.sidecar_status, "a1"), "acme on a1")
            await until(lambda: serving(GLOBEX.sidecar_status, "g1"), "globex on g1")
            assert await served(client, "key-acme") == "a1"
            load = asyncio.create_task(globex_load())
            for version in ("a2", "a1"):  # a rollout, then a rollback (a pointer swap)
                await asyncio.to_thread(pod.annotate, {ACME.target: version})
                await until(lambda v=version: serving(ACME.sidecar_status, v), f"acme {version}")
                assert await served(client, "key-acme") == version
            for version in ("a3", "g1"):
                await asyncio.to_thread(pod.annotate, {ACME.target: version})

                async def refused(v: str = version) -> bool:
                    r = await report(pod, ACME.sidecar_status)
                    # within the publish window a bad signature may be an upload under
                    # way: tried again, never served (model_sidecar.publish_window)
                    return r.get("target") == v and r.get("code") in UNTRUSTED

                await until(refused, f"acme refuses {version}")
                acme = await report(pod, ACME.sidecar_status)
                assert acme["serving"] == "a1", acme
                assert "does not verify against any of the 1 trusted" in acme["reason"], acme
                assert await served(client, "key-acme") == "a1"
            stop.set()
            await load
            assert globex_answers and set(globex_answers) == {"g1"}
            globex = await report(pod, GLOBEX.sidecar_status)
            assert globex["target"] == "g1" and globex["serving"] == "g1"
            assert DEFAULT_TRACK.sidecar_status not in await asyncio.to_thread(pod.annotations)
            assert (volume / "acme" / "mlp" / "a2").is_dir()
            assert not (volume / "acme" / "mlp" / "a3").exists()
            assert sorted(p.name for p in (volume / "globex" / "mlp").iterdir() if p.is_dir()) == [
                "g1"
            ]
        finally:
            stop.set()
            for proc in procs:
                proc.stop()


def test_a_tenant_models_pre_pull_never_holds_the_pod_back(tmp_path: Path) -> None:
    """A tenant version not (yet) in the store: its init container exits 0 so the pod
    starts for everybody else, and its watch sidecar retries and reports; the deployment's
    own model's pre-pull still fails the pod (nothing to serve)."""
    keys = make_keys(tmp_path / "keys")
    common = [
        "init", "--store", f"file://{tmp_path / 'store'}", "--volume", str(tmp_path / "v"),
        "--public-key", str(keys.public), "--version", "a1", "--start-jitter-seconds", "0",
        "--retries", "1",
    ]  # fmt: skip
    tenant = sidecar_cli(*common, "--model", "acme/mlp", "--track", "acme-mlp")
    assert tenant.returncode == 0, tenant.stderr
    assert "acme/mlp: not pre-pulled" in tenant.stderr and "not_found" in tenant.stderr
    own = sidecar_cli(*common, "--model", "mlp")
    assert own.returncode != 0
