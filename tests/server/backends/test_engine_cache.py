"""Engine cache: key and file names, one build across processes, LRU clean-up, and
(issue 13 follow-up) only checked bytes are ever loaded from it: a planted link, a
replaced entry or a missing digest makes a rebuild, never a load."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from model_rollout_contract.manifest import sha256_file
from model_rollout_e2e.onnx_models import INPUT_NAME, write_mlp
from model_server.backends.base import ModelFile
from model_server.backends.engine_cache import DIGEST_SUFFIX, CacheKey, EngineCache
from model_server.backends.onnxruntime_backend import OnnxRuntimeBackend
from model_server.lifecycle.engine_manager import EngineManager
from model_server.lifecycle.repository import ModelRepository
from model_server.observability.audit import AuditLog
from model_server.observability.metrics import ServerMetrics
from tests.support.server import IN_DIM, Version, add_version, infer_on

KEY = CacheKey("resnet50", "ab" * 32, "trt10.3.0", "NVIDIA H200", "fp16", "input:1x3-8x3-32x3")


def test_file_name_is_structured() -> None:
    assert KEY.file_name("engine") == (
        "resnet50_nvidia-h200_trt10.3.0_fp16_input-1x3-8x3-32x3_abababababab.engine"
    )


def test_every_key_part_changes_the_entry(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path)
    variants = [
        KEY,
        replace(KEY, model_sha256="cd" * 32),
        replace(KEY, runtime="trt10.4.0"),
        replace(KEY, device="NVIDIA A100"),
        replace(KEY, precision="int8"),
        replace(KEY, shape_profile="static"),
    ]
    assert len({cache.path_for(k) for k in variants}) == len(variants)


def _slow_build(marker_dir: str) -> callable:  # type: ignore[valid-type]
    def build(tmp: Path) -> None:
        (Path(marker_dir) / f"built-by-{os.getpid()}").touch()
        time.sleep(0.5)
        tmp.write_bytes(b"engine bytes")

    return build


def _worker(cache_dir: str, marker_dir: str, results: multiprocessing.Queue) -> None:
    cache = EngineCache(cache_dir)
    with cache.open(KEY, _slow_build(marker_dir)) as hit:
        results.put((hit.hit, hit.data))


def test_one_process_builds_the_others_wait_and_reuse(tmp_path: Path) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    ctx = multiprocessing.get_context("fork")
    results: multiprocessing.Queue = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(str(tmp_path / "cache"), str(markers), results))
        for _ in range(4)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    outcomes = [results.get(timeout=5) for _ in procs]
    assert len(list(markers.iterdir())) == 1  # exactly one build
    assert sorted(hit for hit, _ in outcomes) == [False, True, True, True]
    assert all(data == b"engine bytes" for _, data in outcomes)


def test_failed_build_leaves_no_entry(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path)

    def broken(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise RuntimeError("builder crashed")

    with pytest.raises(RuntimeError), cache.open(KEY, broken):
        pass
    assert cache.entries() == [] and not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())


def test_lru_clean_up_by_size_and_age(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path, max_bytes=250)
    keys = [CacheKey(f"m{i}", "00" * 32, "r", "d", "fp32", "s") for i in range(4)]
    for i, key in enumerate(keys):
        with cache.open(key, lambda tmp: tmp.write_bytes(b"x" * 100)):
            pass
        os.utime(cache.path_for(key), (1000 + i, 1000 + i))
    assert [p.name.split("_")[0] for p in cache.entries()] == ["m2", "m3"]
    # an evicted entry takes its digest along
    assert not (tmp_path / (cache.path_for(keys[0]).name + DIGEST_SUFFIX)).exists()
    with cache.open(keys[2], lambda tmp: None) as hit:  # a hit makes it the most recent
        assert hit.hit and hit.data == b"x" * 100
    cache.max_bytes = 100
    assert cache.clean_up() == [cache.path_for(keys[3])]
    cache.max_bytes = None
    aged = EngineCache(tmp_path, max_age_seconds=60)
    assert aged.clean_up() == []
    os.utime(cache.path_for(keys[2]), (time.time() - 3600,) * 2)
    assert aged.clean_up() == [cache.path_for(keys[2])]


def test_onnxruntime_uses_the_cache_for_optimised_models(tmp_path: Path) -> None:
    model = tmp_path / "repo" / "mlp" / "v1" / "model.onnx"
    write_mlp(model, seed=1)
    backend = OnnxRuntimeBackend(cache=EngineCache(tmp_path / "cache", suffix="onnx"))
    backend.load(ModelFile.read(model)).close()
    assert backend.last_cache_hit is False
    backend.settle()  # a miss is served at once; its entry is written after
    backend.load(ModelFile.read(model)).close()
    assert backend.last_cache_hit is True
    [entry] = backend.cache.entries()  # type: ignore[union-attr]
    assert entry.name.startswith("mlp_") and "_ort" in entry.name and "_fp32_dynamic_" in entry.name


# --- only checked bytes are loaded (issue 13 follow-up) -----------------------------


def _x() -> np.ndarray:
    return np.linspace(-1, 1, 2 * IN_DIM, dtype=np.float32).reshape(2, IN_DIM)


def _answers(backend: OnnxRuntimeBackend, version: Version) -> np.ndarray:
    engine = backend.load(ModelFile.read(version.path))
    try:
        [out] = engine.infer({INPUT_NAME: _x()}).values()
        return np.asarray(out)
    finally:
        engine.close()
        backend.settle()


@pytest.fixture
def two_models(tmp_path: Path) -> tuple[Version, Version, Path]:
    """v1 (served) and evil (other weights, optimised in a cache of its own): the bytes
    a writer of the cache directory would plant."""
    v1 = add_version(tmp_path / "models", "m", "1", seed=1)
    evil = add_version(tmp_path / "elsewhere", "m", "9", seed=9)
    other = OnnxRuntimeBackend(cache=EngineCache(tmp_path / "evil-cache", suffix="onnx"))
    other.load(ModelFile.read(evil.path)).close()
    other.settle()
    [evil_entry] = other.cache.entries()  # type: ignore[union-attr]
    return v1, evil, evil_entry


def _entry(backend: OnnxRuntimeBackend, version: Version) -> Path:
    assert backend.cache is not None
    return backend.cache.path_for(backend.cache_key(ModelFile.read(version.path)))


def test_a_link_planted_as_an_entry_is_rebuilt_never_loaded(
    tmp_path: Path, two_models: tuple[Version, Version, Path]
) -> None:
    """The reviewer's reproduction: a link in place of v1's entry, to another model's
    optimised bytes, served under v1's verified digest. Through the engine manager."""
    v1, evil, evil_entry = two_models
    backend = OnnxRuntimeBackend(cache=EngineCache(tmp_path / "cache", suffix="onnx"))
    entry = _entry(backend, v1)
    os.symlink(evil_entry, entry)
    manager = EngineManager(
        backend, ModelRepository(tmp_path / "models"), ServerMetrics(), AuditLog(), retain=2
    )
    manager.register("m")

    async def serve() -> tuple[str, np.ndarray]:
        await manager.load("m", "1", path=v1.path, expected_sha256=v1.sha256)
        version, outputs = await infer_on(manager, "m", {INPUT_NAME: _x()})
        return version.sha256, next(iter(outputs.values()))

    try:
        digest, got = asyncio.run(serve())
    finally:
        manager.close()
        backend.settle()
    assert digest == v1.sha256
    np.testing.assert_allclose(got, v1.expected(_x()), rtol=1e-5, atol=1e-5)
    assert not np.allclose(got, evil.expected(_x()))
    assert backend.last_cache_hit is False  # rebuilt
    assert not entry.is_symlink() and entry.is_file()  # the link was replaced, not followed
    assert evil_entry.read_bytes() != entry.read_bytes()


