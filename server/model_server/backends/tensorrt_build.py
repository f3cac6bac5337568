"""Building a TensorRT engine from ONNX, correctly on TensorRT 10 (>= 10.8) and 11.

What differs between the two, and what this module does about it:

* Precision. TensorRT 10 builds weakly typed networks by default and lets a builder flag
  (``BuilderFlag.FP16``) allow fp16 kernels; TensorRT 11 removed those flags and builds
  only strongly typed networks, whose precision is what the ONNX graph carries (NVIDIA,
  "Migrating from TensorRT 10.x to 11.x", Python API reference). So the precision asked
  for is checked against the graph: ``model`` (the graph's own types) works on both;
  ``fp16`` on an fp32 graph works on 10 only and is refused on 11 with what to do; ``int8``
  needs explicit quantization (Q/DQ nodes) on both, since an INT8 flag without calibration
  silently falls back to higher precision while the cache key would say int8. fp32 builds
  clear TF32, so fp32 means fp32.
* Shapes. Every dynamic axis gets an optimization profile derived from the network's
  inputs and configurable bounds; one identical profile per pooled execution context,
  because concurrently used contexts need distinct profiles (``NvInferRuntime.h``).
* Parsing the verified bytes with the model's path beside them (``parse(data, path)``):
  the graph TensorRT builds is exactly the one whose digest was checked, and ONNX with
  external weights (> 2 GB) still finds them next to the model file. (``parse(data)``
  alone fails for external weights; ``parse_from_file`` would reopen a file that may have
  changed since it was hashed.)
* A persistent timing cache per TensorRT version and GPU, beside the engine cache, so a
  rebuild (a new model version, a new pod) reuses kernel timings.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model_rollout_contract.defaults import PRECISIONS

QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})
_FLOAT16_TYPES = frozenset({10, 16})  # onnx.TensorProto.FLOAT16, BFLOAT16

Shape = tuple[int, ...]


class BuildRefused(ValueError):
    """The model cannot be built as asked; the message says why and what to do."""


@dataclass(frozen=True)
class DynamicBounds:
    """min/opt/max for dynamic axes: the first axis (batch) and any other (sequence...)."""

    batch: tuple[int, int, int] = (1, 8, 64)
    other: tuple[int, int, int] = (1, 128, 512)

    def __post_init__(self) -> None:
        for what, (lo, opt, hi) in (("batch", self.batch), ("other", self.other)):
            if not 1 <= lo <= opt <= hi:
                raise ValueError(f"{what} bounds need 1 <= min <= opt <= max, got {lo, opt, hi}")

    def key(self) -> str:
        return "b" + "-".join(map(str, self.batch)) + "_d" + "-".join(map(str, self.other))


@dataclass(frozen=True)
class ShapeProfile:
    """Explicit min/opt/max per input; inputs not named here get ``bounds``."""

    shapes: dict[str, tuple[Shape, Shape, Shape]] = field(default_factory=dict)
    bounds: DynamicBounds = DynamicBounds()

    def key(self) -> str:
        named = "+".join(
            f"{name}:" + "-".join("x".join(map(str, s)) for s in triple)
            for name, triple in sorted(self.shapes.items())
        )
        return f"{named or 'auto'}_{self.bounds.key()}"

    def for_input(self, name: str, shape: Sequence[int]) -> tuple[Shape, Shape, Shape] | None:
        """The input's (min, opt, max), or None when it has no dynamic axis."""
        if name in self.shapes:
            return self.shapes[name]
        if all(dim >= 0 for dim in shape):
            return None
        triples = [
            (dim, dim, dim) if dim >= 0 else (self.bounds.batch if axis == 0 else self.bounds.other)
            for axis, dim in enumerate(shape)
        ]
        lo, opt, hi = zip(*triples, strict=True)
        return tuple(lo), tuple(opt), tuple(hi)


def graph_precision(onnx_bytes: bytes) -> str:
    """What the ONNX graph carries: ``int8`` (Q/DQ nodes), ``fp16`` (16-bit floats), ``fp32``.

    Reads the graph structure only: external weight files are not loaded.
    """
    import onnx

    model = onnx.load_model_from_string(onnx_bytes)
    graph = model.graph
    if any(node.op_type in QDQ_OPS for node in graph.node):
        return "int8"
    types = [init.data_type for init in graph.initializer]
    types += [
        info.type.tensor_type.elem_type
        for info in (*graph.input, *graph.output, *graph.value_info)
        if info.type.HasField("tensor_type")
    ]
    if any(t in _FLOAT16_TYPES for t in types):
        return "fp16"
    return "fp32"


def check_external_data(onnx_bytes: bytes) -> None:
    """Refuse external weight files that are not plain names beside the model: TensorRT
    would read them from disk (they are not covered by the model's digest, so they must at
    least stay inside the version's directory)."""
    import onnx

    model = onnx.load_model_from_string(onnx_bytes)
    for initializer in model.graph.initializer:
        if initializer.data_location != onnx.TensorProto.EXTERNAL:
            continue
        entries = initializer.external_data
        location = next((e.value for e in entries if e.key == "location"), "")
        parts = Path(location).parts
        if not location or Path(location).is_absolute() or ".." in parts or len(parts) != 1:
            raise BuildRefused(
                f"initializer {initializer.name} has its weights at {location!r}: external data "
                "must be a file name beside the model"
            )


@dataclass(frozen=True)
class BuildPlan:
    """How to build for one TensorRT major version: typing mode and builder flags."""

    strongly_typed: bool
    flags: tuple[str, ...]  # BuilderFlag names to set
    clear_tf32: bool


