"""Sidecar pieces that need no server: annotations, signing, verification, retention."""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import replace
from datetime import datetime, timezone
from email.utils import format_datetime
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from model_rollout_contract.annotations import (
    TARGET_VERSION,
    format_downward_annotations,
    parse_downward_annotations,
)
from model_rollout_contract.manifest import (
    Chunks,
    Manifest,
    sha256_file,
    sha256_file_chunked,
)
from model_sidecar.errors import VerificationError
from model_sidecar.init_mode import pre_pull, predecessor
from model_sidecar.kube import API_BACKOFF, RETRY_AFTER_MAX_S, retry_after_seconds
from model_sidecar.publish import publish
from model_sidecar.retry import Backoff
from model_sidecar.signing import load_private_key, load_public_key, sign
from model_sidecar.store import LocalStore, open_store, read_object
from model_sidecar.target import TargetSource
from model_sidecar.verify import Verifier
from tests.support.sidecar import Keys, make_fetcher, make_keys, publish_versions


@given(st.dictionaries(st.from_regex(r"[a-z0-9./-]{1,30}", fullmatch=True), st.text(max_size=40)))
def test_downward_annotations_round_trip(annotations: dict[str, str]) -> None:
    parsed = parse_downward_annotations(format_downward_annotations(annotations))
    assert parsed == annotations


def test_target_source_prefers_pod_annotation(tmp_path: Path) -> None:
    annotations, configmap = tmp_path / "annotations", tmp_path / "configmap"
    source = TargetSource(annotations, configmap)
    assert source.target() is None
    configmap.write_text("v1\n")
    assert source.target() == "v1"
    annotations.write_text(format_downward_annotations({TARGET_VERSION: "v2"}))
    assert source.target() == "v2"
    annotations.write_text(format_downward_annotations({TARGET_VERSION: "../../etc"}))
    assert source.target() == "v1"  # an invalid name is ignored, never used as a path


def test_open_store_urls(tmp_path: Path) -> None:
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    assert isinstance(open_store(f"file://{tmp_path}"), LocalStore)
    with pytest.raises(ValueError, match="unsupported"):
        open_store("ftp://x/y")
    with pytest.raises(ValueError, match="no bucket"):
        open_store("s3:///prefix")


def test_manifest_verification(tmp_path: Path) -> None:
    keys, other = make_keys(tmp_path / "keys"), make_keys(tmp_path / "keys", "other")
    store = LocalStore(tmp_path / "store")
    publish_versions(store, keys, tmp_path, {"v1": 1})
    data = read_object(store, "mlp/v1/manifest.json", 1 << 20)
    signature = read_object(store, "mlp/v1/manifest.sig", 1024)
    verifier = Verifier((load_public_key(keys.public.read_bytes()),), store.scope)
    manifest = verifier.manifest("mlp", "v1", data, signature)
    assert manifest.shapes == {"input": [8], "output": [4]} or "input" in manifest.shapes

    def reason(**kw: object) -> str:
        args = {"model": "mlp", "version": "v1", "data": data, "signature": signature, **kw}
        v = kw.pop("verifier", verifier)  # type: ignore[arg-type]
        with pytest.raises(VerificationError) as info:
            v.manifest(args["model"], args["version"], args["data"], args["signature"])  # type: ignore[union-attr]
        return info.value.reason

    assert reason(signature=None) == "unsigned"
    assert reason(signature=b"x" * 64) == "bad_signature"
    assert reason(data=data.replace(b'"v1"', b'"v9"')) == "bad_signature"
    wrong_key = Verifier((load_public_key(other.public.read_bytes()),), store.scope)
    assert reason(verifier=wrong_key) == "bad_signature"
    assert reason(version="v2") == "bad_manifest"
    allow = Verifier(verifier.keys, store.scope, frozenset({"0" * 64}))
    assert reason(verifier=allow) == "not_allowed"

    unsigned = Verifier((), store.scope)
    bogus = Manifest("mlp", "v1", "model.onnx", "a" * 64, 3).to_bytes()
    assert unsigned.manifest("mlp", "v1", bogus, None).sha256 == "a" * 64


def test_file_checks(tmp_path: Path) -> None:
    verifier = Verifier((), "file:")
    good = tmp_path / "model.onnx"
    good.write_bytes(b"hello")
    manifest = Manifest("mlp", "v1", "model.onnx", sha256_file(good), 5)

    def check() -> None:
        with good.open("rb") as f:
            verifier.file(f, manifest.files()[0])

    check()
    good.write_bytes(b"hell")
    with pytest.raises(VerificationError, match="truncated"):
        check()
    good.write_bytes(b"HELLO")
    with pytest.raises(VerificationError, match="does not match"):
        check()


MIB = 2**20


