"""Engine cache: key and file names, one build across processes, LRU clean-up."""

from __future__ import annotations

import multiprocessing
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest

from model_rollout_e2e.onnx_models import write_mlp
from model_server.backends.base import ModelFile
from model_server.backends.onnxruntime_backend import OnnxRuntimeBackend
from model_server.engine_cache import CacheKey, EngineCache

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
        results.put((hit.hit, hit.path.read_bytes()))


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
    # an entry in use is never removed
    with cache.open(keys[2], lambda tmp: None) as hit:
        cache.max_bytes = 0
        assert cache.clean_up() == [cache.path_for(keys[3])]
        assert hit.path.exists()
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
    backend.load(ModelFile.read(model)).close()
    assert backend.last_cache_hit is True
    [entry] = backend.cache.entries()  # type: ignore[union-attr]
    assert entry.name.startswith("mlp_") and "_ort" in entry.name and "_fp32_dynamic_" in entry.name
