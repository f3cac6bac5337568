"""The TensorRT backend on a real GPU with full TensorRT: ready to run, skipped elsewhere.

Full TensorRT is not installable on this project's CI or on the lent H200 (its library
wheels download from NVIDIA's index, which those machines cannot reach); on a machine with
TensorRT 10.8+ or 11 and a GPU these run as they are: ``pytest -m gpu``.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from model_server.backends.base import ModelFile
from tests.support.server import add_version

pytestmark = pytest.mark.gpu

NO_TENSORRT = "needs full TensorRT (>= 10.8) and an NVIDIA GPU; not installable here"
NO_GPU = "needs an NVIDIA GPU and cuda-python (run on the device machine)"


@pytest.fixture(scope="module")
def gpu() -> object:
    from model_server.backends import cuda_memory

    if importlib.util.find_spec("cuda") is None or cuda_memory.device_count() == 0:
        pytest.skip(NO_GPU)
    return cuda_memory


@pytest.fixture(scope="module")
def cuda(gpu: object) -> object:
    if importlib.util.find_spec("tensorrt") is None:
        pytest.skip(NO_TENSORRT)
    return gpu


def _backend(cache_dir: Path, **options: object) -> object:
    from model_server.backends.engine_cache import EngineCache
    from model_server.backends.tensorrt_backend import TensorRTBackend

    return TensorRTBackend(EngineCache(cache_dir, suffix="engine"), **options)  # type: ignore[arg-type]


def test_default_build_on_the_dynamic_mlp_serves_and_counts_its_memory(
    cuda: object, tmp_path: Path
) -> None:
    version = add_version(tmp_path / "repo", "mlp", "v1", seed=4)
    backend = _backend(tmp_path / "cache")  # the app's defaults: precision model, auto profile
    engine = backend.load(ModelFile.read(version.path))  # type: ignore[attr-defined]
    weights = sum(w.nbytes + b.nbytes for w, b in version.weights.layers)
    assert engine.device_memory_bytes >= weights
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    # fp32 with TF32 cleared: TF32's 10-bit mantissa would miss this tolerance
    np.testing.assert_allclose(engine.infer({"input": x})["output"], version.expected(x), atol=1e-5)
    engine.close()


def test_warm_up_with_a_minimum_batch_above_one(cuda: object, tmp_path: Path) -> None:
    from model_server.backends.tensorrt_backend import DynamicBounds, ShapeProfile
    from model_server.lifecycle.load_pipeline import warm_up

    version = add_version(tmp_path / "repo", "mlp", "v1", seed=5)
    profile = ShapeProfile(bounds=DynamicBounds(batch=(4, 8, 32)))
    engine = _backend(tmp_path / "cache", profile=profile).load(ModelFile.read(version.path))  # type: ignore[attr-defined]
    warm_up(engine)
    engine.warm_up()
    with pytest.raises(ValueError, match="outside"):
        engine.infer({"input": np.zeros((1, 8), dtype=np.float32)})
    engine.close()


def test_threads_with_mixed_batch_sizes_match_the_reference(cuda: object, tmp_path: Path) -> None:
    version = add_version(tmp_path / "repo", "mlp", "v1", seed=6)
    engine = _backend(tmp_path / "cache", contexts=3).load(ModelFile.read(version.path))  # type: ignore[attr-defined]
    failures: list[int] = []

    def client(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(200):
            x = rng.standard_normal((int(rng.integers(1, 65)), 8)).astype(np.float32)
            out = engine.infer({"input": x})["output"]
            if not np.allclose(out, version.expected(x), atol=1e-5):
                failures.append(x.shape[0])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine.close()
    assert failures == []


def test_gpu_memory_comes_back_after_close(cuda: object, tmp_path: Path) -> None:
    version = add_version(tmp_path / "repo", "mlp", "v1", seed=7, hidden=2048, depth=6)
    backend = _backend(tmp_path / "cache")
    backend.load(ModelFile.read(version.path)).close()  # type: ignore[attr-defined]  # build once
    free_before, _ = cuda.memory_info()  # type: ignore[attr-defined]
    engine = backend.load(ModelFile.read(version.path))  # type: ignore[attr-defined]
    free_loaded, _ = cuda.memory_info()  # type: ignore[attr-defined]
    assert free_before - free_loaded >= 0.5 * engine.device_memory_bytes
    engine.close()
    free_after, _ = cuda.memory_info()  # type: ignore[attr-defined]
    assert free_before - free_after <= 0.1 * (free_before - free_loaded) + (8 << 20)


_SECOND_PROCESS = """
import json, sys
from pathlib import Path
from model_server.backends.base import ModelFile
from model_server.backends.tensorrt_backend import TensorRTBackend
from model_server.backends.engine_cache import EngineCache
backend = TensorRTBackend(EngineCache(Path(sys.argv[1]), suffix="engine"))
model = ModelFile.read(sys.argv[2])
with backend.cache.open(backend.cache_key(model), lambda tmp: backend.build(model, tmp)) as hit:
    print(json.dumps({"hit": hit.hit}))