def test_file_checks_by_chunks_refuse_chunks_that_disagree_with_the_whole_digest(
    tmp_path: Path,
) -> None:
    """The server may check a file by its chunks alone: the sidecar checks both, so a
    manifest whose chunks describe other bytes than its sha256 never reaches it."""
    verifier = Verifier((), "file:")
    path = tmp_path / "model.engine"
    data = os.urandom(2 * MIB + 5)
    other = bytearray(data)
    other[MIB + 7] ^= 1  # a byte of the middle chunk
    path.write_bytes(other)
    _, chunks_of_other = sha256_file_chunked(path, MIB)
    path.write_bytes(data)
    whole, chunks = sha256_file_chunked(path, MIB)

    def check(chunks: Chunks, whole: str = whole) -> None:
        ref = Manifest("mlp", "v1", "model.engine", whole, len(data), chunks=chunks).files()[0]
        with path.open("rb") as f:
            verifier.file(f, ref, chunks)

    check(chunks)
    with pytest.raises(VerificationError, match="chunk 1 of 3") as info:
        check(chunks_of_other)  # the whole file's digest matches, a chunk's does not
    assert info.value.reason == "digest_mismatch"
    with pytest.raises(VerificationError, match="does not match") as info:
        check(chunks, "0" * 64)  # each chunk matches, the whole file's digest does not
    assert info.value.reason == "digest_mismatch"


def _published_in_chunks(tmp_path: Path) -> tuple[Keys, LocalStore, Path, Manifest]:
    """mlp:v1, a model of 2 MiB and 5 bytes published in 1 MiB chunks (the last partial)."""
    keys = make_keys(tmp_path / "keys")
    store = LocalStore(tmp_path / "store")
    model = tmp_path / "build" / "model.engine"
    model.parent.mkdir()
    model.write_bytes(os.urandom(2 * MIB + 5))
    return keys, store, model, publish(store, "mlp", "v1", model, keys.private, chunk_size=MIB)


def test_publish_writes_chunks_that_verify(tmp_path: Path) -> None:
    keys, store, model, published = _published_in_chunks(tmp_path)
    data = read_object(store, "mlp/v1/manifest.json", 1 << 20)
    signature = read_object(store, "mlp/v1/manifest.sig", 1024)
    verifier = Verifier((load_public_key(keys.public.read_bytes()),), store.scope)
    manifest = verifier.manifest("mlp", "v1", data, signature)
    assert manifest == published
    assert manifest.chunks is not None and len(manifest.chunks.sha256) == 3
    assert (manifest.sha256, manifest.chunks) == sha256_file_chunked(model, MIB)
    with model.open("rb") as f:
        verifier.file(f, manifest.files()[0], manifest.chunks_of(manifest.files()[0]))
    # by default, in chunks of 8 MiB: one for a small file
    small = tmp_path / "build" / "small.engine"
    small.write_bytes(b"x" * 10)
    default = publish(store, "mlp", "v2", small, keys.private)
    assert default.chunks == Chunks(8 * MIB, (sha256_file(small),))


async def test_a_signed_manifest_whose_chunks_disagree_with_its_digest_is_refused(
    tmp_path: Path,
) -> None:
    keys, store, _model, published = _published_in_chunks(tmp_path)
    assert published.chunks is not None
    wrong = list(published.chunks.sha256)
    wrong[2] = "0" * 64  # the last, partial chunk
    forged = replace(published, chunks=Chunks(MIB, tuple(wrong))).to_bytes()
    store.write("mlp/v1/manifest.json", forged)
    store.write("mlp/v1/manifest.sig", sign(load_private_key(keys.private), forged))
    fetcher = make_fetcher(store, keys, tmp_path / "volume", publish_window_s=0)
    with pytest.raises(VerificationError, match="chunk 2 of 3") as info:
        await fetcher.fetch("mlp", "v1")
    assert info.value.reason == "digest_mismatch"
    assert not (tmp_path / "volume" / "mlp" / "v1").exists()


async def test_init_pulls_target_and_previous_and_skips_present(tmp_path: Path) -> None:
    keys = make_keys(tmp_path / "keys")
    store = LocalStore(tmp_path / "store")
    publish_versions(store, keys, tmp_path, {"v1": 1, "v2": 2, "v10": 10})
    assert predecessor(store, "mlp", "v10") == "v2"
    assert predecessor(store, "mlp", "v1") is None
    fetcher = make_fetcher(store, keys, tmp_path / "volume")
    assert await pre_pull(fetcher, "mlp", "v10", None) == 0
    assert sorted(p.name for p in (tmp_path / "volume" / "mlp").iterdir()) == [
        ".accepted-sequences.json",
        "CURRENT",
        "v10",
        "v2",
    ]
    assert (tmp_path / "volume" / "mlp" / "CURRENT").read_text().strip() == "v10"
    again = await fetcher.fetch("mlp", "v10")
    assert again.downloaded_bytes == 0  # verified copy reused
    # a corrupted local copy is detected and fetched again
    (tmp_path / "volume" / "mlp" / "v10" / "model.onnx").write_bytes(b"rot")
    assert (await fetcher.fetch("mlp", "v10")).downloaded_bytes > 0
    assert await pre_pull(fetcher, "mlp", "v404", None) == 1