def test_an_entry_replaced_in_place_or_without_its_digest_is_rebuilt(
    tmp_path: Path, two_models: tuple[Version, Version, Path]
) -> None:
    v1, _evil, evil_entry = two_models
    backend = OnnxRuntimeBackend(cache=EngineCache(tmp_path / "cache", suffix="onnx"))
    np.testing.assert_allclose(_answers(backend, v1), v1.expected(_x()), rtol=1e-5, atol=1e-5)
    entry = _entry(backend, v1)
    digest = entry.with_name(entry.name + DIGEST_SUFFIX)
    assert digest.read_text().strip() == sha256_file(entry)
    good = entry.read_bytes()

    entry.write_bytes(evil_entry.read_bytes())  # other bytes, same name: the digest differs
    np.testing.assert_allclose(_answers(backend, v1), v1.expected(_x()), rtol=1e-5, atol=1e-5)
    assert backend.last_cache_hit is False and entry.read_bytes() == good

    entry.write_bytes(evil_entry.read_bytes())  # and its digest removed
    digest.unlink()
    np.testing.assert_allclose(_answers(backend, v1), v1.expected(_x()), rtol=1e-5, atol=1e-5)
    assert backend.last_cache_hit is False and digest.read_text().strip() == sha256_file(entry)

    _answers(backend, v1)  # intact now: a hit, and the same bytes
    assert backend.last_cache_hit is True and entry.read_bytes() == good


def test_links_beside_an_entry_are_never_followed(
    tmp_path: Path, two_models: tuple[Version, Version, Path]
) -> None:
    """A planted entry whose digest file is a link to a matching digest is still refused;
    a link in place of the lock file, or of the build's temporary file, is not written
    through (the old builder wrote ``.<entry>.<pid>.tmp`` by path)."""
    v1, _evil, evil_entry = two_models
    backend = OnnxRuntimeBackend(cache=EngineCache(tmp_path / "cache", suffix="onnx"))
    entry = _entry(backend, v1)
    outside = tmp_path / "outside"
    outside.mkdir()
    forged = outside / "digest"
    forged.write_text(sha256_file(evil_entry) + "\n")
    entry.write_bytes(evil_entry.read_bytes())
    os.symlink(forged, entry.with_name(entry.name + DIGEST_SUFFIX))
    os.symlink(outside / "lock-target", entry.with_name(entry.name + ".lock"))
    victim = outside / "victim"
    victim.write_bytes(b"precious")
    os.symlink(victim, entry.with_name(f".{entry.name}.{os.getpid()}.tmp"))

    np.testing.assert_allclose(_answers(backend, v1), v1.expected(_x()), rtol=1e-5, atol=1e-5)
    assert backend.last_cache_hit is False
    assert victim.read_bytes() == b"precious"
    assert not (outside / "lock-target").exists()
    assert forged.read_text().strip() == sha256_file(evil_entry)
    for name in (entry.name, entry.name + DIGEST_SUFFIX, entry.name + ".lock"):
        assert not (entry.parent / name).is_symlink(), name