"""


def test_a_second_process_reuses_the_cached_engine(cuda: object, tmp_path: Path) -> None:
    version = add_version(tmp_path / "repo", "mlp", "v1", seed=8)
    _backend(tmp_path / "cache").load(ModelFile.read(version.path)).close()  # type: ignore[attr-defined]
    out = subprocess.run(
        [sys.executable, "-c", _SECOND_PROCESS, str(tmp_path / "cache"), str(version.path)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"hit": True}
    assert list((tmp_path / "cache" / "timing").glob("*.cache"))  # the timing cache persisted


def test_a_trtexec_built_engine_loads(cuda: object, tmp_path: Path) -> None:
    trtexec = shutil.which("trtexec")
    if trtexec is None:
        pytest.skip("trtexec is not on PATH (it ships with NVIDIA's TensorRT containers)")
    version = add_version(tmp_path / "repo", "mlp", "v1", seed=9)
    plan = version.path.with_name("model.engine")
    subprocess.run(
        [
            trtexec,
            f"--onnx={version.path}",
            f"--saveEngine={plan}",
            "--minShapes=input:1x8",
            "--optShapes=input:4x8",
            "--maxShapes=input:16x8",
            "--profile=0",
        ],
        check=True,
        capture_output=True,
    )
    engine = _backend(tmp_path / "cache", contexts=1).load(ModelFile.read(plan))  # type: ignore[attr-defined]
    x = np.ones((4, 8), dtype=np.float32)
    np.testing.assert_allclose(engine.infer({"input": x})["output"], version.expected(x), atol=1e-3)
    engine.close()


def test_an_out_of_profile_request_is_a_clean_4xx(cuda: object, tmp_path: Path) -> None:
    from model_rollout_e2e.processes import free_port

    add_version(tmp_path / "repo", "mlp", "v1", seed=10)
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable, "-m", "model_server", "--repository", str(tmp_path / "repo"),
            "--model", "mlp", "--backend", "tensorrt", "--port", str(port),
            "--cache-dir", str(tmp_path / "cache"), "--trt-batch", "1,8,16",
        ]
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=1):
                    break
            except (urllib.error.URLError, ConnectionError):
                if server.poll() is not None:
                    pytest.fail("the server exited")
                threading.Event().wait(0.5)
        body = {"inputs": [{"name": "input", "shape": [17, 8], "datatype": "FP32",
                            "data": [0.0] * 136}]}  # fmt: skip
        request = urllib.request.Request(
            f"{url}/v2/models/mlp/infer", json.dumps(body).encode(), method="POST"
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 400
        assert "outside" in json.loads(refused.value.read())["error"]
    finally:
        server.terminate()
        server.wait(30)


def test_cuda_memory_round_trip_through_pinned_buffers(gpu: object) -> None:
    cuda = gpu
    stream = cuda.CudaStream()  # type: ignore[attr-defined]
    data = np.arange(1024, dtype=np.float32)
    host, back = cuda.PinnedBuffer(data.nbytes), cuda.PinnedBuffer(data.nbytes)  # type: ignore[attr-defined]
    device = cuda.DeviceBuffer(data.nbytes)  # type: ignore[attr-defined]
    np.copyto(host.view(data.dtype, data.shape), data)
    device.copy_from(host, data.nbytes, stream)
    device.copy_to(back, data.nbytes, stream)
    stream.synchronize()
    np.testing.assert_array_equal(back.view(data.dtype, data.shape), data)
    for buffer in (host, back, device):
        buffer.free()
    stream.close()


def test_streams_are_non_blocking(gpu: object) -> None:
    """A non-blocking stream never waits on the legacy default stream, which a model load
    on another thread may be using."""
    from cuda.bindings import runtime as cudart

    stream = gpu.CudaStream()  # type: ignore[attr-defined]
    err, flags = cudart.cudaStreamGetFlags(stream.handle)
    assert err == cudart.cudaError_t.cudaSuccess
    assert flags == cudart.cudaStreamNonBlocking
    assert stream.address != 0
    stream.close()


def test_the_cuda_report_names_the_gpu(gpu: object) -> None:
    report = gpu.cuda_report()  # type: ignore[attr-defined]
    assert report.devices >= 1 and report.driver_version >= report.runtime_version // 1000 * 1000
    assert gpu.device_name()  # type: ignore[attr-defined]