def plan_build(trt_major: int, asked: str, carried: str) -> BuildPlan:
    """Decide the build mode, or refuse with a message that says what to do."""
    if asked not in PRECISIONS:
        raise BuildRefused(f"precision must be one of {PRECISIONS}, not {asked!r}")
    if asked == "model":
        return BuildPlan(strongly_typed=True, flags=(), clear_tf32=carried == "fp32")
    if asked == "int8":
        if carried != "int8":
            raise BuildRefused(
                "int8 needs an explicitly quantized model (QuantizeLinear/DequantizeLinear "
                "nodes, e.g. from NVIDIA ModelOpt); TensorRT would otherwise fall back to "
                "higher precision silently. Quantize the model, or ask for precision model"
            )
        return BuildPlan(strongly_typed=True, flags=(), clear_tf32=False)
    if carried == "int8":
        raise BuildRefused(
            f"the model is quantized (Q/DQ nodes) but precision {asked} was asked for: "
            "ask for precision int8 or model"
        )
    if asked == "fp32":
        if carried != "fp32":
            raise BuildRefused(
                f"precision fp32 was asked for but the model carries {carried} tensors: "
                "ask for precision model, or export the model in fp32"
            )
        return BuildPlan(strongly_typed=trt_major >= 11, flags=(), clear_tf32=True)
    # fp16
    if carried == "fp16":
        return BuildPlan(strongly_typed=True, flags=(), clear_tf32=False)
    if trt_major >= 11:
        raise BuildRefused(
            "TensorRT 11 builds strongly typed networks only, so fp16 must be in the model: "
            "convert it (python -m modelopt.onnx.autocast --onnx_path model.onnx "
            "--output_path model_fp16.onnx) and publish that, or ask for precision model "
            "(fp32 here)"
        )
    return BuildPlan(strongly_typed=False, flags=("FP16",), clear_tf32=True)


@dataclass(frozen=True)
class BuildOptions:
    precision: str = "model"
    profile: ShapeProfile = ShapeProfile()
    contexts: int = 2  # pooled execution contexts: one optimization profile each
    workspace_bytes: int = 1 << 30
    timing_cache: Path | None = None  # the persistent timing cache file, if any


def _network_flags(trt: Any, trt_major: int, plan: BuildPlan) -> int:
    # on 11 every network is strongly typed and the creation flag is gone
    if plan.strongly_typed and trt_major < 11:
        return 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    return 0


def _add_profiles(
    builder: Any, network: Any, config: Any, profile: ShapeProfile, contexts: int
) -> list[str]:
    """One optimization profile per pooled context; returns the dynamic inputs' names."""
    inputs = [network.get_input(i) for i in range(network.num_inputs)]
    dynamic: dict[str, tuple[Shape, Shape, Shape]] = {}
    for tensor in inputs:
        if tensor.is_shape_tensor:
            raise BuildRefused(
                f"input {tensor.name} is a shape tensor; the server feeds data tensors only"
            )
        triple = profile.for_input(tensor.name, tuple(tensor.shape))
        if triple is not None:
            dynamic[tensor.name] = triple
    unknown = set(profile.shapes) - {t.name for t in inputs}
    if unknown:
        raise BuildRefused(f"shape profile names inputs the model does not have: {sorted(unknown)}")
    if not dynamic:
        return []
    for _ in range(contexts):
        opt_profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in dynamic.items():
            opt_profile.set_shape(name, lo, opt, hi)
        if config.add_optimization_profile(opt_profile) < 0:
            raise BuildRefused(f"TensorRT refused the optimization profile {dynamic}")
    return sorted(dynamic)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _load_timing_cache(config: Any, path: Path | None) -> Any:
    data = path.read_bytes() if path is not None and path.exists() else b""
    timing_cache = config.create_timing_cache(data)
    config.set_timing_cache(timing_cache, ignore_mismatch=False)
    return timing_cache


def _save_timing_cache(config: Any, timing_cache: Any, path: Path) -> None:
    """Merge this build's timings into the file, under a lock (other builders share it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        if path.exists():
            on_disk = config.create_timing_cache(path.read_bytes())
            on_disk.combine(timing_cache, ignore_mismatch=True)
            timing_cache = on_disk
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(bytes(timing_cache.serialize()))
        os.replace(tmp, path)


def build_engine(
    trt: Any,
    logger: Any,
    trt_major: int,
    onnx: tuple[bytes, Path],
    out_path: Path,
    options: BuildOptions,
) -> None:
    """Build the ONNX ``(bytes, path)`` into a serialized engine at ``out_path``, or raise
    BuildRefused. ``path`` only locates external weights."""
    onnx_bytes, onnx_path = onnx
    check_external_data(onnx_bytes)
    plan = plan_build(trt_major, options.precision, graph_precision(onnx_bytes))
    builder = trt.Builder(logger)
    network = builder.create_network(_network_flags(trt, trt_major, plan))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx_bytes, str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise BuildRefused(f"TensorRT could not parse {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, options.workspace_bytes)
    for flag in plan.flags:
        config.set_flag(getattr(trt.BuilderFlag, flag))
    if plan.clear_tf32:
        config.clear_flag(trt.BuilderFlag.TF32)
    _add_profiles(builder, network, config, options.profile, options.contexts)
    timing = _load_timing_cache(config, options.timing_cache)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"TensorRT failed to build an engine for {onnx_path.name}")
    out_path.write_bytes(bytes(serialized))
    if options.timing_cache is not None:
        _save_timing_cache(config, timing, options.timing_cache)