def test_prune_keeps_newest_in_version_order_and_never_the_serving(tmp_path: Path) -> None:
    keys = make_keys(tmp_path / "keys")
    store = LocalStore(tmp_path / "store")
    fetcher = make_fetcher(store, keys, tmp_path / "volume")
    # arrival order (mtime) differs from version order: v10 came first, yet is the newest
    for i, name in enumerate(["v10", "v2", "v3", "v9"]):
        d = tmp_path / "volume" / "mlp" / name
        d.mkdir(parents=True)
        os.utime(d, (time.time() - 100 + i,) * 2)
    removed = fetcher.prune("mlp", keep=2, protect={"v2"})
    assert sorted(removed) == ["v3", "v9"]
    assert sorted(p.name for p in (tmp_path / "volume" / "mlp").iterdir()) == ["v10", "v2"]


async def test_the_predecessor_of_versions_without_an_order_is_the_one_published_before(
    tmp_path: Path,
) -> None:
    """Git SHAs follow no published rule: the store's publish order (each manifest's
    sequence) decides what the init container pre-pulls as previous, not the text."""
    keys = make_keys(tmp_path / "keys")
    store = LocalStore(tmp_path / "store")
    publish_versions(store, keys, tmp_path, {"beef": 1, "f00d": 2, "c0de": 3})
    assert predecessor(store, "mlp", "c0de") == "f00d"
    assert predecessor(store, "mlp", "f00d") == "beef"
    assert predecessor(store, "mlp", "beef") is None
    # versions that follow PEP 440 are in its order, whenever they were published
    publish_versions(store, keys, tmp_path, {"1.9.0": 1, "1.10.0": 2, "1.10.0-rc1": 3}, "rc")
    assert predecessor(store, "rc", "1.10.0") == "1.10.0-rc1"
    assert predecessor(store, "rc", "1.10.0-rc1") == "1.9.0"


def test_prune_keeps_versions_without_an_order_as_they_were_published(tmp_path: Path) -> None:
    keys = make_keys(tmp_path / "keys")
    fetcher = make_fetcher(LocalStore(tmp_path / "store"), keys, tmp_path / "volume")
    model_dir = tmp_path / "volume" / "mlp"
    for name in ("9f2c1e7", "e5a0c2f", "03b1d4a"):
        (model_dir / name).mkdir(parents=True)
    order = {"9f2c1e7": 1, "e5a0c2f": 2, "03b1d4a": 3}  # publish sequences accepted
    (model_dir / ".accepted-sequences.json").write_text(json.dumps(order))
    assert fetcher.prune("mlp", keep=2, protect={"e5a0c2f"}) == ["9f2c1e7"]


def test_retry_after_in_seconds_or_as_a_date_and_bounded() -> None:
    now = 1_000_000.0
    in_30s = format_datetime(datetime.fromtimestamp(now + 30, timezone.utc), usegmt=True)
    assert retry_after_seconds("2") == 2.0
    assert retry_after_seconds(in_30s, now=now) == 30.0
    assert retry_after_seconds("86400") == RETRY_AFTER_MAX_S  # one odd answer is not a stop
    assert retry_after_seconds(format_datetime(datetime.fromtimestamp(now - 5, timezone.utc)),
                               now=now) == 0.0  # fmt: skip
    # "²" and "١٢" (Arabic-Indic 12) are digits to str.isdigit: not to HTTP
    for bad in (None, "", "soon", "-3", "1.5e9", "Tue, 99 Foo 2026 00:00:00", "\u00b2", "١٢"):
        assert retry_after_seconds(bad) is None, bad


@given(st.integers(0, 80), st.floats(0, 100) | st.none(), st.integers(0, 2**32))
def test_a_backoff_pause_is_within_its_floor_and_cap_and_never_before_retry_after(
    attempt: int, retry_after_s: float | None, seed: int
) -> None:
    pause = API_BACKOFF.delay(attempt, random.Random(seed), retry_after_s)
    assert API_BACKOFF.least(attempt) <= pause
    assert pause <= max(API_BACKOFF.cap(attempt), retry_after_s or 0.0)
    assert retry_after_s is None or pause >= retry_after_s


def test_a_long_api_outage_costs_at_most_one_call_in_15_seconds_per_sidecar() -> None:
    assert API_BACKOFF.least(0) > 0 and API_BACKOFF.least(100) == 15.0
    assert Backoff().least(3) == 0.0  # full jitter, elsewhere (store retries, cycles)
    with pytest.raises(ValueError, match="share of the pause"):
        Backoff(floor=1.5)
