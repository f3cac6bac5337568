"""Issue 11, the golden set's way from the publisher to the pod: ``publish --golden``
checks the file and names it (digest, size) in the signed manifest; init and watch fetch
and verify it like the model, into the version's directory, before the version is
renamed into place; the real server then runs it before the swap."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from model_rollout_contract.canary import GOLDEN_FILE
from model_rollout_contract.manifest import Manifest, ManifestError, sha256_file
from model_rollout_e2e.onnx_models import reference_forward, write_mlp
from model_rollout_e2e.seaweed import SeaweedFS
from model_sidecar.errors import StoreError, VerificationError
from model_sidecar.publish import publish
from model_sidecar.signing import load_private_key, load_trusted_keys, sign
from model_sidecar.store import LocalStore, S3Store, read_object
from model_sidecar.verify import Verifier
from tests.support.server import infer_body
from tests.support.sidecar import (
    Keys,
    PausedPublish,
    downloads_left,
    make_fetcher,
    make_keys,
    make_watcher,
    read_status,
    set_target,
    sidecar_cli,
    start_server,
)

X = np.random.default_rng(5).standard_normal((4, 8)).astype(np.float32)
BIG = 1 << 26


def build(work: Path, version: str, seed: int) -> tuple[Path, np.ndarray]:
    """A model file and what it answers to ``X``."""
    model = work / "build" / version / "model.onnx"
    weights = write_mlp(model, seed, in_dim=8)
    return model, reference_forward(weights, X)


def golden_file(path: Path, **arrays: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        np.savez(f, **arrays)  # type: ignore[arg-type]
    return path


def cli_publish(store: str, keys: Keys, version: str, model: Path, *extra: str) -> tuple[int, str]:
    done = sidecar_cli(
        "publish", "--store", store, "--model", "mlp", "--version", version,
        "--file", str(model), "--key", str(keys.private), *extra,
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr


# --- publish ----------------------------------------------------------------------------


@pytest.mark.s3
async def test_a_golden_set_is_signed_fetched_beside_the_model_and_run_by_the_server(
    bucket: S3Store, s3_env: SeaweedFS, tmp_path: Path
) -> None:
    keys = make_keys(tmp_path / "keys")
    url = f"s3://{bucket.bucket}/{bucket.prefix}"
    endpoint = ("--s3-endpoint", s3_env.endpoint)
    for version, seed, wrong in (("v1", 1, 0.0), ("v2", 2, 0.5)):
        model, answers = build(tmp_path, version, seed)
        golden = golden_file(
            tmp_path / version / "golden.npz",
            **{"input/input": X, "output/output": answers + wrong, "atol": np.float64(1e-4)},
        )
        code, output = cli_publish(url, keys, version, model, "--golden", str(golden), *endpoint)
        assert code == 0, output
        assert f"golden sha256={sha256_file(golden)}" in output
        data = read_object(bucket, f"mlp/{version}/manifest.json", BIG)
        assert json.loads(data)["golden"] == {
            "file": GOLDEN_FILE,
            "sha256": sha256_file(golden),
            "size": golden.stat().st_size,
        }
        signature = read_object(bucket, f"mlp/{version}/manifest.sig", BIG)
        verifier = Verifier(load_trusted_keys(keys.public), bucket.scope)
        assert verifier.manifest("mlp", version, data, signature).golden is not None
        assert read_object(bucket, f"mlp/{version}/{GOLDEN_FILE}", BIG) == golden.read_bytes()

    volume = tmp_path / "volume"
    done = sidecar_cli(
        "init", "--store", url, *endpoint, "--volume", str(volume), "--model", "mlp",
        "--public-key", str(keys.public), "--version", "v1", "--start-jitter-seconds", "0",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (volume / "mlp" / "v1" / GOLDEN_FILE).read_bytes() == (
        tmp_path / "v1" / "golden.npz"
    ).read_bytes()

    client = await start_server(volume, tmp_path / "ctl.sock")  # runs v1's golden set
    try:
        health = await (await client.get("/v1/models/mlp/health")).json()
        assert health["version"] == "v1", health
        podinfo, status_file = tmp_path / "annotations", tmp_path / "status.json"
        set_target(podinfo, "v2")  # its golden set expects other answers than it gives
        watcher = make_watcher(make_fetcher(bucket, keys, volume), tmp_path / "ctl.sock",
                               podinfo, status_file)  # fmt: skip
        assert await watcher.step() == "refused"
        report = read_status(status_file)
        assert (report["state"], report["serving"]) == ("refused", "v1"), report
        assert "golden set" in report["reason"]
        assert (volume / "mlp" / "v2" / GOLDEN_FILE).is_file()  # it was fetched and verified
        answer = await (await client.post("/v2/models/mlp/infer", json=infer_body(X))).json()
        assert answer["model_version"] == "v1"  # the old version keeps serving
    finally:
        await client.close()


Case = Callable[[Path, np.ndarray], None]


def _write(**arrays: object) -> Case:
    """These arrays; ``None`` stands for the model's own answers."""

    def write(path: Path, answers: np.ndarray) -> None:
        golden_file(path, **{k: answers if v is None else v for k, v in arrays.items()})

    return write


