"""Build decisions for TensorRT 10 and 11: precision against what the ONNX graph carries,
optimization profiles from the network's inputs, the persistent timing cache.

Graphs are real ONNX models built here; TensorRT's builder is not installable here, so the
builder objects handed to the profile and timing-cache code are small stand-ins that
record what they are asked.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from model_rollout_e2e.onnx_models import MlpWeights, build_mlp
from model_server.backends.tensorrt_build import (
    BuildRefused,
    DynamicBounds,
    ShapeProfile,
    _add_profiles,
    _save_timing_cache,
    graph_precision,
    plan_build,
)


def fp32_mlp() -> bytes:
    return build_mlp(MlpWeights.random(1, 8, 16, 4, 2)).SerializeToString()


def fp16_matmul() -> bytes:
    w = numpy_helper.from_array(np.ones((8, 4), dtype=np.float16), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "fp16",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["batch", 4])],
        [w],
    )
    return helper.make_model(graph).SerializeToString()


def qdq_matmul() -> bytes:
    inits = [
        numpy_helper.from_array(np.ones((8, 4), dtype=np.float32), "w"),
        numpy_helper.from_array(np.array(0.1, dtype=np.float32), "scale"),
        numpy_helper.from_array(np.array(0, dtype=np.int8), "zero"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "scale", "zero"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "scale", "zero"], ["xd"]),
        helper.make_node("MatMul", ["xd", "w"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "qdq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        inits,
    )
    return helper.make_model(graph).SerializeToString()


def test_graph_precision_reads_what_the_model_carries() -> None:
    assert graph_precision(fp32_mlp()) == "fp32"
    assert graph_precision(fp16_matmul()) == "fp16"
    assert graph_precision(qdq_matmul()) == "int8"


def test_graph_precision_does_not_load_external_weights(tmp_path: Path) -> None:
    model = onnx.load_model_from_string(fp32_mlp())
    onnx.save_model(
        model,
        str(tmp_path / "model.onnx"),
        save_as_external_data=True,
        location="weights.bin",
        size_threshold=0,
    )
    assert (tmp_path / "weights.bin").stat().st_size > 0
    assert graph_precision((tmp_path / "model.onnx").read_bytes()) == "fp32"


@pytest.mark.parametrize("major", [10, 11])
def test_model_precision_builds_strongly_typed_on_both(major: int) -> None:
    plan = plan_build(major, "model", "fp32")
    assert plan.strongly_typed and plan.flags == () and plan.clear_tf32


def test_fp16_on_an_fp32_graph_is_weak_typing_on_10_and_refused_on_11() -> None:
    ten = plan_build(10, "fp16", "fp32")
    assert ten.flags == ("FP16",) and not ten.strongly_typed
    with pytest.raises(BuildRefused, match=r"TensorRT 11 .*strongly typed.*autocast"):
        plan_build(11, "fp16", "fp32")
    assert plan_build(11, "fp16", "fp16").strongly_typed  # the graph carries fp16


@pytest.mark.parametrize("major", [10, 11])
def test_int8_needs_explicit_quantization(major: int) -> None:
    with pytest.raises(BuildRefused, match="QuantizeLinear"):
        plan_build(major, "int8", "fp32")
    assert plan_build(major, "int8", "int8").strongly_typed
    with pytest.raises(BuildRefused, match="quantized"):
        plan_build(major, "fp16", "int8")


@pytest.mark.parametrize("major", [10, 11])
def test_fp32_clears_tf32_and_refuses_an_fp16_graph(major: int) -> None:
    assert plan_build(major, "fp32", "fp32").clear_tf32
    with pytest.raises(BuildRefused, match="carries fp16"):
        plan_build(major, "fp32", "fp16")


def test_unknown_precision_is_refused() -> None:
    with pytest.raises(BuildRefused, match="precision must be one of"):
        plan_build(10, "tf32", "fp32")


def test_bounds_must_be_ordered() -> None:
    with pytest.raises(ValueError, match="min <= opt <= max"):
        DynamicBounds(batch=(4, 2, 8))
    with pytest.raises(ValueError):
        DynamicBounds(other=(0, 1, 2))


def test_profiles_come_from_the_network_inputs() -> None:
    profile = ShapeProfile(bounds=DynamicBounds(batch=(2, 4, 16), other=(1, 32, 64)))
    assert profile.for_input("x", (-1, 8)) == ((2, 8), (4, 8), (16, 8))
    assert profile.for_input("tokens", (-1, -1)) == ((2, 1), (4, 32), (16, 64))
    assert profile.for_input("static", (3, 8)) is None
    named = ShapeProfile({"x": ((1, 8), (2, 8), (3, 8))})
    assert named.for_input("x", (-1, 8)) == ((1, 8), (2, 8), (3, 8))
    assert profile.key() != named.key() != ShapeProfile().key()


class Recorder:
    """Builder, network and config stand-ins that record the profiles asked for."""

    def __init__(self, inputs: list[Any]) -> None:
        self.inputs = inputs
        self.profiles: list[dict[str, tuple[Any, ...]]] = []
        self.num_inputs = len(inputs)

    def get_input(self, i: int) -> Any:
        return self.inputs[i]

    def create_optimization_profile(self) -> Any:
        shapes: dict[str, tuple[Any, ...]] = {}
        return SimpleNamespace(shapes=shapes, set_shape=lambda n, *s: shapes.update({n: s}))

    def add_optimization_profile(self, profile: Any) -> int:
        self.profiles.append(profile.shapes)
        return len(self.profiles) - 1


def tensor(name: str, shape: tuple[int, ...], is_shape: bool = False) -> Any:
    return SimpleNamespace(name=name, shape=shape, is_shape_tensor=is_shape)


def test_one_identical_profile_per_pooled_context() -> None:
    net = Recorder([tensor("x", (-1, 8)), tensor("mask", (4, 8))])
    assert _add_profiles(net, net, net, ShapeProfile(), contexts=3) == ["x"]
    assert len(net.profiles) == 3
    assert all(p == {"x": ((1, 8), (8, 8), (64, 8))} for p in net.profiles)


def test_static_networks_need_no_profile() -> None:
    net = Recorder([tensor("x", (4, 8))])
    assert _add_profiles(net, net, net, ShapeProfile(), contexts=2) == []
    assert net.profiles == []


def test_profile_errors_are_refusals() -> None:
    with pytest.raises(BuildRefused, match="shape tensor"):
        net = Recorder([tensor("n", (1,), is_shape=True)])
        _add_profiles(net, net, net, ShapeProfile(), contexts=1)
    with pytest.raises(BuildRefused, match="does not have"):
        net = Recorder([tensor("x", (-1, 8))])
        named = ShapeProfile({"y": ((1,), (1,), (1,))})
        _add_profiles(net, net, net, named, contexts=1)


class TimingCache:
    def __init__(self, entries: set[str]) -> None:
        self.entries = set(entries)

    def combine(self, other: TimingCache, ignore_mismatch: bool) -> bool:
        self.entries |= other.entries
        return True

    def serialize(self) -> bytes:
        return ",".join(sorted(self.entries)).encode()


class Config:
    def create_timing_cache(self, data: bytes) -> TimingCache:
        return TimingCache(set(filter(None, data.decode().split(","))))


def test_the_timing_cache_merges_with_what_other_builders_saved(tmp_path: Path) -> None:
    path = tmp_path / "timing" / "trt10.16_H200.cache"
    _save_timing_cache(Config(), TimingCache({"a", "b"}), path)
    _save_timing_cache(Config(), TimingCache({"c"}), path)  # another model's build
    assert path.read_bytes() == b"a,b,c"
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []


def test_the_servers_tensorrt_flags_reach_the_backend() -> None:
    from model_server.config import parse_args

    config = parse_args(
        [
            "--repository", "/r", "--backend", "tensorrt", "--precision", "fp16",
            "--trt-batch", "2,4,32", "--trt-dims", "1,64,256", "--trt-contexts", "3",
            "--trt-host-code-allowed", "--trt-plugin-library", "/lib/a.so",
        ]
    )  # fmt: skip
    options = config.backend_options()
    assert options["precision"] == "fp16" and options["contexts"] == 3
    assert options["profile"] == ShapeProfile(
        bounds=DynamicBounds(batch=(2, 4, 32), other=(1, 64, 256))
    )
    assert options["host_code_allowed"] is True
    assert options["plugin_libraries"] == (Path("/lib/a.so"),)
    default = parse_args(["--repository", "/r"])
    assert default.tensorrt.precision == "model" and default.backend_options() == {}


@pytest.mark.parametrize(
    "args",
    [
        ["--precision", "fp16"],  # the default backend runs the graph as it is
        ["--backend", "torch", "--precision", "int8"],
        ["--trt-batch", "4,2,8"],
        ["--trt-batch", "1,2"],
        ["--trt-contexts", "0"],
    ],
)
def test_bad_tensorrt_flags_are_refused(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from model_server.config import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--repository", "/r", *args])
    assert "error" in capsys.readouterr().err


# --- the build itself, against a TensorRT stand-in that records what it is asked --------
class Recorded:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []


def fake_tensorrt(major: int, record: Recorded, inputs: list[Any]) -> Any:
    """TensorRT's builder API as documented for ``major`` (10 has the weak-typing flags
    and NetworkDefinitionCreationFlag; 11 has neither), recording every call."""
    flags = {"TF32": "TF32"} | ({"FP16": "FP16"} if major == 10 else {})

    class Network(Recorder):
        pass

    class Config:
        def set_memory_pool_limit(self, pool: str, size: int) -> None:
            record.calls.append(("workspace", size))

        def set_flag(self, flag: str) -> None:
            record.calls.append(("set_flag", flag))

        def clear_flag(self, flag: str) -> None:
            record.calls.append(("clear_flag", flag))

        def add_optimization_profile(self, profile: Any) -> int:
            record.calls.append(("profile", dict(profile.shapes)))
            return 0

        def create_timing_cache(self, data: bytes) -> TimingCache:
            return TimingCache(set(filter(None, data.decode().split(","))) | {"new"})

        def set_timing_cache(self, cache: TimingCache, ignore_mismatch: bool) -> bool:
            record.calls.append(("timing_cache", ignore_mismatch))
            return True

    class Builder:
        def __init__(self, logger: Any) -> None:
            pass

        def create_network(self, flags: int) -> Network:
            record.calls.append(("network", flags))
            return Network(inputs)

        def create_builder_config(self) -> Config:
            return Config()

        def create_optimization_profile(self) -> Any:
            shapes: dict[str, tuple[Any, ...]] = {}
            return SimpleNamespace(shapes=shapes, set_shape=lambda n, *s: shapes.update({n: s}))

        def build_serialized_network(self, network: Any, config: Any) -> bytes:
            return b"plan"

    class OnnxParser:
        num_errors = 0

        def __init__(self, network: Any, logger: Any) -> None:
            pass

        def parse(self, data: bytes, path: str) -> bool:
            record.calls.append(("parse", len(data), path))
            return True

    module = SimpleNamespace(
        Builder=Builder,
        OnnxParser=OnnxParser,
        BuilderFlag=SimpleNamespace(**flags),
        MemoryPoolType=SimpleNamespace(WORKSPACE="workspace"),
    )
    if major == 10:
        module.NetworkDefinitionCreationFlag = SimpleNamespace(STRONGLY_TYPED=5)
    return module


@pytest.mark.parametrize("major", [10, 11])
def test_a_build_asks_tensorrt_what_its_version_documents(major: int, tmp_path: Path) -> None:
    from model_server.backends.tensorrt_build import BuildOptions, build_engine

    record = Recorded()
    trt = fake_tensorrt(major, record, [tensor("input", (-1, 8))])
    data, path = fp32_mlp(), tmp_path / "m" / "v1" / "model.onnx"
    timing = tmp_path / "timing" / "t.cache"
    options = BuildOptions(precision="model", contexts=3, timing_cache=timing)
    build_engine(trt, None, major, (data, path), tmp_path / "out.engine", options)
    calls = record.calls
    assert ("network", (1 << 5) if major == 10 else 0) in calls  # strongly typed
    assert ("parse", len(data), str(path)) in calls  # the verified bytes, with their path
    assert ("clear_flag", "TF32") in calls and not [c for c in calls if c[0] == "set_flag"]
    assert [c for c in calls if c[0] == "profile"] == [
        ("profile", {"input": ((1, 8), (8, 8), (64, 8))})
    ] * 3
    assert ("timing_cache", False) in calls
    assert (tmp_path / "out.engine").read_bytes() == b"plan"
    assert timing.read_bytes() == b"new"  # this build's timings were saved


def test_fp16_on_10_is_the_weak_typing_flag(tmp_path: Path) -> None:
    from model_server.backends.tensorrt_build import BuildOptions, build_engine

    record = Recorded()
    trt = fake_tensorrt(10, record, [tensor("input", (-1, 8))])
    options = BuildOptions(precision="fp16")
    build_engine(trt, None, 10, (fp32_mlp(), tmp_path / "model.onnx"), tmp_path / "e", options)
    assert ("network", 0) in record.calls and ("set_flag", "FP16") in record.calls


def test_fp16_on_11_is_refused_before_building(tmp_path: Path) -> None:
    from model_server.backends.tensorrt_build import BuildOptions, build_engine

    record = Recorded()
    trt = fake_tensorrt(11, record, [tensor("input", (-1, 8))])
    with pytest.raises(BuildRefused, match="TensorRT 11"):
        build_engine(
            trt, None, 11, (fp32_mlp(), tmp_path / "model.onnx"), tmp_path / "e",
            BuildOptions(precision="fp16"),
        )  # fmt: skip
    assert record.calls == []


@pytest.mark.parametrize("location", ["../other/weights.bin", "/etc/weights.bin", "a/b.bin"])
def test_external_weights_must_sit_beside_the_model(location: str) -> None:
    from model_server.backends.tensorrt_build import check_external_data

    model = onnx.load_model_from_string(fp32_mlp())
    weight = model.graph.initializer[0]
    weight.data_location = TensorProto.EXTERNAL
    del weight.external_data[:]
    weight.external_data.add(key="location", value=location)
    weight.ClearField("raw_data")
    with pytest.raises(BuildRefused, match="beside the model"):
        check_external_data(model.SerializeToString())
    weight.external_data[0].value = "weights.bin"
    check_external_data(model.SerializeToString())


# --- CUDA diagnosis, each branch, on a cudart stand-in ---------------------------------
class CudaError:
    cudaSuccess = 0
    cudaErrorInsufficientDriver = 35
    cudaErrorNoDevice = 100


def fake_cudart(driver: int, runtime: int, count_err: int, count: int = 0) -> Any:
    return SimpleNamespace(
        cudaError_t=CudaError,
        cudaDriverGetVersion=lambda: (0, driver),
        cudaRuntimeGetVersion=lambda: (0, runtime),
        cudaGetDeviceCount=lambda: (count_err, count),
        cudaGetErrorName=lambda err: (0, b"cudaErrorUnknown"),
    )


@pytest.mark.parametrize(
    ("driver", "runtime", "err", "expected"),
    [
        (13000, 13030, CudaError.cudaSuccess, 2),  # an older driver minor is fine
        (13000, 13030, CudaError.cudaErrorNoDevice, 0),  # no GPU given: not a driver issue
        (0, 13030, CudaError.cudaErrorInsufficientDriver, "no NVIDIA driver"),
        (12020, 13000, CudaError.cudaErrorInsufficientDriver, "install cuda-python 12.x"),
        (12020, 13000, 999, "install cuda-python 12.x"),  # another major
        (13000, 13000, 999, "cannot count devices"),
    ],
)
def test_cuda_report_names_the_real_cause(
    driver: int, runtime: int, err: int, expected: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    from model_server.backends import cuda_memory
    from model_server.backends.base import BackendUnavailable

    monkeypatch.setattr(cuda_memory, "_runtime", lambda: fake_cudart(driver, runtime, err, 2))
    if isinstance(expected, int):
        assert cuda_memory.cuda_report().devices == expected
    else:
        with pytest.raises(BackendUnavailable, match=str(expected)):
            cuda_memory.cuda_report()
