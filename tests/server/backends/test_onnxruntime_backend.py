"""The ONNX Runtime backend makes its session from the verified bytes without a copy of
the weights: the graph goes to ONNX Runtime without them and each large weight is an
OrtValue over the model's private copy, which the engine keeps until it is closed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from model_rollout_e2e.onnx_models import write_mlp
from model_server.backends.engine_cache import EngineCache
from model_server.backends.onnxruntime_backend import (
    SUPPLIED_FROM_BYTES,
    OnnxRuntimeBackend,
    split_weights,
)
from model_server.lifecycle.repository import ModelRepository
from tests.support.server import write_manifest


def test_a_session_runs_on_the_verified_bytes_and_answers_as_onnx_runtime_does(
    tmp_path: Path,
) -> None:
    path = tmp_path / "repo" / "mlp" / "v1" / "model.onnx"
    write_mlp(path, 1, in_dim=64, hidden=256, out_dim=4, depth=3)
    write_manifest(path)
    model = ModelRepository(tmp_path / "repo").read_version("mlp", "v1").model
    graph, names, arrays = split_weights(model.data) or (b"", [], [])
    assert names and all(a.nbytes >= SUPPLIED_FROM_BYTES for a in arrays)
    assert len(graph) < model.size // 10  # the graph and small tensors: not the weights
    del arrays  # views of the private copy, as the engine's are
    backend = OnnxRuntimeBackend()
    engine = backend.load(model)
    assert engine.holds_model_bytes and set(engine.load_stages) == {"session", "row_estimate"}
    x = {"input": np.linspace(-1, 1, 3 * 64, dtype=np.float32).reshape(3, 64)}
    plain = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    [want] = plain.run(None, x)
    [got] = engine.infer(x).values()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    model.release()  # the load pipeline's: the engine still holds the bytes
    [again] = engine.infer(x).values()
    np.testing.assert_array_equal(again, got)
    private = model.private
    assert private is not None and private.mapping is not None and not private.mapping.closed
    engine.close()
    backend.settle()
    assert private.mapping.closed  # let go once the session is gone


def test_a_cache_miss_is_served_at_once_and_its_entry_written_after(tmp_path: Path) -> None:
    """The entry is written on the cache's thread from the private copy (read through a
    descriptor of its own, the pages held meanwhile), not on the load's path."""
    path = tmp_path / "repo" / "mlp" / "v1" / "model.onnx"
    write_mlp(path, 1, in_dim=64, hidden=256, out_dim=4, depth=3)
    write_manifest(path)
    backend = OnnxRuntimeBackend(cache=EngineCache(tmp_path / "cache", suffix="onnx"))
    model = ModelRepository(tmp_path / "repo").read_version("mlp", "v1").model
    engine = backend.load(model)
    assert backend.last_cache_hit is False and "cache" in engine.load_stages
    model.release()  # the load pipeline's
    x = {"input": np.linspace(-1, 1, 2 * 64, dtype=np.float32).reshape(2, 64)}
    [want] = engine.infer(x).values()
    backend.settle()
    [entry] = backend.cache.entries()  # type: ignore[union-attr]
    engine.close()
    backend.settle()
    assert model.private is not None and model.private.mapping is not None
    assert model.private.mapping.closed  # the build and the engine both let go
    again = ModelRepository(tmp_path / "repo").read_version("mlp", "v1").model
    hit = backend.load(again)
    assert backend.last_cache_hit is True
    [got] = hit.infer(x).values()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    hit.close()
    again.release()
    assert entry.exists()