def _raw(data: bytes) -> Case:
    def write(path: Path, answers: np.ndarray) -> None:
        path.write_bytes(data)

    return write


def _one_array(path: Path, answers: np.ndarray) -> None:
    with path.open("wb") as f:
        np.save(f, X)


GOOD = {"input/input": X, "output/output": None}  # None: the model's own answers
MALFORMED: dict[str, tuple[Case, str]] = {
    "not a zip": (_raw(b"not an npz at all"), "not a readable .npz"),
    "one array": (_one_array, "one array, not a set of named arrays"),
    "pickled": (
        _write(**{"input/input": np.array([{"x": 1}], dtype=object), "output/output": None}),
        "allow_pickle",
    ),
    "unknown key": (_write(**GOOD, weights=X), "no known kind: ['weights']"),
    "empty name": (_write(**GOOD, **{"input/": X}), "no known kind"),
    "no output": (_write(**{"input/input": X}), "at least one"),
    "atol not one number": (_write(**GOOD, atol=np.ones(2)), "'atol' must be one number"),
    "rtol negative": (_write(**GOOD, rtol=np.float64(-1)), "'rtol' must be finite and not"),
    "atol nan": (_write(**GOOD, atol=np.float64("nan")), "'atol' must be finite"),
    "another input": (
        _write(**{"input/x": X, "output/output": None}),
        "gives inputs ['x']; the model takes ['input']",
    ),
    "another dtype": (
        _write(**{"input/input": X.astype(np.float64), "output/output": None}),
        "input 'input' is float64 [4, 8]",
    ),
    "another shape": (
        _write(**{"input/input": X[:, :4], "output/output": None}),
        "the model takes float32 ['batch', 8]",
    ),
    "unknown output": (
        _write(**{"input/input": X, "output/probs": None}),
        "outputs ['probs'] that the model does not produce",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_publish_refuses_a_malformed_golden_set_and_writes_nothing(
    tmp_path: Path, case: str
) -> None:
    keys = make_keys(tmp_path / "keys")
    model, answers = build(tmp_path, "v1", 1)
    write, reason = MALFORMED[case]
    golden = tmp_path / "golden.npz"
    write(golden, answers)
    store = tmp_path / "store"
    code, output = cli_publish(f"file://{store}", keys, "v1", model, "--golden", str(golden))
    assert code == 1, output
    assert f"--golden {golden}" in output and reason in output, output
    assert "Traceback" not in output
    assert not (store / "mlp").exists()  # refused before anything reached the store
    good = golden_file(tmp_path / "good.npz", **{"input/input": X, "output/output": answers})
    code, output = cli_publish(f"file://{store}", keys, "v1", model, "--golden", str(good))
    assert code == 0, output


def test_an_engine_golden_set_is_checked_for_its_format_only(tmp_path: Path) -> None:
    """No graph to compare an engine's inputs with: the keys and tolerances still count."""
    keys = make_keys(tmp_path / "keys")
    engine = tmp_path / "model.engine"
    engine.write_bytes(os.urandom(1000))
    store = LocalStore(tmp_path / "store")
    good = golden_file(tmp_path / "g.npz", **{"input/images": X, "output/scores": X})
    manifest = publish(store, "mlp", "v1", engine, keys.private, golden=good)
    assert manifest.golden is not None and manifest.golden.size == good.stat().st_size
    bad = golden_file(tmp_path / "b.npz", **{"input/images": X})
    code, output = cli_publish(
        f"file://{tmp_path / 's2'}", keys, "v1", engine, "--golden", str(bad)
    )
    assert code == 1 and "at least one" in output


# --- the manifest's field ---------------------------------------------------------------


@pytest.mark.parametrize(
    "golden, problem",
    [
        ("golden.npz", "object or null"),
        ([GOLDEN_FILE], "object or null"),
        ({"file": "../../model.onnx", "sha256": "a" * 64, "size": 1}, "must be 'golden.npz'"),
        ({"file": GOLDEN_FILE, "sha256": "A" * 64, "size": 1}, "sha256"),
        ({"file": GOLDEN_FILE, "sha256": "a" * 64}, "size"),
        ({"file": GOLDEN_FILE, "sha256": "a" * 64, "size": -1}, "size"),
        ({"file": GOLDEN_FILE, "sha256": "a" * 64, "size": True}, "size"),
        ({"file": GOLDEN_FILE, "sha256": "a" * 64, "size": "10"}, "size"),
    ],
)
def test_the_manifest_golden_field_is_strict(golden: object, problem: str) -> None:
    raw = json.loads(Manifest("mlp", "v1", "model.onnx", "a" * 64, 5).to_bytes())
    raw["golden"] = golden
    with pytest.raises(ManifestError, match="golden") as info:
        Manifest.from_bytes(json.dumps(raw).encode())
    assert problem in str(info.value)


def test_manifests_without_a_golden_set_stay_valid_and_the_signature_covers_it(
    tmp_path: Path,
) -> None:
    raw = json.loads(Manifest("mlp", "v1", "model.onnx", "a" * 64, 5, store="file:").to_bytes())
    for old in ({k: v for k, v in raw.items() if k != "golden"}, {**raw, "golden": None}):
        assert Manifest.from_bytes(json.dumps(old).encode()).golden is None
    keys = make_keys(tmp_path / "keys")
    model, answers = build(tmp_path, "v1", 1)
    golden = golden_file(tmp_path / "g.npz", **{"input/input": X, "output/output": answers})
    store = LocalStore(tmp_path / "store")
    publish(store, "mlp", "v1", model, keys.private, golden=golden)
    data = read_object(store, "mlp/v1/manifest.json", BIG)
    signature = read_object(store, "mlp/v1/manifest.sig", BIG)
    forged = json.loads(data)
    forged["golden"]["sha256"] = "0" * 64  # another golden set under the same signature
    verifier = Verifier(load_trusted_keys(keys.public), store.scope)
    with pytest.raises(VerificationError) as info:
        verifier.manifest("mlp", "v1", json.dumps(forged).encode(), signature)
    assert info.value.reason == "bad_signature"


# --- fetch ------------------------------------------------------------------------------


@pytest.mark.s3
async def test_a_golden_set_that_does_not_match_its_manifest_refuses_the_version(
    bucket: S3Store, tmp_path: Path
) -> None:
    keys = make_keys(tmp_path / "keys")
    for version, seed in (("v1", 1), ("v2", 2), ("v3", 3), ("v4", 4)):
        model, answers = build(tmp_path, version, seed)
        golden = golden_file(
            tmp_path / version / "g.npz", **{"input/input": X, "output/output": answers}
        )
        publish(bucket, "mlp", version, model, keys.private, golden=golden)
    v2_golden = (tmp_path / "v2" / "g.npz").read_bytes()
    tampered = tmp_path / "tampered.npz"
    tampered.write_bytes(v2_golden[:-1] + bytes([v2_golden[-1] ^ 1]))  # same size
    bucket.upload(f"mlp/v2/{GOLDEN_FILE}", tampered)
    huge = tmp_path / "huge.bin"
    huge.write_bytes(os.urandom(1 << 20) * 24)
    bucket.upload(f"mlp/v3/{GOLDEN_FILE}", huge)
    bucket.client.delete_object(Bucket=bucket.bucket, Key=f"{bucket.prefix}/mlp/v4/{GOLDEN_FILE}")

    volume, podinfo, status_file = tmp_path / "volume", tmp_path / "annotations", tmp_path / "s"
    fetcher = make_fetcher(bucket, keys, volume, publish_window_s=0)  # tampered long after
    await fetcher.fetch("mlp", "v1")
    (volume / "mlp" / "CURRENT").write_text("v1\n")
    client = await start_server(volume, tmp_path / "ctl.sock")
    try:
        watcher = make_watcher(fetcher, tmp_path / "ctl.sock", podinfo, status_file)
        for version, code in (
            ("v2", "digest_mismatch"),
            ("v3", "size_mismatch"),
            ("v4", "golden_missing"),
        ):
            set_target(podinfo, version)
            read_before = fetcher.received_bytes
            assert await watcher.step() == "refused"
            report = read_status(status_file)
            assert (report["state"], report["code"], report["serving"]) == (
                "refused",
                code,
                "v1",
            ), report
            assert GOLDEN_FILE in report["reason"]
            assert not (volume / "mlp" / version).exists()
            assert downloads_left(volume) == []
            assert fetcher.received_bytes - read_before < 1 << 20  # the 24 MiB not read
    finally:
        await client.close()


async def test_a_golden_copy_on_the_volume_that_no_longer_verifies_is_fetched_again(
    tmp_path: Path,
) -> None:
    keys = make_keys(tmp_path / "keys")
    model, answers = build(tmp_path, "v1", 1)
    golden = golden_file(tmp_path / "g.npz", **{"input/input": X, "output/output": answers})
    store = LocalStore(tmp_path / "store")
    publish(store, "mlp", "v1", model, keys.private, golden=golden)
    volume = tmp_path / "volume"
    fetcher = make_fetcher(store, keys, volume)
    await fetcher.fetch("mlp", "v1")
    copy = volume / "mlp" / "v1" / GOLDEN_FILE
    assert (await fetcher.fetch("mlp", "v1")).downloaded_bytes == 0  # verified, reused

    copy.write_bytes(b"rot")
    assert (await fetcher.fetch("mlp", "v1")).downloaded_bytes > 0
    assert copy.read_bytes() == golden.read_bytes()

    outside = tmp_path / "outside.npz"  # a link planted by whatever else writes the volume
    outside.write_bytes(golden.read_bytes())
    copy.unlink()
    copy.symlink_to(outside)
    assert (await fetcher.fetch("mlp", "v1")).downloaded_bytes > 0  # not followed
    assert not copy.is_symlink() and copy.read_bytes() == golden.read_bytes()
    assert outside.read_bytes() == golden.read_bytes()  # its target left alone


async def test_a_fetch_while_publish_force_adds_a_golden_set_is_tried_again(
    tmp_path: Path,
) -> None:
    """``publish --force --golden`` over a version that had none: between the new
    manifest and the upload of the golden set, a fetch finds it named and missing —
    publish_in_progress (tried again), not a refusal; afterwards the fetch takes both."""
    keys = make_keys(tmp_path / "keys")
    model, answers = build(tmp_path, "v1", 1)
    store = LocalStore(tmp_path / "store")
    publish(store, "mlp", "v1", model, keys.private)
    golden = golden_file(tmp_path / "g.npz", **{"input/input": X, "output/output": answers})
    writer = PausedPublish(tmp_path / "store", pause_before=3)  # manifest, signature, ...
    publishing = threading.Thread(
        target=publish,
        args=(writer, "mlp", "v1", model, keys.private),
        kwargs={"force": True, "golden": golden},
    )
    publishing.start()
    volume = tmp_path / "volume"
    fetcher = make_fetcher(store, keys, volume)
    try:
        assert await asyncio.to_thread(writer.paused.wait, 60)
        with pytest.raises(StoreError) as caught:
            await fetcher.fetch("mlp", "v1")
        assert (caught.value.transient, caught.value.code) == (True, "publish_in_progress")
        assert GOLDEN_FILE in caught.value.message
        assert not (volume / "mlp" / "v1").exists()
    finally:
        writer.resume.set()
        await asyncio.to_thread(publishing.join, 60)
    fetched = await fetcher.fetch("mlp", "v1")
    assert fetched.local.manifest.golden is not None
    assert (volume / "mlp" / "v1" / GOLDEN_FILE).read_bytes() == golden.read_bytes()


def test_a_manifest_naming_a_golden_set_over_the_cap_is_refused(tmp_path: Path) -> None:
    from model_rollout_contract.canary import MAX_GOLDEN_BYTES
    from model_rollout_contract.manifest import FileRef

    keys = make_keys(tmp_path / "keys")
    manifest = Manifest(
        "mlp", "v1", "model.onnx", "a" * 64, 5, store="file:", sequence=1,
        golden=FileRef(GOLDEN_FILE, "b" * 64, MAX_GOLDEN_BYTES + 1),
    )  # fmt: skip
    data = manifest.to_bytes()
    verifier = Verifier(load_trusted_keys(keys.public), "file:")
    with pytest.raises(VerificationError) as info:
        verifier.manifest("mlp", "v1", data, sign(load_private_key(keys.private), data))
    assert info.value.reason == "golden_too_large"
