"""Sidecar against a real S3 server (SeaweedFS) and the real inference server."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from model_rollout_contract.annotations import TARGET_VERSION, format_downward_annotations
from model_rollout_e2e.onnx_models import MlpWeights, reference_forward
from model_rollout_e2e.seaweed import SeaweedFS
from model_server.app import SERVER
from model_sidecar.store import S3Store
from tests.support.server import infer_body
from tests.support.sidecar import (
    downloads_left,
    make_fetcher,
    make_keys,
    make_watcher,
    publish_versions,
    set_target,
    start_server,
)

pytestmark = pytest.mark.s3
X = np.ones((1, 8), np.float32)


def init_cli(store: S3Store, volume: Path, keys, annotations: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "model_sidecar",
            "init",
            "--store",
            store.description,
            "--s3-endpoint",
            store.client.meta.endpoint_url,
            "--volume",
            str(volume),
            "--model",
            "mlp",
            "--public-key",
            str(keys.public),
            "--annotations-file",
            str(annotations),
            "--retries",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def expected(seed: int) -> np.ndarray:
    return reference_forward(MlpWeights.random(seed, 8, 16, 4, 3), X)


async def until(watcher, state: str, tries: int = 60) -> str:
    for _ in range(tries):
        got = await watcher.step()
        if got == state:
            return got
        await asyncio.sleep(0.05)
    return got


async def test_init_then_watch_swaps_under_load(bucket: S3Store, tmp_path: Path) -> None:
    keys = make_keys(tmp_path / "keys")
    publish_versions(bucket, keys, tmp_path, {"v1": 1, "v2": 2})
    assert bucket.list_children("mlp") == ["v1", "v2"]
    volume, podinfo = tmp_path / "volume", tmp_path / "podinfo" / "annotations"
    podinfo.parent.mkdir()
    set_target(podinfo, "v1")
    proc = init_cli(bucket, volume, keys, podinfo)
    assert proc.returncode == 0, proc.stderr
    assert (volume / "mlp" / "CURRENT").read_text().strip() == "v1"

    client = await start_server(volume, tmp_path / "ctl.sock")
    try:
        watcher = make_watcher(
            make_fetcher(bucket, keys, volume),
            tmp_path / "ctl.sock",
            podinfo,
            tmp_path / "status.json",
        )
        assert await watcher.step() == "ok"
        seen: Counter = Counter()
        failures: list = []
        done = asyncio.Event()

        async def load() -> None:
            while not done.is_set():
                response = await client.post("/v2/models/mlp/infer", json=infer_body(X))
                if response.status != 200:
                    failures.append(await response.text())
                    continue
                answer = await response.json()
                got = np.asarray(answer["outputs"][0]["data"], np.float32).reshape(1, 4)
                seed = int(answer["model_version"][1:])
                assert np.allclose(got, expected(seed), atol=1e-4)
                seen[answer["model_version"]] += 1

        workers = [asyncio.create_task(load()) for _ in range(8)]
        await asyncio.sleep(0.2)
        set_target(podinfo, "v2")
        assert await until(watcher, "ok") == "ok"
        await asyncio.sleep(0.2)
        done.set()
        await asyncio.gather(*workers)
        assert failures == []
        assert seen["v1"] > 0 and seen["v2"] > 0
        status = json.loads((tmp_path / "status.json").read_text())
        assert (status["state"], status["serving"], status["target"]) == ("ok", "v2", "v2")
        assert client.app[SERVER].manager.slot("mlp").current.version == "v2"  # type: ignore[union-attr]
    finally:
        await client.close()


async def test_tampered_wrong_key_and_unsigned_are_refused(bucket: S3Store, tmp_path: Path) -> None:
    keys, rogue = make_keys(tmp_path / "keys"), make_keys(tmp_path / "keys", "rogue")
    files = publish_versions(bucket, keys, tmp_path, {"v1": 1, "v2": 2, "v4": 4})
    publish_versions(bucket, rogue, tmp_path, {"v3": 3})  # signed by an untrusted key
    bucket.upload("mlp/v2/model.onnx", files["v4"])  # tampered: bytes no longer match
    bucket.client.delete_object(Bucket=bucket.bucket, Key=f"{bucket.prefix}/mlp/v4/manifest.sig")
    volume, podinfo = tmp_path / "volume", tmp_path / "annotations"
    set_target(podinfo, "v1")
    fetcher = make_fetcher(bucket, keys, volume, publish_window_s=0)  # tampered long after
    assert (await fetcher.fetch("mlp", "v1")).downloaded_bytes > 0
    client = await start_server(volume, tmp_path / "ctl.sock")
    try:
        watcher = make_watcher(fetcher, tmp_path / "ctl.sock", podinfo, tmp_path / "status.json")
        assert await watcher.step() == "ok"
        reasons = {}
        for version in ("v2", "v3", "v4"):
            set_target(podinfo, version)
            assert await watcher.step() == "refused"
            status = json.loads((tmp_path / "status.json").read_text())
            assert status["state"] == "refused" and status["serving"] == "v1"
            reasons[version] = status["reason"].split(":")[0]
            response = await client.post("/v2/models/mlp/infer", json=infer_body(X))
            assert (await response.json())["model_version"] == "v1"
            assert not (volume / "mlp" / version).exists()  # nothing unverified on disk
        assert reasons == {"v2": "digest_mismatch", "v3": "bad_signature", "v4": "unsigned"}
        assert await watcher.step() == "refused"  # not retried in a loop
        refusals = watcher.metrics.refusals
        assert refusals.labels("mlp", "unsigned")._value.get() == 1
    finally:
        await client.close()


async def test_server_down_is_retried(bucket: S3Store, tmp_path: Path) -> None:
    keys = make_keys(tmp_path / "keys")
    publish_versions(bucket, keys, tmp_path, {"v1": 1})
    volume, podinfo = tmp_path / "volume", tmp_path / "annotations"
    podinfo.write_text(format_downward_annotations({TARGET_VERSION: "v1"}))
    fetcher = make_fetcher(bucket, keys, volume)
    watcher = make_watcher(fetcher, tmp_path / "ctl.sock", podinfo, tmp_path / "status.json")
    assert await watcher.step() == "error"
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["code"] == "server_unavailable" and "not answering" in status["reason"]
    await fetcher.fetch("mlp", "v1")
    client = await start_server(volume, tmp_path / "ctl.sock")
    try:
        assert await watcher.step() == "ok"
    finally:
        await client.close()


async def test_s3_killed_mid_download(
    tmp_path: Path, s3_env: SeaweedFS, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dedicated S3 server dies while v2 streams in: nothing is swapped, the failure is
    reported, and once S3 is back the same watcher completes the swap."""
    s3 = SeaweedFS(tmp_path / "weed").start()
    try:
        s3.create_bucket("models")
        store = S3Store("models", endpoint_url=s3.endpoint)
        keys = make_keys(tmp_path / "keys")
        publish_versions(store, keys, tmp_path, {"v1": 1, "v2": 2}, hidden=1536, depth=4)
        volume, podinfo = tmp_path / "volume", tmp_path / "annotations"
        set_target(podinfo, "v1")
        fetcher = make_fetcher(store, keys, volume)
        await fetcher.fetch("mlp", "v1")
        client = await start_server(volume, tmp_path / "ctl.sock")
        try:
            watcher = make_watcher(
                fetcher, tmp_path / "ctl.sock", podinfo, tmp_path / "status.json"
            )
            assert await watcher.step() == "ok"

            from botocore.response import StreamingBody

            original = StreamingBody.read
            reads = []

            def dying(self, amt=None):  # type: ignore[no-untyped-def]
                reads.append(amt)
                if len(reads) == 2:
                    s3.kill()
                return original(self, amt)

            monkeypatch.setattr(StreamingBody, "read", dying)
            set_target(podinfo, "v2")
            assert await watcher.step() == "error"
            status = json.loads((tmp_path / "status.json").read_text())
            assert status["state"] == "error" and status["code"] == "store_unreachable", status
            assert status["serving"] == "v1"
            assert not (volume / "mlp" / "v2").exists()
            assert downloads_left(volume) == []
            response = await client.post("/v2/models/mlp/infer", json=infer_body(X))
            assert (await response.json())["model_version"] == "v1"

            monkeypatch.setattr(StreamingBody, "read", original)
            s3.start()  # same data directory and ports: the store comes back
            assert await until(watcher, "ok") == "ok"
            assert client.app[SERVER].manager.slot("mlp").current.version == "v2"  # type: ignore[union-attr]
        finally:
            await client.close()
    finally:
        s3.stop()
